// attnlab native kernel: the forward's fused tile steps (forward.h's forward_impl fast path).
//
// * matmul_acc: C[r] = C[r] · alpha[r] + A[r] · B, the P·V product folded into the running
//   output block.  The register tile is gemm_f32.h's (MR × 2W accumulators summed over k in
//   order, from zero); only the store differs: `c · alpha + acc` (one FMA) where the
//   unfused path stored `acc` to a scratch tile and ran row_axpby (`a · alpha + t`, the same
//   FMA): the same bits, one pass over the block and its stores fewer.  A is float32 (B
//   float32) or bf16 pairs (B bf16 pairs, gemm_bf16.h's `dp`: vdpbf16ps where the build has it).
// * row_scale_max: x *= s and its max in one pass (a full row without score mod).
// * row_exp_bf16: exp(x - mx) and its float32 sum as rowmath.h's row_exp computes them (the
//   same bits), written as bf16 (round to nearest even, gemm_bf16.h's to_bf16 on every lane)
//   straight into the P operand of P·V: no float32 P row, no scalar pack pass.
#pragma once

#include <cstdint>
#include <cstring>

#include "gemm_bf16.h"
#include "gemm_f32.h"
#include "rowmath.h"

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

// C[0:n, 0:N] = A · B (the S = Q·Kᵀ tile)
template <typename E>
inline void matmul(const E* A, int64_t lda, const E* B, int64_t ldb, float* C, int64_t ldc, int64_t n, int64_t N,
                   int64_t K) {
  int64_t r = 0;
  for (; r + MR <= n; r += MR) band<MR>(A + r * lda, lda, B, ldb, C + r * ldc, ldc, N, K, nullptr);
  if (r < n) band_rest<MR - 1>(static_cast<int>(n - r), A + r * lda, lda, B, ldb, C + r * ldc, ldc, N, K, nullptr);
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

// float32 -> bf16 bits on every lane: gemm_bf16.h's to_bf16 (nearest even; NaN stays NaN)
inline vh to_bf16_v(vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof u);
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (u >> 16) | 0x40u;
  const vu r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return __builtin_convertvector(r, vh);
}

// out[0:n] = bf16(exp(x[0:n] - mx)) (n a multiple of W); returns the float32 sum (rowmath.h's
// row_exp: the same P, the same sum)
inline float row_exp_bf16(const float* x, uint16_t* out, int64_t n, float mx) {
  vf s = vf{};
  for (int64_t c = 0; c < n; c += W) {
    const vf p = attnlab_rows::exp_v(vload(x + c) - mx);
    const vh h = to_bf16_v(p);
    std::memcpy(out + c, &h, sizeof h);
    s += p;
  }
  return attnlab_rows::hsum(s);
}

}  // namespace attnlab_fwd
