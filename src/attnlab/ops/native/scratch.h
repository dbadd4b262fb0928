// attnlab native kernel: the process's scratch for the large per-call copies (the packed K and V
// panels), kept between calls.
//
// A pass packs Kᵀ and V once per call, O(N·D) bytes each.  Allocated per call, a pack above
// glibc's mmap threshold (at most 32 MiB, lower after trims) comes from fresh pages every call:
// (1, 8, 16384, 128) bf16 packs are 2 × 32 MiB, 16,386 page faults per call, 16 ms of a 29.5 ms
// forward with 64 queries (2026-12-05, 2 threads; docs/native.md, "The packs' scratch").  Scratch
// keeps one buffer per slot, grown to the largest request and reused: a call's packs above MIN_BYTES
// are views into it (no allocation, no fault).  Smaller packs are allocated per call as before
// (glibc reuses their memory without faults).
//
// One call at a time holds the scratch (a try_lock on construction, released on destruction);
// a concurrent call (another Python thread) allocates its own packs.  The memory stays with
// the process (the largest packs seen so far) until release_scratch();
// ATTNLAB_NATIVE_SCRATCH=0 (or false/off/no) turns it off (every pack allocated per call).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>

namespace attnlab_scratch {

constexpr int SLOTS = 3;                    // 0: the K pack, 1: the V pack, 2: the backward's K copy
constexpr int64_t MIN_BYTES = 8ll << 20;   // smaller packs: allocated per call

struct Store {
  std::mutex m;
  at::Tensor buf[SLOTS];  // uint8, grown on demand
};
inline Store& store() {
  static Store s;
  return s;
}

// An ATTNLAB_NATIVE_* switch: on unless set to 0 / false / off / no (any case, blanks
// ignored), the values build.disabled() reads for ATTNLAB_NATIVE
inline bool env_on(const char* name) {
  const char* e = std::getenv(name);
  if (e == nullptr) return true;
  std::string v;
  for (const char* c = e; *c != '\0'; ++c)
    if (!std::isspace(static_cast<unsigned char>(*c))) v += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  return v != "0" && v != "false" && v != "off" && v != "no";
}

// ATTNLAB_NATIVE_SCRATCH=0 (or false/off/no) turns the scratch off
inline bool enabled() { return env_on("ATTNLAB_NATIVE_SCRATCH"); }

// A thread's own buffer (slot 0 or 1) of at least `words` 32-bit words, 64-byte aligned, kept
// with the thread and grown on demand: the forward's local packs (forward.h), which a chunk of
// work writes and reads while they sit in its core's L2.  At most a few hundred KiB per thread.
inline uint32_t* thread_buffer(int slot, size_t words) {
  struct Buffers {
    void* p[2] = {nullptr, nullptr};
    size_t n[2] = {0, 0};
    ~Buffers() {
      std::free(p[0]);
      std::free(p[1]);
    }
  };
  static thread_local Buffers t;
  if (t.n[slot] < words) {
    std::free(t.p[slot]);
    t.p[slot] = nullptr;
    t.n[slot] = 0;  // a failed allocation leaves no stale size behind (the next call tries again)
    const size_t bytes = (words * 4 + 63) / 64 * 64;
    t.p[slot] = std::aligned_alloc(64, bytes);
    if (t.p[slot] == nullptr) throw std::bad_alloc();
    t.n[slot] = bytes / 4;
  }
  return static_cast<uint32_t*>(t.p[slot]);
}

// The scratch for one call: empty(slot, sizes, options) is a view into slot's buffer where
// this call holds the scratch and the tensor is at least MIN_BYTES, else at::empty.
class Scratch {
 public:
  Scratch() : lock_(store().m, std::defer_lock) {
    if (enabled()) lock_.try_lock();
  }
  at::Tensor empty(int slot, at::IntArrayRef sizes, const at::TensorOptions& opt) {
    int64_t n = 1;
    for (const int64_t s : sizes) n *= s;
    const int64_t bytes = n * static_cast<int64_t>(opt.dtype().itemsize());
    if (!lock_.owns_lock() || bytes < MIN_BYTES) return at::empty(sizes, opt);
    at::Tensor& b = store().buf[slot];
    if (!b.defined() || b.numel() < bytes) {
      b = at::Tensor();  // the old buffer first: never both at once
      b = at::empty({bytes}, opt.dtype(at::kByte));
    }
    return at::from_blob(b.data_ptr(), sizes, opt);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

// Frees the scratch's buffers (the next large call allocates them again); returns the bytes freed.
// Waits for a call that holds the scratch to finish.
inline int64_t release() {
  std::lock_guard<std::mutex> g(store().m);
  int64_t freed = 0;
  for (at::Tensor& b : store().buf) {
    if (b.defined()) freed += b.numel();
    b = at::Tensor();
  }
  return freed;
}

}  // namespace attnlab_scratch
