// The built-in score mods of attnlab's native kernel, from their structured description
// (attnlab.scores.ScoreTerm, ScoreMod.lower()): a sequence of at most MAX_TERMS terms, applied
// in order to the scaled score s at absolute positions qp, kp, before the mask:
//
//     softcap c:        s = c · tanh(s / c)                       ds/ds' = 1 − tanh²
//     alibi:            s = s + m[b|0, h] · (kp − qp)             ∂/∂m  = (kp − qp)
//     alibi symmetric:  s = s − m[b|0, h] · |kp − qp|             ∂/∂m  = −|kp − qp|
//     relative bias:    s = s + T[h, clamp(kp − qp, −R, R) + R]   ∂/∂T[h, idx] = 1
//
// Forward: apply_row on a row's visible entries (hidden ones stay -inf).  Backward: grad
// recomputes the chain from the raw scaled score and walks it back, giving dL/ds (times the
// derivative of each term) and adding the slope / table gradients of the entry to the
// caller's per-work-item accumulators.
#pragma once

#include <cmath>
#include <cstdint>

#include "masking.h"

struct ScoreMods {
  static constexpr int MAX_TERMS = 8;
  enum Kind : int64_t { SOFTCAP = 1, ALIBI = 2, ALIBI_SYMMETRIC = 3, RELATIVE_BIAS = 4 };
  int n = 0;
  int64_t kind[MAX_TERMS] = {};
  float cap[MAX_TERMS] = {};
  const float* slopes = nullptr;  // (B|1, H) float32, row stride slopes_bs (0 for one row)
  int64_t slopes_bs = 0;
  const float* table = nullptr;  // (H, 2R + 1) float32
  int64_t R = 0;
  int64_t q_offset = 0, kv_offset = 0, H = 1;
  // the backward's per-work-item gradient sums (dQ pass items): a slope each, a table row each,
  // in double (a slope's gradient sums g·(kp − qp) over every pair: large terms that cancel)
  double* dslope_items = nullptr;
  double* dtable_items = nullptr;

  bool active() const { return n > 0; }
  int64_t dist(int64_t i, int64_t c) const { return (kv_offset + c) - (q_offset + i); }  // kp − qp
  double* dslope(int64_t it) const { return dslope_items == nullptr ? nullptr : dslope_items + it; }
  double* dtable(int64_t it) const { return dtable_items == nullptr ? nullptr : dtable_items + it * (2 * R + 1); }
  void zero_slot(int64_t it) const {
    if (dslope_items != nullptr) dslope_items[it] = 0.0;
    if (dtable_items != nullptr)
      for (int64_t x = 0; x <= 2 * R; ++x) dtable_items[it * (2 * R + 1) + x] = 0.0;
  }

  float step(int t, float s, int64_t b, int64_t h, int64_t d) const {
    switch (kind[t]) {
      case SOFTCAP: return cap[t] * std::tanh(s / cap[t]);
      case ALIBI: return s + slopes[b * slopes_bs + h] * static_cast<float>(d);
      case ALIBI_SYMMETRIC: return s - slopes[b * slopes_bs + h] * static_cast<float>(d < 0 ? -d : d);
      default: return s + table[h * (2 * R + 1) + (d < -R ? -R : (d > R ? R : d)) + R];
    }
  }
  float eval(float s, int64_t b, int64_t h, int64_t d) const {
    for (int t = 0; t < n; ++t) s = step(t, s, b, h, d);
    return s;
  }
  // the row of query i (absolute qp = q_offset + i): S[0:m] are columns c0.. (visible ones modded)
  void apply_row(float* S, int64_t b, int64_t h, int64_t i, int64_t c0, int64_t m, const RowMask& rm) const {
    const int64_t qp = q_offset + i, k0 = kv_offset + c0;
    const bool all = rm.full(c0, c0 + m);
    for (int64_t c = 0; c < m; ++c)
      if (all || rm.visible(c0 + c)) S[c] = eval(S[c], b, h, k0 + c - qp);
  }
  // g = dL/d(modded score) at raw scaled score s0, distance d = kp − qp: returns dL/ds0 and
  // adds ∂L/∂slope to *dslope and ∂L/∂T[h, ·] to dtab[·] (either may be null)
  float grad(float s0, float g, int64_t b, int64_t h, int64_t d, double* dslope, double* dtab) const {
    float vals[MAX_TERMS + 1];
    vals[0] = s0;
    for (int t = 0; t < n; ++t) vals[t + 1] = step(t, vals[t], b, h, d);
    for (int t = n - 1; t >= 0; --t) {
      switch (kind[t]) {
        case SOFTCAP: {
          const float th = std::tanh(vals[t] / cap[t]);
          g *= 1.0f - th * th;
          break;
        }
        case ALIBI:
          if (dslope != nullptr) *dslope += static_cast<double>(g) * static_cast<double>(d);
          break;
        case ALIBI_SYMMETRIC:
          if (dslope != nullptr) *dslope -= static_cast<double>(g) * static_cast<double>(d < 0 ? -d : d);
          break;
        default:
          if (dtab != nullptr) dtab[(d < -R ? -R : (d > R ? R : d)) + R] += g;
      }
    }
    return g;
  }
  // dS[0:m] (dL/d modded score) of row i -> dL/d raw score · scale, in place; S0 the raw scaled
  // scores; hidden entries (S0 == -inf or not visible) are left as they are (zeros)
  void grad_row(float* dS, const float* S0, float scale, int64_t b, int64_t h, int64_t i, int64_t c0, int64_t m,
                const RowMask& rm, double* dslope, double* dtab) const {
    const int64_t qp = q_offset + i, k0 = kv_offset + c0;
    const bool all = rm.full(c0, c0 + m);
    double ls = 0.0;  // the row's slope gradient, added once
    for (int64_t c = 0; c < m; ++c)
      if (all || rm.visible(c0 + c))
        dS[c] = grad(S0[c], dS[c], b, h, k0 + c - qp, dslope == nullptr ? nullptr : &ls, dtab) * scale;
    if (dslope != nullptr) *dslope += ls;
  }
};
