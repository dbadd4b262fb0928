// The native kernel's shared pieces (included by kernel.cpp, through forward.h and backward.h):
// the argument views (View, view_of, Dims), row loads (load_row, load_kt, score_row), the
// float32 / bf16-pair packing of Q, Kᵀ and V panels (pack_t_blocked, pack_rows_pairs,
// pack_kt_pairs, pack_v_pairs) and the bf16 path's switch (bf16_pairs).
//
// kernel.cpp is the extension's only translation unit that includes tiles.h, forward.h and
// backward.h: their definitions stay in an anonymous namespace (internal linkage, as when they
// were one file), so the compiler sees and optimises them exactly as before the split.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "gemm_bf16.h"
#include "gemm_f32.h"
#include "masking.h"
#include "scratch.h"
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

#if defined(__AVX512F__)
// dst[j * ld + i] = rows[i][p + j] for i, j < 16: a 16 × 16 transpose of 32-bit words in
// registers (16 row loads, 32 unpacks, 16 lane shuffles, 16 stores; the scalar loop it
// replaces ran 256 loads and 256 stores)
inline void transpose16_words(const uint32_t* const rows[16], int64_t p, uint32_t* dst, int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + p);
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: (r2i, r2i+1) at columns 4L, 4L+1 / 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], lane L: rows 4i..4i+3 at column 4L + j
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512i a0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), b0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i a1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd), b1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_si512(dst + j * ld, _mm512_shuffle_i32x4(a0, b0, 0x88));
    _mm512_storeu_si512(dst + (8 + j) * ld, _mm512_shuffle_i32x4(a0, b0, 0xdd));
    _mm512_storeu_si512(dst + (4 + j) * ld, _mm512_shuffle_i32x4(a1, b1, 0x88));
    _mm512_storeu_si512(dst + (12 + j) * ld, _mm512_shuffle_i32x4(a1, b1, 0xdd));
  }
}
#endif

// Transposed 32-bit words of keys [c0, c0 + m) of (b, h), whose contiguous rows hold W words
// each (float32 values, or bf16 pairs): panel[p * bk + c] = word p of key c0 + c, 16 keys at a
// time (16 words at a time through transpose16_words where the build has AVX-512).  Returns the
// keys done, a multiple of 16: the caller packs the rest.
template <typename T>
int64_t transpose_keys(const View<T>& x, int64_t b, int64_t h, int64_t c0, int64_t m, int64_t W, int64_t bk,
                       uint32_t* panel) {
  int64_t c = 0;
  for (; c + 16 <= m; c += 16) {
    const uint32_t* rows[16];
    for (int64_t i = 0; i < 16; ++i) rows[i] = reinterpret_cast<const uint32_t*>(x.row(b, h, c0 + c + i));
    int64_t p = 0;
#if defined(__AVX512F__)
    for (; p + 16 <= W; p += 16) transpose16_words(rows, p, panel + p * bk + c, bk);
#endif
    for (; p < W; ++p) {
      uint32_t* dst = panel + p * bk + c;
#pragma GCC unroll 16
      for (int64_t i = 0; i < 16; ++i) dst[i] = rows[i][p];
    }
  }
  return c;
}

// Xᵀ of a (B, Hkv, N, D) tensor in float32, packed per column block: (B, Hkv, nb, D, bk),
// columns past N zero.  A tile's K panel (D × bk) is then contiguous: the micro-kernel
// streams it row by row from L1 (a D × Nk layout puts its rows Nk floats apart, which for
// Nk = 4096 maps every row to one L1 set).
template <typename T>
at::Tensor pack_t_blocked(const View<T>& x, int64_t B, int64_t Hkv, int64_t N, int64_t D, int64_t bk,
                          const at::TensorOptions& opt, attnlab_scratch::Scratch& ws, int slot) {
  const int64_t nb = (N + bk - 1) / bk;
  at::Tensor out = ws.empty(slot, {B, Hkv, nb, D, bk}, opt.dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv * nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t jb = w % nb, h = (w / nb) % Hkv, b = w / (nb * Hkv);
      const int64_t c0 = jb * bk, m = std::min(N, c0 + bk) - c0;
      float* panel = o + w * D * bk;
      if (m < bk) std::fill(panel, panel + D * bk, 0.0f);
      int64_t c = 0;
      if constexpr (std::is_same_v<T, float>)
        // float32 rows: a transpose of 32-bit words in registers (load_kt's scalar loop wrote one
        // float per store: a decode step's Kᵀ of 16k keys took longer than its attention)
        if (x.s3 == 1) c = transpose_keys(x, b, h, c0, m, D, bk, reinterpret_cast<uint32_t*>(panel));
      load_kt(panel + c, x, b, h, c0 + c, m - c, D, bk);
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


// Kᵀ of kv block jb of (b, h) as pairs along D into panel (Dw × bk words): word (p, c) =
// K[c0 + c, 2p..2p+1] (transposed: the B operand of S = Q·Kᵀ); columns past N and the half
// past D are zero.  Every word is written (no memset first).
template <typename T>
void pack_kt_pairs_block(const View<T>& x, int64_t b, int64_t h, int64_t jb, int64_t N, int64_t D, int64_t bk,
                         uint32_t* panel) {
  const int64_t Dw = (D + 1) / 2;
  const int64_t c0 = jb * bk, m = std::min(N, c0 + bk) - c0;
  if (m < bk)
    for (int64_t p = 0; p < Dw; ++p) std::fill(panel + p * bk + m, panel + (p + 1) * bk, 0u);
  int64_t c = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bf16 rows of even length are already pairs (word p = K[c, 2p] | K[c, 2p + 1] << 16,
    // little-endian): the panel is a transpose of 32-bit words, 16 keys at a time (16
    // sequential row reads, one 16-word store per p)
    if (x.s3 == 1 && D % 2 == 0) c = transpose_keys(x, b, h, c0, m, Dw, bk, panel);
  }
  for (; c < m; ++c) {
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

// Kᵀ per kv block as pairs along D: (B, Hkv, nb, Dw, bk) words (pack_kt_pairs_block per block)
template <typename T>
at::Tensor pack_kt_pairs(const View<T>& x, int64_t B, int64_t Hkv, int64_t N, int64_t D, int64_t bk,
                         const at::TensorOptions& opt, attnlab_scratch::Scratch& ws) {
  const int64_t nb = (N + bk - 1) / bk, Dw = (D + 1) / 2;
  at::Tensor out = ws.empty(0, {B, Hkv, nb, Dw, bk}, opt.dtype(at::kInt));
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, B * Hkv * nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w)
      pack_kt_pairs_block(x, w / (nb * Hkv), (w / nb) % Hkv, w % nb, N, D, bk, o + w * Dw * bk);
  });
  return out;
}

// V of kv block jb of (b, h) as pairs along the keys into panel (bk / 2 × Dp words): word
// (p, e) = V[c0 + 2p, e] | V[c0 + 2p + 1, e] << 16 (the B operand of P·V); rows past N and
// columns past D zero.  Contiguous rows write every word; strided rows OR their halves into
// a zeroed panel.
template <typename T>
void pack_v_pairs_block(const View<T>& x, int64_t b, int64_t h, int64_t jb, int64_t N, int64_t D, int64_t Dp,
                        int64_t bk, uint32_t* panel) {
  const int64_t c0 = jb * bk, m = std::min(N, c0 + bk) - c0;
  if (x.s3 == 1) {  // contiguous rows: two keys' rows interleaved at once (the loop vectorises)
    const int64_t filled = (m + 1) / 2;  // word rows holding a key
    if (Dp > D)
      for (int64_t p = 0; p < filled; ++p) std::fill(panel + p * Dp + D, panel + (p + 1) * Dp, 0u);
    std::fill(panel + filled * Dp, panel + (bk / 2) * Dp, 0u);
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
    return;
  }
  std::fill(panel, panel + (bk / 2) * Dp, 0u);
  for (int64_t c = 0; c < m; ++c) {
    const T* src = x.row(b, h, c0 + c);
    uint32_t* dst = panel + (c / 2) * Dp;
    const int shift = (c % 2) * 16;
    for (int64_t e = 0; e < D; ++e) dst[e] |= static_cast<uint32_t>(bf16_bits(src[e * x.s3])) << shift;
  }
}

// V per kv block as pairs along the keys: (B, Hkv, nb, bk / 2, Dp) words (pack_v_pairs_block
// per block)
template <typename T>
at::Tensor pack_v_pairs(const View<T>& x, int64_t B, int64_t Hkv, int64_t N, int64_t D, int64_t Dp, int64_t bk,
                        const at::TensorOptions& opt, attnlab_scratch::Scratch& ws) {
  const int64_t nb = (N + bk - 1) / bk;
  at::Tensor out = ws.empty(1, {B, Hkv, nb, bk / 2, Dp}, opt.dtype(at::kInt));
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, B * Hkv * nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w)
      pack_v_pairs_block(x, w / (nb * Hkv), (w / nb) % Hkv, w % nb, N, D, Dp, bk, o + w * (bk / 2) * Dp);
  });
  return out;
}

}  // namespace
