// attnlab native kernel: the bfloat16 "pairs" GEMM micro-kernel, float32 accumulation.
//
//     C[0:n, 0:N] = A[0:n, 0:2K] · B[0:2K, 0:N]       (C float32, A and B bfloat16)
//
// Operands hold bf16 *pairs* along the reduction axis, one 32-bit word per pair (the layout
// of `vdpbf16ps`): A[r] is a row of K words (bf16 values 2k, 2k+1: a bf16 row-major matrix
// with an even row length is already in that form); B is K rows of N words, word (k, c)
// holding B[2k, c] (low half) and B[2k+1, c] (high half): a K tile (D × bk) or V tile
// (bk × Dv) packed once per call.  One C lane gets, per word,
//     c += a_lo·b_lo + a_hi·b_hi      (products of bf16 values are exact in float32)
// With AVX512_BF16 that is `vdpbf16ps` (_mm512_dpbf16_ps: 32 multiply-adds per instruction,
// twice the float32 FMA rate); other builds emulate it with two FMAs on the widened halves
// (lo first, so the sum runs over the reduction index in order, as the float32 kernel).
// The register tile is gemm_f32.h's: MR × 2W accumulators.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define ATTNLAB_BF16_DP 1
#else
#define ATTNLAB_BF16_DP 0
#endif

#include "gemm_f32.h"

namespace attnlab_bf16 {

using attnlab_gemm::MR;
using attnlab_gemm::vf;
using attnlab_gemm::W;
typedef uint32_t vu __attribute__((vector_size(ATTNLAB_GEMM_W * 4)));

inline vu uload(const uint32_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// float32 -> bfloat16 bits, round to nearest even (NaN stays NaN)
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// acc += a_lo·b_lo + a_hi·b_hi per lane (a one word, broadcast)
inline vf dp(vf acc, uint32_t a, vu b) {
#if ATTNLAB_BF16_DP
  const __m512i av = _mm512_set1_epi32(static_cast<int>(a));
  __m512i bi;
  std::memcpy(&bi, &b, sizeof bi);
  __m512 ac;
  std::memcpy(&ac, &acc, sizeof ac);
  ac = _mm512_dpbf16_ps(ac, (__m512bh)av, (__m512bh)bi);
  std::memcpy(&acc, &ac, sizeof ac);
  return acc;
#else
  const float alo = from_bf16(static_cast<uint16_t>(a & 0xffffu)), ahi = from_bf16(static_cast<uint16_t>(a >> 16));
  vf blo, bhi;
  const vu ulo = b << 16, uhi = b & 0xffff0000u;
  std::memcpy(&blo, &ulo, sizeof blo);
  std::memcpy(&bhi, &uhi, sizeof bhi);
  acc += alo * blo;
  acc += ahi * bhi;
  return acc;
#endif
}

template <int R, int NV>
inline void tile(const uint32_t* __restrict A, int64_t lda, const uint32_t* __restrict B, int64_t ldb,
                 float* __restrict C, int64_t ldc, int64_t K) {
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  for (int64_t kk = 0; kk < K; ++kk) {
    vu bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = uload(B + kk * ldb + W * j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const uint32_t a = A[r * lda + kk];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = dp(acc[r][j], a, bv[j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) attnlab_gemm::vstore(C + r * ldc + W * j, acc[r][j]);
}

template <int R>
inline void band(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc, int64_t N,
                 int64_t K) {
  int64_t c = 0;
  for (; c + 2 * W <= N; c += 2 * W) tile<R, 2>(A, lda, B + c, ldb, C + c, ldc, K);
  for (; c + W <= N; c += W) tile<R, 1>(A, lda, B + c, ldb, C + c, ldc, K);
}

template <int R>
inline void band_rest(int rest, const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                      int64_t ldc, int64_t N, int64_t K) {
  if constexpr (R > 0) {
    if (rest == R) return band<R>(A, lda, B, ldb, C, ldc, N, K);
    band_rest<R - 1>(rest, A, lda, B, ldb, C, ldc, N, K);
  }
}

// C[0:n, 0:N] (float32) = A (n × K words) · B (K × N words), N a multiple of 16
inline void matmul(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc, int64_t n,
                   int64_t N, int64_t K) {
  int64_t r = 0;
  for (; r + MR <= n; r += MR) band<MR>(A + r * lda, lda, B, ldb, C + r * ldc, ldc, N, K);
  if (r < n) band_rest<MR - 1>(static_cast<int>(n - r), A + r * lda, lda, B, ldb, C + r * ldc, ldc, N, K);
}

// a row of float32 P (length n, even) as n/2 words of rounded bf16 pairs
inline void pack_row(const float* p, uint32_t* out, int64_t n) {
  for (int64_t c = 0; c < n; c += 2)
    out[c / 2] = static_cast<uint32_t>(to_bf16(p[c])) | (static_cast<uint32_t>(to_bf16(p[c + 1])) << 16);
}

inline const char* isa() {
#if ATTNLAB_BF16_DP
  return "bf16 pairs vdpbf16ps";
#else
  return "bf16 pairs emulated (2 fma)";
#endif
}

}  // namespace attnlab_bf16
