// attnlab's native CPU attention kernel: forward and backward, fp32 / bf16 / fp16 inputs,
// float32 accumulation of S = QKᵀ, P·V, dP = dO·Vᵀ and dS; LSE in natural log (float32).
//
// Layout (any strides): q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv);
// out (B, H, Nq, Dv) in q's dtype, lse (B, H, Nq) float32.  Query head h reads kv head
// h / (H / Hkv) (GQA): K/V are read in place, never copied per head.
//
// Positions are absolute: row i sits at qp = q_offset + i, column j at kp = kv_offset + j.
// The mask is evaluated here from its structure (MASK_STRUCTURE.md):
//     visible = ((no left or qp - kp <= left) and (no right or kp - qp <= right))
//               or (kp < sinks and (no sinks_right or kp - qp <= sinks_right))
//               and (no kv_len or kp < kv_len[b])
// For one row that is the union of two column intervals [0, s1) and [b0, b1).
//
// One at::parallel_for region per pass; each work item runs a tile loop with per-thread
// float32 buffers, items handed out largest first (sched.h): forward over (b, h, q-block);
// backward atomics-free in one of two schedules (backward.h): fused, one item per (b,
// kv-head, chunk of kv-blocks) owning its dK, dV and its dQ sums (added up by q-block after),
// or split, dK/dV over (b, kv-head, kv-block) then dQ over (b, h, q-block).  Hidden entries
// (masked) are exact zeros in every product, so a NaN/inf in a key or value a row cannot
// see has no effect.  The tile products run on a register-blocked GEMM micro-kernel
// (gemm_f32.h: 8x32 AVX-512, 6x16 AVX2, 6x8 portable; the build picks -mavx512* / -mavx2
// from the CPU's flags) and the softmax rows on native-width loops (rowmath.h).
//
// Files: this one holds the argument checks (dims_of, mask_of, mods_of), the entry points
// native_fwd / native_bwd / native_features / native_parallel_threads and their registration
// as torch ops (torch.ops.attnlab_native.*: ATen and torch/library.h, not torch/extension.h,
// whose pybind11 headers took 19.5 s of each build's parse where these take 5.7 s);
// tiles.h the views, row loads and K/V panel packing; forward.h the forward pass; backward.h
// Δ and the backward's fused and split schedules.  They are one translation unit (decode.cpp
// is the extension's other one), their definitions in an anonymous namespace.
// The op headers it calls, not ATen/ATen.h (which declares every op): 2 s less per source file.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backward.h"
#include "forward.h"
#include "gemm_bf16.h"
#include "gemm_f32.h"
#include "mask_args.h"
#include "masking.h"
#include "scoremods.h"
#include "tiles.h"

namespace {

Dims dims_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t bq, int64_t bk) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attnlab native: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attnlab native: q, k, v must share a dtype");
  Dims d{q.size(0), q.size(1), k.size(1), 0, q.size(2), k.size(2), q.size(3), v.size(3), bq, bk};
  TORCH_CHECK(d.Hkv > 0 && d.H % d.Hkv == 0, "attnlab native: H must be a multiple of Hkv");
  TORCH_CHECK(bq > 0 && bk > 0 && bk % 16 == 0, "attnlab native: block sizes must be positive, bk a multiple of 16");
  d.G = d.H / d.Hkv;
  return d;
}

// ids (q_ids (B|1, Nq) with kv_ids (B|1, Nk), int64) and keep ((B|1, Nk), bool/uint8): already
// sliced to the problem's rows and columns by the caller; tables for kv blocks of bk columns
Mask mask_of(const c10::optional<at::Tensor>& kv_len, const c10::optional<at::Tensor>& q_ids,
             const c10::optional<at::Tensor>& kv_ids, const c10::optional<at::Tensor>& keep, bool has_left,
             int64_t left, bool has_right, int64_t right, int64_t sinks, bool has_sinks_right, int64_t sinks_right,
             int64_t q_offset, int64_t kv_offset, const std::vector<at::Tensor>& ext,
             const std::vector<int64_t>& ext_block, const Dims& dm) {
  const int64_t* kl = nullptr;
  if (kv_len.has_value() && kv_len->defined()) {
    TORCH_CHECK(kv_len->scalar_type() == at::kLong && kv_len->is_contiguous(), "attnlab native: kv_len int64");
    kl = kv_len->data_ptr<int64_t>();
  }
  Mask mk{has_left, has_right, left, right, sinks, has_sinks_right, sinks_right, kl, q_offset, kv_offset, dm.Nk};
  auto rows_of = [&](const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.dim() == 2 && (t.size(0) == 1 || t.size(0) == dm.B) && t.size(1) == n && t.is_contiguous(),
                "attnlab native: ", what, " must be a contiguous (B|1, ", n, ") tensor");
    return t.size(0);
  };
  int64_t Bids = 0, Bkeep = 0;
  const bool has_q = q_ids.has_value() && q_ids->defined(), has_k = kv_ids.has_value() && kv_ids->defined();
  TORCH_CHECK(has_q == has_k, "attnlab native: q_ids and kv_ids come together");
  if (has_q) {
    TORCH_CHECK(q_ids->scalar_type() == at::kLong && kv_ids->scalar_type() == at::kLong, "attnlab native: ids int64");
    const int64_t bq = rows_of(*q_ids, dm.Nq, "q_ids"), bk = rows_of(*kv_ids, dm.Nk, "kv_ids");
    mk.q_ids = q_ids->data_ptr<int64_t>();
    mk.kv_ids = kv_ids->data_ptr<int64_t>();
    mk.q_ids_bs = bq == 1 ? 0 : dm.Nq;
    mk.kv_ids_bs = bk == 1 ? 0 : dm.Nk;
    Bids = bk;
  }
  if (keep.has_value() && keep->defined()) {
    TORCH_CHECK(keep->scalar_type() == at::kBool || keep->scalar_type() == at::kByte, "attnlab native: keep bool");
    Bkeep = rows_of(*keep, dm.Nk, "key_keep");
    mk.keep = reinterpret_cast<const uint8_t*>(keep->data_ptr());
    mk.keep_bs = Bkeep == 1 ? 0 : dm.Nk;
  }
  mask_extra(mk, ext, ext_block, dm.B, dm.H, dm.Nq, dm.Nk);  // band positions, a BlockMask's tiles
  mk.tables(dm.bq, dm.bk, Bids, Bkeep);
  return mk;
}

// the score mod's terms (ScoreMods::Kind codes, softcap values in order) and its tensors:
// slopes (B|1, H) and table (H, 2R + 1), float32 contiguous
ScoreMods mods_of(const c10::optional<at::Tensor>& slopes, const c10::optional<at::Tensor>& table,
                  std::vector<int64_t> mods, const std::vector<double>& caps, int64_t q_offset,
                  int64_t kv_offset, const Dims& dm) {
  ScoreMods sm;
  TORCH_CHECK(static_cast<int64_t>(mods.size()) <= ScoreMods::MAX_TERMS, "attnlab native: too many score terms");
  sm.n = static_cast<int>(mods.size());
  sm.q_offset = q_offset;
  sm.kv_offset = kv_offset;
  sm.H = dm.H;
  size_t ncap = 0;
  bool need_slopes = false, need_table = false;
  for (int t = 0; t < sm.n; ++t) {
    sm.kind[t] = mods[t];
    TORCH_CHECK(mods[t] >= ScoreMods::SOFTCAP && mods[t] <= ScoreMods::RELATIVE_BIAS, "attnlab native: bad term");
    if (mods[t] == ScoreMods::SOFTCAP) {
      TORCH_CHECK(ncap < caps.size(), "attnlab native: a softcap value per softcap term");
      sm.cap[t] = static_cast<float>(caps[ncap++]);
    }
    need_slopes = need_slopes || mods[t] == ScoreMods::ALIBI || mods[t] == ScoreMods::ALIBI_SYMMETRIC;
    need_table = need_table || mods[t] == ScoreMods::RELATIVE_BIAS;
  }
  const bool has_s = slopes.has_value() && slopes->defined(), has_t = table.has_value() && table->defined();
  TORCH_CHECK(has_s == need_slopes && has_t == need_table, "attnlab native: score terms and tensors disagree");
  if (has_s) {
    TORCH_CHECK(slopes->scalar_type() == at::kFloat && slopes->is_contiguous() && slopes->dim() == 2 &&
                    (slopes->size(0) == 1 || slopes->size(0) == dm.B) && slopes->size(1) == dm.H,
                "attnlab native: slopes must be a contiguous float32 (B|1, H) tensor");
    sm.slopes = slopes->data_ptr<float>();
    sm.slopes_bs = slopes->size(0) == 1 ? 0 : dm.H;
  }
  if (has_t) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                    table->size(0) == dm.H && table->size(1) % 2 == 1,
                "attnlab native: table must be a contiguous float32 (H, 2R + 1) tensor");
    sm.table = table->data_ptr<float>();
    sm.R = table->size(1) / 2;
  }
  return sm;
}

}  // namespace

std::vector<at::Tensor> native_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                   int64_t q_offset, int64_t kv_offset, bool has_left, int64_t left, bool has_right,
                                   int64_t right, int64_t sinks, bool has_sinks_right, int64_t sinks_right,
                                   const c10::optional<at::Tensor>& kv_len, const c10::optional<at::Tensor>& q_ids,
                                   const c10::optional<at::Tensor>& kv_ids, const c10::optional<at::Tensor>& keep,
                                   const c10::optional<at::Tensor>& slopes, const c10::optional<at::Tensor>& table,
                                   int64_t bq, int64_t bk, std::vector<int64_t> mods,
                                   std::vector<double> caps, std::vector<at::Tensor> mask_ext,
                                   std::vector<int64_t> mask_block) {
  // bf16 pairs are half the bytes of float32: the K tile that ops.blocks sizes for L1 in float32
  // (D × bk) holds a kv block twice as long (measured: 5 % at D = 128, 2-4 % at D = 64), and four
  // times as long up to 256 columns (one thread, 2026-12-04: D = 128 causal 6 %, full 3 %;
  // D = 256 7 %): fewer rescales of the output block and longer P·V reductions per kv block
  const bool pairs = q.scalar_type() == at::kBFloat16 && bf16_pairs();
  const Dims dm = dims_of(q, k, v, bq, pairs && bk < 256 ? std::min<int64_t>(256, 4 * bk) : bk);
  const Mask mk = mask_of(kv_len, q_ids, kv_ids, keep, has_left, left, has_right, right, sinks, has_sinks_right,
                          sinks_right, q_offset, kv_offset, mask_ext, mask_block, dm);
  ScoreMods sm = mods_of(slopes, table, mods, caps, q_offset, kv_offset, dm);
  auto out = at::empty({dm.B, dm.H, dm.Nq, dm.Dv}, q.options());
  auto lse = at::empty({dm.B, dm.H, dm.Nq}, q.options().dtype(at::kFloat));
  switch (q.scalar_type()) {
    case at::kFloat: forward_impl<float>(q, k, v, out, lse, dm, mk, sm, static_cast<float>(scale)); break;
    case at::kBFloat16: forward_impl<c10::BFloat16>(q, k, v, out, lse, dm, mk, sm, static_cast<float>(scale)); break;
    case at::kHalf: forward_impl<c10::Half>(q, k, v, out, lse, dm, mk, sm, static_cast<float>(scale)); break;
    default: TORCH_CHECK(false, "attnlab native: dtype must be float32, bfloat16 or float16");
  }
  return {out, lse};
}

std::vector<at::Tensor> native_bwd(const at::Tensor& dout_in, const c10::optional<at::Tensor>& dlse,
                                   const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out_in,
                                   const at::Tensor& lse, double scale, int64_t q_offset, int64_t kv_offset,
                                   bool has_left, int64_t left, bool has_right, int64_t right, int64_t sinks,
                                   bool has_sinks_right, int64_t sinks_right,
                                   const c10::optional<at::Tensor>& kv_len, const c10::optional<at::Tensor>& q_ids,
                                   const c10::optional<at::Tensor>& kv_ids, const c10::optional<at::Tensor>& keep,
                                   const c10::optional<at::Tensor>& slopes, const c10::optional<at::Tensor>& table,
                                   int64_t bq, int64_t bk, std::vector<int64_t> mods,
                                   std::vector<double> caps, std::vector<at::Tensor> mask_ext,
                                   std::vector<int64_t> mask_block) {
  const Dims dm = dims_of(q, k, v, bq, bk);
  const Mask mk = mask_of(kv_len, q_ids, kv_ids, keep, has_left, left, has_right, right, sinks, has_sinks_right,
                          sinks_right, q_offset, kv_offset, mask_ext, mask_block, dm);
  ScoreMods sm = mods_of(slopes, table, mods, caps, q_offset, kv_offset, dm);
  const at::Tensor dout = dout_in.to(q.scalar_type()), out = out_in.to(q.scalar_type());
  at::Tensor lse_c = lse.to(at::kFloat).contiguous();
  at::Tensor delta = at::empty({dm.B, dm.H, dm.Nq}, q.options().dtype(at::kFloat));
  at::Tensor dlse_c;
  if (dlse.has_value() && dlse->defined()) dlse_c = dlse->to(at::kFloat).contiguous();
  auto dq = at::empty({dm.B, dm.H, dm.Nq, dm.D}, q.options());
  auto dk = at::empty({dm.B, dm.Hkv, dm.Nk, dm.D}, q.options());
  auto dv = at::empty({dm.B, dm.Hkv, dm.Nk, dm.Dv}, q.options());
  const float s = static_cast<float>(scale);
  const int64_t nqb = (dm.Nq + dm.bq - 1) / dm.bq;
  at::Tensor dslope_items, dtable_items;
  if (sm.slopes != nullptr) {
    dslope_items = at::zeros({dm.B, dm.H, nqb}, q.options().dtype(at::kDouble));
    sm.dslope_items = dslope_items.data_ptr<double>();
  }
  if (sm.table != nullptr) {
    dtable_items = at::zeros({dm.B, dm.H, nqb, 2 * sm.R + 1}, q.options().dtype(at::kDouble));
    sm.dtable_items = dtable_items.data_ptr<double>();
  }
  switch (q.scalar_type()) {
    case at::kFloat: delta_impl<float>(dout, out, dlse_c, delta, dm); break;
    case at::kBFloat16: delta_impl<c10::BFloat16>(dout, out, dlse_c, delta, dm); break;
    case at::kHalf: delta_impl<c10::Half>(dout, out, dlse_c, delta, dm); break;
    default: TORCH_CHECK(false, "attnlab native: dtype must be float32, bfloat16 or float16");
  }
  switch (q.scalar_type()) {
    case at::kFloat: backward_impl<float>(dout, q, k, v, lse_c, delta, dq, dk, dv, dm, mk, sm, s); break;
    case at::kBFloat16: backward_impl<c10::BFloat16>(dout, q, k, v, lse_c, delta, dq, dk, dv, dm, mk, sm, s); break;
    case at::kHalf: backward_impl<c10::Half>(dout, q, k, v, lse_c, delta, dq, dk, dv, dm, mk, sm, s); break;
    default: TORCH_CHECK(false, "attnlab native: dtype must be float32, bfloat16 or float16");
  }
  // the slope / table gradients: the dQ pass's per-item sums, reduced to the parameters' shapes
  at::Tensor dslopes = at::zeros({0}, q.options().dtype(at::kFloat));
  at::Tensor dtable = at::zeros({0}, q.options().dtype(at::kFloat));  // (outputs never alias)
  if (sm.dslope_items != nullptr) {
    dslopes = dslope_items.sum(2);  // (B, H)
    if (slopes->size(0) == 1) dslopes = dslopes.sum(0, true);
    dslopes = dslopes.to(at::kFloat);
  }
  if (sm.dtable_items != nullptr) dtable = dtable_items.sum({0, 2}).to(at::kFloat);  // (H, 2R + 1)
  return {dq, dk, dv, dslopes, dtable};
}

std::string native_features() {
  std::string f;
#if defined(__AVX512F__)
  f += "avx512f ";
#endif
#if defined(__AVX512BF16__)
  f += "avx512bf16 ";
#endif
#if defined(__AVX2__)
  f += "avx2 ";
#endif
#if defined(__FMA__)
  f += "fma ";
#endif
  f = f.empty() ? std::string("portable") : f.substr(0, f.size() - 1);
#if defined(_OPENMP)
  f += ", openmp";
#endif
  return f + "; " + attnlab_gemm::isa() + "; " + attnlab_bf16::isa() + (bf16_pairs() ? " (bf16 forward)" : " (bf16 via f32)");
}

// How many distinct OS threads run the items of one at::parallel_for region of n_items.
// at::parallel_for is a header template: built without -fopenmp its `#pragma omp parallel`
// is dropped and every region runs on the calling thread alone, silently (build.py passes
// the flag; tests/ops/native/test_native_threads.py holds it with this probe).
int64_t native_parallel_threads(int64_t n_items) {
  std::mutex mu;
  std::set<std::thread::id> seen;
  at::parallel_for(0, n_items, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // long enough that no thread takes every item
      std::lock_guard<std::mutex> g(mu);
      seen.insert(std::this_thread::get_id());
    }
  });
  return static_cast<int64_t>(seen.size());
}

int64_t native_last_bwd_plan() { return last_bwd_plan.load(); }
int64_t native_last_fwd_plan() { return last_fwd_plan.load(); }

// frees the packs' scratch (scratch.h); the bytes it held
int64_t native_release_scratch() { return attnlab_scratch::release(); }

// The ops, in a namespace of their own (attnlab's Python custom ops, attnlab::native_fwd and
// native_bwd, call these).  One build is loaded per process: the library registers once.
#define ATTNLAB_MASK_ARGS                                                                                   \
  "float scale, int q_offset, int kv_offset, bool has_left, int left, bool has_right, int right, int sinks, " \
  "bool has_sinks_right, int sinks_right, Tensor? kv_len, Tensor? q_ids, Tensor? kv_ids, Tensor? keep, "       \
  "Tensor? slopes, Tensor? table, int bq, int bk, int[] mods, float[] caps, Tensor[] mask_ext, int[] mask_block"
TORCH_LIBRARY(attnlab_native, m) {
  // attnlab native attention forward -> [out, lse]
  m.def("fwd(Tensor q, Tensor k, Tensor v, " ATTNLAB_MASK_ARGS ") -> Tensor[]", &native_fwd);
  // attnlab native attention backward -> [dq, dk, dv, dslopes, dtable]
  m.def("bwd(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, " ATTNLAB_MASK_ARGS
        ") -> Tensor[]",
        &native_bwd);
  m.def("features() -> str", &native_features);  // the instruction sets this build was compiled for
  // distinct threads that ran one parallel_for region of n items
  m.def("parallel_threads(int n_items) -> int", &native_parallel_threads);
  // the last backward call's kv chunks per (b, kv head); negative where it ran the split schedule
  m.def("last_bwd_plan() -> int", &native_last_bwd_plan);
  // the last forward call's chunks on local packs (forward.h); 0 where it packed K and V once for the call
  m.def("last_fwd_plan() -> int", &native_last_fwd_plan);
  // frees the process's scratch for the large packs (scratch.h) -> the bytes it held
  m.def("release_scratch() -> int", &native_release_scratch);
}
