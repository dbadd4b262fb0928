// Float helpers shared by the attention kernel (kernel.cpp) and the decode kernel (decode.cpp):
// to_f reads one element of an input dtype as float32; exp_f is the scalar exp of the softmax
// (rowmath.h's exp_v is the same polynomial at native vector width); v16 and its loads,
// stores, splat and horizontal sum are the decode kernel's 16-lane float vectors; convert
// widens a unit-stride run of float32 / bf16 / fp16 values to float32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace attnlab_vecmath {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// exp(x) in float32 (Cephes' polynomial, about 1 ulp); x < -87 (and -inf) gives exactly 0.
// Branch-free, so the loops that call it vectorise.
inline float exp_f(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float t = xc * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &e, sizeof s);
  y = y * s;
  return x < -87.0f ? 0.0f : y;
}

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

inline v16 ld(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void st(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat(float x) { return v16{} + x; }
inline float hsum(v16 a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(a));
#else
  float r = 0.0f;
  for (int j = 0; j < 16; ++j) r += a[j];
  return r;
#endif
}

// n values at src (unit stride) -> float32 at dst
inline void convert(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void convert(float* dst, const c10::BFloat16* src, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    u16x16 h;
    std::memcpy(&h, src + d, sizeof h);
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    std::memcpy(dst + d, &w, sizeof w);
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
inline void convert(float* dst, const c10::Half* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

}  // namespace attnlab_vecmath
