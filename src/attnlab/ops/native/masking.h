// The mask of attnlab's native kernel, evaluated from its structure (MASK_STRUCTURE.md), never
// from a mask tensor.  For row i (qp = q_offset + i) and column j (kp = kv_offset + j) of batch b:
//
//     visible = (((no left or qp - kp <= left) and (no right or kp - qp <= right))
//                or (kp < sinks and (no sinks_right or kp - qp <= sinks_right)))
//               and (no kv_len or kp < kv_len[b])
//               and (no ids or q_ids[b', i] == kv_ids[b', j])        (document ids)
//               and (no keep or key_keep[b', j])                     (key padding mask)
//
// The id and keep vectors arrive sliced to this problem's rows and columns (b' = b, or 0 for
// a batch of one: row stride 0).  Per tile (kv block j of bk columns) the kernel reads tables
// made once per call -- the min/max kv id and the number of kept keys of each kv block -- so
// a tile is skipped (no row can see it), full (nothing to evaluate) or partial, where the
// rule is evaluated per entry.  For one row the band is [0, s1) ∪ [b0, b1).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

struct RowMask {  // one row's visible columns
  int64_t s1 = 0, b0 = 0, b1 = 0;
  // document id / key keep of this row (null: that clause is absent)
  int64_t qid = 0;
  const int64_t* kvid = nullptr;  // the row's batch's kv ids (Nk)
  const uint8_t* keep = nullptr;  // the row's batch's keep vector (Nk)
  const int64_t* kmin = nullptr;  // per kv block: min / max kv id, kept count
  const int64_t* kmax = nullptr;
  const int64_t* kcnt = nullptr;
  int64_t bk = 1, Nk = 0;

  bool band_full(int64_t c0, int64_t c1) const {
    if (c1 <= s1) return true;
    if (c0 >= b0 && c1 <= b1) return true;
    return b0 <= s1 && c1 <= std::max(s1, b1);
  }
  bool band_none(int64_t c0, int64_t c1) const { return c0 >= s1 && (c1 <= b0 || c0 >= b1); }
  // [c0, c1) is a whole kv block (the kernel's tiles are): its table entry applies
  bool whole(int64_t c0, int64_t c1) const { return c0 % bk == 0 && c1 == std::min(Nk, c0 + bk); }
  bool extra_full(int64_t c0, int64_t c1) const {
    if (kvid == nullptr && keep == nullptr) return true;
    if (!whole(c0, c1)) {
      for (int64_t c = c0; c < c1; ++c)
        if (!extra_visible(c)) return false;
      return true;
    }
    const int64_t j = c0 / bk;
    return (kvid == nullptr || (kmin[j] == qid && kmax[j] == qid)) && (keep == nullptr || kcnt[j] == c1 - c0);
  }
  bool extra_none(int64_t c0, int64_t c1) const {
    if (kvid == nullptr && keep == nullptr) return false;
    if (!whole(c0, c1)) {
      for (int64_t c = c0; c < c1; ++c)
        if (extra_visible(c)) return false;
      return true;
    }
    const int64_t j = c0 / bk;
    return (kvid != nullptr && (qid < kmin[j] || qid > kmax[j])) || (keep != nullptr && kcnt[j] == 0);
  }
  bool extra_visible(int64_t c) const {
    return (kvid == nullptr || kvid[c] == qid) && (keep == nullptr || keep[c] != 0);
  }

  bool full(int64_t c0, int64_t c1) const { return band_full(c0, c1) && extra_full(c0, c1); }
  bool none(int64_t c0, int64_t c1) const { return band_none(c0, c1) || extra_none(c0, c1); }
  bool visible(int64_t c) const { return (c < s1 || (c >= b0 && c < b1)) && extra_visible(c); }
};

struct Mask {
  bool has_left, has_right;
  int64_t left, right, sinks;
  bool has_sinks_right;  // the sinks obey kp - qp <= sinks_right too (sink_window: 0, causal)
  int64_t sinks_right;
  const int64_t* kv_len;  // (B,) or nullptr
  int64_t q_offset, kv_offset, Nk;
  // document ids (q_ids with kv_ids) and key keep, sliced to the problem; row strides (0: one batch)
  const int64_t* q_ids = nullptr;
  const int64_t* kv_ids = nullptr;
  int64_t q_ids_bs = 0, kv_ids_bs = 0;
  const uint8_t* keep = nullptr;
  int64_t keep_bs = 0;
  // per (b', kv block) tables (tables()): min / max kv id, kept count
  int64_t bk = 1, nkb = 0;
  std::vector<int64_t> kmin, kmax, kcnt;

  static int64_t clamp(__int128 x, int64_t lo, int64_t hi) {
    return x < lo ? lo : (x > hi ? hi : static_cast<int64_t>(x));
  }
  // the band's visible columns of row i (batch b): [0, s1) ∪ [b0, b1), each within [0, end)
  void ranges(int64_t b, int64_t i, int64_t& s1, int64_t& b0, int64_t& b1) const {
    int64_t end = Nk;
    if (kv_len != nullptr) end = clamp(static_cast<__int128>(kv_len[b]) - kv_offset, 0, Nk);
    const __int128 qp = static_cast<__int128>(q_offset) + i;
    s1 = clamp(static_cast<__int128>(sinks) - kv_offset, 0, end);
    if (has_sinks_right) s1 = std::min(s1, clamp(qp + sinks_right - kv_offset + 1, 0, end));
    b0 = has_left ? clamp(qp - left - kv_offset, 0, end) : 0;
    b1 = has_right ? clamp(qp + right - kv_offset + 1, 0, end) : end;
    if (b1 < b0) b0 = b1;
  }
  bool extra() const { return q_ids != nullptr || keep != nullptr; }
  // row i of batch b, every clause
  RowMask row(int64_t b, int64_t i) const {
    RowMask rm;
    ranges(b, i, rm.s1, rm.b0, rm.b1);
    rm.bk = bk;
    rm.Nk = Nk;
    if (q_ids != nullptr) {
      rm.qid = q_ids[b * q_ids_bs + i];
      rm.kvid = kv_ids + b * kv_ids_bs;
      const int64_t t = (kv_ids_bs == 0 ? 0 : b) * nkb;
      rm.kmin = kmin.data() + t;
      rm.kmax = kmax.data() + t;
    }
    if (keep != nullptr) {
      rm.keep = keep + b * keep_bs;
      rm.kcnt = kcnt.data() + (keep_bs == 0 ? 0 : b) * nkb;
    }
    return rm;
  }
  // the per-kv-block tables for tiles of bk columns, batches Bids (ids) and Bkeep (keep)
  void tables(int64_t bk_, int64_t Bids, int64_t Bkeep) {
    bk = bk_;
    nkb = (Nk + bk - 1) / bk;
    if (q_ids != nullptr) {
      kmin.assign(Bids * nkb, 0);
      kmax.assign(Bids * nkb, 0);
      for (int64_t b = 0; b < Bids; ++b)
        for (int64_t j = 0; j < nkb; ++j) {
          const int64_t* p = kv_ids + b * kv_ids_bs;
          int64_t lo = p[j * bk], hi = lo;
          for (int64_t c = j * bk; c < std::min(Nk, (j + 1) * bk); ++c) {
            lo = std::min(lo, p[c]);
            hi = std::max(hi, p[c]);
          }
          kmin[b * nkb + j] = lo;
          kmax[b * nkb + j] = hi;
        }
    }
    if (keep != nullptr) {
      kcnt.assign(Bkeep * nkb, 0);
      for (int64_t b = 0; b < Bkeep; ++b)
        for (int64_t c = 0; c < Nk; ++c) kcnt[b * nkb + c / bk] += keep[b * keep_bs + c] != 0;
    }
  }
};

// Does any row in [r0, r1) of batch b see a column of [c0, c1)?  (b0, b1 grow with the row.)
inline bool block_visits(const Mask& mk, int64_t b, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  int64_t s1, b0, b1, t0, t1;
  mk.ranges(b, r0, s1, b0, t1);
  mk.ranges(b, r1 - 1, s1, t0, b1);
  if (!(c0 < s1 || (c0 < b1 && c1 > b0))) return false;
  if (!mk.extra()) return true;
  const RowMask rm = mk.row(b, r0);  // the kv block's tables
  if (!rm.whole(c0, c1)) return true;
  const int64_t j = c0 / mk.bk;
  if (rm.keep != nullptr && rm.kcnt[j] == 0) return false;  // no key kept
  if (rm.kvid != nullptr) {  // the q block's id range must meet the kv block's
    const int64_t* qi = mk.q_ids + b * mk.q_ids_bs;
    int64_t lo = qi[r0], hi = lo;
    for (int64_t i = r0 + 1; i < r1; ++i) {
      lo = std::min(lo, qi[i]);
      hi = std::max(hi, qi[i]);
    }
    if (hi < rm.kmin[j] || lo > rm.kmax[j]) return false;
  }
  return true;
}
