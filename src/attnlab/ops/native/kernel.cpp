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
// float32 buffers: forward over (b, h, q-block); backward in two atomics-free passes,
// dK/dV over (b, kv-head, kv-block) and dQ over (b, h, q-block).  Hidden entries
// (masked) are exact zeros in every product, so a NaN/inf in a key or value a row cannot
// see has no effect.  The tile products run on a register-blocked GEMM micro-kernel
// (gemm_f32.h: 8x32 AVX-512, 6x16 AVX2, 6x8 portable; the build picks -mavx512* / -mavx2
// from the CPU's flags) and the softmax rows on native-width loops (rowmath.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <type_traits>
#include <vector>

#include "gemm_bf16.h"
#include "fwd_tile.h"
#include "gemm_f32.h"
#include "mask_args.h"
#include "masking.h"
#include "rowmath.h"
#include "sched.h"
#include "scoremods.h"
#include "vecmath.h"

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// a·b + c, fused where the CPU has FMA: Δ and dP use it in the same order, so they agree bit for bit
#if defined(__FMA__)
#define MADD(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

using attnlab_vecmath::exp_f;
using attnlab_vecmath::to_f;

template <typename T>
struct View {  // a 4-D tensor read through its strides
  const T* p;
  int64_t s0, s1, s2, s3;
  const T* row(int64_t b, int64_t h, int64_t n) const { return p + b * s0 + h * s1 + n * s2; }
};

template <typename T>
View<T> view_of(const at::Tensor& t) {
  return View<T>{t.data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

template <typename T>
inline void load_row(float* dst, const T* src, int64_t n, int64_t stride) {
  if (stride == 1) {
    for (int64_t d = 0; d < n; ++d) dst[d] = to_f(src[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = to_f(src[d * stride]);
  }
}

struct Dims {
  int64_t B, H, Hkv, G, Nq, Nk, D, Dv, bq, bk;
};

// S[r, 0:m] = scale · Q[r] · K[c0:c0+m]ᵀ, masked entries -inf (KT is D × bk, row-major).
inline void score_row(float* S, const float* Qr, const float* KT, int64_t D, int64_t bk, int64_t m, float scale,
                      const RowMask& rm, int64_t c0) {
  for (int64_t c = 0; c < m; ++c) S[c] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float qv = Qr[d];
    const float* kt = KT + d * bk;
    for (int64_t c = 0; c < m; ++c) S[c] += qv * kt[c];
  }
  for (int64_t c = 0; c < m; ++c) S[c] *= scale;
  if (!rm.full(c0, c0 + m)) rm.hide(S, c0, m);
}

template <typename T>
void load_kt(float* KT, const View<T>& k, int64_t b, int64_t hk, int64_t c0, int64_t m, int64_t D, int64_t bk) {
  for (int64_t c = 0; c < m; ++c) {
    const T* src = k.row(b, hk, c0 + c);
    for (int64_t d = 0; d < D; ++d) KT[d * bk + c] = to_f(src[d * k.s3]);
  }
}

// ---------------------------------------------------------------- micro-kernels
// gemm_f32.h (register-blocked GEMM) and rowmath.h (a tile row's max / exp / sum / dS), both
// at the build's native vector width.
// the GEMMs of every tile: gemm_f32.h's register-blocked micro-kernel (native vector width)
using attnlab_gemm::matmul;

// Xᵀ of a (B, Hkv, N, D) tensor in float32, packed per column block: (B, Hkv, nb, D, bk),
// columns past N zero.  A tile's K panel (D × bk) is then contiguous: the micro-kernel
// streams it row by row from L1 (a D × Nk layout puts its rows Nk floats apart, which for
// Nk = 4096 maps every row to one L1 set).
template <typename T>
at::Tensor pack_t_blocked(const View<T>& x, int64_t B, int64_t Hkv, int64_t N, int64_t D, int64_t bk,
                          const at::TensorOptions& opt) {
  const int64_t nb = (N + bk - 1) / bk;
  at::Tensor out = at::empty({B, Hkv, nb, D, bk}, opt.dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv * nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t jb = w % nb, h = (w / nb) % Hkv, b = w / (nb * Hkv);
      const int64_t c0 = jb * bk, m = std::min(N, c0 + bk) - c0;
      float* panel = o + w * D * bk;
      if (m < bk) std::fill(panel, panel + D * bk, 0.0f);
      load_kt(panel, x, b, h, c0, m, D, bk);
    }
  });
  return out;
}

// bf16 inputs: the tile GEMMs on bf16 pairs (gemm_bf16.h) or on float32 copies.
// ATTNLAB_NATIVE_BF16=pairs / f32 forces one; the default is pairs where the build has
// vdpbf16ps (twice the float32 rate) and f32 elsewhere (the emulated pairs are slower there).
inline bool bf16_pairs() {
  const char* e = std::getenv("ATTNLAB_NATIVE_BF16");
  if (e != nullptr && std::strcmp(e, "pairs") == 0) return true;
  if (e != nullptr && std::strcmp(e, "f32") == 0) return false;
  return ATTNLAB_BF16_DP != 0;
}

template <typename T>
inline uint16_t bf16_bits(T x) {
  return attnlab_bf16::to_bf16(to_f(x));
}
template <>
inline uint16_t bf16_bits(c10::BFloat16 x) {
  return x.x;
}

// Q (B, H, N, D) as bf16 pairs along D: (B, H, N, Dw) words, Dw = ceil(D / 2), a zero past D
template <typename T>
at::Tensor pack_rows_pairs(const View<T>& x, int64_t B, int64_t H, int64_t N, int64_t D,
                           const at::TensorOptions& opt) {
  const int64_t Dw = (D + 1) / 2;
  at::Tensor out = at::empty({B, H, N, Dw}, opt.dtype(at::kInt));
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w)
      for (int64_t i = 0; i < N; ++i) {
        const T* src = x.row(w / H, w % H, i);
        uint32_t* dst = o + (w * N + i) * Dw;
        if (x.s3 == 1) {  // contiguous rows: no stride multiplies (the loop vectorises)
          for (int64_t p = 0; p < D / 2; ++p)
            dst[p] =
                static_cast<uint32_t>(bf16_bits(src[2 * p])) | (static_cast<uint32_t>(bf16_bits(src[2 * p + 1])) << 16);
          if (D % 2 != 0) dst[Dw - 1] = bf16_bits(src[D - 1]);
          continue;
        }
        for (int64_t p = 0; p < Dw; ++p) {
          const uint32_t lo16 = bf16_bits(src[2 * p * x.s3]);
          const uint32_t hi16 = 2 * p + 1 < D ? bf16_bits(src[(2 * p + 1) * x.s3]) : 0u;
          dst[p] = lo16 | (hi16 << 16);
        }
      }
  });
  return out;
}

// Kᵀ per kv block as pairs along D: (B, Hkv, nb, Dw, bk) words, word (p, c) = K[c, 2p..2p+1]
// (transposed: the B operand of S = Q·Kᵀ); columns past N and the half past D are zero
template <typename T>
at::Tensor pack_kt_pairs(const View<T>& x, int64_t B, int64_t Hkv, int64_t N, int64_t D, int64_t bk,
                         const at::TensorOptions& opt) {
  const int64_t nb = (N + bk - 1) / bk, Dw = (D + 1) / 2;
  at::Tensor out = at::zeros({B, Hkv, nb, Dw, bk}, opt.dtype(at::kInt));
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, B * Hkv * nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t jb = w % nb, h = (w / nb) % Hkv, b = w / (nb * Hkv);
      const int64_t c0 = jb * bk, m = std::min(N, c0 + bk) - c0;
      uint32_t* panel = o + w * Dw * bk;
      for (int64_t c = 0; c < m; ++c) {
        const T* src = x.row(b, h, c0 + c);
        if (x.s3 == 1) {  // contiguous rows: no stride multiplies
          for (int64_t p = 0; p < D / 2; ++p)
            panel[p * bk + c] =
                static_cast<uint32_t>(bf16_bits(src[2 * p])) | (static_cast<uint32_t>(bf16_bits(src[2 * p + 1])) << 16);
          if (D % 2 != 0) panel[(Dw - 1) * bk + c] = bf16_bits(src[D - 1]);
          continue;
        }
        for (int64_t p = 0; p < Dw; ++p) {
          const uint32_t lo16 = bf16_bits(src[2 * p * x.s3]);
          const uint32_t hi16 = 2 * p + 1 < D ? bf16_bits(src[(2 * p + 1) * x.s3]) : 0u;
          panel[p * bk + c] = lo16 | (hi16 << 16);
        }
      }
    }
  });
  return out;
}

// V per kv block as pairs along the keys: (B, Hkv, nb, bk / 2, Dp) words, word (p, e) =
// V[2p, e] | V[2p + 1, e] << 16 (the B operand of P·V); rows past N and columns past D zero
template <typename T>
at::Tensor pack_v_pairs(const View<T>& x, int64_t B, int64_t Hkv, int64_t N, int64_t D, int64_t Dp, int64_t bk,
                        const at::TensorOptions& opt) {
  const int64_t nb = (N + bk - 1) / bk;
  at::Tensor out = at::zeros({B, Hkv, nb, bk / 2, Dp}, opt.dtype(at::kInt));
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, B * Hkv * nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t jb = w % nb, h = (w / nb) % Hkv, b = w / (nb * Hkv);
      const int64_t c0 = jb * bk, m = std::min(N, c0 + bk) - c0;
      uint32_t* panel = o + w * (bk / 2) * Dp;
      if (x.s3 == 1) {  // contiguous rows: two keys' rows interleaved at once (the loop vectorises)
        int64_t c = 0;
        for (; c + 2 <= m; c += 2) {
          const T* r0 = x.row(b, h, c0 + c);
          const T* r1 = x.row(b, h, c0 + c + 1);
          uint32_t* dst = panel + (c / 2) * Dp;
          for (int64_t e = 0; e < D; ++e)
            dst[e] = static_cast<uint32_t>(bf16_bits(r0[e])) | (static_cast<uint32_t>(bf16_bits(r1[e])) << 16);
        }
        if (c < m) {  // an odd last key: the high halves stay zero
          const T* r0 = x.row(b, h, c0 + c);
          uint32_t* dst = panel + (c / 2) * Dp;
          for (int64_t e = 0; e < D; ++e) dst[e] = bf16_bits(r0[e]);
        }
        continue;
      }
      for (int64_t c = 0; c < m; ++c) {
        const T* src = x.row(b, h, c0 + c);
        uint32_t* dst = panel + (c / 2) * Dp;
        const int shift = (c % 2) * 16;
        for (int64_t e = 0; e < D; ++e) dst[e] |= static_cast<uint32_t>(bf16_bits(src[e * x.s3])) << shift;
      }
    }
  });
  return out;
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
        if (l == 0.0f) {
          for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(0.0f);
          lp[(b * dm.H + h) * dm.Nq + r0 + r] = NEG_INF;
        } else {
          const float inv = 1.0f / l;
          for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(ar[e] * inv);
          lp[(b * dm.H + h) * dm.Nq + r0 + r] = mrow[r] + std::log(l);
        }
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
        if (l == 0.0f) {
          for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(0.0f);
          lp[(b * dm.H + h) * dm.Nq + r0 + r] = NEG_INF;
        } else {
          const float inv = 1.0f / l;
          for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(ar[e] * inv);
          lp[(b * dm.H + h) * dm.Nq + r0 + r] = mrow[r] + std::log(l);
        }
      }
    };
    for (int64_t it; queue.pop(it);)
      if (!fast(it)) careful(it);
  });
}

// ---------------------------------------------------------------- backward
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
      for (int64_t d = 0; d < D; ++d) {
        const float x = dKa[c * a.Dp + d];
        z += x - x;
        dkr[d] = static_cast<T>(x);
      }
      for (int64_t e = 0; e < Dv; ++e) {
        const float x = dVa[c * a.Dvp + e];
        z += x - x;
        dvr[e] = static_cast<T>(x);
      }
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
      for (int64_t d = 0; d < D; ++d) {
        const float x = dQa[r * a.Dp + d];
        z += x - x;
        dst[d] = static_cast<T>(x);
      }
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
    const int64_t items = dm.B * dm.Hkv;
    std::atomic<int64_t> next{0};  // work items handed out one at a time
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      BwdWork<T> w(a);
      for (int64_t it; (it = next.fetch_add(1)) < items;) w.fused(it);
    });
    return;
  }
  // ---- split, pass 1: dK, dV per (b, kv head, kv block), over the G query heads and the q blocks
  const int64_t items1 = dm.B * dm.Hkv * a.nkb, items2 = dm.B * dm.H * a.nqb;
  std::atomic<int64_t> next1{0}, next2{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    BwdWork<T> w(a);
    for (int64_t it; (it = next1.fetch_add(1)) < items1;)
      if (!w.dkv_fast(it)) w.dkv_careful(it);
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
    for (int64_t it; (it = next2.fetch_add(1)) < items2;)
      if (!w.dq_fast(it, kt32p, vt32p, k32p)) w.dq_careful(it);
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
                  const std::vector<int64_t>& mods, const std::vector<double>& caps, int64_t q_offset,
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
                                   int64_t bq, int64_t bk, const std::vector<int64_t>& mods,
                                   const std::vector<double>& caps, const std::vector<at::Tensor>& mask_ext,
                                   const std::vector<int64_t>& mask_block) {
  // bf16 pairs are half the bytes of float32: the K tile that ops.blocks sizes for L1 in float32
  // (D × bk) holds a kv block twice as long (measured: 5 % at D = 128, 2-4 % at D = 64)
  const bool pairs = q.scalar_type() == at::kBFloat16 && bf16_pairs();
  const Dims dm = dims_of(q, k, v, bq, pairs && 2 * bk <= 256 ? 2 * bk : bk);
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
                                   int64_t bq, int64_t bk, const std::vector<int64_t>& mods,
                                   const std::vector<double>& caps, const std::vector<at::Tensor>& mask_ext,
                                   const std::vector<int64_t>& mask_block) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fwd", &native_fwd, "attnlab native attention forward -> [out, lse]");
  m.def("bwd", &native_bwd, "attnlab native attention backward -> [dq, dk, dv, dslopes, dtable]");
  m.def("features", &native_features, "the instruction sets this build was compiled for");
  m.def("parallel_threads", &native_parallel_threads, "distinct threads that ran one parallel_for region of n items");
}
