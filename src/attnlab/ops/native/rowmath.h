// attnlab native kernel: the per-row softmax loops of a tile (max, exp, sum, dS) at the
// build's native vector width (gemm_f32.h's vf: 16 lanes AVX-512, 8 AVX2, 4 portable).
//
// They replace 16-float GCC vectors that a 256-bit build split into halves and spilled to
// the stack on every operation.  Row lengths are multiples of 16 (tiles are padded with
// -inf scores).  exp is Cephes' float32 polynomial (about 1 ulp); x < -87 and -inf give
// exactly 0, exp(0) is exactly 1.  The fast and careful paths (forward.h, backward.h) call the same
// functions, so P and its row sum have the same bits on both.
#pragma once

#include <cstdint>

#include "gemm_f32.h"

namespace attnlab_rows {

using attnlab_gemm::vf;
using attnlab_gemm::vload;
using attnlab_gemm::vstore;
using attnlab_gemm::W;

typedef int32_t vi __attribute__((vector_size(ATTNLAB_GEMM_W * 4)));

inline vf splat(float x) { return x - vf{}; }  // a broadcast (x - 0 is x for every x, -0 too)

inline vf exp_v(vf x) {
  const vf lo = splat(-87.0f), hi = splat(88.0f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf t = xc * 1.44269504088896341f;
  const vf n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf sc;
  std::memcpy(&sc, &e, sizeof sc);
  y = y * sc;
  return x < lo ? vf{} : y;
}

inline float hmax(vf m) {
  float r = m[0];
  for (int j = 1; j < W; ++j) r = r > m[j] ? r : m[j];
  return r;
}
inline float hsum(vf s) {
  float r = 0.0f;
  for (int j = 0; j < W; ++j) r += s[j];
  return r;
}

// max of x[0:n] (n a multiple of 16)
inline float row_max(const float* x, int64_t n) {
  vf m = vload(x);
  for (int64_t c = W; c < n; c += W) {
    const vf y = vload(x + c);
    m = m > y ? m : y;
  }
  return hmax(m);
}

// out[0:n] = exp(x[0:n] - mx) (out may be x); returns the sum of out
inline float row_exp(const float* x, float* out, int64_t n, float mx) {
  vf s = vf{};
  for (int64_t c = 0; c < n; c += W) {
    const vf p = exp_v(vload(x + c) - mx);
    vstore(out + c, p);
    s += p;
  }
  return hsum(s);
}

// backward: P = exp(S - L), dS = P · (dP - Δ) · scale.  With keep_p, S becomes P; dP becomes dS.
// Without, S becomes dS (dP is left as it is).
template <bool keep_p>
inline void row_ds(float* S, float* dP, int64_t n, float L, float Di, float scale) {
  for (int64_t c = 0; c < n; c += W) {
    const vf p = exp_v(vload(S + c) - L);
    const vf ds = p * (vload(dP + c) - Di) * scale;
    if constexpr (keep_p) {
      vstore(S + c, p);
      vstore(dP + c, ds);
    } else {
      vstore(S + c, ds);
    }
  }
}

// x[0:n] *= s
inline void row_scale(float* x, int64_t n, float s) {
  int64_t c = 0;
  for (; c + W <= n; c += W) vstore(x + c, vload(x + c) * s);
  for (; c < n; ++c) x[c] *= s;
}

// a[0:n] = a[0:n] · alpha + t[0:n]  (n a multiple of 16)
inline void row_axpby(float* a, const float* t, int64_t n, float alpha) {
  for (int64_t c = 0; c < n; c += W) vstore(a + c, vload(a + c) * alpha + vload(t + c));
}

// a[0:n] += t[0:n]
inline void row_add(float* a, const float* t, int64_t n) {
  int64_t c = 0;
  for (; c + W <= n; c += W) vstore(a + c, vload(a + c) + vload(t + c));
  for (; c < n; ++c) a[c] += t[c];
}

}  // namespace attnlab_rows
