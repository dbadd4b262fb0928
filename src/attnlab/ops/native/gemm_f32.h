// attnlab native kernel: the float32 register-blocked GEMM micro-kernel.
//
//     C[0:n, 0:N] = A[0:n, 0:K] · B[0:K, 0:N]      (row-major, row strides lda, ldb, ldc)
//
// N is a multiple of 16 (the kernel's tiles are padded to 16 columns); B is read a row of
// NR columns at a time, so a B whose rows are short (a packed panel: a K tile stored as
// D × bk, a V tile as bk × Dv) streams from L1.  The C tile of MR × NR floats lives in
// registers for the whole K loop:
//
//   AVX-512 (32 zmm):  MR = 8, NR = 32  -> 16 accumulators, 2 B loads + 8 broadcasts / k
//   AVX2    (16 ymm):  MR = 6, NR = 16  -> 12 accumulators, 2 B loads + 6 broadcasts / k
//   portable (SSE/NEON, 4 lanes): MR = 6, NR = 8
//
// The vector width W is the build's native one (GCC vector extensions; -ffp-contract=fast
// turns `c += a * b` into FMAs).  Every lane is an independent chain summed over k in order
// 0..K-1, so the result of one entry does not depend on the tile shape, the row position
// or the build's width: all variants give the same bits (FMA builds) for the same problem.
#pragma once

#include <cstdint>
#include <cstring>

namespace attnlab_gemm {

#if defined(__AVX512F__)
#define ATTNLAB_GEMM_W 16
constexpr int MR = 8;
#elif defined(__AVX2__)
#define ATTNLAB_GEMM_W 8
constexpr int MR = 6;
#else
#define ATTNLAB_GEMM_W 4
constexpr int MR = 6;
#endif
constexpr int W = ATTNLAB_GEMM_W;
constexpr int NR = 2 * W;

typedef float vf __attribute__((vector_size(ATTNLAB_GEMM_W * 4)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// the C tile [0:R, 0:NV·W]; R ≤ MR, NV ≤ 2 (constants: the accumulators stay in registers).
// TA: A is stored transposed (entry (r, k) at A[k · lda + r]: Aᵀ of a row-major K × R panel,
// so the backward's Pᵀ·dO and dSᵀ·Q read P and dS in place, never transposed).  ADD: the tile
// is added to C (C + (A·B), the product summed from zero first: the bits of a product into a
// scratch tile then added, without the scratch).
template <int R, int NV, bool TA = false, bool ADD = false>
inline void tile(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb, float* __restrict C,
                 int64_t ldc, int64_t K) {
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = vf{};
  for (int64_t kk = 0; kk < K; ++kk) {
    vf bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = vload(B + kk * ldb + W * j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      // a broadcast (x - 0 is x for every x; 0 + x is not for -0)
      const vf a = (TA ? A[kk * lda + r] : A[r * lda + kk]) - vf{};
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] += a * bv[j];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      float* c = C + r * ldc + W * j;
      if constexpr (ADD)
        vstore(c, vload(c) + acc[r][j]);
      else
        vstore(c, acc[r][j]);
    }
}

// one band of R rows across all N columns: NR-wide tiles, then one W-wide tile
template <int R, bool TA = false, bool ADD = false>
inline void band(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t N,
                 int64_t K) {
  int64_t c = 0;
  for (; c + NR <= N; c += NR) tile<R, 2, TA, ADD>(A, lda, B + c, ldb, C + c, ldc, K);
  for (; c + W <= N; c += W) tile<R, 1, TA, ADD>(A, lda, B + c, ldb, C + c, ldc, K);
}

template <int R, bool TA = false, bool ADD = false>
inline void band_rest(int rest, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                      int64_t N, int64_t K) {
  if constexpr (R > 0) {
    if (rest == R) return band<R, TA, ADD>(A, lda, B, ldb, C, ldc, N, K);
    band_rest<R - 1, TA, ADD>(rest, A, lda, B, ldb, C, ldc, N, K);
  }
}

// C[0:n, 0:N] = op(A)[0:n, 0:K] · B[0:K, 0:N] (ADD: C +=), N a multiple of 16; op(A) is A
// (n × K, row stride lda) or, TA, Aᵀ of a K × n matrix A (row stride lda)
template <bool TA, bool ADD>
inline void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t n,
                 int64_t N, int64_t K) {
  int64_t r = 0;
  const int64_t step = TA ? 1 : lda;  // from one band's A to the next: MR rows (columns of the stored Aᵀ)
  for (; r + MR <= n; r += MR) band<MR, TA, ADD>(A + r * step, lda, B, ldb, C + r * ldc, ldc, N, K);
  if (r < n)
    band_rest<MR - 1, TA, ADD>(static_cast<int>(n - r), A + r * step, lda, B, ldb, C + r * ldc, ldc, N, K);
}

// C[0:n, 0:N] = A[0:n, 0:K] · B[0:K, 0:N], N a multiple of 16
inline void matmul(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t n,
                   int64_t N, int64_t K) {
  gemm<false, false>(A, lda, B, ldb, C, ldc, n, N, K);
}

inline const char* isa() {
#if defined(__AVX512F__)
  return "f32 gemm avx512 8x32";
#elif defined(__AVX2__)
  return "f32 gemm avx2 6x16";
#else
  return "f32 gemm portable 6x8";
#endif
}

}  // namespace attnlab_gemm
