// The native kernel's backward: Δ (delta_impl), the plan (bwd_plan: chunks, costs, schedule)
// and the two schedules (backward_impl), "fused" (one pass over (b, kv head, chunk of kv
// blocks)) and "split" (a dK/dV pass over kv blocks, a dQ pass over q blocks), their tile
// loops in BwdWork (fast paths on the micro-kernel, careful paths that skip hidden entries).  Included by kernel.cpp only (see tiles.h: an anonymous namespace,
// one unit).
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <functional>
#include <queue>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm_f32.h"
#include "masking.h"
#include "rowmath.h"
#include "sched.h"
#include "scoremods.h"
#include "tiles.h"
#include "vecmath.h"

namespace {

// dst[0:n] = src converted to T; returns z plus the sum of (x - x), which stays 0 exactly
// where every x is finite (NaN otherwise): the stores' finiteness check.
template <typename T>
inline float store_row(T* dst, const float* src, int64_t n, float z) {
  for (int64_t d = 0; d < n; ++d) {
    const float x = src[d];
    z += x - x;
    dst[d] = static_cast<T>(x);
  }
  return z;
}

// float32 rows of a (B, H, N, D) tensor, D padded to Dp with zeros: the tensor itself where it
// already is that (float32, contiguous, D == Dp), else a copy made once per call (O(N·D))
inline at::Tensor rows_f32(const at::Tensor& x, int64_t Dp) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(3) == Dp) return x;
  at::Tensor out = at::zeros({x.size(0), x.size(1), x.size(2), Dp}, x.options().dtype(at::kFloat));
  out.narrow(3, 0, x.size(3)).copy_(x);
  return out;
}

// The backward's two schedules.  "split": two atomics-free passes, dK/dV over (b, kv head,
// kv block) and dQ over (b, h, q block), each recomputing S and dP (7 tile products).
// "fused": one pass over (b, kv head, kv chunk) work items, a thread owning the chunk's dK and
// dV and its share of dQ, so every tile's S and dP serve all three (5 tile products,
// FlashAttention-2's count).
//
// Chunks: each (b, kv head)'s kv blocks are cut into C runs of consecutive blocks (C from the
// problem alone: bwd_chunks), so a few heads still make enough items that a thread running at
// half speed (its core shared with another process) does not hold the pass on a head's last
// item.  Where C > 1 an item's dQ sums go to its own slab of a float32 buffer (its q rows of the
// G query heads; chunk 0's to dq itself where that is float32 rows of Dp), and the thread that
// finishes a head's last chunk adds each q block's slabs in chunk order; split's dQ item
// sums its kv blocks chunk by chunk and adds the chunks' sums in the same order, so both give
// the same bits, for any thread count.  C = 1 is the plain per-head pass (dQ in place).
//
// bwd_plan counts the tiles every item visits; fused where its makespan on the threads (items
// largest first, each to the first idle thread) times 5 is at most split's two makespans times
// 4 and 3; ATTNLAB_NATIVE_BWD=fused / split forces one.  Every pass hands its items out largest
// first (sched.h).
constexpr int64_t BWD_ITEMS = 16;           // fused items aimed at: C = ⌈16 / (B·Hkv)⌉ ...
constexpr int64_t BWD_CHUNK_BLOCKS = 4;     // ... chunks of at least 4 kv blocks ...
constexpr int64_t BWD_SLABS_MAX = 16 << 20; // ... and at most 16 MiB of dQ slabs

struct BwdPlan {
  int64_t C = 1;                              // kv chunks per (b, kv head)
  std::vector<int64_t> jb;                    // chunk c: kv blocks [jb[c], jb[c + 1])
  std::vector<int64_t> cost_f, cost1, cost2;  // tiles of the fused, dK/dV and dQ items
  // per (b, kv head, kv block): the first and one past the last q block that visits it (any of
  // the G heads; lo ≥ hi: none)
  std::vector<int64_t> qlo, qhi;
  // C > 1, fused: item (b, kv head, c)'s slab, q blocks [slab_q0, slab_q1) of the G heads
  // (G × rows × Dp floats at slab_off; chunk 0 in dq itself where dq_in_place)
  std::vector<int64_t> slab_q0, slab_q1, slab_off;
  int64_t slab_floats = 0;
  bool dq_in_place = false;
  bool fused = true;
  int64_t lo(int64_t c) const { return jb[c]; }
  int64_t hi(int64_t c) const { return jb[c + 1]; }
};

// the time of a pass whose items cost cost[i], handed out largest first, each to the first
// idle of `threads` threads (list scheduling, as sched.h's Queue does)
inline int64_t makespan(std::vector<int64_t> cost, int64_t threads) {
  std::sort(cost.begin(), cost.end(), std::greater<int64_t>());
  std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>> idle;
  for (int64_t t = 0; t < std::max<int64_t>(threads, 1); ++t) idle.push(0);
  int64_t end = 0;
  for (const int64_t c : cost) {
    const int64_t t = idle.top() + c;
    idle.pop();
    idle.push(t);
    end = std::max(end, t);
  }
  return end;
}

// chunk boundaries of C runs over nkb kv blocks, as equal as they come
inline std::vector<int64_t> chunk_bounds(int64_t nkb, int64_t C) {
  std::vector<int64_t> jb(C + 1);
  for (int64_t c = 0; c <= C; ++c) jb[c] = c * nkb / C;
  return jb;
}

// G × (the chunk's q rows) × Dp floats per (b, kv head, chunk): the fused pass's dQ slabs (none
// for chunk 0 where dq takes its sums in place)
inline int64_t slab_floats(const Dims& dm, int64_t nkb, int64_t Dp, bool in_place, const std::vector<int64_t>& jb,
                           const std::vector<int64_t>& qlo, const std::vector<int64_t>& qhi,
                           std::vector<int64_t>* q0 = nullptr, std::vector<int64_t>* q1 = nullptr,
                           std::vector<int64_t>* off = nullptr) {
  const int64_t C = static_cast<int64_t>(jb.size()) - 1;
  int64_t total = 0;
  for (int64_t hi = 0; hi < dm.B * dm.Hkv; ++hi)
    for (int64_t c = 0; c < C; ++c) {
      int64_t lo = INT64_MAX, up = 0;
      for (int64_t jk = jb[c]; jk < jb[c + 1]; ++jk)
        if (qlo[hi * nkb + jk] < qhi[hi * nkb + jk]) {
          lo = std::min(lo, qlo[hi * nkb + jk]);
          up = std::max(up, qhi[hi * nkb + jk]);
        }
      if (lo >= up) lo = up = 0;
      const int64_t rows = std::min(dm.Nq, up * dm.bq) - std::min(dm.Nq, lo * dm.bq);
      if (q0 != nullptr) {
        (*q0)[hi * C + c] = lo;
        (*q1)[hi * C + c] = up;
        (*off)[hi * C + c] = total;
      }
      if (!(in_place && c == 0)) total += dm.G * rows * Dp;
    }
  return total;
}

// The chunks and the schedule of one backward call.  C depends on the problem only (shape,
// mask, mods), never on the thread count: it sets the order of dQ's sums.
// ATTNLAB_NATIVE_BWD_CHUNKS=n (tests) sets C = min(n, kv blocks) whatever the memory.  Score
// mods with learnable parameters keep C = 1: their gradient sums live per (b, h, q block)
// (ScoreMods slots), which one item must own.
inline BwdPlan bwd_plan(const Dims& dm, const Mask& mk, const ScoreMods& sm, int64_t nqb, int64_t nkb, int64_t Dp,
                        bool dq_in_place, int64_t threads) {
  BwdPlan pl;
  pl.dq_in_place = dq_in_place;
  const int64_t BH = dm.B * dm.Hkv;
  pl.cost1.assign(BH * nkb, 0);
  pl.cost2.assign(dm.B * dm.H * nqb, 0);
  pl.qlo.assign(BH * nkb, INT64_MAX);
  pl.qhi.assign(BH * nkb, 0);
  // (on the calling thread: one parallel region more costs more than this under load)
  for (int64_t b = 0; b < dm.B; ++b)
    for (int64_t h = 0; h < dm.H; ++h)
      for (int64_t iq = 0; iq < nqb; ++iq) {
        const int64_t r0 = iq * dm.bq, r1 = std::min(dm.Nq, r0 + dm.bq), kvh = b * dm.Hkv + h / dm.G;
        int64_t& c2 = pl.cost2[(b * dm.H + h) * nqb + iq];
        for (int64_t jk = 0; jk < nkb; ++jk) {
          if (!block_visits(mk, b, h, r0, r1, jk * dm.bk, std::min(dm.Nk, (jk + 1) * dm.bk))) continue;
          ++c2;
          const int64_t x = kvh * nkb + jk;
          ++pl.cost1[x];
          pl.qlo[x] = std::min(pl.qlo[x], iq);
          pl.qhi[x] = std::max(pl.qhi[x], iq + 1);
        }
      }
  const bool mod_grads = sm.dslope_items != nullptr || sm.dtable_items != nullptr;
  const char* ce = std::getenv("ATTNLAB_NATIVE_BWD_CHUNKS");
  if (mod_grads) {
    pl.C = 1;
  } else if (ce != nullptr && std::atoll(ce) > 0) {
    pl.C = std::min<int64_t>(std::atoll(ce), std::max<int64_t>(nkb, 1));
  } else {
    pl.C = std::min((BWD_ITEMS + BH - 1) / BH, std::max<int64_t>(nkb / BWD_CHUNK_BLOCKS, 1));
    while (pl.C > 1 &&
           slab_floats(dm, nkb, Dp, dq_in_place, chunk_bounds(nkb, pl.C), pl.qlo, pl.qhi) * 4 > BWD_SLABS_MAX)
      --pl.C;
  }
  pl.jb = chunk_bounds(nkb, pl.C);
  pl.cost_f.assign(BH * pl.C, 0);
  for (int64_t hi = 0; hi < BH; ++hi)
    for (int64_t c = 0; c < pl.C; ++c)
      for (int64_t jk = pl.lo(c); jk < pl.hi(c); ++jk) pl.cost_f[hi * pl.C + c] += pl.cost1[hi * nkb + jk];
  const char* e = std::getenv("ATTNLAB_NATIVE_BWD");
  if (e != nullptr && std::strcmp(e, "fused") == 0)
    pl.fused = true;
  else if (e != nullptr && std::strcmp(e, "split") == 0)
    pl.fused = false;
  else
    pl.fused = 5 * makespan(pl.cost_f, threads) <= 4 * makespan(pl.cost1, threads) + 3 * makespan(pl.cost2, threads);
  if (pl.fused && pl.C > 1) {
    pl.slab_q0.assign(BH * pl.C, 0);
    pl.slab_q1.assign(BH * pl.C, 0);
    pl.slab_off.assign(BH * pl.C, 0);
    pl.slab_floats =
        slab_floats(dm, nkb, Dp, dq_in_place, pl.jb, pl.qlo, pl.qhi, &pl.slab_q0, &pl.slab_q1, &pl.slab_off);
  }
  return pl;
}

// dst[0:n] += src[0:n]: the chunks' dQ sums, added alike in both schedules
inline void add_rows(float* dst, const float* src, int64_t n) {
  for (int64_t x = 0; x < n; ++x) dst[x] += src[x];
}

template <typename T>
struct BwdArgs {
  View<T> qv, kv, vv, gv;
  const float* lp;  // LSE (B, H, Nq) contiguous
  const float* dp;  // Δ (B, H, Nq) contiguous
  T *dqp, *dkp, *dvp;
  const Dims& dm;
  const Mask& mk;
  const ScoreMods& sm;
  float scale, dsc;  // dsc: dS's scale (1 with mods: they scale after their chain rule)
  int64_t nqb, nkb, Dp, Dvp;
  const float* q32;   // Q (B, H, Nq, Dp) float32
  const float* do32;  // dO (B, H, Nq, Dvp) float32
};

// One thread's buffers and the backward's tile loops.  The fast paths run every product on the
// register-blocked micro-kernel (gemm_f32.h), P and dS read in place for Pᵀ·dO and dSᵀ·Q;
// hidden entries are P = dS = 0 there, so a result that is not finite (a NaN/inf in a hidden
// key or value) is computed again on the careful paths, where hidden entries are skipped.
template <typename T>
struct BwdWork {
  const BwdArgs<T>& a;
  int64_t D, Dv, bq, bk;
  // careful paths
  std::vector<float> KT, VT, Kb, dKb, dVb, dKt, dVt, Qr, dOr, Qb, dOb, dQb, S, P, dP, S0, dQt;
  std::vector<RowMask> rms;
  // fast paths
  std::vector<float> KTz, VTz, Kz, dKa, dVa, dQa, St, dPt, Lr, Dr;
  std::vector<float> dQh;  // fused, one chunk: the G heads' dQ where dq is not float32 (lazily sized)
  std::vector<float> dQc;  // split's dQ item: one chunk's sum (C > 1)

  explicit BwdWork(const BwdArgs<T>& args)
      : a(args), D(args.dm.D), Dv(args.dm.Dv), bq(args.dm.bq), bk(args.dm.bk) {
    KT.resize(D * bk);
    VT.resize(Dv * bk);
    Kb.resize(bk * D);
    dKb.resize(bk * D);
    dVb.resize(bk * Dv);
    dKt.resize(bk * D);
    dVt.resize(bk * Dv);
    Qr.resize(D);
    dOr.resize(Dv);
    Qb.resize(bq * D);
    dOb.resize(bq * Dv);
    dQb.resize(bq * D);
    S.resize(bk);
    P.resize(bk);
    dP.resize(bk);
    S0.resize(bk);
    dQt.resize(D);
    rms.resize(bq);
    KTz.assign(D * bk, 0.0f);
    VTz.assign(Dv * bk, 0.0f);
    Kz.assign(bk * a.Dp, 0.0f);
    dKa.resize(bk * a.Dp);
    dVa.resize(bk * a.Dvp);
    dQa.resize(bq * a.Dp);
    St.resize(bq * bk);
    dPt.resize(bq * bk);
    Lr.resize(bq);
    Dr.resize(bq);
    dQc.resize(bq * a.Dp);
  }

  // the kv block's Kᵀ and Vᵀ panels (D × bk, Dv × bk; columns past m zero), with_k: K's rows
  // (m × Dp, zeros past D) for dQ += dS·K
  void load_block(int64_t b, int64_t hk, int64_t c0, int64_t m, bool with_k) {
    if (m < bk) {
      std::fill(KTz.begin(), KTz.end(), 0.0f);
      std::fill(VTz.begin(), VTz.end(), 0.0f);
    }
    load_kt(KTz.data(), a.kv, b, hk, c0, m, D, bk);
    load_kt(VTz.data(), a.vv, b, hk, c0, m, Dv, bk);
    if (with_k)
      for (int64_t c = 0; c < m; ++c) load_row(Kz.data() + c * a.Dp, a.kv.row(b, hk, c0 + c), D, a.kv.s3);
  }

  // one tile, q rows [r0, r0 + n) of head h against the loaded kv block [c0, c0 + m): St gets P,
  // dPt gets dS (rows [0, n), columns [0, mp); hidden rows and entries exact zeros)
  void tile_pds(const float* Qp, const float* dOp, const float* KTp, const float* VTp, int64_t b, int64_t h,
                int64_t r0, int64_t n, int64_t c0, int64_t m, int64_t mp, double* dslope, double* dtable) {
    const Dims& dm = a.dm;
    const ScoreMods& sm = a.sm;
    const int64_t c1 = c0 + m;
    for (int64_t r = 0; r < n; ++r) {
      Lr[r] = a.lp[(b * dm.H + h) * dm.Nq + r0 + r];
      Dr[r] = a.dp[(b * dm.H + h) * dm.Nq + r0 + r];
    }
    matmul(Qp, a.Dp, KTp, bk, St.data(), bk, n, mp, D);
    matmul(dOp, a.Dvp, VTp, bk, dPt.data(), bk, n, mp, Dv);
    for (int64_t r = 0; r < n; ++r) {
      float* Sr = St.data() + r * bk;
      float* dPr = dPt.data() + r * bk;
      const RowMask rm = a.mk.row(b, h, r0 + r);
      if (Lr[r] == NEG_INF || rm.none(c0, c1)) {
        std::fill(Sr, Sr + mp, 0.0f);
        std::fill(dPr, dPr + mp, 0.0f);
        continue;
      }
      attnlab_rows::row_scale(Sr, m, a.scale);
      for (int64_t c = m; c < mp; ++c) Sr[c] = NEG_INF;
      if (!rm.full(c0, c1)) rm.hide(Sr, c0, m);
      if (sm.active()) {  // the raw scores, for the mods' derivatives
        std::copy(Sr, Sr + m, S0.data());
        sm.apply_row(Sr, b, h, r0 + r, c0, m, rm);
      }
      attnlab_rows::row_ds<true>(Sr, dPr, mp, Lr[r], Dr[r], a.dsc);
      if (sm.active()) sm.grad_row(dPr, S0.data(), a.scale, b, h, r0 + r, c0, m, rm, dslope, dtable);
    }
  }

  // dK, dV rows [c0, c0 + m) of (b, hk) from dKa / dVa; false where one is not finite
  bool store_dkv(int64_t b, int64_t hk, int64_t c0, int64_t m) {
    const Dims& dm = a.dm;
    float z = 0.0f;
    for (int64_t c = 0; c < m; ++c) {
      T* dkr = a.dkp + ((b * dm.Hkv + hk) * dm.Nk + c0 + c) * D;
      T* dvr = a.dvp + ((b * dm.Hkv + hk) * dm.Nk + c0 + c) * Dv;
      z = store_row(dkr, dKa.data() + c * a.Dp, D, z);
      z = store_row(dvr, dVa.data() + c * a.Dvp, Dv, z);
    }
    return z == 0.0f;
  }

  // the fast path of split's dK/dV item (b, kv head, kv block): four products per tile
  bool dkv_fast(int64_t it) {
    const Dims& dm = a.dm;
    const int64_t jk = it % a.nkb, hk = (it / a.nkb) % dm.Hkv, b = it / (a.nkb * dm.Hkv);
    const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0, mp = (m + 15) / 16 * 16;
    load_block(b, hk, c0, m, false);
    std::fill(dKa.begin(), dKa.begin() + m * a.Dp, 0.0f);
    std::fill(dVa.begin(), dVa.begin() + m * a.Dvp, 0.0f);
    for (int64_t h = hk * dm.G; h < (hk + 1) * dm.G; ++h) {
      for (int64_t iq = 0; iq < a.nqb; ++iq) {
        const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
        if (!block_visits(a.mk, b, h, r0, r1, c0, c1)) continue;
        const float* Qp = a.q32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dp;
        const float* dOp = a.do32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dvp;
        tile_pds(Qp, dOp, KTz.data(), VTz.data(), b, h, r0, n, c0, m, mp, nullptr, nullptr);
        attnlab_gemm::gemm<true, true>(St.data(), bk, dOp, a.Dvp, dVa.data(), a.Dvp, m, a.Dvp, n);  // dV += Pᵀ·dO
        attnlab_gemm::gemm<true, true>(dPt.data(), bk, Qp, a.Dp, dKa.data(), a.Dp, m, a.Dp, n);     // dK += dSᵀ·Q
      }
    }
    return store_dkv(b, hk, c0, m);
  }

  // the fast path of split's dQ item (b, h, q block) on the call's packed Kᵀ, Vᵀ and K: the kv
  // blocks it sees summed chunk by chunk (pl.C > 1: each chunk's sum from zero, then the chunks'
  // sums added in order, as the fused pass's slabs are)
  bool dq_fast(int64_t it, const float* kt32p, const float* vt32p, const float* k32p, const BwdPlan& pl) {
    const Dims& dm = a.dm;
    a.sm.zero_slot(it);  // this work item's slope / table gradient sums
    const int64_t iq = it % a.nqb, h = (it / a.nqb) % dm.H, b = it / (a.nqb * dm.H);
    const int64_t hk = h / dm.G, kvh = b * dm.Hkv + hk;
    const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
    const float* Qp = a.q32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dp;
    const float* dOp = a.do32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dvp;
    std::fill(dQa.begin(), dQa.begin() + n * a.Dp, 0.0f);
    float* dQs = pl.C > 1 ? dQc.data() : dQa.data();  // the chunk's sum
    for (int64_t ch = 0; ch < pl.C; ++ch) {
      bool seen = false;
      for (int64_t jk = pl.lo(ch); jk < pl.hi(ch); ++jk) {
        const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0, mp = (m + 15) / 16 * 16;
        if (!block_visits(a.mk, b, h, r0, r1, c0, c1)) continue;
        if (!seen && pl.C > 1) std::fill(dQs, dQs + n * a.Dp, 0.0f);
        seen = true;
        tile_pds(Qp, dOp, kt32p + (kvh * a.nkb + jk) * D * bk, vt32p + (kvh * a.nkb + jk) * Dv * bk, b, h, r0, n, c0,
                 m, mp, a.sm.dslope(it), a.sm.dtable(it));
        attnlab_gemm::gemm<false, true>(dPt.data(), bk, k32p + (kvh * dm.Nk + c0) * a.Dp, a.Dp, dQs, a.Dp, n, a.Dp,
                                        m);  // dQ += dS·K
      }
      if (seen && pl.C > 1) add_rows(dQa.data(), dQs, n * a.Dp);
    }
    float z = 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      T* dst = a.dqp + ((b * dm.H + h) * dm.Nq + r0 + r) * D;
      z = store_row(dst, dQa.data() + r * a.Dp, D, z);
    }
    return z == 0.0f;
  }

  // the fused item (b, kv head, chunk ch): for each kv block of the chunk, every q block of the
  // G query heads that sees it: S, dP, then dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K (five products
  // per tile).  dQ accumulates in dq itself where that is float32 rows of Dp (pl.C > 1: chunk
  // 0's sums), else in dQh (pl.C = 1) or the item's slab, over the kv blocks in order as
  // split's dQ item sums them; pl.C = 1 stores it here, pl.C > 1 leaves the chunks' sums to
  // reduce_dq.  A kv block or q block whose result is not finite runs again on its careful path.
  void fused(int64_t it, const BwdPlan& pl, float* slabs) {
    const Dims& dm = a.dm;
    const int64_t ch = it % pl.C, hi = it / pl.C;
    const int64_t b = hi / dm.Hkv, hk = hi % dm.Hkv, G = dm.G, h0 = hk * G;
    const bool in_place = pl.dq_in_place;
    const int64_t ldq = a.Dp;
    // the q rows [q0, q0 + rows) of the G heads, head g's row r at dQ + g · hs + (r - q0) · ldq
    int64_t q0 = 0, rows = dm.Nq;
    if (pl.C > 1) {
      q0 = std::min(dm.Nq, pl.slab_q0[it] * bq);
      rows = std::min(dm.Nq, pl.slab_q1[it] * bq) - q0;
    }
    float* dQ;
    int64_t hs = rows * ldq;
    if (in_place && (pl.C == 1 || ch == 0)) {
      dQ = reinterpret_cast<float*>(a.dqp) + ((b * dm.H + h0) * dm.Nq + q0) * D;
      hs = dm.Nq * D;
    } else if (pl.C > 1) {
      dQ = slabs + pl.slab_off[it];
    } else {
      dQh.resize(G * dm.Nq * a.Dp);
      dQ = dQh.data();
    }
    for (int64_t g = 0; g < G; ++g) std::fill(dQ + g * hs, dQ + g * hs + rows * ldq, 0.0f);
    if (pl.C == 1)
      for (int64_t h = h0; h < h0 + G; ++h)
        for (int64_t iq = 0; iq < a.nqb; ++iq) a.sm.zero_slot((b * dm.H + h) * a.nqb + iq);
    for (int64_t jk = pl.lo(ch); jk < pl.hi(ch); ++jk) {
      const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0, mp = (m + 15) / 16 * 16;
      load_block(b, hk, c0, m, true);
      std::fill(dKa.begin(), dKa.begin() + m * a.Dp, 0.0f);
      std::fill(dVa.begin(), dVa.begin() + m * a.Dvp, 0.0f);
      for (int64_t h = h0; h < h0 + G; ++h) {
        for (int64_t iq = 0; iq < a.nqb; ++iq) {
          const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
          if (!block_visits(a.mk, b, h, r0, r1, c0, c1)) continue;
          const int64_t it2 = (b * dm.H + h) * a.nqb + iq;
          const float* Qp = a.q32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dp;
          const float* dOp = a.do32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dvp;
          tile_pds(Qp, dOp, KTz.data(), VTz.data(), b, h, r0, n, c0, m, mp, a.sm.dslope(it2), a.sm.dtable(it2));
          attnlab_gemm::gemm<true, true>(St.data(), bk, dOp, a.Dvp, dVa.data(), a.Dvp, m, a.Dvp, n);
          attnlab_gemm::gemm<true, true>(dPt.data(), bk, Qp, a.Dp, dKa.data(), a.Dp, m, a.Dp, n);
          attnlab_gemm::gemm<false, true>(dPt.data(), bk, Kz.data(), a.Dp, dQ + (h - h0) * hs + (r0 - q0) * ldq, ldq,
                                          n, a.Dp, m);
        }
      }
      if (!store_dkv(b, hk, c0, m)) dkv_careful((b * dm.Hkv + hk) * a.nkb + jk);
    }
    if (pl.C > 1) return;
    for (int64_t h = h0; h < h0 + G; ++h)
      for (int64_t iq = 0; iq < a.nqb; ++iq) {
        const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq);
        float z = 0.0f;
        for (int64_t i = r0; i < r1; ++i) {
          const float* src = dQ + (h - h0) * hs + i * ldq;
          T* dst = a.dqp + ((b * dm.H + h) * dm.Nq + i) * D;
          if (in_place) {
            for (int64_t d = 0; d < D; ++d) z += src[d] - src[d];
          } else {
            z = store_row(dst, src, D, z);
          }
        }
        if (z != 0.0f) dq_careful((b * dm.H + h) * a.nqb + iq);
      }
  }

  // the fused pass's dQ (pl.C > 1) of q block `it` (b, h, q block), once every chunk of its kv
  // head is done: the slabs of the chunks that it sees added in chunk order (as dq_fast adds
  // its chunks' sums), then stored; not finite: the careful path
  void reduce_dq(int64_t it, const BwdPlan& pl, const float* slabs) {
    const Dims& dm = a.dm;
    const int64_t iq = it % a.nqb, h = (it / a.nqb) % dm.H, b = it / (a.nqb * dm.H);
    const int64_t hk = h / dm.G, h0 = hk * dm.G;
    const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
    std::fill(dQa.begin(), dQa.begin() + n * a.Dp, 0.0f);
    for (int64_t ch = 0; ch < pl.C; ++ch) {
      const int64_t si = (b * dm.Hkv + hk) * pl.C + ch;
      if (iq < pl.slab_q0[si] || iq >= pl.slab_q1[si]) continue;  // no kv block of the chunk sees it
      bool seen = false;
      for (int64_t jk = pl.lo(ch); jk < pl.hi(ch) && !seen; ++jk)
        seen = block_visits(a.mk, b, h, r0, r1, jk * bk, std::min(dm.Nk, (jk + 1) * bk));
      if (!seen) continue;
      const int64_t q0 = std::min(dm.Nq, pl.slab_q0[si] * bq), rows = std::min(dm.Nq, pl.slab_q1[si] * bq) - q0;
      const float* src = pl.dq_in_place && ch == 0
                             ? reinterpret_cast<const float*>(a.dqp) + ((b * dm.H + h) * dm.Nq + r0) * D
                             : slabs + pl.slab_off[si] + ((h - h0) * rows + r0 - q0) * a.Dp;
      add_rows(dQa.data(), src, n * a.Dp);
    }
    float z = 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      T* dst = a.dqp + ((b * dm.H + h) * dm.Nq + r0 + r) * D;
      z = store_row(dst, dQa.data() + r * a.Dp, D, z);
    }
    if (z != 0.0f) dq_careful(it);
  }

  // the careful paths: hidden entries skipped (an exact zero whatever K, V hold), per row
  void dkv_careful(int64_t it) {
    const Dims& dm = a.dm;
    const Mask& mk = a.mk;
    const ScoreMods& sm = a.sm;
    const View<T>&qv = a.qv, &kv = a.kv, &vv = a.vv, &gv = a.gv;
    const float *lp = a.lp, *dp = a.dp;
    const float scale = a.scale, dsc = a.dsc;
    const int64_t nqb = a.nqb, nkb = a.nkb;
    T *dkp = a.dkp, *dvp = a.dvp;
    (void)nqb;
    const int64_t jk = it % nkb, hk = (it / nkb) % dm.Hkv, b = it / (nkb * dm.Hkv);
    const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0;
    load_kt(KT.data(), kv, b, hk, c0, m, D, bk);
    load_kt(VT.data(), vv, b, hk, c0, m, Dv, bk);
    std::fill(dKb.begin(), dKb.begin() + m * D, 0.0f);
    std::fill(dVb.begin(), dVb.begin() + m * Dv, 0.0f);
    for (int64_t h = hk * dm.G; h < (hk + 1) * dm.G; ++h) {
      for (int64_t iq = 0; iq < nqb; ++iq) {
        const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq);
        if (!block_visits(mk, b, h, r0, r1, c0, c1)) continue;
        // this q block's sums, added once (two-level sums keep long columns accurate)
        std::fill(dKt.begin(), dKt.begin() + m * D, 0.0f);
        std::fill(dVt.begin(), dVt.begin() + m * Dv, 0.0f);
        for (int64_t i = r0; i < r1; ++i) {
          const float L = lp[(b * dm.H + h) * dm.Nq + i];
          if (L == NEG_INF) continue;  // fully masked row: no gradient
          const RowMask rm = mk.row(b, h, i);
          if (rm.none(c0, c1)) continue;
          const float Di = dp[(b * dm.H + h) * dm.Nq + i];
          load_row(Qr.data(), qv.row(b, h, i), D, qv.s3);
          load_row(dOr.data(), gv.row(b, h, i), Dv, gv.s3);
          score_row(S.data(), Qr.data(), KT.data(), D, bk, m, scale, rm, c0);
          if (sm.active()) {
            std::copy(S.data(), S.data() + m, S0.data());
            sm.apply_row(S.data(), b, h, i, c0, m, rm);
          }
          for (int64_t c = 0; c < m; ++c) P[c] = exp_f(S[c] - L);
          for (int64_t c = 0; c < m; ++c) dP[c] = 0.0f;
          for (int64_t e = 0; e < Dv; ++e) {
            const float g = dOr[e];
            const float* vt = VT.data() + e * bk;
            for (int64_t c = 0; c < m; ++c) dP[c] = MADD(g, vt[c], dP[c]);
          }
          for (int64_t c = 0; c < m; ++c) {
            if (S[c] == NEG_INF) continue;  // hidden
            const float p = P[c];
            float* dvr = dVt.data() + c * Dv;
            for (int64_t e = 0; e < Dv; ++e) dvr[e] += p * dOr[e];
            float ds = p * (dP[c] - Di) * dsc;
            if (sm.active()) ds = sm.grad(S0[c], ds, b, h, sm.dist(i, c0 + c), nullptr, nullptr) * scale;
            float* dkr = dKt.data() + c * D;
            for (int64_t d = 0; d < D; ++d) dkr[d] += ds * Qr[d];
          }
        }
        for (int64_t x = 0; x < m * D; ++x) dKb[x] += dKt[x];
        for (int64_t x = 0; x < m * Dv; ++x) dVb[x] += dVt[x];
      }
    }
    for (int64_t c = 0; c < m; ++c) {
      T* dkr = dkp + ((b * dm.Hkv + hk) * dm.Nk + c0 + c) * D;
      T* dvr = dvp + ((b * dm.Hkv + hk) * dm.Nk + c0 + c) * Dv;
      for (int64_t d = 0; d < D; ++d) dkr[d] = static_cast<T>(dKb[c * D + d]);
      for (int64_t e = 0; e < Dv; ++e) dvr[e] = static_cast<T>(dVb[c * Dv + e]);
    }
  }

  void dq_careful(int64_t it) {
    const Dims& dm = a.dm;
    const Mask& mk = a.mk;
    const ScoreMods& sm = a.sm;
    const View<T>&qv = a.qv, &kv = a.kv, &vv = a.vv, &gv = a.gv;
    const float *lp = a.lp, *dp = a.dp;
    const float scale = a.scale, dsc = a.dsc;
    const int64_t nqb = a.nqb, nkb = a.nkb;
    T* dqp = a.dqp;
    (void)nkb;
    sm.zero_slot(it);  // this work item's slope / table gradient sums
    const int64_t iq = it % nqb, h = (it / nqb) % dm.H, b = it / (nqb * dm.H);
    const int64_t hk = h / dm.G;
    const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
    for (int64_t r = 0; r < n; ++r) {
      load_row(Qb.data() + r * D, qv.row(b, h, r0 + r), D, qv.s3);
      load_row(dOb.data() + r * Dv, gv.row(b, h, r0 + r), Dv, gv.s3);
      rms[r] = mk.row(b, h, r0 + r);
    }
    std::fill(dQb.begin(), dQb.begin() + n * D, 0.0f);
    for (int64_t jk = 0; jk < nkb; ++jk) {
      const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0;
      if (!block_visits(mk, b, h, r0, r1, c0, c1)) continue;
      load_kt(KT.data(), kv, b, hk, c0, m, D, bk);
      load_kt(VT.data(), vv, b, hk, c0, m, Dv, bk);
      for (int64_t c = 0; c < m; ++c) load_row(Kb.data() + c * D, kv.row(b, hk, c0 + c), D, kv.s3);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t i = r0 + r;
        const float L = lp[(b * dm.H + h) * dm.Nq + i];
        if (L == NEG_INF || rms[r].none(c0, c1)) continue;
        const float Di = dp[(b * dm.H + h) * dm.Nq + i];
        score_row(S.data(), Qb.data() + r * D, KT.data(), D, bk, m, scale, rms[r], c0);
        if (sm.active()) {
          std::copy(S.data(), S.data() + m, S0.data());
          sm.apply_row(S.data(), b, h, i, c0, m, rms[r]);
        }
        const float* g = dOb.data() + r * Dv;
        for (int64_t c = 0; c < m; ++c) dP[c] = 0.0f;
        for (int64_t e = 0; e < Dv; ++e) {
          const float ge = g[e];
          const float* vt = VT.data() + e * bk;
          for (int64_t c = 0; c < m; ++c) dP[c] = MADD(ge, vt[c], dP[c]);
        }
        float* dqr = dQb.data() + r * D;
        float* tq = dQt.data();
        for (int64_t d = 0; d < D; ++d) tq[d] = 0.0f;
        for (int64_t c = 0; c < m; ++c) {
          if (S[c] == NEG_INF) continue;  // hidden
          float ds = exp_f(S[c] - L) * (dP[c] - Di) * dsc;
          if (sm.active()) ds = sm.grad(S0[c], ds, b, h, sm.dist(i, c0 + c), sm.dslope(it), sm.dtable(it)) * scale;
          const float* kr = Kb.data() + c * D;
          for (int64_t d = 0; d < D; ++d) tq[d] += ds * kr[d];
        }
        for (int64_t d = 0; d < D; ++d) dqr[d] += tq[d];
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      T* dst = dqp + ((b * dm.H + h) * dm.Nq + r0 + r) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(dQb[r * D + d]);
    }
  }
};

// the last backward call's schedule: its chunk count C, negative where it ran split (diagnostics:
// the extension's last_bwd_plan)
inline std::atomic<int64_t> last_bwd_plan{0};

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                   const Dims& dm, const Mask& mk, const ScoreMods& sm, float scale) {
  const int64_t Dp = (dm.D + 15) / 16 * 16, Dvp = (dm.Dv + 15) / 16 * 16;
  const at::Tensor q32 = rows_f32(q, Dp), do32 = rows_f32(dout, Dvp);
  const BwdArgs<T> a{view_of<T>(q),
                     view_of<T>(k),
                     view_of<T>(v),
                     view_of<T>(dout),
                     lse.data_ptr<float>(),
                     delta.data_ptr<float>(),
                     dq.data_ptr<T>(),
                     dk.data_ptr<T>(),
                     dv.data_ptr<T>(),
                     dm,
                     mk,
                     sm,
                     scale,
                     sm.active() ? 1.0f : scale,
                     (dm.Nq + dm.bq - 1) / dm.bq,
                     (dm.Nk + dm.bk - 1) / dm.bk,
                     Dp,
                     Dvp,
                     q32.data_ptr<float>(),
                     do32.data_ptr<float>()};
  const int64_t threads = at::get_num_threads();
  const BwdPlan pl = bwd_plan(dm, mk, sm, a.nqb, a.nkb, Dp, std::is_same_v<T, float> && dm.D == Dp, threads);
  last_bwd_plan.store(pl.fused ? pl.C : -pl.C);
  if (pl.fused) {
    at::Tensor slabs;  // pl.C > 1: the items' dQ sums
    if (pl.slab_floats > 0) slabs = at::empty({pl.slab_floats}, q.options().dtype(at::kFloat));
    float* sp = pl.slab_floats > 0 ? slabs.data_ptr<float>() : nullptr;
    attnlab_sched::Queue queue(dm.B * dm.Hkv * pl.C, [&](int64_t i) { return pl.cost_f[i]; });
    // chunks of each (b, kv head) not yet done: the thread that finishes its last one adds
    // up the head's dQ (reduce_dq; the same sums in the same order whichever thread it is)
    std::vector<std::atomic<int64_t>> left(static_cast<size_t>(dm.B * dm.Hkv));
    for (auto& x : left) x.store(pl.C, std::memory_order_relaxed);
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      BwdWork<T> w(a);
      attnlab_sched::drain(queue, [&](int64_t it) {
        w.fused(it, pl, sp);
        const int64_t hi = it / pl.C;
        if (pl.C == 1 || left[hi].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
        const int64_t b = hi / dm.Hkv, hk = hi % dm.Hkv;
        for (int64_t h = hk * dm.G; h < (hk + 1) * dm.G; ++h)
          for (int64_t iq = 0; iq < a.nqb; ++iq) w.reduce_dq((b * dm.H + h) * a.nqb + iq, pl, sp);
      });
    });
    return;
  }
  // ---- split, pass 1: dK, dV per (b, kv head, kv block), over the G query heads and the q blocks
  attnlab_sched::Queue queue1(dm.B * dm.Hkv * a.nkb, [&](int64_t i) { return pl.cost1[i]; });
  attnlab_sched::Queue queue2(dm.B * dm.H * a.nqb, [&](int64_t i) { return pl.cost2[i]; });
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    BwdWork<T> w(a);
    attnlab_sched::drain(queue1, [&](int64_t it) {
      if (!w.dkv_fast(it)) w.dkv_careful(it);
    });
  });
  // ---- split, pass 2: dQ per (b, h, q block), over the kv blocks its rows see.  float32 copies
  // of Kᵀ, Vᵀ (packed per kv block) and K (D padded to 16), made once: tiles read them in place.
  const View<T> kv = view_of<T>(k), vv = view_of<T>(v);
  attnlab_scratch::Scratch ws;  // the large packs: views into the process's scratch (scratch.h)
  const at::Tensor kt32 = pack_t_blocked(kv, dm.B, dm.Hkv, dm.Nk, dm.D, dm.bk, q.options(), ws, 0);
  const at::Tensor vt32 = pack_t_blocked(vv, dm.B, dm.Hkv, dm.Nk, dm.Dv, dm.bk, q.options(), ws, 1);
  at::Tensor k32 = ws.empty(2, {dm.B, dm.Hkv, dm.Nk, Dp}, q.options().dtype(at::kFloat)).zero_();
  k32.narrow(3, 0, dm.D).copy_(k);
  const float* kt32p = kt32.data_ptr<float>();
  const float* vt32p = vt32.data_ptr<float>();
  const float* k32p = k32.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    BwdWork<T> w(a);
    attnlab_sched::drain(queue2, [&](int64_t it) {
      if (!w.dq_fast(it, kt32p, vt32p, k32p, pl)) w.dq_careful(it);
    });
  });
}

// Δ = rowsum(dO ∘ O) − dLSE in float32 from the upcast output, summed in the same order and
// with the same fused multiply-adds as the kernel's dP = dO · v: where a row sees one key
// (O = v exactly) dP − Δ is exactly 0, as in the math.
template <typename T>
void delta_impl(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& dlse, at::Tensor& delta,
                const Dims& dm) {
  const View<T> gv = view_of<T>(dout), ov = view_of<T>(out);
  const float* dl = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  float* dp = delta.data_ptr<float>();
  at::parallel_for(0, dm.B * dm.H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> g(dm.Dv), o(dm.Dv);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / dm.H, h = bh % dm.H;
      for (int64_t i = 0; i < dm.Nq; ++i) {
        load_row(g.data(), gv.row(b, h, i), dm.Dv, gv.s3);
        load_row(o.data(), ov.row(b, h, i), dm.Dv, ov.s3);
        float d = 0.0f;
        for (int64_t e = 0; e < dm.Dv; ++e) d = MADD(g[e], o[e], d);
        const int64_t idx = bh * dm.Nq + i;
        dp[idx] = dl != nullptr ? d - dl[idx] : d;
      }
    }
  });
}

}  // namespace
