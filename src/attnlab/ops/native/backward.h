// The native kernel's backward: Δ (delta_impl) and the two schedules (backward_impl), "fused"
// (one pass per (b, kv head)) and "split" (a dK/dV pass over kv blocks, a dQ pass over q
// blocks), their tile loops in BwdWork (fast paths on the micro-kernel, careful paths that
// skip hidden entries).  Included by kernel.cpp only (see tiles.h: an anonymous namespace,
// one unit).
#pragma once

#include <algorithm>
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
// "fused": one pass over (b, kv head) work items, a thread owning the head's dK, dV and dQ,
// so every tile's S and dP serve all three (5 tile products, FlashAttention-2's count), with
// parallelism B·Hkv.  Fused where that many items keep the threads busy enough to beat
// split's extra 2/5 of work (items / (threads · rounds) ≥ 5/7); ATTNLAB_NATIVE_BWD=fused /
// split forces one.  Both give the same bits.
inline bool bwd_fused(int64_t items, int64_t threads) {
  const char* e = std::getenv("ATTNLAB_NATIVE_BWD");
  if (e != nullptr && std::strcmp(e, "fused") == 0) return true;
  if (e != nullptr && std::strcmp(e, "split") == 0) return false;
  threads = std::max<int64_t>(threads, 1);
  const int64_t rounds = (items + threads - 1) / threads;
  return 7 * items >= 5 * threads * rounds;
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
  std::vector<float> dQh;  // fused: the G heads' dQ where dq is not float32 (lazily sized)

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

  // the fast path of split's dQ item (b, h, q block) on the call's packed Kᵀ, Vᵀ and K
  bool dq_fast(int64_t it, const float* kt32p, const float* vt32p, const float* k32p) {
    const Dims& dm = a.dm;
    a.sm.zero_slot(it);  // this work item's slope / table gradient sums
    const int64_t iq = it % a.nqb, h = (it / a.nqb) % dm.H, b = it / (a.nqb * dm.H);
    const int64_t hk = h / dm.G, kvh = b * dm.Hkv + hk;
    const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
    const float* Qp = a.q32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dp;
    const float* dOp = a.do32 + ((b * dm.H + h) * dm.Nq + r0) * a.Dvp;
    std::fill(dQa.begin(), dQa.begin() + n * a.Dp, 0.0f);
    for (int64_t jk = 0; jk < a.nkb; ++jk) {
      const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0, mp = (m + 15) / 16 * 16;
      if (!block_visits(a.mk, b, h, r0, r1, c0, c1)) continue;
      tile_pds(Qp, dOp, kt32p + (kvh * a.nkb + jk) * D * bk, vt32p + (kvh * a.nkb + jk) * Dv * bk, b, h, r0, n, c0, m, mp, a.sm.dslope(it), a.sm.dtable(it));
      attnlab_gemm::gemm<false, true>(dPt.data(), bk, k32p + (kvh * dm.Nk + c0) * a.Dp, a.Dp, dQa.data(), a.Dp, n,
                                      a.Dp, m);  // dQ += dS·K
    }
    float z = 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      T* dst = a.dqp + ((b * dm.H + h) * dm.Nq + r0 + r) * D;
      z = store_row(dst, dQa.data() + r * a.Dp, D, z);
    }
    return z == 0.0f;
  }

  // the fused item (b, kv head): for each kv block, every q block of the G query heads that
  // sees it: S, dP, then dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K (five products per tile).  dQ
  // accumulates in dq itself where that is float32 rows of Dp (else in dQh), over the kv blocks
  // in order as split's dQ item sums them.  Where a result is not finite the head's items run
  // on the careful paths.
  void fused(int64_t hi) {
    const Dims& dm = a.dm;
    const int64_t b = hi / dm.Hkv, hk = hi % dm.Hkv, G = dm.G, h0 = hk * G;
    const bool in_place = std::is_same_v<T, float> && D == a.Dp;
    const int64_t ldq = a.Dp;
    float* dQ;  // (G, Nq, Dp)
    if (in_place) {
      dQ = reinterpret_cast<float*>(a.dqp) + (b * dm.H + h0) * dm.Nq * D;
    } else {
      dQh.resize(G * dm.Nq * a.Dp);
      dQ = dQh.data();
    }
    std::fill(dQ, dQ + G * dm.Nq * ldq, 0.0f);
    for (int64_t h = h0; h < h0 + G; ++h)
      for (int64_t iq = 0; iq < a.nqb; ++iq) a.sm.zero_slot((b * dm.H + h) * a.nqb + iq);
    bool finite = true;
    for (int64_t jk = 0; jk < a.nkb; ++jk) {
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
          attnlab_gemm::gemm<false, true>(dPt.data(), bk, Kz.data(), a.Dp, dQ + ((h - h0) * dm.Nq + r0) * ldq, ldq,
                                          n, a.Dp, m);
        }
      }
      finite = store_dkv(b, hk, c0, m) && finite;
    }
    float z = 0.0f;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < dm.Nq; ++i) {
        const float* src = dQ + (g * dm.Nq + i) * ldq;
        T* dst = a.dqp + ((b * dm.H + h0 + g) * dm.Nq + i) * D;
        for (int64_t d = 0; d < D; ++d) {
          const float x = src[d];
          z += x - x;
          if (!in_place) dst[d] = static_cast<T>(x);
        }
      }
    if (finite && z == 0.0f) return;
    for (int64_t jk = 0; jk < a.nkb; ++jk) dkv_careful((b * dm.Hkv + hk) * a.nkb + jk);
    for (int64_t h = h0; h < h0 + G; ++h)
      for (int64_t iq = 0; iq < a.nqb; ++iq) dq_careful((b * dm.H + h) * a.nqb + iq);
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
  if (bwd_fused(dm.B * dm.Hkv, threads)) {
    attnlab_sched::Queue queue(dm.B * dm.Hkv);  // work items handed out one at a time
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      BwdWork<T> w(a);
      attnlab_sched::drain(queue, [&](int64_t it) { w.fused(it); });
    });
    return;
  }
  // ---- split, pass 1: dK, dV per (b, kv head, kv block), over the G query heads and the q blocks
  attnlab_sched::Queue queue1(dm.B * dm.Hkv * a.nkb), queue2(dm.B * dm.H * a.nqb);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    BwdWork<T> w(a);
    attnlab_sched::drain(queue1, [&](int64_t it) {
      if (!w.dkv_fast(it)) w.dkv_careful(it);
    });
  });
  // ---- split, pass 2: dQ per (b, h, q block), over the kv blocks its rows see.  float32 copies
  // of Kᵀ, Vᵀ (packed per kv block) and K (D padded to 16), made once: tiles read them in place.
  const View<T> kv = view_of<T>(k), vv = view_of<T>(v);
  const at::Tensor kt32 = pack_t_blocked(kv, dm.B, dm.Hkv, dm.Nk, dm.D, dm.bk, q.options());
  const at::Tensor vt32 = pack_t_blocked(vv, dm.B, dm.Hkv, dm.Nk, dm.Dv, dm.bk, q.options());
  at::Tensor k32 = at::zeros({dm.B, dm.Hkv, dm.Nk, Dp}, q.options().dtype(at::kFloat));
  k32.narrow(3, 0, dm.D).copy_(k);
  const float* kt32p = kt32.data_ptr<float>();
  const float* vt32p = vt32.data_ptr<float>();
  const float* k32p = k32.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    BwdWork<T> w(a);
    attnlab_sched::drain(queue2, [&](int64_t it) {
      if (!w.dq_fast(it, kt32p, vt32p, k32p)) w.dq_careful(it);
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
