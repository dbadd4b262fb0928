"""The backward kernels (FlashAttention-2): Δ preprocessing and dQ here, dK/dV in
:mod:`attnlab.ops.triton.backward_dkdv`.

With ``P = exp(S − LSE)`` recomputed tile by tile from the saved natural-log LSE::

    Δ_i  = rowsum(dO_i ∘ O_i) − dLSE_i            attn_bwd_delta, one program per (q-block, b, h)
    dP   = dO Vᵀ,   dS = P ∘ (dP − Δ)            (dS = dL/d(final score))
    g    = mod'(dS)                               score-mod backward (mod_grad), times scale
    dQ_i = Σ_j g K_j                              attn_bwd_dq:   one program per (q-block, b, h),
                                                  walking the same kv lists as the forward
    dV_j = Σ_i Pᵀ dO_i,   dK_j = Σ_i gᵀ Q_i       attn_bwd_dkdv (backward_dkdv.py): one program per
                                                  (kv-block, b, kv head), walking the q lists of
                                                  each of its G query heads

S is recomputed exactly as the forward computed it — the same ``Q·Kᵀ`` with K read as
the same (D, BN) tile — so ``exp(S − LSE)`` is consistent with the saved LSE to the bit
where the dot's summation order is fixed by the tile shapes (the interpreter; on a GPU
the MMA's k-order, unverified here).  A transposed K tile changes numpy's summation
order, and on a peaky softmax (scores ~70) that alone made dV 7× less accurate than the
reference.

Every sum runs over the visited tiles of the *whole* other axis, whatever the mask —
the Triton tutorial's kernel bounds the dK/dV loop to the causal triangle, which is why
its non-causal backward is wrong.  Rows with LSE = -inf (no visible key) get P = 0 and
zero gradients; rows past ``Nq`` are read with LSE = +inf, so P = 0 there too.  No
atomics except the relative-bias table gradient; dQ, dK and dV are each written once
(deterministic).  The slopes' gradient is written per program and summed on the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.ops.triton.jitlib import LOG2E, cast, device, dropout_tile, mma, mod_grad, rowsum, score_tile, total


@triton.jit
def attn_bwd_delta(
    O,
    DO,
    DLSE,
    DELTA,
    sob,
    soh,
    som,
    sod,
    sdb,
    sdh,
    sdm,
    sdd,
    H,
    Nq,
    Dv,
    BM: tl.constexpr,
    BDV: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: b·stride may pass 2^31
    b = bh // H
    h = bh % H
    rows = i * BM + tl.arange(0, BM)
    rdv = tl.arange(0, BDV)
    m = (rows[:, None] < Nq) & (rdv[None, :] < Dv)
    o = tl.load(O + b * sob + h * soh + rows[:, None] * som + rdv[None, :] * sod, mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdm + rdv[None, :] * sdd, mask=m, other=0.0).to(tl.float32)
    delta = rowsum(o * do)
    if HAS_DLSE:
        delta = delta - tl.load(DLSE + bh * Nq + rows, mask=rows < Nq, other=0.0)
    tl.store(DELTA + bh * Nq + rows, delta, mask=rows < Nq)


@device
def _dq_step(
    dq,
    dsl,
    q,
    do,
    lse,
    delta,
    j,
    b,
    h,
    i,
    rows,
    kbase,
    vbase,
    skn,
    skd,
    svn,
    svd,
    Nq,
    Nk,
    D,
    Dv,
    q_offset,
    kv_offset,
    scale,
    band_lo,
    band_hi,
    sink_n,
    sink_lo,
    QIDS,
    s_qids,
    KVIDS,
    s_kvids,
    KEEP,
    s_keep,
    TID,
    TAB,
    s_tab_t,
    s_tab_b,
    s_tab_h,
    n_kv_blocks,
    SLOPES,
    RTAB,
    s_rtab,
    R,
    cap,
    DRTAB,
    s_drtab,
    key_r,
    key_c,
    thr,
    inv_keep,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    W: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_N: tl.constexpr,
    MB: tl.constexpr,
    MS: tl.constexpr,
    MD: tl.constexpr,
    MK: tl.constexpr,
    MT: tl.constexpr,
    ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,
    RELBIAS: tl.constexpr,
    ALIBI_GRAD: tl.constexpr,
    RELBIAS_GRAD: tl.constexpr,
    UPCAST: tl.constexpr,
    FIX_BF16: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    cols = j * BN + tl.arange(0, BN)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    # K as the same (D, BN) tile the forward reads: S is recomputed bit for bit (see module doc)
    kt = tl.load(
        kbase + cols[None, :] * skn + rd[:, None] * skd, mask=(cols[None, :] < Nk) & (rd[:, None] < D), other=0.0
    )
    vv = tl.load(
        vbase + cols[:, None] * svn + rdv[None, :] * svd, mask=(cols[:, None] < Nk) & (rdv[None, :] < Dv), other=0.0
    )
    qk = mma(q, kt, UPCAST)
    s, t1, t2 = score_tile(
        qk,
        b,
        h,
        i,
        j,
        rows,
        cols,
        Nq,
        Nk,
        q_offset,
        kv_offset,
        scale,
        band_lo,
        band_hi,
        sink_n,
        sink_lo,
        QIDS,
        s_qids,
        KVIDS,
        s_kvids,
        KEEP,
        s_keep,
        TID,
        TAB,
        s_tab_t,
        s_tab_b,
        s_tab_h,
        n_kv_blocks,
        SLOPES,
        RTAB,
        s_rtab,
        R,
        cap,
        BM,
        BN,
        W,
        MASKED,
        EVEN_N,
        MB,
        MS,
        MD,
        MK,
        MT,
        ALIBI,
        SOFTCAP,
        RELBIAS,
    )
    p = tl.math.exp2((s - lse[:, None]) * LOG2E)
    dp = mma(do, tl.trans(vv), UPCAST)
    if DROPOUT:  # out = (P∘Zs)V: dP = Zs∘(dO Vᵀ); Δ = rowsum(dO∘O) is unchanged
        dp = dp * dropout_tile(b, h, rows, cols, q_offset, kv_offset, key_r, key_c, thr, inv_keep)
    g = p * (dp - delta[:, None])
    g, dsl_t = mod_grad(
        g,
        t1,
        t2,
        h,
        rows,
        cols,
        Nq,
        Nk,
        q_offset,
        kv_offset,
        DRTAB,
        s_drtab,
        R,
        BM,
        ALIBI,
        SOFTCAP,
        ALIBI_GRAD,
        RELBIAS_GRAD,
    )
    dq += mma(cast(g * scale, kt.dtype, FIX_BF16), tl.trans(kt), UPCAST)
    return dq, dsl + dsl_t


@triton.jit
def attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdb,
    sdh,
    sdm,
    sdd,
    sgb,
    sgh,
    sgm,
    sgd,
    H,
    G,
    Nq,
    Nk,
    D,
    Dv,
    q_offset,
    kv_offset,
    scale,
    n_kv_blocks,
    n_q_blocks,
    LISTS,
    slb,
    slh,
    slr,
    band_lo,
    band_hi,
    sink_n,
    sink_lo,
    QIDS,
    s_qids,
    KVIDS,
    s_kvids,
    KEEP,
    s_keep,
    TID,
    TAB,
    s_tab_t,
    s_tab_b,
    s_tab_h,
    SLOPES,
    RTAB,
    s_rtab,
    R,
    cap,
    DSLOPE,
    DRTAB,
    s_drtab,
    key_r,
    key_c,
    thr,
    inv_keep,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    W: tl.constexpr,
    SPARSE: tl.constexpr,
    EVEN_N: tl.constexpr,
    MB: tl.constexpr,
    MS: tl.constexpr,
    MD: tl.constexpr,
    MK: tl.constexpr,
    MT: tl.constexpr,
    ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,
    RELBIAS: tl.constexpr,
    ALIBI_GRAD: tl.constexpr,
    RELBIAS_GRAD: tl.constexpr,
    UPCAST: tl.constexpr,
    FIX_BF16: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: b·stride may pass 2^31
    b = bh // H
    h = bh % H
    hk = h // G
    rows = i * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + rd[None, :] * sqd,
        mask=(rows[:, None] < Nq) & (rd[None, :] < D),
        other=0.0,
    )
    do = tl.load(
        DO + b * sdb + h * sdh + rows[:, None] * sdm + rdv[None, :] * sdd,
        mask=(rows[:, None] < Nq) & (rdv[None, :] < Dv),
        other=0.0,
    )
    lse = tl.load(LSE + bh * Nq + rows, mask=rows < Nq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(DELTA + bh * Nq + rows, mask=rows < Nq, other=0.0)
    kbase = K + b * skb + hk * skh
    vbase = V + b * svb + hk * svh
    dq = tl.full([BM, BD], 0.0, tl.float32)
    dsl = tl.full([BM], 0.0, tl.float32)
    if SPARSE:
        base = LISTS + b * slb + h * slh + i * slr
        n_part = tl.load(base)
        n_full = tl.load(base + 1)
        for t in range(0, n_part):
            j = tl.load(base + 2 + t)
            dq, dsl = _dq_step(
                dq,
                dsl,
                q,
                do,
                lse,
                delta,
                j,
                b,
                h,
                i,
                rows,
                kbase,
                vbase,
                skn,
                skd,
                svn,
                svd,
                Nq,
                Nk,
                D,
                Dv,
                q_offset,
                kv_offset,
                scale,
                band_lo,
                band_hi,
                sink_n,
                sink_lo,
                QIDS,
                s_qids,
                KVIDS,
                s_kvids,
                KEEP,
                s_keep,
                TID,
                TAB,
                s_tab_t,
                s_tab_b,
                s_tab_h,
                n_kv_blocks,
                SLOPES,
                RTAB,
                s_rtab,
                R,
                cap,
                DRTAB,
                s_drtab,
                key_r,
                key_c,
                thr,
                inv_keep,
                BM,
                BN,
                BD,
                BDV,
                W,
                True,
                EVEN_N,
                MB,
                MS,
                MD,
                MK,
                MT,
                ALIBI,
                SOFTCAP,
                RELBIAS,
                ALIBI_GRAD,
                RELBIAS_GRAD,
                UPCAST,
                FIX_BF16,
                DROPOUT,
            )
        for t in range(n_part, n_part + n_full):
            j = tl.load(base + 2 + t)
            dq, dsl = _dq_step(
                dq,
                dsl,
                q,
                do,
                lse,
                delta,
                j,
                b,
                h,
                i,
                rows,
                kbase,
                vbase,
                skn,
                skd,
                svn,
                svd,
                Nq,
                Nk,
                D,
                Dv,
                q_offset,
                kv_offset,
                scale,
                band_lo,
                band_hi,
                sink_n,
                sink_lo,
                QIDS,
                s_qids,
                KVIDS,
                s_kvids,
                KEEP,
                s_keep,
                TID,
                TAB,
                s_tab_t,
                s_tab_b,
                s_tab_h,
                n_kv_blocks,
                SLOPES,
                RTAB,
                s_rtab,
                R,
                cap,
                DRTAB,
                s_drtab,
                key_r,
                key_c,
                thr,
                inv_keep,
                BM,
                BN,
                BD,
                BDV,
                W,
                False,
                EVEN_N,
                MB,
                MS,
                MD,
                MK,
                MT,
                ALIBI,
                SOFTCAP,
                RELBIAS,
                ALIBI_GRAD,
                RELBIAS_GRAD,
                UPCAST,
                FIX_BF16,
                DROPOUT,
            )
    else:
        for j in range(0, n_kv_blocks):
            dq, dsl = _dq_step(
                dq,
                dsl,
                q,
                do,
                lse,
                delta,
                j,
                b,
                h,
                i,
                rows,
                kbase,
                vbase,
                skn,
                skd,
                svn,
                svd,
                Nq,
                Nk,
                D,
                Dv,
                q_offset,
                kv_offset,
                scale,
                band_lo,
                band_hi,
                sink_n,
                sink_lo,
                QIDS,
                s_qids,
                KVIDS,
                s_kvids,
                KEEP,
                s_keep,
                TID,
                TAB,
                s_tab_t,
                s_tab_b,
                s_tab_h,
                n_kv_blocks,
                SLOPES,
                RTAB,
                s_rtab,
                R,
                cap,
                DRTAB,
                s_drtab,
                key_r,
                key_c,
                thr,
                inv_keep,
                BM,
                BN,
                BD,
                BDV,
                W,
                False,
                EVEN_N,
                MB,
                MS,
                MD,
                MK,
                MT,
                ALIBI,
                SOFTCAP,
                RELBIAS,
                ALIBI_GRAD,
                RELBIAS_GRAD,
                UPCAST,
                FIX_BF16,
                DROPOUT,
            )
    tl.store(
        DQ + b * sgb + h * sgh + rows[:, None] * sgm + rd[None, :] * sgd,
        cast(dq, DQ.dtype.element_ty, FIX_BF16),
        mask=(rows[:, None] < Nq) & (rd[None, :] < D),
    )
    if ALIBI_GRAD:
        tl.store(DSLOPE + bh * n_q_blocks + i, total(dsl))
