// What the bf16 forward's exp step costs per 16 values, op by op: variants of the loop in
// fwd_tile.h (exp2_v<4> then bf16 P and the float32 sum) on one window row (272 scores, in
// L1), 16 rows at a time (a probe for kernel design, not a test).
//
//   current      fwd_tile.h as it is: clamp at -125, round by a magic add, degree-4 Horner,
//                vscalefps under the keep mask, vcvtneps2bf16, the sum
//   no clamp     without the max at -125 (the keep mask zeroes those lanes anyway)
//   int exponent 2^n added to the exponent bits (vpslld + vpaddd) instead of vscalefps
//   no cvt       P stored as float32 (what the bf16 conversion costs)
//   int rounding the conversion by integer ops (c10's rounding) instead of vcvtneps2bf16
//   cvt pairs    two vectors per vcvtne2ps2bf16
//
//   g++ -O3 -std=c++17 -march=native scripts/exp_step_ops.cpp -o exp_step_ops && ./exp_step_ops
//
// 2026-12-05 10:45 (AMD EPYC, family 26; ns per 16 values, three rounds alike): current 1.38-1.39,
// no clamp 1.25-1.26, int exponent 1.55-1.56, no cvt 1.14, int rounding 1.94-1.96, cvt pairs
// 1.25, no clamp + cvt pairs 1.13: each FP op the loop drops saves about 0.1 ns alone.  In the
// kernel none of these helped window256: there the exp's arithmetic is 0.11 ms of the exp
// loop's 0.42 (docs/native.md, "Where window256's time goes, by removal").
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>

alignas(64) static float S[16 * 288];
alignas(64) static uint16_t P[16 * 288];
alignas(64) static float PF[16 * 288];

enum : int { NOCLAMP = 1, INTEXP = 2, F32 = 4, INTCVT = 8, PAIRS = 16 };

template <int V>
inline __m512 exp_p(const float* x, int k, __m512 cc, __m512 mm) {
  const __m512 lo = _mm512_set1_ps(-125.f), mg = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(x + k), cc, mm);
  const __m512 tc = (V & NOCLAMP) ? t : _mm512_max_ps(lo, t);
  const __m512 r = _mm512_add_ps(tc, mg);
  const __m512 nm = _mm512_sub_ps(r, mg);
  const __m512 f = _mm512_sub_ps(tc, nm);
  __m512 p = _mm512_set1_ps(0.009582744911313057f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05590614303946495f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099111557007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931242346763611f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __mmask16 keep = _mm512_cmp_ps_mask(t, lo, _CMP_NLT_UQ);
  if (V & INTEXP) {
    const __m512i e = _mm512_slli_epi32(_mm512_castps_si512(r), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e)));
  }
  return _mm512_maskz_scalef_ps(keep, p, nm);
}

template <int V>
inline void store1(uint16_t* out, float* outf, __m512 p) {
  if (V & F32) {
    _mm512_storeu_ps(outf, p);
  } else if (V & INTCVT) {
    const __m512i u = _mm512_castps_si512(p);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rr = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rr));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(p));
  }
}

template <int V>
__attribute__((noinline)) float row(const float* x, uint16_t* out, float* outf, int n, float c, float mb) {
  const __m512 cc = _mm512_set1_ps(c), mm = _mm512_set1_ps(mb);
  __m512 s = _mm512_setzero_ps();
  if (V & PAIRS) {
    int k = 0;
    for (; k + 32 <= n; k += 32) {
      const __m512 p0 = exp_p<V>(x, k, cc, mm), p1 = exp_p<V>(x, k + 16, cc, mm);
      s = _mm512_add_ps(_mm512_add_ps(s, p0), p1);
      _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    for (; k < n; k += 16) {
      const __m512 p = exp_p<V>(x, k, cc, mm);
      s = _mm512_add_ps(s, p);
      store1<V>(out + k, outf + k, p);
    }
    return _mm512_reduce_add_ps(s);
  }
  for (int k = 0; k < n; k += 16) {
    const __m512 p = exp_p<V>(x, k, cc, mm);
    s = _mm512_add_ps(s, p);
    store1<V>(out + k, outf + k, p);
  }
  return _mm512_reduce_add_ps(s);
}

template <int V>
void bench(const char* name) {
  float sum = 0;
  const int iters = 20000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it)
    for (int r = 0; r < 16; ++r) sum += row<V>(S + r * 288, P + r * 288, PF + r * 288, 272, 0.125f * 1.442695f, 3.0f);
  const auto t1 = std::chrono::steady_clock::now();
  const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / iters / 16 / 17;
  std::printf("%-24s %.3f ns per 16 values  (checksum %g)\n", name, ns, sum);
}

int main() {
  std::mt19937 g(0);
  std::normal_distribution<float> d;
  for (auto& x : S) x = d(g) * 8;
  for (int i = 0; i < 3; ++i) {
    bench<0>("current");
    bench<NOCLAMP>("no clamp");
    bench<INTEXP>("int exponent");
    bench<F32>("no cvt (float32 P)");
    bench<INTCVT>("int rounding");
    bench<PAIRS>("cvt pairs");
    bench<NOCLAMP | PAIRS>("no clamp + cvt pairs");
    std::printf("\n");
  }
}
