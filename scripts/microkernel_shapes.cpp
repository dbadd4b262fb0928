// Which register tile feeds vdpbf16ps fastest on this CPU: the rate per dot-product instruction
// of three bf16 micro-kernel shapes on operands in L1 (a probe for kernel design, not a test).
//
//   8x2   8 rows x 2 vectors (16 accumulators; per k: 8 broadcasts + 2 loads): the native
//         kernel's shape (gemm_bf16.h, fwd_tile.h)
//   16x1  16 rows x 1 vector (16 accumulators; per k: 16 broadcasts + 1 load): the shape a
//         transposed tile (Sᵀ = K·Qᵀ with 16 queries as the lanes) needs
//   16x1p 16x1 with the 16 A values loaded once and broadcast by vpermd
//
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 scripts/microkernel_shapes.cpp \
//       -o /tmp/microkernel_shapes && /tmp/microkernel_shapes
//
// One thread; K = 136 (a window-256 tile's key pairs); prints ns per instruction, three rounds.
// 2026-12-05 (AMD EPYC, family 26): 8x2 0.117, 16x1 0.127-0.129, 16x1p 0.209-0.211.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
alignas(64) uint32_t A[4096 * 32];
alignas(64) uint32_t Bm[4096 * 32];
alignas(64) float C[64 * 64];
// 16 rows x 1 vector: 16 bcast + 1 load per k
__attribute__((noinline)) void k16x1(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t K, float* c) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, a += lda) {
    const __m512i bv = _mm512_loadu_si512(b + k * 16);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)a[r]), (__m512bh)bv);
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(c + r * 16, acc[r]);
}
// 8 rows x 2 vectors: 8 bcast + 2 loads per k
__attribute__((noinline)) void k8x2(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t K, float* c) {
  __m512 acc[8][2];
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512i b0 = _mm512_loadu_si512(b + k * 32), b1 = _mm512_loadu_si512(b + k * 32 + 16);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      const __m512i av = _mm512_set1_epi32((int)a[r * lda + k]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)av, (__m512bh)b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)av, (__m512bh)b1);
    }
  }
  for (int r = 0; r < 8; ++r) { _mm512_storeu_ps(c + r * 32, acc[r][0]); _mm512_storeu_ps(c + r * 32 + 16, acc[r][1]); }
}
// 16 rows x 1 vector with register-held broadcasts: 1 load of 16 words + permutes
__attribute__((noinline)) void k16x1p(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t K, float* c) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, a += lda) {
    const __m512i bv = _mm512_loadu_si512(b + k * 16);
    const __m512i av = _mm512_loadu_si512(a);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(r), av), (__m512bh)bv);
  }
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(c + r * 16, acc[r]);
}
int main() {
  for (int i = 0; i < 4096 * 32; ++i) { A[i] = 0x3f803f80u; Bm[i] = 0x3f803f80u; }
  const int64_t K = 136; const int reps = 200000;
  for (int t = 0; t < 3; ++t) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) k16x1(A, 64, Bm, K, C);
    auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) k8x2(A, K, Bm, K, C);
    auto t2 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) k16x1p(A, 64, Bm, K, C);
    auto t3 = std::chrono::steady_clock::now();
    double d = 16.0 * K * reps;  // dp instructions
    printf("16x1 %.3f  8x2 %.3f  16x1perm %.3f  ns per dp\n", std::chrono::duration<double, std::nano>(t1 - t0).count() / d,
           std::chrono::duration<double, std::nano>(t2 - t1).count() / d, std::chrono::duration<double, std::nano>(t3 - t2).count() / d);
  }
}
