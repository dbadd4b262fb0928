// attnlab native kernel: dynamic work distribution for one parallel region.
//
// A pass's work items are handed out one at a time by an atomic counter, in an order that
// puts the largest items first (a causal mask's last q blocks see every kv block, its first
// one), so a thread whose core is busy with another process takes fewer items instead of
// holding the region back by its static share, and the last items handed out are the
// shortest (the region's tail is at most one small item).  Usage:
//
//     attnlab_sched::Queue queue(n_items, cost);   // cost(i) -> int64_t, or no cost: i order
//     at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
//       <per-thread buffers>
//       attnlab_sched::drain(queue, [&](int64_t it) { work(it); });
//     });
//
// Which thread runs an item never changes its result (items are independent and write
// disjoint outputs), so the order is free: results are the same bits for any thread count.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <vector>

namespace attnlab_sched {

class Queue {
 public:
  explicit Queue(int64_t n) : n_(n) {}
  // items in order of decreasing cost (ties keep their index order, so neighbours that share
  // operands still run close together)
  template <typename Cost>
  Queue(int64_t n, Cost&& cost) : n_(n), order_(static_cast<size_t>(n)) {
    std::vector<int64_t> c(static_cast<size_t>(n));
    bool same = true;
    for (int64_t i = 0; i < n; ++i) {
      c[i] = cost(i);
      same = same && c[i] == c[0];
    }
    if (same) {
      order_.clear();
      return;
    }
    std::iota(order_.begin(), order_.end(), int64_t{0});
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return c[a] > c[b]; });
  }
  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  // the next item to run; false when every item is taken
  bool pop(int64_t& item) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_) return false;
    item = order_.empty() ? i : order_[i];
    return true;
  }
  int64_t size() const { return n_; }

 private:
  int64_t n_;
  std::vector<int64_t> order_;  // empty: index order
  std::atomic<int64_t> next_{0};
};

// The bench knob ATTNLAB_NATIVE_SLOW=f (f > 0; unset or 0: off, the default): thread 1 of each
// region spins f times each item's own run time after it, as a thread whose core another
// process shares runs at 1 / (1 + f) of its speed (f = 1: half speed, one core busy).  It
// measures how a schedule copes with a slow thread without loading the machine
// (attnlab.bench.native --slow); it changes no result, only when items finish.
inline double slow_factor() {
  const char* e = std::getenv("ATTNLAB_NATIVE_SLOW");
  const double f = e == nullptr ? 0.0 : std::atof(e);
  return f > 0.0 ? f : 0.0;
}

// this thread's share of a queue's items: work(it) for each item it pops (paced, under the
// bench knob above, on thread 1)
template <typename Work>
void drain(Queue& queue, Work&& work) {
  const double slow = at::get_thread_num() == 1 ? slow_factor() : 0.0;
  if (slow == 0.0) {
    for (int64_t it; queue.pop(it);) work(it);
    return;
  }
  using clock = std::chrono::steady_clock;
  for (int64_t it; queue.pop(it);) {
    const auto t0 = clock::now();
    work(it);
    const auto t1 = clock::now();
    const auto until = t1 + std::chrono::duration_cast<clock::duration>((t1 - t0) * slow);
    while (clock::now() < until) {
    }
  }
}

}  // namespace attnlab_sched
