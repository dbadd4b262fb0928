// The native kernel's forward pass (forward_impl): one at::parallel_for region over
// (b, h, q block) work items (sched.h's queue, the most kv blocks first); each runs the fast
// tile loop (S and P·V on the register-blocked micro-kernels, fwd_tile.h, float32 or bf16
// pairs) and, where its result is not finite, again on the careful path that skips hidden
// entries.  Included by kernel.cpp only (see tiles.h: an anonymous namespace, one unit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fwd_tile.h"
#include "masking.h"
#include "rowmath.h"
#include "sched.h"
#include "scoremods.h"
#include "tiles.h"
#include "vecmath.h"

namespace {

// A finished row: out = acc / l and LSE = m + log l; a row that saw no key (l = 0) gives
// output 0 and LSE -inf.  The fast and careful paths both end here.
template <typename T>
inline void finish_row(T* orow, const float* ar, int64_t Dv, float l, float m, float* lse) {
  if (l == 0.0f) {
    for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(0.0f);
    *lse = NEG_INF;
  } else {
    const float inv = 1.0f / l;
    for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(ar[e] * inv);
    *lse = m + std::log(l);
  }
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                  const Dims& dm, const Mask& mk, const ScoreMods& sm, float scale) {
  const View<T> qv = view_of<T>(q), kv = view_of<T>(k), vv = view_of<T>(v);
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const int64_t nqb = (dm.Nq + dm.bq - 1) / dm.bq, nkb = (dm.Nk + dm.bk - 1) / dm.bk;
  const int64_t items = dm.B * dm.H * nqb;
  // float32 copies made once per call (O(N·D)): Q, Kᵀ (packed per kv block) and V (Dv padded
  // to 16), so the tile loop reads its operands in place instead of converting every tile
  // (bf16 on the pairs path: Q, Kᵀ and V as bf16 pairs, packed the same way, in words)
  const int64_t Dvp0 = (dm.Dv + 15) / 16 * 16, Dw = (dm.D + 1) / 2;
  const bool pairs = std::is_same_v<T, c10::BFloat16> && bf16_pairs();
  at::Tensor q32, kt32, v32;
  if (pairs) {
    q32 = pack_rows_pairs(qv, dm.B, dm.H, dm.Nq, dm.D, q.options());
    kt32 = pack_kt_pairs(kv, dm.B, dm.Hkv, dm.Nk, dm.D, dm.bk, q.options());
    v32 = pack_v_pairs(vv, dm.B, dm.Hkv, dm.Nk, dm.Dv, Dvp0, dm.bk, q.options());
  } else {
    q32 = q.to(at::kFloat).contiguous();
    kt32 = pack_t_blocked(kv, dm.B, dm.Hkv, dm.Nk, dm.D, dm.bk, q.options());
    v32 = at::zeros({dm.B, dm.Hkv, dm.Nk, Dvp0}, q.options().dtype(at::kFloat));
    v32.narrow(3, 0, dm.Dv).copy_(v);
  }
  const float* q32p = pairs ? nullptr : q32.data_ptr<float>();
  const float* kt32p = pairs ? nullptr : kt32.data_ptr<float>();
  const float* v32p = pairs ? nullptr : v32.data_ptr<float>();
  const uint32_t* qhp = pairs ? reinterpret_cast<const uint32_t*>(q32.data_ptr<int32_t>()) : nullptr;
  const uint32_t* khp = pairs ? reinterpret_cast<const uint32_t*>(kt32.data_ptr<int32_t>()) : nullptr;
  const uint32_t* vhp = pairs ? reinterpret_cast<const uint32_t*>(v32.data_ptr<int32_t>()) : nullptr;
  // work items handed out one at a time, the most kv blocks first (sched.h): a thread whose
  // core is busy takes fewer items, and the region ends on the shortest ones
  std::vector<int64_t> visits(items, 0);  // kv blocks each work item (b, h, q block) visits
  for (int64_t it = 0; it < items; ++it) {
    const int64_t iq = it % nqb, h = (it / nqb) % dm.H, b = it / (nqb * dm.H);
    for (int64_t jk = 0; jk < nkb; ++jk)
      visits[it] += block_visits(mk, b, h, iq * dm.bq, std::min(dm.Nq, (iq + 1) * dm.bq), jk * dm.bk,
                                 std::min(dm.Nk, (jk + 1) * dm.bk));
  }
  attnlab_sched::Queue queue(items, [&](int64_t it) { return visits[it]; });
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t D = dm.D, Dv = dm.Dv, bq = dm.bq, bk = dm.bk;
    std::vector<float> Qb(bq * D), KT(D * bk), Vb(bk * Dv), S(bk), Pc(bk), acc(bq * Dv), mrow(bq), lrow(bq), tile(Dv);
    std::vector<RowMask> rms(bq);
    const int64_t Dvp = (Dv + 15) / 16 * 16;
    std::vector<float> St(bq * bk), accp(bq * Dvp), alph(bq);
    std::vector<uint32_t> Pw(pairs ? bq * bk / 2 : 0);  // P rounded to bf16 pairs
    // The fast path: S and P·V tiles through the register-blocked matmul.  A hidden entry is
    // P = 0 there, so a NaN/inf in a hidden value would leak (0·NaN): a q block whose result
    // is not finite runs again on the careful path below, where hidden entries are skipped.
    auto fast = [&](int64_t it) -> bool {
      const int64_t iq = it % nqb, h = (it / nqb) % dm.H, b = it / (nqb * dm.H);
      const int64_t hk = h / dm.G;
      const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
      const int64_t qrow = (b * dm.H + h) * dm.Nq + r0, kvh = b * dm.Hkv + hk;
      const float* Qf = pairs ? nullptr : q32p + qrow * D;
      const float* KTf = pairs ? nullptr : kt32p + kvh * nkb * D * bk;  // packed: one D × bk panel per kv block
      const float* Vf = pairs ? nullptr : v32p + kvh * dm.Nk * Dvp;
      for (int64_t r = 0; r < n; ++r) {
        rms[r] = mk.row(b, h, r0 + r);
        mrow[r] = NEG_INF;
        lrow[r] = 0.0f;
      }
      std::fill(accp.begin(), accp.begin() + n * Dvp, 0.0f);
      int64_t qlo = mk.qp_of(b, r0), qhi = mk.qp_of(b, r1 - 1);  // the q block's band positions
      if (mk.qpos != nullptr)  // they need not grow with the row (varlen's restart)
        for (int64_t i = r0; i < r1; ++i) {
          qlo = std::min(qlo, mk.qp_of(b, i));
          qhi = std::max(qhi, mk.qp_of(b, i));
        }
      for (int64_t jk = 0; jk < nkb; ++jk) {
        const int64_t cb0 = jk * bk, cb1 = std::min(dm.Nk, cb0 + bk);  // the kv block
        if (!block_visits(mk, b, h, r0, r1, cb0, cb1)) continue;
        // S and P·V run on the block's columns that some row of the q block may see, from a
        // 16-column boundary: the band's envelope (b0, b1 and the sinks' end grow with the band
        // position; ranges_at gives the whole [0, end) where the band is per column or a
        // BlockMask's), so a window's or a causal diagonal's hidden columns cost nothing
        int64_t s1a, b0a, b1a, s1z, b0z, b1z;
        mk.ranges_at(b, qlo, s1a, b0a, b1a);
        mk.ranges_at(b, qhi, s1z, b0z, b1z);
        int64_t lo = s1z > cb0 ? cb0 : std::max(cb0, b0a), hi = std::min(cb1, std::max(s1z, b1z));
        if (hi <= lo) lo = cb0, hi = cb1;
        const int64_t o = (lo - cb0) / 16 * 16;  // column offset in the packed panels
        const int64_t c0 = cb0 + o, c1 = hi, m = c1 - c0, mp = (m + 15) / 16 * 16;
        if (pairs)
          attnlab_fwd::matmul(qhp + qrow * Dw, Dw, khp + (kvh * nkb + jk) * Dw * bk + o, bk, St.data(), bk, n, mp,
                              Dw);
        else
          attnlab_fwd::matmul(Qf, D, KTf + jk * D * bk + o, bk, St.data(), bk, n, mp, D);
        for (int64_t r = 0; r < n; ++r) {
          float* Sr = St.data() + r * bk;
          const RowMask& rm = rms[r];
          uint16_t* Ph = reinterpret_cast<uint16_t*>(Pw.data() + r * (bk / 2));  // this row's bf16 P (pairs path)
          if (rm.none(cb0, cb1)) {
            if (pairs)
              std::fill(Ph, Ph + mp, uint16_t{0});
            else
              std::fill(Sr, Sr + mp, 0.0f);
            alph[r] = 1.0f;
            continue;
          }
          float mx;
          // the ids / keep / BlockMask tables hold whole kv blocks: full there is full on [c0, c1)
          const bool full = rm.band_full(c0, c1) && rm.extra_full(cb0, cb1);
          int64_t e0 = 0, e1 = mp;  // 16-column chunks outside [e0, e1) are hidden: P there is 0
          if (m == mp && !sm.active() && full) {  // the common tile: scale and max in one pass
            mx = attnlab_fwd::row_scale_max(Sr, mp, scale);
          } else {
            if (!full && !sm.active()) {  // a band's row: its visible span (RowMask::span)
              int64_t vlo, vhi;
              rm.span(c0, m, vlo, vhi);
              e0 = vlo / 16 * 16;
              e1 = vlo < vhi ? (vhi + 15) / 16 * 16 : e0;
            }
            attnlab_rows::row_scale(Sr + e0, std::min(m, e1) - e0, scale);
            for (int64_t c = m; c < mp; ++c) Sr[c] = NEG_INF;
            if (!full) rm.hide(Sr, c0, m);
            if (sm.active()) sm.apply_row(Sr, b, h, r0 + r, c0, m, rm);
            mx = e1 > e0 ? attnlab_rows::row_max(Sr + e0, e1 - e0) : NEG_INF;
          }
          const float m_new = std::isnan(mx) ? mx : std::max(mrow[r], mx);
          if (m_new == NEG_INF) {
            if (pairs)
              std::fill(Ph, Ph + mp, uint16_t{0});
            else
              std::fill(Sr, Sr + mp, 0.0f);
            alph[r] = 1.0f;
            continue;
          }
          alph[r] = exp_f(mrow[r] - m_new);
          // P rounded to bf16 (as flash-attn does) straight into P·V's operand; float32 row sum
          // (exp of -inf is exactly 0: the chunks outside [e0, e1) add nothing to the sum's lanes)
          if (pairs) {
            std::fill(Ph, Ph + e0, uint16_t{0});
            std::fill(Ph + e1, Ph + mp, uint16_t{0});
          } else {
            std::fill(Sr, Sr + e0, 0.0f);
            std::fill(Sr + e1, Sr + mp, 0.0f);
          }
          const float sum = pairs ? attnlab_fwd::row_exp_bf16(Sr + e0, Ph + e0, e1 - e0, m_new)
                                  : attnlab_rows::row_exp(Sr + e0, Sr + e0, e1 - e0, m_new);
          lrow[r] = lrow[r] * alph[r] + sum;
          mrow[r] = m_new;
        }
        // acc = acc · alpha + P·V (float32 accumulation), one pass
        if (pairs)
          attnlab_fwd::matmul_acc(Pw.data(), bk / 2, vhp + ((kvh * nkb + jk) * (bk / 2) + o / 2) * Dvp, Dvp,
                                  accp.data(), Dvp, n, Dvp, mp / 2, alph.data());
        else
          attnlab_fwd::matmul_acc(St.data(), bk, Vf + c0 * Dvp, Dvp, accp.data(), Dvp, n, Dvp, m, alph.data());
      }
      bool finite = true;
      for (int64_t r = 0; r < n; ++r) {
        T* orow = op + ((b * dm.H + h) * dm.Nq + r0 + r) * Dv;
        const float l = lrow[r];
        const float* ar = accp.data() + r * Dvp;
        float z = l - l;
        for (int64_t e = 0; e < Dv; ++e) z += ar[e] - ar[e];
        finite = finite && z == 0.0f;
        finish_row(orow, ar, Dv, l, mrow[r], lp + (b * dm.H + h) * dm.Nq + r0 + r);
      }
      return finite;
    };
    auto careful = [&](int64_t it) {
      const int64_t iq = it % nqb, h = (it / nqb) % dm.H, b = it / (nqb * dm.H);
      const int64_t hk = h / dm.G;
      const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
      for (int64_t r = 0; r < n; ++r) {
        load_row(Qb.data() + r * D, qv.row(b, h, r0 + r), D, qv.s3);
        rms[r] = mk.row(b, h, r0 + r);
        mrow[r] = NEG_INF;
        lrow[r] = 0.0f;
      }
      std::fill(acc.begin(), acc.begin() + n * Dv, 0.0f);
      for (int64_t jk = 0; jk < nkb; ++jk) {
        const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0;
        if (!block_visits(mk, b, h, r0, r1, c0, c1)) continue;
        load_kt(KT.data(), kv, b, hk, c0, m, D, bk);
        for (int64_t c = 0; c < m; ++c) load_row(Vb.data() + c * Dv, vv.row(b, hk, c0 + c), Dv, vv.s3);
        for (int64_t r = 0; r < n; ++r) {
          const RowMask& rm = rms[r];
          if (rm.none(c0, c1)) continue;
          float* Sr = S.data();
          score_row(Sr, Qb.data() + r * D, KT.data(), D, bk, m, scale, rm, c0);
          if (sm.active()) sm.apply_row(Sr, b, h, r0 + r, c0, m, rm);
          float mx = NEG_INF;
          for (int64_t c = 0; c < m; ++c) mx = std::max(mx, Sr[c]);
          for (int64_t c = 0; c < m; ++c) mx = std::isnan(Sr[c]) ? Sr[c] : mx;
          const float m_new = std::isnan(mx) ? mx : std::max(mrow[r], mx);  // a visible NaN propagates
          if (m_new == NEG_INF) continue;  // nothing visible yet
          const float alpha = exp_f(mrow[r] - m_new);
          float* ar = acc.data() + r * Dv;
          float* tr = tile.data();  // this tile's P·V, added once: two-level sums keep long rows accurate
          // P and its sum exactly as the fast path computes them (the same bits on finite inputs)
          const int64_t mp = (m + 15) / 16 * 16;
          for (int64_t c = m; c < mp; ++c) Sr[c] = NEG_INF;
          const float sum = attnlab_rows::row_exp(Sr, Pc.data(), mp, m_new);
          for (int64_t e = 0; e < Dv; ++e) tr[e] = 0.0f;
          for (int64_t c = 0; c < m; ++c) {
            if (Sr[c] == NEG_INF) continue;  // hidden: an exact zero, whatever V holds
            const float p = Pc[c];
            const float* vr = Vb.data() + c * Dv;
            for (int64_t e = 0; e < Dv; ++e) tr[e] += p * vr[e];
          }
          for (int64_t e = 0; e < Dv; ++e) ar[e] = ar[e] * alpha + tr[e];
          lrow[r] = lrow[r] * alpha + sum;
          mrow[r] = m_new;
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        T* orow = op + ((b * dm.H + h) * dm.Nq + r0 + r) * Dv;
        const float l = lrow[r];
        float* ar = acc.data() + r * Dv;
        finish_row(orow, ar, Dv, l, mrow[r], lp + (b * dm.H + h) * dm.Nq + r0 + r);
      }
    };
    attnlab_sched::drain(queue, [&](int64_t it) {
      if (!fast(it)) careful(it);
    });
  });
}

}  // namespace
