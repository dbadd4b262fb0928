"""The forward kernel: tiled online softmax (FlashAttention-2), one program per (q-block, b, h).

For each visited kv-block ``j`` (natural log; exponentials as ``exp2(x·log2 e)`` after the
subtraction, so large scores keep the reference's accuracy)::

    S     = mask(mod(scale · Q_i K_jᵀ))          mask only on PARTIAL tiles; -inf outside
    m'    = max(m, rowmax S)                     the running max stays -inf until a key is seen
    P     = exp(S − m̃'),  m̃' = 0 where m' = -inf (so P = 0 there, never NaN)
    l     = l·exp(m − m̃') + rowsum P
    acc   = acc·exp(m − m̃') + P V_j
    O_i   = acc / l,   LSE_i = m + log l          l = 0: O_i = 0 and LSE_i = -inf (true -inf)

The program walks the PARTIAL tiles of its row of the block lists first (mask
evaluated), then the FULL ones (no mask code at all); EMPTY tiles are never read.
Query head ``h`` reads kv head ``h // G`` through its strides: K/V are never copied.
Head dims are padded to a power of two inside (masked loads), so any ``D, Dv <= 256``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.ops.triton.jitlib import LOG2E, cast, device, dropout_tile, mma, rowmax, rowsum, score_tile


@device
def _fwd_step(acc, m_i, l_i, q, j, b, h, i, rows, kbase, vbase, skn, skd, svn, svd, Nq, Nk, D, Dv,
              q_offset, kv_offset, scale,
              band_lo, band_hi, sink_n, sink_lo, QIDS, s_qids, KVIDS, s_kvids, KEEP, s_keep,
              TID, TAB, s_tab_t, s_tab_b, s_tab_h, n_kv_blocks, SLOPES, RTAB, s_rtab, R, cap,
              key_r, key_c, thr, inv_keep,
              BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, W: tl.constexpr,
              MASKED: tl.constexpr, EVEN_N: tl.constexpr,
              MB: tl.constexpr, MS: tl.constexpr, MD: tl.constexpr, MK: tl.constexpr, MT: tl.constexpr,
              ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, RELBIAS: tl.constexpr,
              UPCAST: tl.constexpr, FIX_BF16: tl.constexpr, DROPOUT: tl.constexpr):
    cols = j * BN + tl.arange(0, BN)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    kt = tl.load(kbase + cols[None, :] * skn + rd[:, None] * skd,
                 mask=(cols[None, :] < Nk) & (rd[:, None] < D), other=0.0)
    qk = mma(q, kt, UPCAST)
    s, _t1, _t2 = score_tile(qk, b, h, i, j, rows, cols, Nq, Nk, q_offset, kv_offset, scale,
                           band_lo, band_hi, sink_n, sink_lo, QIDS, s_qids, KVIDS, s_kvids, KEEP, s_keep,
                           TID, TAB, s_tab_t, s_tab_b, s_tab_h, n_kv_blocks, SLOPES, RTAB, s_rtab, R, cap,
                           BM, BN, W, MASKED, EVEN_N, MB, MS, MD, MK, MT, ALIBI, SOFTCAP, RELBIAS)
    m_new = tl.maximum(m_i, rowmax(s))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2((s - m_safe[:, None]) * LOG2E)
    alpha = tl.math.exp2((m_i - m_safe) * LOG2E)
    l_i = l_i * alpha + rowsum(p)  # the LSE is of the undropped probabilities
    if DROPOUT:
        p = p * dropout_tile(b, h, rows, cols, q_offset, kv_offset, key_r, key_c, thr, inv_keep)
    vv = tl.load(vbase + cols[:, None] * svn + rdv[None, :] * svd,
                 mask=(cols[:, None] < Nk) & (rdv[None, :] < Dv), other=0.0)
    acc = acc * alpha[:, None] + mma(cast(p, vv.dtype, FIX_BF16), vv, UPCAST)
    return acc, m_new, l_i


@triton.jit
def attn_fwd(Q, K, V, O, LSE,
             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
             H, G, Nq, Nk, D, Dv, q_offset, kv_offset, scale, n_kv_blocks,
             LISTS, slb, slh, slr,
             band_lo, band_hi, sink_n, sink_lo, QIDS, s_qids, KVIDS, s_kvids, KEEP, s_keep,
             TID, TAB, s_tab_t, s_tab_b, s_tab_h,
             SLOPES, RTAB, s_rtab, R, cap, key_r, key_c, thr, inv_keep,
             BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, W: tl.constexpr,
             SPARSE: tl.constexpr, EVEN_N: tl.constexpr,
             MB: tl.constexpr, MS: tl.constexpr, MD: tl.constexpr, MK: tl.constexpr, MT: tl.constexpr,
             ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, RELBIAS: tl.constexpr,
             UPCAST: tl.constexpr, FIX_BF16: tl.constexpr, DROPOUT: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: b·stride may pass 2^31
    b = bh // H
    h = bh % H
    hk = h // G
    rows = i * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + rd[None, :] * sqd,
                mask=(rows[:, None] < Nq) & (rd[None, :] < D), other=0.0)
    kbase = K + b * skb + hk * skh
    vbase = V + b * svb + hk * svh
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.full([BM], 0.0, tl.float32)
    acc = tl.full([BM, BDV], 0.0, tl.float32)
    if SPARSE:
        base = LISTS + b * slb + h * slh + i * slr
        n_part = tl.load(base)
        n_full = tl.load(base + 1)
        for t in range(0, n_part):
            j = tl.load(base + 2 + t)
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, b, h, i, rows, kbase, vbase, skn, skd, svn, svd,
                                      Nq, Nk, D, Dv, q_offset, kv_offset, scale,
                                      band_lo, band_hi, sink_n, sink_lo, QIDS, s_qids, KVIDS, s_kvids, KEEP, s_keep,
                                      TID, TAB, s_tab_t, s_tab_b, s_tab_h, n_kv_blocks, SLOPES, RTAB, s_rtab, R, cap,
                                      key_r, key_c, thr, inv_keep, BM, BN, BD, BDV, W, True, EVEN_N, MB, MS, MD, MK, MT,
                                      ALIBI, SOFTCAP, RELBIAS, UPCAST, FIX_BF16, DROPOUT)
        for t in range(n_part, n_part + n_full):
            j = tl.load(base + 2 + t)
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, b, h, i, rows, kbase, vbase, skn, skd, svn, svd,
                                      Nq, Nk, D, Dv, q_offset, kv_offset, scale,
                                      band_lo, band_hi, sink_n, sink_lo, QIDS, s_qids, KVIDS, s_kvids, KEEP, s_keep,
                                      TID, TAB, s_tab_t, s_tab_b, s_tab_h, n_kv_blocks, SLOPES, RTAB, s_rtab, R, cap,
                                      key_r, key_c, thr, inv_keep, BM, BN, BD, BDV, W, False, EVEN_N, MB, MS, MD, MK, MT,
                                      ALIBI, SOFTCAP, RELBIAS, UPCAST, FIX_BF16, DROPOUT)
    else:
        for j in range(0, n_kv_blocks):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, b, h, i, rows, kbase, vbase, skn, skd, svn, svd,
                                      Nq, Nk, D, Dv, q_offset, kv_offset, scale,
                                      band_lo, band_hi, sink_n, sink_lo, QIDS, s_qids, KVIDS, s_kvids, KEEP, s_keep,
                                      TID, TAB, s_tab_t, s_tab_b, s_tab_h, n_kv_blocks, SLOPES, RTAB, s_rtab, R, cap,
                                      key_r, key_c, thr, inv_keep, BM, BN, BD, BDV, W, False, EVEN_N, MB, MS, MD, MK, MT,
                                      ALIBI, SOFTCAP, RELBIAS, UPCAST, FIX_BF16, DROPOUT)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    tl.store(O + b * sob + h * soh + rows[:, None] * som + rdv[None, :] * sod,
             cast(out, O.dtype.element_ty, FIX_BF16), mask=(rows[:, None] < Nq) & (rdv[None, :] < Dv))
    tl.store(LSE + bh * Nq + rows, lse, mask=rows < Nq)
