// The native kernel's forward pass (forward_impl): one at::parallel_for region over
// (b, h, q block) work items (sched.h's queue, the most kv blocks first); each runs the fast
// tile loop (S and P·V on the register-blocked micro-kernels, fwd_tile.h, float32 or bf16
// pairs) in row groups of 16, each on the columns its rows may see -- as wide tiles across kv
// blocks where every row's columns are intervals (bands, sinks, sorted documents), else per
// kv block -- and, where its result is not finite, again on the careful path that skips
// hidden entries.  Included by kernel.cpp only (see tiles.h: an anonymous namespace, one unit).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fwd_tile.h"
#include "masking.h"
#include "rowmath.h"
#include "sched.h"
#include "scoremods.h"
#include "tiles.h"
#include "vecmath.h"

namespace {

// A finished row: out = acc / l and LSE = m + log l; a row that saw no key (l = 0) gives
// output 0 and LSE -inf.  The fast and careful paths both end here.
template <typename T>
inline void finish_row(T* orow, const float* ar, int64_t Dv, float l, float m, float* lse) {
  if (l == 0.0f) {
    for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(0.0f);
    *lse = NEG_INF;
  } else {
    const float inv = 1.0f / l;
    for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<T>(ar[e] * inv);
    *lse = m + std::log(l);
  }
}

// The fast path's row groups: a q block runs in groups of RG rows, each on the columns its own
// rows may see (a window's group sees RG + left columns, the whole block bq + left).  Where
// every row's visible columns are intervals (RowMask::intervals), a group runs them as wide
// tiles of up to WIDE columns across kv blocks (one softmax step and one P·V per row and
// tile), else per kv block.  One thread, 2026-12-04, (1,4,8192,64), against per kv block
// tiles: window256 +10 % (f32, bf16), doc8 +6 %, causal and prefix +4-6 %; 2048 columns at
// least as fast as 512 and 1024, 8192; RG 8 and 32 no faster than 16.
constexpr int64_t RG = 16;
constexpr int64_t WIDE = 2048;
// local packs (forward_impl): CQ q blocks per chunk, at most LOCAL_BLOCKS kv blocks each.  bf16
// (1,4,8192,64) window 256, 2026-12-05 (scripts/ab_native.sh-style paired rounds, new/old
// medians, local packs against the call's packs): chunks of 16 q blocks 0.80 at two threads,
// 0.93 at one; 8 and 32 q blocks 1.04 and 1.03 times the time of 16; documents of 1024 rows
// 0.97-1.02 (neutral).
constexpr int64_t CQ = 16;
constexpr int64_t LOCAL_BLOCKS = 6;
// the last forward call's chunks on local packs (0: the call's packs; the extension's last_fwd_plan)
inline std::atomic<int64_t> last_fwd_plan{0};
inline bool local_packs_on() { return attnlab_scratch::env_on("ATTNLAB_NATIVE_LOCAL"); }
// a row group's columns: [0, s1) ∪ [b0, end), within [il, ih) (its rows' document runs)
struct Env {
  int64_t s1, b0, end, il, ih;
};

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                  const Dims& dm, const Mask& mk, const ScoreMods& sm, float scale) {
  const View<T> qv = view_of<T>(q), kv = view_of<T>(k), vv = view_of<T>(v);
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const int64_t nqb = (dm.Nq + dm.bq - 1) / dm.bq, nkb = (dm.Nk + dm.bk - 1) / dm.bk;
  const int64_t items = dm.B * dm.H * nqb;
  const int64_t Dvp0 = (dm.Dv + 15) / 16 * 16, Dw = (dm.D + 1) / 2;
  const bool pairs = std::is_same_v<T, c10::BFloat16> && bf16_pairs();
  std::vector<int64_t> visits(items, 0);  // kv blocks each work item (b, h, q block) visits
  std::vector<int64_t> ijlo(items, 0), ijhi(items, 0);  // and the range of kv blocks they lie in
  for (int64_t it = 0; it < items; ++it) {
    const int64_t iq = it % nqb, h = (it / nqb) % dm.H, b = it / (nqb * dm.H);
    const int64_t r0 = iq * dm.bq, r1 = std::min(dm.Nq, r0 + dm.bq);
    int64_t qlo = mk.qp_of(b, r0), qhi = mk.qp_of(b, r1 - 1);
    if (mk.qpos != nullptr)
      for (int64_t i = r0; i < r1; ++i) {
        qlo = std::min(qlo, mk.qp_of(b, i));
        qhi = std::max(qhi, mk.qp_of(b, i));
      }
    int64_t s1a, b0a, b1a, s1z, b0z, b1z;  // the band's envelope: no block outside it is visited
    mk.ranges_at(b, qlo, s1a, b0a, b1a);
    mk.ranges_at(b, qhi, s1z, b0z, b1z);
    int64_t lo = s1z > 0 ? 0 : b0a, hi = std::max(s1z, b1z);
    // sorted kv ids (documents): no column outside the runs of the block's ids is visible
    if (mk.q_ids != nullptr && !mk.ksorted.empty() && mk.ksorted[mk.kv_ids_bs == 0 ? 0 : b]) {
      const int64_t* qi = mk.q_ids + b * mk.q_ids_bs;
      const int64_t* ki = mk.kv_ids + b * mk.kv_ids_bs;
      const auto [idl, idh] = std::minmax_element(qi + r0, qi + r1);
      lo = std::max(lo, static_cast<int64_t>(std::lower_bound(ki, ki + dm.Nk, *idl) - ki));
      hi = std::min(hi, static_cast<int64_t>(std::upper_bound(ki, ki + dm.Nk, *idh) - ki));
    }
    ijlo[it] = std::min(nkb, lo / dm.bk);
    ijhi[it] = std::max(ijlo[it], std::min(nkb, (std::max(hi, lo) + dm.bk - 1) / dm.bk));
    for (int64_t jk = ijlo[it]; jk < ijhi[it]; ++jk)
      visits[it] += block_visits(mk, b, h, r0, r1, jk * dm.bk, std::min(dm.Nk, (jk + 1) * dm.bk));
  }
  // wide tiles (see fast) for masks whose rows are intervals, without score mod, scale > 0:
  // at most CW columns each, ATTNLAB_NATIVE_WIDE=<columns> (a multiple of 16; 0: kv block tiles only)
  const char* wenv = std::getenv("ATTNLAB_NATIVE_WIDE");
  const int64_t CW = wenv != nullptr ? std::max<int64_t>(0, std::atoll(wenv)) / 16 * 16 : WIDE;
  bool wide_ok = CW > 0 && !sm.active() && scale > 0.0f && mk.keep == nullptr && mk.kpos == nullptr &&
                 mk.states == nullptr;
  for (const uint8_t s : mk.ksorted) wide_ok = wide_ok && s != 0;
  // Local packs (the bf16 pairs path on narrow bands: a window, short documents): work items
  // are chunks of CQ q blocks of one (b, kv head), its G heads' blocks in turn, and each chunk
  // packs the kv blocks it sees into its thread's own buffers (scratch.h's thread_buffer), where
  // they stay in L2, instead of one pass packing every block into memory that the tile loop
  // then reads back (16 MiB of memory traffic per call at (1,4,8192,64): the pass and the two
  // threads' reads contended for it).  Taken where every chunk sees at most LOCAL_BLOCKS kv
  // blocks and the chunks pack at most 1.5 times the blocks of the one pass (their bands
  // overlap: a window of 256 packs 1.22 times); the same bits either way.
  // ATTNLAB_NATIVE_LOCAL=0 (or false/off/no) turns it off.
  const int64_t nqc = (nqb + CQ - 1) / CQ, chunks = dm.B * dm.Hkv * nqc;
  // f(it) for chunk ch's work items in the order it runs them: (b, kv head hk, q chunk qc)'s G
  // heads, each its q blocks in turn
  auto chunk_items = [&](int64_t ch, auto&& f) {
    const int64_t qc = ch % nqc, hk = (ch / nqc) % dm.Hkv, b = ch / (nqc * dm.Hkv);
    for (int64_t g = 0; g < dm.G; ++g)
      for (int64_t iq = qc * CQ; iq < std::min(nqb, (qc + 1) * CQ); ++iq) f((b * dm.H + hk * dm.G + g) * nqb + iq);
  };
  std::vector<int64_t> cjlo, cjhi;
  bool local = pairs && wide_ok && local_packs_on();
  if (local) {
    cjlo.assign(chunks, nkb);
    cjhi.assign(chunks, 0);
    int64_t packed = 0;
    for (int64_t ch = 0; local && ch < chunks; ++ch) {
      chunk_items(ch, [&](int64_t it) {
        if (ijhi[it] <= ijlo[it]) return;
        cjlo[ch] = std::min(cjlo[ch], ijlo[it]);
        cjhi[ch] = std::max(cjhi[ch], ijhi[it]);
      });
      cjhi[ch] = std::max(cjhi[ch], cjlo[ch]);
      packed += cjhi[ch] - cjlo[ch];
      local = cjhi[ch] - cjlo[ch] <= LOCAL_BLOCKS;
    }
    local = local && 2 * packed <= 3 * dm.B * dm.Hkv * nkb;
  }
  last_fwd_plan.store(local ? chunks : 0);
  // work items handed out one at a time, the most kv blocks first (sched.h): a thread whose
  // core is busy takes fewer items, and the region ends on the shortest ones
  attnlab_sched::Queue queue(local ? chunks : items, [&](int64_t w) {
    if (!local) return visits[w];
    int64_t v = 0;
    chunk_items(w, [&](int64_t it) { v += visits[it]; });
    return v;
  });
  // float32 copies made once per call (O(N·D)): Q, Kᵀ (packed per kv block) and V (Dv padded
  // to 16), so the tile loop reads its operands in place instead of converting every tile
  // (bf16 on the pairs path: Q, Kᵀ and V as bf16 pairs, packed the same way, in words)
  at::Tensor q32, kt32, v32;
  attnlab_scratch::Scratch ws;  // the large packs: views into the process's scratch (scratch.h)
  // a contiguous bf16 Q of even D is already in pairs form (word p of a row = its values 2p,
  // 2p + 1): read in place, not copied
  const bool q_words = pairs && q.is_contiguous() && dm.D % 2 == 0;
  if (pairs) {
    if (!q_words) q32 = pack_rows_pairs(qv, dm.B, dm.H, dm.Nq, dm.D, q.options());
    if (!local) {  // local packs: each chunk packs its own blocks (below)
      kt32 = pack_kt_pairs(kv, dm.B, dm.Hkv, dm.Nk, dm.D, dm.bk, q.options(), ws);
      v32 = pack_v_pairs(vv, dm.B, dm.Hkv, dm.Nk, dm.Dv, Dvp0, dm.bk, q.options(), ws);
    }
  } else {
    q32 = q.to(at::kFloat).contiguous();
    kt32 = pack_t_blocked(kv, dm.B, dm.Hkv, dm.Nk, dm.D, dm.bk, q.options(), ws, 0);
    if (v.scalar_type() == at::kFloat && v.is_contiguous() && dm.Dv == Dvp0) {
      v32 = v;  // already the layout the tile loop reads: no copy
    } else {
      v32 = ws.empty(1, {dm.B, dm.Hkv, dm.Nk, Dvp0}, q.options().dtype(at::kFloat)).zero_();
      v32.narrow(3, 0, dm.Dv).copy_(v);
    }
  }
  const float* q32p = pairs ? nullptr : q32.data_ptr<float>();
  const float* kt32p = pairs ? nullptr : kt32.data_ptr<float>();
  const float* v32p = pairs ? nullptr : v32.data_ptr<float>();
  const uint32_t* qhp = !pairs  ? nullptr
                        : q_words ? reinterpret_cast<const uint32_t*>(q.data_ptr())
                                  : reinterpret_cast<const uint32_t*>(q32.data_ptr<int32_t>());
  const uint32_t* khp = pairs && !local ? reinterpret_cast<const uint32_t*>(kt32.data_ptr<int32_t>()) : nullptr;
  const uint32_t* vhp = pairs && !local ? reinterpret_cast<const uint32_t*>(v32.data_ptr<int32_t>()) : nullptr;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t D = dm.D, Dv = dm.Dv, bq = dm.bq, bk = dm.bk;
    std::vector<float> Qb(bq * D), KT(D * bk), Vb(bk * Dv), S(bk), Pc(bk), acc(bq * Dv), mrow(bq), lrow(bq), tile(Dv);
    std::vector<RowMask> rms(bq);
    // per row: its visible columns as two intervals (RowMask::intervals, ivs[4r..4r+4): a0, a1,
    // x0, x1) where ivok[r], read by the bf16 path's softmax step
    std::vector<int64_t> ivs(4 * bq);
    std::vector<uint8_t> ivok(bq);
    // per row of the tile at hand (span_pass): its one visible range [slo, shi) and the max of
    // its scores there (smx, scaled) where the bf16 span path applies (sok)
    std::vector<int64_t> slo(bq), shi(bq);
    std::vector<float> smx(bq);
    std::vector<uint8_t> sok(bq);
    const int64_t Dvp = (Dv + 15) / 16 * 16;
    std::vector<float> St(bq * bk), accp(bq * Dvp), alph(bq);
    std::vector<uint32_t> Pw(pairs ? bq * bk / 2 : 0);  // P rounded to bf16 pairs
    const int64_t ngmax = (bq + RG - 1) / RG;
    std::vector<Env> genv(ngmax);  // per row group: the columns its rows may see
    std::vector<int64_t> gc0(ngmax), gc1(ngmax);
    // a wide tile's S (float32 P), RG rows of its width + 16 floats (not CW: rows CW = 2048
    // floats apart all map to the same L1 sets, and a group's 16 rows of a window's ~288
    // columns thrashed its 8 ways), and its bf16 P pairs at half that stride
    std::vector<float> Sw(wide_ok ? RG * (CW + 16) : 0);
    std::vector<uint32_t> Pww(wide_ok && pairs ? RG * (CW + 16) / 2 : 0);
    int64_t lb0 = 0;                                  // local packs: the chunk's first kv block
    const uint32_t *lkh = nullptr, *lvh = nullptr;    // and its Kᵀ and V panels (thread_buffer)
    // The fast path: S and P·V tiles through the register-blocked matmul.  A hidden entry is
    // P = 0 there, so a NaN/inf in a hidden value would leak (0·NaN): a q block whose result
    // is not finite runs again on the careful path below, where hidden entries are skipped.
    auto fast = [&](int64_t it) -> bool {
      const int64_t iq = it % nqb, h = (it / nqb) % dm.H, b = it / (nqb * dm.H);
      const int64_t hk = h / dm.G;
      const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
      const int64_t qrow = (b * dm.H + h) * dm.Nq + r0, kvh = b * dm.Hkv + hk;
      const float* Qf = pairs ? nullptr : q32p + qrow * D;
      const float* KTf = pairs ? nullptr : kt32p + kvh * nkb * D * bk;  // packed: one D × bk panel per kv block
      const float* Vf = pairs ? nullptr : v32p + kvh * dm.Nk * Dvp;
      // the bf16 pairs' Kᵀ and V panels of kv blocks jb0 on: the call's packs, or the chunk's
      // local packs (blocks [lb0, ...) in the thread's buffers)
      const int64_t jb0 = local ? lb0 : 0;
      const uint32_t* KH = !pairs ? nullptr : local ? lkh : khp + kvh * nkb * Dw * bk;
      const uint32_t* VH = !pairs ? nullptr : local ? lvh : vhp + kvh * nkb * (bk / 2) * Dvp;
      for (int64_t r = 0; r < n; ++r) {
        mk.row_into(rms[r], b, h, r0 + r, r > 0 ? &rms[r - 1] : nullptr);
        ivok[r] = rms[r].intervals();
        if (ivok[r]) rms[r].intervals(ivs[4 * r], ivs[4 * r + 1], ivs[4 * r + 2], ivs[4 * r + 3]);
        mrow[r] = NEG_INF;
        lrow[r] = 0.0f;
      }
      std::fill(accp.begin(), accp.begin() + n * Dvp, 0.0f);
      // The q block's row groups (RG rows) and the columns each may see: the band's envelope of
      // its rows (ranges_at at its lowest and highest band position: b0, b1 and the sinks' end
      // grow with it; ranges_at gives the whole [0, end) where the band is per column or a
      // BlockMask's), within the span of its rows' document runs (sorted kv ids).  A group of a
      // window sees RG + left columns, where the whole block would run bq + left.
      const int64_t ng = (n + RG - 1) / RG;
      int64_t jlo = nkb, jhi = 0;  // the kv blocks some group may see
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t ga = g * RG, gb = std::min(n, ga + RG);
        int64_t qlo = mk.qp_of(b, r0 + ga), qhi = mk.qp_of(b, r0 + gb - 1);
        if (mk.qpos != nullptr)  // band positions need not grow with the row (varlen's restart)
          for (int64_t i = r0 + ga; i < r0 + gb; ++i) {
            qlo = std::min(qlo, mk.qp_of(b, i));
            qhi = std::max(qhi, mk.qp_of(b, i));
          }
        int64_t s1a, b0a, b1a, s1z, b0z, b1z;
        mk.ranges_at(b, qlo, s1a, b0a, b1a);
        mk.ranges_at(b, qhi, s1z, b0z, b1z);
        int64_t il = 0, ih = dm.Nk;
        if (rms[ga].kvid != nullptr && rms[ga].idlo >= 0) {
          il = rms[ga].idlo, ih = rms[ga].idhi;
          for (int64_t r = ga + 1; r < gb; ++r) {
            if (rms[r].idlo < 0) {
              il = 0, ih = dm.Nk;
              break;
            }
            il = std::min(il, rms[r].idlo);
            ih = std::max(ih, rms[r].idhi);
          }
        }
        genv[g] = {s1z, b0a, std::max(s1z, b1z), il, ih};
        const int64_t lo = std::max(s1z > 0 ? 0 : b0a, il), hi = std::min(std::max(s1z, b1z), ih);
        if (hi > lo) {
          jlo = std::min(jlo, lo / bk);
          jhi = std::max(jhi, std::min(nkb, (hi + bk - 1) / bk));
        }
      }
      // The bf16 path's first step on rows [ra, rb) of a tile (row r's scores at S0 + (r - ra) ·
      // ld, columns c0 + [0, m)): where a row's visible columns there are one range (a band, a
      // causal diagonal, a sorted document's run, a band meeting its sinks: RowMask::intervals),
      // that range and the max of its scores (span_max: its edges masked in registers, no -inf
      // written), every row's max before any row's exp (the rows' steps then overlap)
      auto span_pass = [&](int64_t ra, int64_t rb, const float* S0, int64_t ld, int64_t c0, int64_t m) {
        const bool on = pairs && !sm.active() && scale > 0.0f && scale < INFINITY;
        const int64_t e = c0 + m;
        for (int64_t r = ra; r < rb; ++r) {
          sok[r] = 0;
          if (!on || !ivok[r]) continue;
          const int64_t* iv = ivs.data() + 4 * r;
          const int64_t alo = std::max(iv[0], c0), ahi = std::min(iv[1], e);
          const int64_t xlo = std::max(iv[2], c0), xhi = std::min(iv[3], e);
          const bool ha = alo < ahi, hx = xlo < xhi;
          if (ha && hx && ahi < xlo) continue;  // two separate pieces (a0 <= x0): the general step
          const int64_t lo = ha ? alo : hx ? xlo : 0, hi = ha && hx ? std::max(ahi, xhi) : ha ? ahi : hx ? xhi : 0;
          sok[r] = 1;
          slo[r] = lo;
          shi[r] = hi;
          smx[r] = lo < hi ? attnlab_fwd::span_max(S0 + (r - ra) * ld, lo - c0, hi - c0) * scale : NEG_INF;
        }
      };
      // One row's softmax step on its S row Sr (columns c0 + [0, m), padded to mp): the running
      // max, alpha (the old sums' rescale) and P (float32 in Sr, bf16 pairs in Ph on the pairs
      // path), zero where hidden; full_of(): every column visible (asked only where needed)
      auto soft_row = [&](int64_t r, float* Sr, uint16_t* Ph, int64_t c0, int64_t m, int64_t mp, const auto& full_of) {
        const RowMask& rm = rms[r];
        // The bf16 path on a row whose visible columns in the tile are one range [lo, hi)
        // (span_pass: its max already taken): exp on that range only, its edges masked in
        // registers (span_exp2_bf16), the scale folded into the exponent
        if (sok[r]) {
          const int64_t lo = slo[r], hi = shi[r];
          const float mx = smx[r];
          const float m_new = std::isnan(mx) ? mx : std::max(mrow[r], mx);
          if (m_new == NEG_INF || lo >= hi) {  // nothing visible here: P = 0, the sums unchanged
            std::fill(Ph, Ph + mp, uint16_t{0});
            alph[r] = 1.0f;
            return;
          }
          alph[r] = m_new == mrow[r] ? 1.0f : mrow[r] == NEG_INF ? 0.0f : attnlab_fwd::exp_s(mrow[r] - m_new);
          using attnlab_fwd::LOG2E;
          const float sum =
              attnlab_fwd::span_exp2_bf16<true>(Sr, Ph, mp, lo - c0, hi - c0, scale * LOG2E, m_new * LOG2E);
          lrow[r] = lrow[r] * alph[r] + sum;
          mrow[r] = m_new;
          return;
        }
        const bool full = full_of();
        float mx;
        int64_t e0 = 0, e1 = mp;  // 16-column chunks outside [e0, e1) are hidden: P there is 0
        bool raw = false;         // Sr unscaled: the bf16 path's exp folds the scale in
        if (m == mp && !sm.active() && full) {  // the common tile: scale and max in one pass
          raw = pairs && scale > 0.0f && scale < INFINITY;  // the max commutes with the scale
          mx = raw ? attnlab_fwd::row_max(Sr, mp) * scale : attnlab_fwd::row_scale_max(Sr, mp, scale);
        } else if (!full && !sm.active() && scale > 0.0f) {
          // a masked row: its visible span (RowMask::span) only, hidden entries -inf before the
          // scale (-inf · scale is -inf) so that scale and max run in one pass; on the bf16
          // path the span stays unscaled, as the common tile's (the scale folded into the exp)
          raw = pairs && scale < INFINITY;
          int64_t vlo, vhi;
          rm.span(c0, m, vlo, vhi);
          e0 = vlo / 16 * 16;
          e1 = vlo < vhi ? (vhi + 15) / 16 * 16 : e0;
          const int64_t em = std::min(m, e1);
          for (int64_t c = std::max(m, e0); c < e1; ++c) Sr[c] = NEG_INF;
          if (em > e0) rm.hide(Sr + e0, c0 + e0, em - e0);
          mx = e1 <= e0 ? NEG_INF
               : raw    ? attnlab_fwd::row_max(Sr + e0, e1 - e0) * scale
                        : attnlab_fwd::row_scale_max(Sr + e0, e1 - e0, scale);
        } else {
          if (!full && !sm.active()) {  // a band's row: its visible span (RowMask::span)
            int64_t vlo, vhi;
            rm.span(c0, m, vlo, vhi);
            e0 = vlo / 16 * 16;
            e1 = vlo < vhi ? (vhi + 15) / 16 * 16 : e0;
          }
          attnlab_rows::row_scale(Sr + e0, std::min(m, e1) - e0, scale);
          for (int64_t c = m; c < mp; ++c) Sr[c] = NEG_INF;
          if (!full) rm.hide(Sr, c0, m);
          if (sm.active()) sm.apply_row(Sr, b, h, r0 + r, c0, m, rm);
          mx = e1 > e0 ? attnlab_rows::row_max(Sr + e0, e1 - e0) : NEG_INF;
        }
        const float m_new = std::isnan(mx) ? mx : std::max(mrow[r], mx);
        if (m_new == NEG_INF) {
          if (pairs)
            std::fill(Ph, Ph + mp, uint16_t{0});
          else
            std::fill(Sr, Sr + mp, 0.0f);
          alph[r] = 1.0f;
          return;
        }
        // exp(0) is exactly 1 and exp(-inf) exactly 0: a row max that did not move, and a row's
        // first visible tile (a window row's only one), cost no exp (a scalar exp's latency
        // was a sixth of the bf16 softmax step's time at window 256)
        alph[r] = m_new == mrow[r]    ? 1.0f
                  : mrow[r] == NEG_INF ? 0.0f
                  : pairs              ? attnlab_fwd::exp_s(mrow[r] - m_new)
                                       : exp_f(mrow[r] - m_new);
        // P rounded to bf16 (as flash-attn does) straight into P·V's operand; float32 row sum
        // (exp of -inf is exactly 0: the chunks outside [e0, e1) add nothing to the sum's lanes)
        if (pairs) {
          std::fill(Ph, Ph + e0, uint16_t{0});
          std::fill(Ph + e1, Ph + mp, uint16_t{0});
        } else {
          std::fill(Sr, Sr + e0, 0.0f);
          std::fill(Sr + e1, Sr + mp, 0.0f);
        }
        using attnlab_fwd::LOG2E;
        const float sum = !pairs ? attnlab_rows::row_exp(Sr + e0, Sr + e0, e1 - e0, m_new)
                          : raw  ? attnlab_fwd::row_exp2_bf16<true>(Sr + e0, Ph + e0, e1 - e0, scale * LOG2E,
                                                                            m_new * LOG2E)
                                 : attnlab_fwd::row_exp2_bf16<false>(Sr + e0, Ph + e0, e1 - e0, LOG2E, m_new);
        lrow[r] = lrow[r] * alph[r] + sum;
        mrow[r] = m_new;
      };
      // S and P·V of rows [ra, rb) (every row intervals(); no score mod, scale > 0) on columns
      // [c0, c1) (c0 a multiple of 16, c1 - c0 <= CW) as one tile: S from each kv block's panel
      // it meets, one softmax step per row, one P·V (V is contiguous across kv blocks)
      auto wide_rows = [&](int64_t ra, int64_t rb, int64_t c0, int64_t c1) {
        const int64_t m = c1 - c0, mp = (m + 15) / 16 * 16, nr = rb - ra;
        const int64_t ld = mp + 16;  // the tile's row stride (floats; its P pairs: ld / 2 words)
        for (int64_t p0 = c0; p0 < c0 + mp;) {  // the part [p0, pe) in kv block jk
          const int64_t jk = p0 / bk, pe = std::min(c0 + mp, (jk + 1) * bk), o = p0 - jk * bk;
          if (pairs)
            attnlab_fwd::matmul(qhp + (qrow + ra) * Dw, Dw, KH + (jk - jb0) * Dw * bk + o, bk,
                                Sw.data() + (p0 - c0), ld, nr, pe - p0, Dw);
          else
            attnlab_fwd::matmul(Qf + ra * D, D, KTf + jk * D * bk + o, bk, Sw.data() + (p0 - c0), ld, nr, pe - p0,
                                D);
          p0 = pe;
        }
        span_pass(ra, rb, Sw.data(), ld, c0, m);
        for (int64_t r = ra; r < rb; ++r)
          soft_row(r, Sw.data() + (r - ra) * ld, reinterpret_cast<uint16_t*>(Pww.data() + (r - ra) * (ld / 2)), c0,
                   m, mp, [&] { return rms[r].covers(c0, c1); });
        if (pairs)
          attnlab_fwd::matmul_acc(Pww.data(), ld / 2, VH + ((c0 - jb0 * bk) / 2) * Dvp, Dvp,
                                  accp.data() + ra * Dvp, Dvp, nr, Dvp, mp / 2, alph.data() + ra);
        else
          attnlab_fwd::matmul_acc(Sw.data(), ld, Vf + c0 * Dvp, Dvp, accp.data() + ra * Dvp, Dvp, nr, Dvp, m,
                                  alph.data() + ra);
      };
      // S and P·V of rows [ra, rb) on columns [c0, c1) of kv block jk (c0 - cb0 a multiple of 16)
      auto tile_rows = [&](int64_t ra, int64_t rb, int64_t jk, int64_t cb0, int64_t cb1, int64_t c0, int64_t c1) {
        const int64_t o = c0 - cb0;  // column offset in the packed panels
        const int64_t m = c1 - c0, mp = (m + 15) / 16 * 16, nr = rb - ra;
        if (pairs)
          attnlab_fwd::matmul(qhp + (qrow + ra) * Dw, Dw, KH + (jk - jb0) * Dw * bk + o, bk,
                              St.data() + ra * bk, bk, nr, mp, Dw);
        else
          attnlab_fwd::matmul(Qf + ra * D, D, KTf + jk * D * bk + o, bk, St.data() + ra * bk, bk, nr, mp, D);
        span_pass(ra, rb, St.data() + ra * bk, bk, c0, m);
        for (int64_t r = ra; r < rb; ++r) {
          float* Sr = St.data() + r * bk;
          const RowMask& rm = rms[r];
          uint16_t* Ph = reinterpret_cast<uint16_t*>(Pw.data() + r * (bk / 2));  // this row's bf16 P (pairs path)
          if (rm.none(cb0, cb1)) {
            if (pairs)
              std::fill(Ph, Ph + mp, uint16_t{0});
            else
              std::fill(Sr, Sr + mp, 0.0f);
            alph[r] = 1.0f;
            continue;
          }
          // the ids / keep / BlockMask tables hold whole kv blocks: full there is full on [c0, c1)
          soft_row(r, Sr, Ph, c0, m, mp, [&] { return rm.band_full(c0, c1) && rm.extra_full(cb0, cb1); });
        }
        // acc = acc · alpha + P·V (float32 accumulation), one pass
        if (pairs)
          attnlab_fwd::matmul_acc(Pw.data() + ra * (bk / 2), bk / 2, VH + ((jk - jb0) * (bk / 2) + o / 2) * Dvp,
                                  Dvp, accp.data() + ra * Dvp, Dvp, nr, Dvp, mp / 2, alph.data() + ra);
        else
          attnlab_fwd::matmul_acc(St.data() + ra * bk, bk, Vf + c0 * Dvp, Dvp, accp.data() + ra * Dvp, Dvp, nr, Dvp,
                                  m, alph.data() + ra);
      };
      // A q block whose row groups each see at most CW columns, every row two intervals (a band,
      // its sinks, a sorted document): each group runs its columns as one tile that spans kv
      // blocks (S per kv block's panel, one softmax and one P·V per row), not one per kv block
      bool wide = wide_ok;
      for (int64_t r = 0; wide && r < n; ++r) wide = rms[r].intervals();
      if (wide) {
        for (int64_t g = 0; g < ng; ++g) {
          const Env& e = genv[g];
          // the sinks' columns [0, s1) and the band's [b0, end), each within the document runs
          // [il, ih) and from a 16-column boundary, one range where they meet (the tiles must not
          // overlap: a column in two would count twice), in tiles of at most CW columns
          int64_t pc[2][2] = {{std::max<int64_t>(0, e.il) / 16 * 16, std::min(e.s1, e.ih)},
                              {std::max(e.b0, e.il) / 16 * 16, std::min(e.end, e.ih)}};
          if (pc[0][1] > pc[0][0] && pc[1][1] > pc[1][0] && pc[1][0] < pc[0][1]) {
            pc[1][0] = std::min(pc[0][0], pc[1][0]);
            pc[1][1] = std::max(pc[0][1], pc[1][1]);
            pc[0][1] = pc[0][0];
          }
          for (const auto& pr : pc)
            for (int64_t c = pr[0]; c < pr[1]; c += CW)
              wide_rows(g * RG, std::min(n, (g + 1) * RG), c, std::min(pr[1], c + CW));
        }
        jhi = jlo;  // no kv block loop
      }
      for (int64_t jk = jlo; jk < jhi; ++jk) {
        const int64_t cb0 = jk * bk, cb1 = std::min(dm.Nk, cb0 + bk);  // the kv block
        if (!block_visits(mk, b, h, r0, r1, cb0, cb1)) continue;
        // each group's columns of the block, from a 16-column boundary (none: gc0 = -1); a
        // window's or a causal diagonal's hidden columns cost nothing
        for (int64_t g = 0; g < ng; ++g) {
          const Env& e = genv[g];
          const int64_t lo = std::max({cb0, e.s1 > cb0 ? cb0 : e.b0, e.il}), hi = std::min({cb1, e.end, e.ih});
          gc0[g] = hi > lo ? cb0 + (lo - cb0) / 16 * 16 : -1;
          gc1[g] = hi;
        }
        for (int64_t g = 0; g < ng;) {  // groups that share their columns run as one
          int64_t g2 = g + 1;
          while (g2 < ng && gc0[g2] == gc0[g] && gc1[g2] == gc1[g]) ++g2;
          if (gc0[g] >= 0) tile_rows(g * RG, std::min(n, g2 * RG), jk, cb0, cb1, gc0[g], gc1[g]);
          g = g2;
        }
      }
      bool finite = true;
      for (int64_t r = 0; r < n; ++r) {
        T* orow = op + ((b * dm.H + h) * dm.Nq + r0 + r) * Dv;
        const float l = lrow[r];
        const float* ar = accp.data() + r * Dvp;
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (l != 0.0f && std::isfinite(l)) {  // finish_row's values, vectorised (out_row_bf16)
            finite = attnlab_fwd::out_row_bf16(reinterpret_cast<uint16_t*>(orow), ar, Dv, 1.0f / l) && finite;
            lp[(b * dm.H + h) * dm.Nq + r0 + r] = mrow[r] + std::log(l);
            continue;
          }
        }
        finite = finite && std::isfinite(l) && attnlab_fwd::all_finite(ar, Dv);
        finish_row(orow, ar, Dv, l, mrow[r], lp + (b * dm.H + h) * dm.Nq + r0 + r);
      }
      return finite;
    };
    auto careful = [&](int64_t it) {
      const int64_t iq = it % nqb, h = (it / nqb) % dm.H, b = it / (nqb * dm.H);
      const int64_t hk = h / dm.G;
      const int64_t r0 = iq * bq, r1 = std::min(dm.Nq, r0 + bq), n = r1 - r0;
      for (int64_t r = 0; r < n; ++r) {
        load_row(Qb.data() + r * D, qv.row(b, h, r0 + r), D, qv.s3);
        rms[r] = mk.row(b, h, r0 + r);
        mrow[r] = NEG_INF;
        lrow[r] = 0.0f;
      }
      std::fill(acc.begin(), acc.begin() + n * Dv, 0.0f);
      for (int64_t jk = 0; jk < nkb; ++jk) {
        const int64_t c0 = jk * bk, c1 = std::min(dm.Nk, c0 + bk), m = c1 - c0;
        if (!block_visits(mk, b, h, r0, r1, c0, c1)) continue;
        load_kt(KT.data(), kv, b, hk, c0, m, D, bk);
        for (int64_t c = 0; c < m; ++c) load_row(Vb.data() + c * Dv, vv.row(b, hk, c0 + c), Dv, vv.s3);
        for (int64_t r = 0; r < n; ++r) {
          const RowMask& rm = rms[r];
          if (rm.none(c0, c1)) continue;
          float* Sr = S.data();
          score_row(Sr, Qb.data() + r * D, KT.data(), D, bk, m, scale, rm, c0);
          if (sm.active()) sm.apply_row(Sr, b, h, r0 + r, c0, m, rm);
          float mx = NEG_INF;
          for (int64_t c = 0; c < m; ++c) mx = std::max(mx, Sr[c]);
          for (int64_t c = 0; c < m; ++c) mx = std::isnan(Sr[c]) ? Sr[c] : mx;
          const float m_new = std::isnan(mx) ? mx : std::max(mrow[r], mx);  // a visible NaN propagates
          if (m_new == NEG_INF) continue;  // nothing visible yet
          const float alpha = exp_f(mrow[r] - m_new);
          float* ar = acc.data() + r * Dv;
          float* tr = tile.data();  // this tile's P·V, added once: two-level sums keep long rows accurate
          // P and its sum exactly as the fast path computes them (the same bits on finite inputs)
          const int64_t mp = (m + 15) / 16 * 16;
          for (int64_t c = m; c < mp; ++c) Sr[c] = NEG_INF;
          const float sum = attnlab_rows::row_exp(Sr, Pc.data(), mp, m_new);
          for (int64_t e = 0; e < Dv; ++e) tr[e] = 0.0f;
          for (int64_t c = 0; c < m; ++c) {
            if (Sr[c] == NEG_INF) continue;  // hidden: an exact zero, whatever V holds
            const float p = Pc[c];
            const float* vr = Vb.data() + c * Dv;
            for (int64_t e = 0; e < Dv; ++e) tr[e] += p * vr[e];
          }
          for (int64_t e = 0; e < Dv; ++e) ar[e] = ar[e] * alpha + tr[e];
          lrow[r] = lrow[r] * alpha + sum;
          mrow[r] = m_new;
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        T* orow = op + ((b * dm.H + h) * dm.Nq + r0 + r) * Dv;
        const float l = lrow[r];
        float* ar = acc.data() + r * Dv;
        finish_row(orow, ar, Dv, l, mrow[r], lp + (b * dm.H + h) * dm.Nq + r0 + r);
      }
    };
    if (!local) {
      attnlab_sched::drain(queue, [&](int64_t it) {
        if (!fast(it)) careful(it);
      });
      return;
    }
    // a chunk: its kv blocks packed into this thread's buffers, then its G heads' q blocks in turn
    attnlab_sched::drain(queue, [&](int64_t ch) {
      const int64_t hk = (ch / nqc) % dm.Hkv, b = ch / (nqc * dm.Hkv);
      lb0 = cjlo[ch];
      const int64_t nb = cjhi[ch] - lb0;
      uint32_t* kp = attnlab_scratch::thread_buffer(0, static_cast<size_t>(std::max<int64_t>(nb, 1) * Dw * bk));
      uint32_t* vp = attnlab_scratch::thread_buffer(1, static_cast<size_t>(std::max<int64_t>(nb, 1) * (bk / 2) * Dvp));
      for (int64_t j = 0; j < nb; ++j) {
        pack_kt_pairs_block(kv, b, hk, lb0 + j, dm.Nk, dm.D, bk, kp + j * Dw * bk);
        pack_v_pairs_block(vv, b, hk, lb0 + j, dm.Nk, dm.Dv, Dvp, bk, vp + j * (bk / 2) * Dvp);
      }
      lkh = kp;
      lvh = vp;
      chunk_items(ch, [&](int64_t it) {
        if (!fast(it)) careful(it);
      });
    });
  });
}

}  // namespace
