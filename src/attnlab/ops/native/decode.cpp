// attnlab's native decode kernel: a few new queries per sequence over keys that live in a
// PagedCache's block pools or a QuantizedCache's packed groups, read in place.
//
//   paged:     q (B, H, Nq, D); k_pool (Hkv, n_blocks, bs, D), v_pool (Hkv, n_blocks, bs, Dv);
//              tables (B, max_blocks) int32/int64; lens (B,) keys held; kv_start (B,) absolute
//              position of held key 0; q_pos (B,) absolute position of query 0.
//   quantized: q (B, H, Nq, D); codes kc (B, Hkv, T, ceil(D·bits/8)) uint8, ks/kz (B, Hkv, groups, D)
//              per-channel key scale/zero per group of G tokens; vc (B, Hkv, T, ceil(Dv·bits/8)),
//              vs/vz (B, Hkv, T, Dv/gv) per-token value scale/zero per gv channels; then a float
//              tail k_tail (B, Hkv, W, D), v_tail; keys at absolute positions 0 .. n_groups·G + W.
//
// The mask is the native kernel's structure (structure.py) at absolute positions:
//     visible = ((no left or qp - kp <= left) and (no right or kp - qp <= right))
//               or (kp < sinks and (no sinks_right or kp - qp <= sinks_right))
//               and (no kv_len or kp < kv_len[b])
//
// Work items are (b, kv head, split of the keys): every item attends the G·Nq query rows of
// its kv head (GQA: each key is read once for all of them) over a run of keys, with an
// online softmax in float32, and leaves (O, m, l); the item that finishes a (b, kv head)
// last merges its splits with the LSE rule.  One at::parallel_for region, items handed
// out by an atomic counter (ragged lengths balance themselves).  Quantized keys and values
// are dequantised into float32 tile buffers (never a cache-sized copy); float32 pools are
// read in place.  Out in q's dtype, lse float32 (natural log); rows that see no key give
// 0 and -inf.
// ATen and the operator registry only (no pybind, no torch/extension.h): a shorter compile
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "vecmath.h"

namespace attnlab_decode {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t TILE = 32;  // keys per tile: K and V tiles of 32 × D floats stay in L1

using namespace attnlab_vecmath;  // to_f, exp_f, the 16-lane v16 helpers, convert

struct MaskS {  // the structure, at absolute positions
  bool has_left, has_right, has_sinks_right;
  int64_t left, right, sinks, sinks_right;
  const int64_t* kv_len;  // (B,) or nullptr

  static int64_t clamp(__int128 x, int64_t lo, int64_t hi) {
    return x < lo ? lo : (x > hi ? hi : static_cast<int64_t>(x));
  }
  // visible local keys of the query at absolute qp, batch b, keys local [0, L) at absolute k0:
  // [0, s1) ∪ [b0, b1)
  void ranges(int64_t b, int64_t qp_, int64_t k0, int64_t L, int64_t& s1, int64_t& b0, int64_t& b1) const {
    int64_t end = L;
    if (kv_len != nullptr) end = clamp(static_cast<__int128>(kv_len[b]) - k0, 0, L);
    const __int128 qp = qp_;
    s1 = clamp(static_cast<__int128>(sinks) - k0, 0, end);
    if (has_sinks_right) s1 = std::min(s1, clamp(qp + sinks_right - k0 + 1, 0, end));
    b0 = has_left ? clamp(qp - left - k0, 0, end) : 0;
    b1 = has_right ? clamp(qp + right - k0 + 1, 0, end) : end;
    if (b1 < b0) b0 = b1;
  }
};

struct Row {  // one query row's visible local keys: [0, s1) ∪ [b0, b1)
  int64_t s1, b0, b1;
  bool none(int64_t c0, int64_t c1) const { return c0 >= s1 && (c1 <= b0 || c0 >= b1); }
  bool all(int64_t c0, int64_t c1) const { return c1 <= s1 || (c0 >= b0 && c1 <= b1); }
  bool visible(int64_t c) const { return c < s1 || (c >= b0 && c < b1); }
};

// ----------------------------------------------------------------------------- key sources
// load(b, hk, i0, n, krow, vrow, kbuf, vbuf): pointers to n float32 rows of keys/values of
// local keys [i0, i0+n) (into the pools when they are float32, else into kbuf/vbuf).

template <typename T>
struct PagedSrc {
  const T *K, *V;
  int64_t kh, kb, kt, vh, vb, vt;  // strides of the pools (head, block, token); channels unit stride
  const void* table;
  bool table64;
  int64_t tstride, bs, D, Dv;

  int64_t block(int64_t b, int64_t j) const {
    return table64 ? static_cast<const int64_t*>(table)[b * tstride + j]
                   : static_cast<const int32_t*>(table)[b * tstride + j];
  }
  void load(int64_t b, int64_t hk, int64_t i0, int64_t n, const float** krow, const float** vrow, float* kbuf,
            float* vbuf) const {
    int64_t c = 0;
    while (c < n) {
      const int64_t i = i0 + c, j = i / bs, slot = i % bs, m = std::min(n - c, bs - slot);
      const int64_t blk = block(b, j);
      const T* kp = K + hk * kh + blk * kb + slot * kt;
      const T* vp = V + hk * vh + blk * vb + slot * vt;
      for (int64_t t = 0; t < m; ++t, ++c) {
        if constexpr (std::is_same_v<T, float>) {
          krow[c] = kp + t * kt;
          vrow[c] = vp + t * vt;
        } else {
          convert(kbuf + c * D, kp + t * kt, D);
          convert(vbuf + c * Dv, vp + t * vt, Dv);
          krow[c] = kbuf + c * D;
          vrow[c] = vbuf + c * Dv;
        }
      }
    }
  }
};

inline float read_scalar(const void* p, int64_t idx, int kind) {  // kind: 0 float32, 1 float16, 2 bfloat16
  if (kind == 0) return static_cast<const float*>(p)[idx];
  if (kind == 1) return static_cast<float>(static_cast<const c10::Half*>(p)[idx]);
  return static_cast<float>(static_cast<const c10::BFloat16*>(p)[idx]);
}

template <int BITS>
inline void dequant_row(float* dst, const uint8_t* codes, const float* s, const float* z, int64_t n) {
  if constexpr (BITS == 8) {
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      u8x16 c;
      std::memcpy(&c, codes + d, sizeof c);
      st(dst + d, __builtin_convertvector(c, v16) * ld(s + d) + ld(z + d));
    }
    for (; d < n; ++d) dst[d] = static_cast<float>(codes[d]) * s[d] + z[d];
  } else {
    constexpr int PER = 8 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1;
    for (int64_t d = 0; d < n; ++d) {
      const unsigned c = (codes[d / PER] >> (BITS * (d % PER))) & MASK;
      dst[d] = static_cast<float>(c) * s[d] + z[d];
    }
  }
}

template <typename T, int BITS>
struct QuantSrc {
  const uint8_t *kc, *vc;
  int64_t kc0, kc1, kc2, vc0, vc1, vc2;  // strides (b, h, token) of the codes; bytes unit stride
  const void *ks, *kz, *vs, *vz;
  int scale_kind;
  int64_t ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3;  // strides of ks/kz (b, h, group, d), vs/vz (b, h, t, grp)
  const T *kt, *vt;                                // the float tail
  int64_t kt0, kt1, kt2, kt3, vt0, vt1, vt2, vt3;
  int64_t nq, G, gv, D, Dv;  // nq = quantized tokens (n_groups · G)

  // per-thread: the current key group's scales/zeros in float32
  struct Scratch {
    std::vector<float> s, z, vsr, vzr;
    int64_t b = -1, h = -1, g = -1;
  };

  void load(int64_t b, int64_t hk, int64_t i0, int64_t n, const float** krow, const float** vrow, float* kbuf,
            float* vbuf, Scratch& sc) const {
    const int64_t ngv = Dv / gv;
    for (int64_t c = 0; c < n; ++c) {
      const int64_t i = i0 + c;
      float* kd = kbuf + c * D;
      float* vd = vbuf + c * Dv;
      if (i < nq) {
        const int64_t g = i / G;
        if (sc.b != b || sc.h != hk || sc.g != g) {
          const int64_t base = b * ks0 + hk * ks1 + g * ks2;
          for (int64_t d = 0; d < D; ++d) {
            sc.s[d] = read_scalar(ks, base + d * ks3, scale_kind);
            sc.z[d] = read_scalar(kz, base + d * ks3, scale_kind);
          }
          sc.b = b, sc.h = hk, sc.g = g;
        }
        dequant_row<BITS>(kd, kc + b * kc0 + hk * kc1 + i * kc2, sc.s.data(), sc.z.data(), D);
        const int64_t vbase = b * vs0 + hk * vs1 + i * vs2;
        for (int64_t q = 0; q < ngv; ++q) {
          const float s = read_scalar(vs, vbase + q * vs3, scale_kind), z = read_scalar(vz, vbase + q * vs3, scale_kind);
          for (int64_t j = 0; j < gv; ++j) sc.vsr[q * gv + j] = s, sc.vzr[q * gv + j] = z;
        }
        dequant_row<BITS>(vd, vc + b * vc0 + hk * vc1 + i * vc2, sc.vsr.data(), sc.vzr.data(), Dv);
      } else {
        const int64_t w = i - nq;
        const T* kp = kt + b * kt0 + hk * kt1 + w * kt2;
        const T* vp = vt + b * vt0 + hk * vt1 + w * vt2;
        if (kt3 == 1) {
          convert(kd, kp, D);
        } else {
          for (int64_t d = 0; d < D; ++d) kd[d] = to_f(kp[d * kt3]);
        }
        if (vt3 == 1) {
          convert(vd, vp, Dv);
        } else {
          for (int64_t d = 0; d < Dv; ++d) vd[d] = to_f(vp[d * vt3]);
        }
      }
      krow[c] = kd;
      vrow[c] = vd;
    }
  }
};

// ----------------------------------------------------------------------------- the driver
struct Problem {
  int64_t B, H, Hkv, G, Nq, D, Dv, R;  // R = G·Nq rows per (b, kv head)
  float scale;
  MaskS mask;
  const int64_t *lens, *kv_start, *q_pos;  // (B,) each
};

// Q rows of (b, hk) as float32, pre-scaled: row r = g·Nq + i is query head hk·G + g, query i
template <typename T>
void load_q(float* Q, const at::Tensor& q, const Problem& p, int64_t b, int64_t hk) {
  const T* qp = q.data_ptr<T>();
  const int64_t s0 = q.stride(0), s1 = q.stride(1), s2 = q.stride(2), s3 = q.stride(3);
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t h = hk * p.G + r / p.Nq, i = r % p.Nq;
    const T* src = qp + b * s0 + h * s1 + i * s2;
    for (int64_t d = 0; d < p.D; ++d) Q[r * p.D + d] = to_f(src[d * s3]) * p.scale;
  }
}

struct Item {
  int64_t bh, i0, i1, slot;  // (b·Hkv + hk), local keys [i0, i1), partial slot
};

template <typename T, typename Src, typename... Extra>
void run(const at::Tensor& q, const Problem& p, const Src& src, int64_t split, at::Tensor& out, at::Tensor& lse,
         Extra... extra) {
  const int64_t B = p.B, Hkv = p.Hkv, R = p.R, D = p.D, Dv = p.Dv;
  // each (b, kv head): its rows' union of visible keys, cut into splits
  std::vector<Item> items;
  std::vector<int64_t> nsplit(B * Hkv), first(B * Hkv);
  int64_t total = 0;
  std::vector<int64_t> lo(B), hi(B);
  for (int64_t b = 0; b < B; ++b) {
    lo[b] = p.lens[b], hi[b] = 0;
    for (int64_t i = 0; i < p.Nq; ++i) {
      int64_t s1, b0, b1;
      p.mask.ranges(b, p.q_pos[b] + i, p.kv_start[b], p.lens[b], s1, b0, b1);
      if (s1 > 0) lo[b] = 0, hi[b] = std::max(hi[b], s1);
      if (b1 > b0) lo[b] = std::min(lo[b], b0), hi[b] = std::max(hi[b], b1);
    }
    if (hi[b] <= lo[b]) lo[b] = hi[b] = 0;
    total += (hi[b] - lo[b]) * Hkv;
  }
  const int64_t nth = std::max<int64_t>(1, at::get_num_threads());
  if (split <= 0) split = std::min<int64_t>(2048, std::max<int64_t>(256, total / (nth * 32)));
  split = (split + TILE - 1) / TILE * TILE;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      const int64_t bh = b * Hkv + hk, n = std::max<int64_t>(1, (hi[b] - lo[b] + split - 1) / split);
      nsplit[bh] = n, first[bh] = static_cast<int64_t>(items.size());
      for (int64_t s = 0; s < n; ++s) {
        const int64_t a = lo[b] + s * split;
        items.push_back(Item{bh, a, std::min(hi[b], a + split), static_cast<int64_t>(items.size())});
      }
    }
  const int64_t nitems = static_cast<int64_t>(items.size());
  std::vector<float> part_o(nitems * R * Dv), part_m(nitems * R), part_l(nitems * R);
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[B * Hkv]);
  for (int64_t i = 0; i < B * Hkv; ++i) done[i].store(0);
  std::atomic<int64_t> next{0};
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();

  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    std::vector<float> Q(R * D), S(R * TILE), kbuf(TILE * D), vbuf(TILE * Dv), sum(Dv);
    std::vector<const float*> krow(TILE), vrow(TILE);
    std::vector<Row> rows(R);
    std::vector<uint8_t> active(R);
    auto scratch = [&]() {
      if constexpr (sizeof...(Extra) == 0) {
        return 0;
      } else {
        typename Src::Scratch sc;
        sc.s.resize(D), sc.z.resize(D), sc.vsr.resize(Dv), sc.vzr.resize(Dv);
        return sc;
      }
    }();
    int64_t loaded_bh = -1;
    for (int64_t it = next.fetch_add(1); it < nitems; it = next.fetch_add(1)) {
      const Item& w = items[it];
      const int64_t b = w.bh / Hkv, hk = w.bh % Hkv;
      if (loaded_bh != w.bh) {
        load_q<T>(Q.data(), q, p, b, hk);
        loaded_bh = w.bh;
      }
      for (int64_t r = 0; r < R; ++r) {
        int64_t s1, b0, b1;
        p.mask.ranges(b, p.q_pos[b] + r % p.Nq, p.kv_start[b], p.lens[b], s1, b0, b1);
        rows[r] = Row{s1, b0, b1};
      }
      float* O = part_o.data() + w.slot * R * Dv;
      float* M = part_m.data() + w.slot * R;
      float* L = part_l.data() + w.slot * R;
      std::fill(O, O + R * Dv, 0.0f);
      std::fill(M, M + R, NEG_INF);
      std::fill(L, L + R, 0.0f);
      for (int64_t t0 = w.i0; t0 < w.i1; t0 += TILE) {
        const int64_t n = std::min(TILE, w.i1 - t0);
        bool any = false;
        for (int64_t r = 0; r < R; ++r) any |= (active[r] = !rows[r].none(t0, t0 + n));
        if (!any) continue;
        if constexpr (sizeof...(Extra) == 0) {
          src.load(b, hk, t0, n, krow.data(), vrow.data(), kbuf.data(), vbuf.data());
        } else {
          src.load(b, hk, t0, n, krow.data(), vrow.data(), kbuf.data(), vbuf.data(), scratch);
        }
        // S = (scale·Q) Kᵀ for the active rows
        for (int64_t c = 0; c < n; ++c) {
          const float* kr = krow[c];
          int64_t r = 0;
          for (; r + 4 <= R; r += 4) {
            const float *q0 = &Q[r * D], *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
            v16 a0{}, a1{}, a2{}, a3{};
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) {
              const v16 kv = ld(kr + d);
              a0 += ld(q0 + d) * kv, a1 += ld(q1 + d) * kv, a2 += ld(q2 + d) * kv, a3 += ld(q3 + d) * kv;
            }
            float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
            for (; d < D; ++d) s0 += q0[d] * kr[d], s1 += q1[d] * kr[d], s2 += q2[d] * kr[d], s3 += q3[d] * kr[d];
            S[r * TILE + c] = s0, S[(r + 1) * TILE + c] = s1, S[(r + 2) * TILE + c] = s2, S[(r + 3) * TILE + c] = s3;
          }
          for (; r < R; ++r) {
            const float* q0 = &Q[r * D];
            v16 a0{};
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) a0 += ld(q0 + d) * ld(kr + d);
            float s0 = hsum(a0);
            for (; d < D; ++d) s0 += q0[d] * kr[d];
            S[r * TILE + c] = s0;
          }
        }
        // online softmax per row; P overwrites S (0 for hidden and inactive rows)
        for (int64_t r = 0; r < R; ++r) {
          float* s = &S[r * TILE];
          if (!active[r]) {
            std::fill(s, s + n, 0.0f);
            continue;
          }
          if (!rows[r].all(t0, t0 + n))
            for (int64_t c = 0; c < n; ++c)
              if (!rows[r].visible(t0 + c)) s[c] = NEG_INF;
          float mx = M[r];
          for (int64_t c = 0; c < n; ++c) mx = std::max(mx, s[c]);
          if (mx == NEG_INF) {  // a NaN-free row that sees nothing here
            std::fill(s, s + n, 0.0f);
            continue;
          }
          const float alpha = exp_f(M[r] - mx);
          float rs = 0.0f;
          for (int64_t c = 0; c < n; ++c) rs += (s[c] = exp_f(s[c] - mx));
          L[r] = L[r] * alpha + rs;
          M[r] = mx;
          if (alpha != 1.0f)
            for (int64_t j = 0; j < Dv; ++j) O[r * Dv + j] *= alpha;
        }
        // O += P V, row blocks of 4 in registers
        for (int64_t r = 0; r < R; r += 4) {
          const int64_t rn = std::min<int64_t>(4, R - r);
          int64_t j = 0;
          for (; j + 16 <= Dv; j += 16) {
            v16 a[4];
            for (int64_t u = 0; u < rn; ++u) a[u] = ld(&O[(r + u) * Dv + j]);
            for (int64_t c = 0; c < n; ++c) {
              const v16 vv = ld(vrow[c] + j);
              for (int64_t u = 0; u < rn; ++u) a[u] += S[(r + u) * TILE + c] * vv;
            }
            for (int64_t u = 0; u < rn; ++u) st(&O[(r + u) * Dv + j], a[u]);
          }
          for (; j < Dv; ++j)
            for (int64_t u = 0; u < rn; ++u) {
              float acc = O[(r + u) * Dv + j];
              for (int64_t c = 0; c < n; ++c) acc += S[(r + u) * TILE + c] * vrow[c][j];
              O[(r + u) * Dv + j] = acc;
            }
        }
      }
      // the last split of (b, hk) to finish merges them all
      if (done[w.bh].fetch_add(1, std::memory_order_acq_rel) + 1 != nsplit[w.bh]) continue;
      const int64_t f = first[w.bh], ns = nsplit[w.bh];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = hk * p.G + r / p.Nq, i = r % p.Nq;
        T* dst = op + ((b * p.H + h) * p.Nq + i) * Dv;
        float mx = NEG_INF;
        for (int64_t s = 0; s < ns; ++s)
          if (part_l[(f + s) * R + r] > 0.0f) mx = std::max(mx, part_m[(f + s) * R + r]);
        std::fill(sum.begin(), sum.end(), 0.0f);
        float tot = 0.0f;
        if (mx != NEG_INF) {
          for (int64_t s = 0; s < ns; ++s) {
            const float l = part_l[(f + s) * R + r];
            if (!(l > 0.0f)) continue;
            const float e = exp_f(part_m[(f + s) * R + r] - mx);
            tot += l * e;
            const float* po = part_o.data() + ((f + s) * R + r) * Dv;
            for (int64_t j = 0; j < Dv; ++j) sum[j] += e * po[j];
          }
        }
        const float inv = tot > 0.0f ? 1.0f / tot : 0.0f;
        for (int64_t j = 0; j < Dv; ++j) dst[j] = static_cast<T>(sum[j] * inv);
        lp[(b * p.H + h) * p.Nq + i] = tot > 0.0f ? mx + std::log(tot) : NEG_INF;
      }
    }
  });
}

MaskS mask_of(const std::vector<int64_t>& band, int64_t sinks, const c10::optional<at::Tensor>& kv_len) {
  TORCH_CHECK(band.size() == 6, "attnlab decode: band must hold 6 ints, got ", band.size());
  MaskS m{};
  m.has_left = band[0] != 0, m.left = band[1];
  m.has_right = band[2] != 0, m.right = band[3];
  m.has_sinks_right = band[4] != 0, m.sinks_right = band[5];
  m.sinks = sinks;
  m.kv_len = nullptr;
  return m;
}

at::Tensor long_vec(const at::Tensor& t, int64_t B, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == B, "attnlab decode: ", name, " must be a (", B,
              ",) CPU tensor, got ", t.sizes());
  return t.to(at::kLong).contiguous();
}

void check_q(const at::Tensor& q, int64_t Hkv) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4, "attnlab decode: q must be a (B, H, Nq, D) CPU tensor");
  TORCH_CHECK(Hkv >= 1 && q.size(1) % Hkv == 0, "attnlab decode: query heads ", q.size(1),
              " are not a multiple of kv heads ", Hkv);
}

std::vector<at::Tensor> paged(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& kv_start,
                              const at::Tensor& q_pos, const c10::optional<at::Tensor>& kv_len, double scale,
                              std::vector<int64_t> band, int64_t sinks, int64_t split) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4, "attnlab paged decode: pools must be (Hkv, n_blocks, bs, D)");
  const int64_t Hkv = k_pool.size(0), nblk = k_pool.size(1), bs = k_pool.size(2), D = k_pool.size(3);
  const int64_t Dv = v_pool.size(3);
  check_q(q, Hkv);
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2);
  TORCH_CHECK(q.size(3) == D, "attnlab paged decode: q head dim ", q.size(3), " != pool head dim ", D);
  TORCH_CHECK(v_pool.size(0) == Hkv && v_pool.size(1) == nblk && v_pool.size(2) == bs,
              "attnlab paged decode: k_pool ", k_pool.sizes(), " and v_pool ", v_pool.sizes(), " do not match");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type(),
              "attnlab paged decode: q and the pools must share one dtype");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, "attnlab paged decode: pools need unit channel stride");
  TORCH_CHECK(tables.device().is_cpu() && tables.dim() == 2 && tables.size(0) == B &&
                  (tables.scalar_type() == at::kInt || tables.scalar_type() == at::kLong),
              "attnlab paged decode: tables must be a (B, max_blocks) int32/int64 CPU tensor, got ", tables.sizes());
  const at::Tensor tab = tables.contiguous();
  const at::Tensor ln = long_vec(lens, B, "lens"), ks = long_vec(kv_start, B, "kv_start"), qp = long_vec(q_pos, B, "q_pos");
  MaskS m = mask_of(band, sinks, kv_len);
  at::Tensor kvl;
  if (kv_len.has_value()) kvl = long_vec(*kv_len, B, "kv_len"), m.kv_len = kvl.data_ptr<int64_t>();
  const int64_t* L = ln.data_ptr<int64_t>();
  const int64_t mb = tab.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(L[b] >= 0 && L[b] <= mb * bs, "attnlab paged decode: row ", b, " holds ", L[b],
                " keys but its table has ", mb, " blocks of ", bs);
    const int64_t used = (L[b] + bs - 1) / bs;
    for (int64_t j = 0; j < used; ++j) {
      const int64_t blk = tab.scalar_type() == at::kLong ? tab.data_ptr<int64_t>()[b * mb + j]
                                                          : tab.data_ptr<int32_t>()[b * mb + j];
      TORCH_CHECK(blk >= 0 && blk < nblk, "attnlab paged decode: row ", b, " block ", j, " is ", blk,
                  ", outside the pool's ", nblk, " blocks");
    }
  }
  Problem p{B, H, Hkv, H / Hkv, Nq, D, Dv, (H / Hkv) * Nq, static_cast<float>(scale), m,
            L,  ks.data_ptr<int64_t>(), qp.data_ptr<int64_t>()};
  at::Tensor out = at::empty({B, H, Nq, Dv}, q.options());
  at::Tensor lse = at::empty({B, H, Nq}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnlab_paged_decode", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "attnlab paged decode: float64 is not supported (float32, bfloat16, float16)");
    } else {
      PagedSrc<scalar_t> src{k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(), k_pool.stride(0),
                             k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1),
                             v_pool.stride(2), tab.data_ptr(), tab.scalar_type() == at::kLong, mb, bs, D, Dv};
      run<scalar_t>(q, p, src, split, out, lse);
    }
  });
  return {out, lse};
}

int scale_kind(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return 0;
  if (t.scalar_type() == at::kHalf) return 1;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "attnlab quantized decode: scales must be float32/float16/bfloat16");
  return 2;
}

template <typename T, int BITS>
void run_quant(const at::Tensor& q, const Problem& p, const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& kz,
               const at::Tensor& vc, const at::Tensor& vs, const at::Tensor& vz, const at::Tensor& k_tail,
               const at::Tensor& v_tail, int64_t nq, int64_t G, int64_t gv, int64_t split, at::Tensor& out,
               at::Tensor& lse) {
  QuantSrc<T, BITS> src{kc.data_ptr<uint8_t>(), vc.data_ptr<uint8_t>(), kc.stride(0), kc.stride(1), kc.stride(2),
                        vc.stride(0), vc.stride(1), vc.stride(2), ks.data_ptr(), kz.data_ptr(), vs.data_ptr(),
                        vz.data_ptr(), scale_kind(ks), ks.stride(0), ks.stride(1), ks.stride(2), ks.stride(3),
                        vs.stride(0), vs.stride(1), vs.stride(2), vs.stride(3), k_tail.data_ptr<T>(),
                        v_tail.data_ptr<T>(), k_tail.stride(0), k_tail.stride(1), k_tail.stride(2),
                        k_tail.stride(3), v_tail.stride(0), v_tail.stride(1), v_tail.stride(2), v_tail.stride(3),
                        nq, G, gv, p.D, p.Dv};
  run<T>(q, p, src, split, out, lse, 0);
}

std::vector<at::Tensor> quantized(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& kz,
                                  const at::Tensor& vc, const at::Tensor& vs, const at::Tensor& vz,
                                  const at::Tensor& k_tail, const at::Tensor& v_tail, int64_t n_groups, int64_t G,
                                  int64_t gv, int64_t bits, int64_t q_offset, const c10::optional<at::Tensor>& kv_len,
                                  double scale, std::vector<int64_t> band, int64_t sinks, int64_t split) {
  TORCH_CHECK(k_tail.dim() == 4 && v_tail.dim() == 4, "attnlab quantized decode: tails must be (B, Hkv, W, D)");
  const int64_t B = k_tail.size(0), Hkv = k_tail.size(1), W = k_tail.size(2), D = k_tail.size(3), Dv = v_tail.size(3);
  check_q(q, Hkv);
  TORCH_CHECK(q.size(0) == B && q.size(3) == D, "attnlab quantized decode: q ", q.sizes(), " does not fit the cache (B=",
              B, ", D=", D, ")");
  TORCH_CHECK(k_tail.scalar_type() == q.scalar_type() && v_tail.scalar_type() == q.scalar_type(),
              "attnlab quantized decode: q and the float window must share one dtype");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "attnlab quantized decode: bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK(G >= 1 && gv >= 1 && Dv % gv == 0 && n_groups >= 0, "attnlab quantized decode: bad group sizes");
  const int64_t nq = n_groups * G, per = 8 / bits;
  if (n_groups > 0) {
    for (const at::Tensor* t : {&kc, &ks, &kz, &vc, &vs, &vz})
      TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == Hkv,
                  "attnlab quantized decode: a code/scale tensor is ", t->sizes(), ", expected (", B, ", ", Hkv, ", ...)");
    TORCH_CHECK(kc.scalar_type() == at::kByte && vc.scalar_type() == at::kByte, "attnlab quantized decode: codes are uint8");
    TORCH_CHECK(kc.size(2) >= nq && vc.size(2) >= nq && kc.size(3) == (D + per - 1) / per &&
                    vc.size(3) == (Dv + per - 1) / per && kc.stride(3) == 1 && vc.stride(3) == 1,
                "attnlab quantized decode: codes ", kc.sizes(), " / ", vc.sizes(), " do not hold ", nq, " tokens of ",
                D, " / ", Dv, " channels at ", bits, " bits");
    TORCH_CHECK(ks.size(2) >= n_groups && ks.size(3) == D && kz.sizes() == ks.sizes() && vs.size(2) >= nq &&
                    vs.size(3) == Dv / gv && vz.sizes() == vs.sizes() && ks.scalar_type() == kz.scalar_type() &&
                    vs.scalar_type() == ks.scalar_type() && vz.scalar_type() == ks.scalar_type(),
                "attnlab quantized decode: scales/zeros ", ks.sizes(), " / ", vs.sizes(), " do not fit");
  }
  const int64_t H = q.size(1), Nq = q.size(2), L = nq + W;
  MaskS m = mask_of(band, sinks, kv_len);
  at::Tensor kvl;
  if (kv_len.has_value()) kvl = long_vec(*kv_len, B, "kv_len"), m.kv_len = kvl.data_ptr<int64_t>();
  std::vector<int64_t> lens(B, L), starts(B, 0), qpos(B, q_offset);
  Problem p{B, H, Hkv, H / Hkv, Nq, D, Dv, (H / Hkv) * Nq, static_cast<float>(scale), m, lens.data(), starts.data(),
            qpos.data()};
  at::Tensor out = at::empty({B, H, Nq, Dv}, q.options());
  at::Tensor lse = at::empty({B, H, Nq}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnlab_quant_decode", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "attnlab quantized decode: float64 is not supported (float32, bfloat16, float16)");
    } else {
      if (bits == 8)
        run_quant<scalar_t, 8>(q, p, kc, ks, kz, vc, vs, vz, k_tail, v_tail, nq, G, gv, split, out, lse);
      else if (bits == 4)
        run_quant<scalar_t, 4>(q, p, kc, ks, kz, vc, vs, vz, k_tail, v_tail, nq, G, gv, split, out, lse);
      else
        run_quant<scalar_t, 2>(q, p, kc, ks, kz, vc, vs, vz, k_tail, v_tail, nq, G, gv, split, out, lse);
    }
  });
  return {out, lse};
}

}  // namespace attnlab_decode

TORCH_LIBRARY_FRAGMENT(attnlab_decode, m) {
  m.def(
      "paged(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lens, Tensor kv_start, Tensor q_pos, "
      "Tensor? kv_len, float scale, int[] band, int sinks, int split) -> Tensor[]",
      &attnlab_decode::paged);
  m.def(
      "quantized(Tensor q, Tensor kc, Tensor ks, Tensor kz, Tensor vc, Tensor vs, Tensor vz, Tensor k_tail, "
      "Tensor v_tail, int n_groups, int group, int value_group, int bits, int q_offset, Tensor? kv_len, float scale, "
      "int[] band, int sinks, int split) -> Tensor[]",
      &attnlab_decode::quantized);
}
