// attnlab native kernel: the forward's fused tile steps (forward.h's forward_impl fast path).
//
// * matmul_acc: C[r] = C[r] · alpha[r] + A[r] · B, the P·V product folded into the running
//   output block.  The register tile is gemm_f32.h's (MR × 2W accumulators summed over k in
//   order, from zero); only the store differs: `c · alpha + acc` (one FMA) where the
//   unfused path stored `acc` to a scratch tile and ran row_axpby (`a · alpha + t`, the same
//   FMA): the same bits, one pass over the block and its stores fewer.  A is float32 (B
//   float32) or bf16 pairs (B bf16 pairs, gemm_bf16.h's `dp`: vdpbf16ps where the build has it).
// * row_scale_max: x *= s and its max in one pass (a full row without score mod).
// * row_max: the max of an unscaled row (the bf16 path's common tile: no scaling pass, the
//   scale is folded into the exponent below).
// * all_finite: the fast path's check of a finished row (an inf or NaN sends the q block to
//   the careful path).
// * row_exp2_bf16 / span_exp2_bf16 (and exp_s, the bf16 path's rescale factor): exp(s - m) as
//   2^((s - m) · log2 e) (exp2_v: a polynomial and an exponent scaling, not rowmath.h's
//   bits: degree 4 for P, within 2.9e-6 relative, degree 5 for the rescale factors, within
//   2e-7) and its float32 sum,
//   written as bf16 (round to nearest even: vcvtneps2bf16 where the build has AVX512_BF16,
//   gemm_bf16.h's to_bf16 on every lane elsewhere) straight into the P operand of P·V: no
//   float32 P row, no scalar pack pass.  The bf16 path's P differs from the careful path's in
//   any case (rounded to bf16), so it need not share rowmath.h's exp bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemm_bf16.h"
#include "gemm_f32.h"
#include "rowmath.h"

#if ATTNLAB_GEMM_W == 16 || ATTNLAB_BF16_DP
#include <immintrin.h>
#endif

namespace attnlab_fwd {

using attnlab_gemm::MR;
using attnlab_gemm::vf;
using attnlab_gemm::vload;
using attnlab_gemm::vstore;
using attnlab_gemm::W;
using attnlab_bf16::vu;
typedef uint16_t vh __attribute__((vector_size(ATTNLAB_GEMM_W * 2)));

inline vf bload(const float* p) { return vload(p); }
inline vu bload(const uint32_t* p) { return attnlab_bf16::uload(p); }
inline vf step(vf acc, float a, vf b) { return acc + (a - vf{}) * b; }  // gemm_f32.h's broadcast FMA
inline vf step(vf acc, uint32_t a, vu b) { return attnlab_bf16::dp(acc, a, b); }

// alpha null: C = A·B (gemm_f32.h's / gemm_bf16.h's matmul, the same bits); else C = C·alpha + A·B
template <int R, int NV, typename E>
inline void tile(const E* __restrict A, int64_t lda, const E* __restrict B, int64_t ldb, float* __restrict C,
                 int64_t ldc, int64_t K, const float* __restrict alpha) {
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  for (int64_t kk = 0; kk < K; ++kk) {
    decltype(bload(B)) bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = bload(B + kk * ldb + W * j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const E a = A[r * lda + kk];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = step(acc[r][j], a, bv[j]);
    }
  }
  if (alpha == nullptr) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) vstore(C + r * ldc + W * j, acc[r][j]);
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) vstore(C + r * ldc + W * j, vload(C + r * ldc + W * j) * alpha[r] + acc[r][j]);
}

// not inlined into the forward's tile loop: there the K loop ran short of general registers
// and kept its B pointer on the stack (a load and a store per k step)
template <int R, typename E>
__attribute__((noinline)) void band(const E* A, int64_t lda, const E* B, int64_t ldb, float* C, int64_t ldc, int64_t N, int64_t K,
                 const float* alpha) {
  int64_t c = 0;
  for (; c + 2 * W <= N; c += 2 * W) tile<R, 2>(A, lda, B + c, ldb, C + c, ldc, K, alpha);
  for (; c + W <= N; c += W) tile<R, 1>(A, lda, B + c, ldb, C + c, ldc, K, alpha);
}

template <int R, typename E>
inline void band_rest(int rest, const E* A, int64_t lda, const E* B, int64_t ldb, float* C, int64_t ldc, int64_t N,
                      int64_t K, const float* alpha) {
  if constexpr (R > 0) {
    if (rest == R) return band<R>(A, lda, B, ldb, C, ldc, N, K, alpha);
    band_rest<R - 1>(rest, A, lda, B, ldb, C, ldc, N, K, alpha);
  }
}

// C[r, 0:N] = C[r, 0:N] · alpha[r] + (A · B)[r, 0:N] for r < n; N a multiple of W.
// E = float (A n × K floats, B K × N floats) or uint32_t (bf16 pairs: K words per A row).
template <typename E>
inline void matmul_acc(const E* A, int64_t lda, const E* B, int64_t ldb, float* C, int64_t ldc, int64_t n,
                       int64_t N, int64_t K, const float* alpha) {
  int64_t r = 0;
  for (; r + MR <= n; r += MR) band<MR>(A + r * lda, lda, B, ldb, C + r * ldc, ldc, N, K, alpha + r);
  if (r < n)
    band_rest<MR - 1>(static_cast<int>(n - r), A + r * lda, lda, B, ldb, C + r * ldc, ldc, N, K, alpha + r);
}

// C[0:n, 0:N] = A · B (the S = Q·Kᵀ tile).  Where N ends in one vector of W columns past its
// 2W-wide tiles (a window's 272 columns: 8 · 32 + 16), that last vector runs on 2 · MR rows at
// once on AVX-512 (16 accumulators): on MR rows its 8 accumulators waited on the dot product's
// latency, 2.6 times the cost per column of the 2W-wide tiles (perf, window256 bf16).  The
// same sums in the same order: the same bits.
template <typename E>
inline void matmul(const E* A, int64_t lda, const E* B, int64_t ldb, float* C, int64_t ldc, int64_t n, int64_t N,
                   int64_t K) {
  const int64_t N2 = N / (2 * W) * (2 * W);
  const bool rest16 = W == 16 && N - N2 == W && n >= 2 * MR;
  const int64_t Nb = rest16 ? N2 : N;
  int64_t r = 0;
  for (; r + MR <= n; r += MR) band<MR>(A + r * lda, lda, B, ldb, C + r * ldc, ldc, Nb, K, nullptr);
  if (r < n) band_rest<MR - 1>(static_cast<int>(n - r), A + r * lda, lda, B, ldb, C + r * ldc, ldc, Nb, K, nullptr);
  if (!rest16) return;
  r = 0;
  for (; r + 2 * MR <= n; r += 2 * MR) band<2 * MR>(A + r * lda, lda, B + N2, ldb, C + r * ldc + N2, ldc, W, K, nullptr);
  for (; r + MR <= n; r += MR) band<MR>(A + r * lda, lda, B + N2, ldb, C + r * ldc + N2, ldc, W, K, nullptr);
  if (r < n)
    band_rest<MR - 1>(static_cast<int>(n - r), A + r * lda, lda, B + N2, ldb, C + r * ldc + N2, ldc, W, K, nullptr);
}

// x[0:n] *= s; returns max(x[0:n]) (n a multiple of W): row_scale then row_max, one pass
inline float row_scale_max(float* x, int64_t n, float s) {
  vf m = vload(x) * s;
  vstore(x, m);
  for (int64_t c = W; c < n; c += W) {
    const vf y = vload(x + c) * s;
    vstore(x + c, y);
    m = m > y ? m : y;
  }
  return attnlab_rows::hmax(m);
}

// float32 -> bf16 bits on every lane: gemm_bf16.h's to_bf16 (nearest even; NaN stays NaN).
// With AVX512_BF16 one vcvtneps2bf16: the same bits for every normal, zero, inf or NaN input
// (it reads denormals as zero: the P it converts is 0 or at least 2^-125.5, never denormal)
inline vh to_bf16_v(vf x) {
#if ATTNLAB_BF16_DP && ATTNLAB_GEMM_W == 16
  __m512 xm;
  std::memcpy(&xm, &x, sizeof xm);
  const __m256bh hb = _mm512_cvtneps_pbh(xm);
  vh h;
  std::memcpy(&h, &hb, sizeof h);
  return h;
#else
  vu u;
  std::memcpy(&u, &x, sizeof u);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (u >> 16) | 0x40u;
  const vu r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return __builtin_convertvector(r, vh);
#endif
}

// horizontal max / sum as a tree (4 steps on AVX-512, not a chain of 16): the bf16 path only
// (the float32 path keeps rowmath.h's order, the careful path's bits)
inline float hmax_tree(vf m) {
#if ATTNLAB_GEMM_W == 16
  __m512 x;
  std::memcpy(&x, &m, sizeof x);
  return _mm512_reduce_max_ps(x);
#else
  return attnlab_rows::hmax(m);
#endif
}
inline float hsum_tree(vf s) {
#if ATTNLAB_GEMM_W == 16
  __m512 x;
  std::memcpy(&x, &s, sizeof x);
  return _mm512_reduce_add_ps(x);
#else
  return attnlab_rows::hsum(s);
#endif
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// The bf16 path's softmax step on a row whose visible columns in the tile are one range
// [lo, hi) (0 <= lo < hi <= n, n a multiple of W): the vectors that meet it are read, the lanes
// of its two edge vectors outside it masked in registers (-inf for the max, 0 for P), so no
// -inf is written into the row and no column outside it is visited.  Lanes outside the range
// may hold anything (a hidden key's inf or NaN score): they are never used.
using attnlab_rows::vi;
inline vi lane_index() {
  vi v;
  for (int j = 0; j < W; ++j) v[j] = j;
  return v;
}
// lanes k + [0, W) of [lo, hi): all ones where inside
inline vi lanes_in(vi io, int64_t k, int64_t lo, int64_t hi) {
  const int32_t a = static_cast<int32_t>(std::max<int64_t>(lo - k, -1)),
                z = static_cast<int32_t>(std::min<int64_t>(hi - k, W + 1));
  return (io >= a) & (io < z);
}

// max of x[lo, hi) (unscaled: the scale commutes with the max, scale > 0): four running maxima
// on the vectors between the two edge vectors (one chained max per vector waited on its latency
// each step: a 17-vector row spent more cycles there than in its loads; the max of a set is the
// same whatever the grouping)
inline float span_max(const float* x, int64_t lo, int64_t hi) {
  const int64_t a = lo / W * W, z = (hi + W - 1) / W * W;
  const vi io = lane_index();
  const vf ninf = attnlab_rows::splat(-__builtin_inff());
  const vf first = lanes_in(io, a, lo, hi) ? vload(x + a) : ninf;
  if (z - a == W) return hmax_tree(first);
  const vf last = lanes_in(io, z - W, lo, hi) ? vload(x + z - W) : ninf;
  vf m0 = first, m1 = last, m2 = ninf, m3 = ninf;
  int64_t c = a + W;
  for (; c + 4 * W <= z - W; c += 4 * W) {
    m0 = vmax(m0, vload(x + c));
    m1 = vmax(m1, vload(x + c + W));
    m2 = vmax(m2, vload(x + c + 2 * W));
    m3 = vmax(m3, vload(x + c + 3 * W));
  }
  for (; c < z - W; c += W) m0 = vmax(m0, vload(x + c));
  return hmax_tree(vmax(vmax(m0, m1), vmax(m2, m3)));
}

// max(x[0:n]) (n a multiple of W, n >= W), the row read once, nothing stored: span_max on the
// whole row
inline float row_max(const float* x, int64_t n) { return span_max(x, 0, n); }

constexpr float LOG2E = 1.44269504088896341f;

// 2^t for t <= 0 (up to rounding): t < -125 and -inf give exactly 0 (so no result is
// denormal), NaN stays NaN.  2^t = 2^n · 2^f, n = round(t) (to nearest even, by adding and
// subtracting 1.5 · 2^23: two adds, not vrndscaleps), f in [-1/2, 1/2]: a polynomial with
// p(0) = 1 exactly (near-minimax fits of 2^f) and an exponent scaling (vscalefps on AVX-512).
// The exp step is bound by the FMA pipes, so its degree is what P needs: DEG = 5 (relative
// error under 2e-7 in float32 Horner: 3 ulp) for the rescale factors (exp_s), which multiply
// the running sums tile after tile; DEG = 4 (under 2.9e-6) for P, which is rounded to bf16
// (2^-9) after it, and whose unrounded values sum to the row's l (the LSE then within 2.3e-6
// of float64: test_bf16_lse_is_the_float32_softmax_normaliser).  Degree 6 -> 5 (2026-12-04)
// took window256 and doc8 bf16 to 0.975 and 0.96 of their time at one thread; 5 -> 4 for P
// (2026-12-05, scripts/ab_native.sh, best of 5 alternating rounds) to 0.97-1.00 and 0.96-0.97
// at one thread (two runs), 0.975 and 0.984 at two.
template <int DEG = 5>
inline vf exp2_v(vf t) {
  static_assert(DEG == 4 || DEG == 5, "exp2_v: degree 4 (P) or 5 (the rescale factors)");
  const vf lo = attnlab_rows::splat(-125.0f);
#if ATTNLAB_GEMM_W == 16
  __m512 tm, lm;
  std::memcpy(&tm, &t, sizeof tm);
  std::memcpy(&lm, &lo, sizeof lm);
  const __m512 tc = _mm512_max_ps(lm, tm);  // the second operand where either is NaN: NaN stays NaN
  const __m512 mg = _mm512_set1_ps(12582912.0f);
  const __m512 nm = _mm512_sub_ps(_mm512_add_ps(tc, mg), mg);
  const __m512 fm = _mm512_sub_ps(tc, nm);
  vf f;
  std::memcpy(&f, &fm, sizeof f);
#else
  const vf tc = t < lo ? lo : t;                  // NaN stays NaN
  const vf n = (tc + 12582912.0f) - 12582912.0f;  // round to nearest
  const vf f = tc - n;
#endif
  vf p;
  if constexpr (DEG == 5) {
    p = attnlab_rows::splat(0.001326472731307149f);
    p = p * f + 0.009671512991189957f;
    p = p * f + 0.05550733581185341f;
    p = p * f + 0.24022242426872253f;
    p = p * f + 0.6931470036506653f;
  } else {  // relative error under 2.9e-6 in float32 Horner, p(0) = 1 exactly
    p = attnlab_rows::splat(0.009582744911313057f);
    p = p * f + 0.05590614303946495f;
    p = p * f + 0.24024099111557007f;
    p = p * f + 0.6931242346763611f;
  }
  p = p * f + 1.0f;
#if ATTNLAB_GEMM_W == 16
  __m512 pm;
  std::memcpy(&pm, &p, sizeof pm);
  const __mmask16 keep = _mm512_cmp_ps_mask(tm, lm, _CMP_NLT_UQ);  // t >= -125 or NaN
  pm = _mm512_maskz_scalef_ps(keep, pm, nm);
  std::memcpy(&p, &pm, sizeof p);
  return p;
#else
  const attnlab_rows::vi e = (__builtin_convertvector(n, attnlab_rows::vi) + 127) << 23;
  vf sc;
  std::memcpy(&sc, &e, sizeof sc);
  p = p * sc;
  return t < lo ? vf{} : p;
#endif
}

// exp(x) for one float (x <= 0 up to rounding: the online softmax's rescale factor) by exp2_v
inline float exp_s(float x) { return exp2_v(attnlab_rows::splat(x * LOG2E))[0]; }

// no inf or NaN in x[0:n] (an OR of exponent tests: vectorises, unlike a float sum in order)
inline bool all_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t e = 0; e < n; ++e) {
    uint32_t u;
    std::memcpy(&u, x + e, sizeof u);
    bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

// The fast path's bf16 output row: out[e] = bf16(acc[e] · inv) for e < n, 16 at a time, rounded
// as c10::BFloat16 rounds (nearest even, on the integer bits: not vcvtneps2bf16, which reads a
// denormal as zero); returns whether acc[0:n] is finite (a row that is not reruns on the
// careful path, which writes it again).  One pass where the scalar loop converted value by value.
inline bool out_row_bf16(uint16_t* out, const float* acc, int64_t n, float inv) {
  using attnlab_bf16::vu;
  vu bad = vu{};
  int64_t e = 0;
  for (; e + W <= n; e += W) {
    const vf a = vload(acc + e), y = a * inv;
    vu ua, uy;
    std::memcpy(&ua, &a, sizeof ua);
    std::memcpy(&uy, &y, sizeof uy);
    bad |= (ua & 0x7f800000u) == 0x7f800000u;
    const vu r = (uy + 0x7fffu + ((uy >> 16) & 1u)) >> 16;  // finite rows only are kept
    const vh h = __builtin_convertvector(r, vh);
    std::memcpy(out + e, &h, sizeof h);
  }
#if ATTNLAB_GEMM_W == 16
  // one mask test (the lane loop below compiled to 16 extracts and ORs a row)
  bool ok = _mm512_test_epi32_mask((__m512i)bad, (__m512i)bad) == 0;
#else
  uint32_t any = 0;  // an OR over the lanes (no early exit: one vector reduction)
  for (int j = 0; j < W; ++j) any |= bad[j];
  bool ok = any == 0;
#endif
  for (; e < n; ++e) {
    ok = ok && std::isfinite(acc[e]);
    out[e] = attnlab_bf16::to_bf16(acc[e] * inv);
  }
  return ok;
}

// one vector of the bf16 P row: P at columns k + [0, W) (EDGE: 0 on the lanes outside keep),
// written as bf16; returns it (float32)
template <bool RAW, bool EDGE = false>
inline vf exp2_bf16_at(const float* x, uint16_t* out, int64_t k, float c, float mb, vi keep = vi{}) {
  const vf t = RAW ? vload(x + k) * c - mb : (vload(x + k) - mb) * c;
  vf p = exp2_v<4>(t);
  if constexpr (EDGE) p = keep ? p : vf{};
  const vh h = to_bf16_v(p);
  std::memcpy(out + k, &h, sizeof h);
  return p;
}

// The bf16 path's P row: out[0:n] = bf16(exp(s - m)) (n a multiple of W); returns the float32
// sum of the unrounded values.  exp(s - m) = 2^((s - m) · log2 e): RAW, x holds unscaled
// scores (s = x · scale, scale > 0) and the exponent is one FMA, x · c - mb (c = scale ·
// log2 e, mb = m · log2 e); else x holds s and the exponent is (x - mb) · c (mb = m, c = log2 e:
// the row's max gives exactly 1).
template <bool RAW>
inline float row_exp2_bf16(const float* x, uint16_t* out, int64_t n, float c, float mb) {
  vf s = vf{};
  for (int64_t k = 0; k < n; k += W) s += exp2_bf16_at<RAW>(x, out, k, c, mb);
  return hsum_tree(s);
}

// out[0:n] = bf16(exp(s - m)) on [lo, hi), exactly 0 elsewhere; returns the float32 sum of the
// unrounded values (row_exp2_bf16's values and sum where [lo, hi) is the whole row: the same
// bits, a masked lane adds an exact 0 as exp(-inf) did)
template <bool RAW>
inline float span_exp2_bf16(const float* x, uint16_t* out, int64_t n, int64_t lo, int64_t hi, float c, float mb) {
  const int64_t a = lo / W * W, z = (hi + W - 1) / W * W;
  const vi io = lane_index();
  const vh zero = vh{};
  for (int64_t k = 0; k < a; k += W) std::memcpy(out + k, &zero, sizeof zero);
  for (int64_t k = z; k < n; k += W) std::memcpy(out + k, &zero, sizeof zero);
  vf s = exp2_bf16_at<RAW, true>(x, out, a, c, mb, lanes_in(io, a, lo, hi));
  for (int64_t k = a + W; k < z - W; k += W) s += exp2_bf16_at<RAW>(x, out, k, c, mb);
  if (z - W > a) s += exp2_bf16_at<RAW, true>(x, out, z - W, c, mb, lanes_in(io, z - W, lo, hi));
  return hsum_tree(s);
}

}  // namespace attnlab_fwd
