// The mask of attnlab's native kernel, evaluated from its structure (MASK_STRUCTURE.md),
// never from a mask tensor.  For row i and column j of batch b (absolute q = q_offset + i
// (+ q_shift[b]), kv = kv_offset + j; band positions qp = q_pos[q] or q, kp = kv_pos[kv] or kv):
//
//     visible = (((no left or qp - kp <= left) and (no right or kp - qp <= right))
//                or (kp < sinks and (no sinks_right or kp - qp <= sinks_right)))
//               and (no kv_len or kv < kv_len[b])
//               and (no ids or q_ids[b', i] == kv_ids[b', j])        (document ids)
//               and (no keep or key_keep[b', j])                     (key padding mask)
//
// The id and keep vectors arrive sliced to this problem's rows and columns (b' = b, or 0 for
// a batch of one: row stride 0); so do the band positions: qpos (B|1, Nq) -- q_pos at the
// (shifted) query positions, or the shifted positions themselves -- and kpos (Nk).  Per tile
// (kv block j of bk columns) the kernel reads tables made once per call -- the min/max kv id,
// the number of kept keys and the min/max key position of each kv block -- so a tile is
// skipped (no row can see it), full (nothing to evaluate) or partial, where the rule is
// evaluated per entry.  Without kpos, one row's band is [0, s1) ∪ [b0, b1).
//
// A mask with no structure (custom, tree, |, ~, dense) arrives as a BlockMask at the kernel's
// tiles instead: its tile states (EMPTY / PARTIAL / FULL per (b', h', q block, kv block)) and
// the predicate's bits on the partial tiles (BlockMask.partial_bits(): 32 columns per word);
// then no structure field is set and a tile is skipped, run with no mask code, or read bit by bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

// The band with sinks on band positions, for a row whose keys carry their own positions (kpos)
struct PosBand {
  bool hl = false, hr = false, hs = false;  // left / right / sinks_right bounds present
  int64_t l = 0, r = 0, s = 0, sr = 0;      // s: sinks (0: no sink clause)
  bool on() const { return hl || hr; }      // a band without bounds hides nothing (nor do its sinks)
  bool at(int64_t qp, int64_t kp) const {
    return ((!hl || qp - kp <= l) && (!hr || kp - qp <= r)) || (s != 0 && kp < s && (!hs || kp - qp <= sr));
  }
  // every pair of qp in [q0, q1] and kp in [k0, k1] is visible (a sufficient test)
  bool all(int64_t q0, int64_t q1, int64_t k0, int64_t k1) const {
    return ((!hl || q1 - k0 <= l) && (!hr || k1 - q0 <= r)) || (s != 0 && k1 < s && (!hs || k1 - q0 <= sr));
  }
  // some pair may be visible (false: none is)
  bool any(int64_t q0, int64_t q1, int64_t k0, int64_t k1) const {
    return ((!hl || q0 - k1 <= l) && (!hr || k0 - q1 <= r)) || (s != 0 && k0 < s && (!hs || k0 - q1 <= sr));
  }
};

struct RowMask {  // one row's visible columns
  int64_t s1 = 0, b0 = 0, b1 = 0;
  // document id / key keep of this row (null: that clause is absent)
  int64_t qid = 0;
  int64_t idlo = -1, idhi = -1;  // the columns of id qid, [idlo, idhi), where the kv ids are sorted (else -1)
  const int64_t* kvid = nullptr;  // the row's batch's kv ids (Nk)
  const uint8_t* keep = nullptr;  // the row's batch's keep vector (Nk)
  const int64_t* kmin = nullptr;  // per kv block: min / max kv id, kept count
  const int64_t* kmax = nullptr;
  const int64_t* kcnt = nullptr;
  // the band on key positions (null kpos: the band is the interval [0, s1) ∪ [b0, b1))
  const int64_t* kpos = nullptr;  // (Nk)
  const int64_t* kpmin = nullptr;  // per kv block: min / max key position
  const int64_t* kpmax = nullptr;
  PosBand pb;
  int64_t qp = 0;  // this row's band position
  // a BlockMask's tiles (null st: none), of tbk columns (its own, whatever the kernel's): this
  // row's q block's states and tile ids per kv block, its bits in tile 0 (tile t: + t * tstride)
  const int8_t* st = nullptr;
  const int32_t* tid = nullptr;
  const uint32_t* bits = nullptr;
  int64_t tstride = 0, tbk = 1;
  int64_t bk = 1, Nk = 0;

  // the band (with a BlockMask: its tiles and bits) on [c0, c1); the extra clauses below
  bool band_full(int64_t c0, int64_t c1) const {
    if (st != nullptr) return tile_all(c0, c1, true);
    if (c1 <= s1) return true;
    if (c0 >= b0 && c1 <= b1) return true;
    return b0 <= s1 && c1 <= std::max(s1, b1);
  }
  bool band_none(int64_t c0, int64_t c1) const {
    if (st != nullptr) return tile_all(c0, c1, false);
    return c0 >= s1 && (c1 <= b0 || c0 >= b1);
  }
  // [c0, c1) is a whole kv block (the kernel's tiles are): its table entry applies
  bool whole(int64_t c0, int64_t c1) const { return c0 % bk == 0 && c1 == std::min(Nk, c0 + bk); }
  bool has_extra() const { return kvid != nullptr || keep != nullptr || kpos != nullptr; }
  bool extra_full(int64_t c0, int64_t c1) const {
    if (!has_extra()) return true;
    if (!whole(c0, c1)) {
      for (int64_t c = c0; c < c1; ++c)
        if (!extra_visible(c)) return false;
      return true;
    }
    const int64_t j = c0 / bk;
    return (kvid == nullptr || (kmin[j] == qid && kmax[j] == qid)) && (keep == nullptr || kcnt[j] == c1 - c0) &&
           (kpos == nullptr || pb.all(qp, qp, kpmin[j], kpmax[j]));
  }
  bool extra_none(int64_t c0, int64_t c1) const {
    if (!has_extra()) return false;
    if (!whole(c0, c1)) {
      for (int64_t c = c0; c < c1; ++c)
        if (extra_visible(c)) return false;
      return true;
    }
    const int64_t j = c0 / bk;
    return (kvid != nullptr && (qid < kmin[j] || qid > kmax[j])) || (keep != nullptr && kcnt[j] == 0) ||
           (kpos != nullptr && !pb.any(qp, qp, kpmin[j], kpmax[j]));
  }
  bool extra_visible(int64_t c) const {
    return (kvid == nullptr || kvid[c] == qid) && (keep == nullptr || keep[c] != 0) &&
           (kpos == nullptr || pb.at(qp, kpos[c]));
  }
  // the BlockMask's verdict on column c (st set)
  bool tile_visible(int64_t c) const {
    const int64_t j = c / tbk;
    if (st[j] != 1) return st[j] == 2;  // EMPTY 0, PARTIAL 1, FULL 2 (attnlab.masks.blockmask)
    const int64_t x = c - j * tbk;
    return (bits[tid[j] * tstride + x / 32] >> (x % 32)) & 1u;
  }
  // every column of [c0, c1) visible (want) / hidden (!want): per BlockMask tile, bits only
  // where one is partial
  bool tile_all(int64_t c0, int64_t c1, bool want) const {
    for (int64_t j = c0 / tbk; j * tbk < c1; ++j) {
      if (st[j] != 1) {
        if ((st[j] == 2) != want) return false;
        continue;
      }
      for (int64_t c = std::max(c0, j * tbk); c < std::min(c1, (j + 1) * tbk); ++c)
        if (tile_visible(c) != want) return false;
    }
    return true;
  }

  // every clause (a BlockMask comes alone: band_* read it, the extra clauses are absent)
  bool full(int64_t c0, int64_t c1) const { return band_full(c0, c1) && extra_full(c0, c1); }
  bool none(int64_t c0, int64_t c1) const { return band_none(c0, c1) || extra_none(c0, c1); }
  bool visible(int64_t c) const {
    if (st != nullptr) return tile_visible(c);
    return (c < s1 || (c >= b0 && c < b1)) && extra_visible(c);
  }
  // S[c] = -inf where column c0 + c (c < m) is hidden; a BlockMask's partial tile is read a
  // word (32 columns) at a time and only its hidden bits are visited
  // a pure band (no keep, no key positions, no BlockMask; ids only where sorted: the row's
  // document is then the run [idlo, idhi)): its visible columns are two intervals
  bool intervals() const {
    return st == nullptr && keep == nullptr && kpos == nullptr && (kvid == nullptr || idlo >= 0);
  }
  // those intervals [a0, a1), [x0, x1) (intervals() true), a0 <= x0; an empty one sits on the other's start
  void intervals(int64_t& a0, int64_t& a1, int64_t& x0, int64_t& x1) const {
    a0 = 0, a1 = s1, x0 = b0, x1 = b1;
    if (kvid != nullptr) {
      a0 = idlo;
      a1 = std::min(a1, idhi);
      x0 = std::max(x0, idlo);
      x1 = std::min(x1, idhi);
    }
    if (a1 <= a0) a0 = a1 = x0;  // empty: drop it
    if (x1 <= x0) x0 = x1 = a0;
    if (x0 < a0) {
      std::swap(a0, x0);
      std::swap(a1, x1);
    }
  }
  // every column of [c0, c1) visible (intervals() true): within one interval, or within their
  // union where they meet
  bool covers(int64_t c0, int64_t c1) const {
    int64_t a0, a1, x0, x1;
    intervals(a0, a1, x0, x1);
    if (x0 <= a1) a1 = std::max(a1, x1);
    return (c0 >= a0 && c1 <= a1) || (c0 >= x0 && c1 <= x1);
  }
  // [lo, hi) within [0, m): the columns c0 + c the row may see lie there (all of [0, m) unless
  // intervals(); lo == hi: none)
  void span(int64_t c0, int64_t m, int64_t& lo, int64_t& hi) const {
    lo = 0, hi = m;
    if (!intervals()) return;
    int64_t a0, a1, x0, x1;
    intervals(a0, a1, x0, x1);
    const int64_t e = c0 + m;
    const bool ina = a0 < a1 && a1 > c0 && a0 < e, inx = x0 < x1 && x1 > c0 && x0 < e;
    if (!ina && !inx) {
      lo = hi = 0;
      return;
    }
    lo = std::max(c0, ina ? a0 : x0) - c0;
    hi = std::min(e, std::max(ina ? a1 : c0, inx ? x1 : c0)) - c0;
  }
  void hide(float* S, int64_t c0, int64_t m) const {
    constexpr float ninf = -std::numeric_limits<float>::infinity();
    if (intervals()) {  // the hidden ranges filled directly
      int64_t a0, a1, x0, x1;
      intervals(a0, a1, x0, x1);
      const int64_t hi = c0 + m;
      int64_t cur = c0;
      if (a0 > cur) std::fill(S, S + (std::min(hi, a0) - c0), ninf);
      cur = std::max(cur, a1);
      if (x0 > cur && cur < hi) std::fill(S + (cur - c0), S + (std::min(hi, x0) - c0), ninf);
      cur = std::max(cur, x1);
      if (cur < hi) std::fill(S + (cur - c0), S + m, ninf);
      return;
    }
    if (st == nullptr) {
      for (int64_t c = 0; c < m; ++c)
        if (!visible(c0 + c)) S[c] = ninf;
      return;
    }
    for (int64_t j = c0 / tbk; j * tbk < c0 + m; ++j) {  // the BlockMask tiles [c0, c0 + m) meets
      const int64_t t0 = j * tbk, lo = std::max(c0, t0), hi = std::min(c0 + m, t0 + tbk);
      if (st[j] == 2) continue;
      if (st[j] == 0) {
        for (int64_t c = lo; c < hi; ++c) S[c - c0] = ninf;
        continue;
      }
      const uint32_t* w = bits + tid[j] * tstride;
      for (int64_t x = lo - t0; x < hi - t0;) {  // x: column within the tile; a word's bits at once
        const int64_t sh = x % 32, n = std::min<int64_t>(32 - sh, hi - t0 - x);
        uint32_t hidden = ~w[x / 32] >> sh;
        if (n < 32) hidden &= (1u << n) - 1u;
        for (; hidden != 0; hidden &= hidden - 1u) S[t0 + x + __builtin_ctz(hidden) - c0] = ninf;
        x += n;
      }
    }
  }
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
  // band positions: qpos (B|1, Nq) per row (null: q_offset + i), kpos (Nk) per column (null: the
  // band is an interval of columns)
  const int64_t* qpos = nullptr;
  int64_t qpos_bs = 0;
  const int64_t* kpos = nullptr;
  // a BlockMask's tiles (mask_args.h) of tbq x tbk, its own (the kernel's tiles may differ):
  // states (Bm, Hm, tnqb, tnkb) int8, tile ids (tnqb, tnkb), bits (T, Bp, Hp, tbq, W) of the
  // partial tiles; strides in elements (0: broadcast)
  const int8_t* states = nullptr;
  int64_t st_bs = 0, st_hs = 0, tbq = 1, tbk = 1, tnkb = 0;
  const int32_t* tile_id = nullptr;
  const uint32_t* bits = nullptr;
  int64_t bits_ts = 0, bits_bs = 0, bits_hs = 0, W = 0;
  // per (b', kv block) tables (tables()): min / max kv id, kept count; per kv block: min / max kpos
  int64_t bq = 1, bk = 1, nkb = 0;
  std::vector<int64_t> kmin, kmax, kcnt, kpmin, kpmax;
  std::vector<uint8_t> ksorted;  // per b': the kv ids are non-decreasing

  static int64_t clamp(__int128 x, int64_t lo, int64_t hi) {
    return x < lo ? lo : (x > hi ? hi : static_cast<int64_t>(x));
  }
  // row i's band position
  int64_t qp_of(int64_t b, int64_t i) const { return qpos != nullptr ? qpos[b * qpos_bs + i] : q_offset + i; }
  PosBand posband() const {
    PosBand p;
    p.hl = has_left;
    p.hr = has_right;
    p.hs = has_sinks_right;
    p.l = left;
    p.r = right;
    p.s = sinks;
    p.sr = sinks_right;
    return p;
  }
  // the visible columns of a row at band position qp (batch b): [0, s1) ∪ [b0, b1), each within
  // [0, end); with kpos only the kv_len bound [0, end) (the band is evaluated per column)
  void ranges_at(int64_t b, int64_t qp64, int64_t& s1, int64_t& b0, int64_t& b1) const {
    int64_t end = Nk;
    if (kv_len != nullptr) end = clamp(static_cast<__int128>(kv_len[b]) - kv_offset, 0, Nk);
    if (kpos != nullptr || states != nullptr) {
      s1 = 0;
      b0 = 0;
      b1 = end;
      return;
    }
    const __int128 qp = qp64;
    s1 = clamp(static_cast<__int128>(sinks) - kv_offset, 0, end);
    if (has_sinks_right) s1 = std::min(s1, clamp(qp + sinks_right - kv_offset + 1, 0, end));
    b0 = has_left ? clamp(qp - left - kv_offset, 0, end) : 0;
    b1 = has_right ? clamp(qp + right - kv_offset + 1, 0, end) : end;
    if (b1 < b0) b0 = b1;
  }
  void ranges(int64_t b, int64_t i, int64_t& s1, int64_t& b0, int64_t& b1) const {
    ranges_at(b, qp_of(b, i), s1, b0, b1);
  }
  bool extra() const { return q_ids != nullptr || keep != nullptr || kpos != nullptr; }
  // row i of batch b and query head h, every clause.  Where the kv ids are sorted the row's
  // document run [idlo, idhi) comes from two binary searches, or from prev (the row before, of
  // the same batch) when it has the same id; run false leaves it unset (-1: the per-column rule)
  RowMask row(int64_t b, int64_t h, int64_t i, const RowMask* prev = nullptr, bool run = true) const {
    RowMask rm;
    row_into(rm, b, h, i, prev, run);
    return rm;
  }
  // row() written into rm in place (a row() assigned to a vector's element copied its 200-odd
  // bytes through the stack, a store-forwarding stall per row)
  void row_into(RowMask& rm, int64_t b, int64_t h, int64_t i, const RowMask* prev = nullptr, bool run = true) const {
    rm = RowMask{};
    rm.qp = qp_of(b, i);
    ranges_at(b, rm.qp, rm.s1, rm.b0, rm.b1);
    rm.bk = bk;
    rm.Nk = Nk;
    if (states != nullptr) {
      const int64_t iq = i / tbq;
      rm.st = states + b * st_bs + h * st_hs + iq * tnkb;
      rm.tid = tile_id + iq * tnkb;
      rm.bits = bits + b * bits_bs + h * bits_hs + (i - iq * tbq) * W;
      rm.tstride = bits_ts;
      rm.tbk = tbk;
      return;
    }
    if (q_ids != nullptr) {
      rm.qid = q_ids[b * q_ids_bs + i];
      rm.kvid = kv_ids + b * kv_ids_bs;
      const int64_t t = (kv_ids_bs == 0 ? 0 : b) * nkb;
      rm.kmin = kmin.data() + t;
      rm.kmax = kmax.data() + t;
      if (run && !ksorted.empty() && ksorted[kv_ids_bs == 0 ? 0 : b]) {  // the row's document: a run of columns
        if (prev != nullptr && prev->kvid == rm.kvid && prev->qid == rm.qid && prev->idlo >= 0) {
          rm.idlo = prev->idlo;
          rm.idhi = prev->idhi;
        } else {
          rm.idlo = std::lower_bound(rm.kvid, rm.kvid + Nk, rm.qid) - rm.kvid;
          rm.idhi = std::upper_bound(rm.kvid + rm.idlo, rm.kvid + Nk, rm.qid) - rm.kvid;
        }
      }
    }
    if (keep != nullptr) {
      rm.keep = keep + b * keep_bs;
      rm.kcnt = kcnt.data() + (keep_bs == 0 ? 0 : b) * nkb;
    }
    if (kpos != nullptr && has_left + has_right > 0) {
      rm.kpos = kpos;
      rm.kpmin = kpmin.data();
      rm.kpmax = kpmax.data();
      rm.pb = posband();
    }
  }
  // the per-kv-block tables for tiles of bq x bk, batches Bids (ids) and Bkeep (keep)
  void tables(int64_t bq_, int64_t bk_, int64_t Bids, int64_t Bkeep) {
    bq = bq_;
    bk = bk_;
    nkb = (Nk + bk - 1) / bk;
    if (q_ids != nullptr) {
      kmin.assign(Bids * nkb, 0);
      kmax.assign(Bids * nkb, 0);
      ksorted.assign(Bids, 1);
      for (int64_t b = 0; b < Bids; ++b) {
        const int64_t* p = kv_ids + b * kv_ids_bs;
        ksorted[b] = std::is_sorted(p, p + Nk);
      }
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
    if (kpos != nullptr) {
      kpmin.assign(nkb, 0);
      kpmax.assign(nkb, 0);
      for (int64_t j = 0; j < nkb; ++j) {
        int64_t lo = kpos[j * bk], hi = lo;
        for (int64_t c = j * bk; c < std::min(Nk, (j + 1) * bk); ++c) {
          lo = std::min(lo, kpos[c]);
          hi = std::max(hi, kpos[c]);
        }
        kpmin[j] = lo;
        kpmax[j] = hi;
      }
    }
  }
};

// Does any row in [r0, r1) of batch b, query head h see a column of [c0, c1)?
inline bool block_visits(const Mask& mk, int64_t b, int64_t h, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  if (mk.states != nullptr) {  // some BlockMask tile the rows and columns meet is not EMPTY
    const int8_t* st = mk.states + b * mk.st_bs + h * mk.st_hs;
    for (int64_t iq = r0 / mk.tbq; iq * mk.tbq < r1; ++iq)
      for (int64_t j = c0 / mk.tbk; j * mk.tbk < c1; ++j)
        if (st[iq * mk.tnkb + j] != 0) return true;
    return false;
  }
  const RowMask rm = mk.row(b, h, r0, nullptr, false);  // the kv block's tables (no document run: unused)
  int64_t qlo = mk.q_offset + r0, qhi = mk.q_offset + r1 - 1;
  if (mk.qpos != nullptr) {  // band positions need not grow with the row (varlen's restart)
    qlo = qhi = mk.qp_of(b, r0);
    for (int64_t i = r0 + 1; i < r1; ++i) {
      qlo = std::min(qlo, mk.qp_of(b, i));
      qhi = std::max(qhi, mk.qp_of(b, i));
    }
  }
  int64_t s1, b0, b1, t0, t1;  // b0, b1 grow with the band position
  mk.ranges_at(b, qlo, s1, b0, t1);
  mk.ranges_at(b, qhi, s1, t0, b1);
  if (!(c0 < s1 || (c0 < b1 && c1 > b0))) return false;
  if (!mk.extra()) return true;
  if (!rm.whole(c0, c1)) return true;
  const int64_t j = c0 / mk.bk;
  if (rm.keep != nullptr && rm.kcnt[j] == 0) return false;  // no key kept
  if (rm.kpos != nullptr && !rm.pb.any(qlo, qhi, rm.kpmin[j], rm.kpmax[j])) return false;
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
