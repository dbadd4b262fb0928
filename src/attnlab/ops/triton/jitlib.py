"""Device functions shared by the forward and backward kernels (inlined by Triton).

* :func:`mma` — ``tl.dot`` with float32 accumulation; float32 inputs use IEEE precision
  (Triton's default would be TF32, 10 mantissa bits, which breaks the precision contract).
* :func:`cast` — the rounding casts of P, dS and the outputs.
* :func:`score_tile` — the exact score tile ``mask(mod(scale · q·kᵀ))`` in natural units:
  score mods as described in :mod:`.scoremods`, the mask only when ``MASKED`` (partial
  tiles; see :mod:`.masking`), out-of-range keys always ``-inf``.
* :func:`mod_grad` — the score mod's backward: from dL/d(modded score) to dL/d(scaled
  score), accumulating the gradients of the slopes and of the relative-bias table.

Two workarounds for the interpreter of triton 3.8/3.9 (both under ``UPCAST``/``FIX_BF16``,
which the launcher sets only when interpreting bfloat16): its ``tl.dot`` reads bfloat16
operands as their uint16 bit patterns, so they are widened to float32 first (exact: a
bf16×bf16 product fits a float32, and the sum is float32 either way); and its
float32→bfloat16 cast truncates, so :func:`cast` rounds to nearest even itself, as the
GPU's ``cvt.rn.bf16.f32`` does.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


def device(fn):
    """``triton.jit`` for a device function; under the interpreter the plain function.

    The interpreter re-patches ``triton.language`` on every call of a jitted device
    function (about 2 ms each, most of the tests' time); the kernel's own launch has
    already patched it, so the plain function computes the same thing.  Like
    ``triton.jit``, it reads ``TRITON_INTERPRET`` when the function is defined."""
    return fn if triton.knobs.runtime.interpret else triton.jit(fn)


if triton.knobs.runtime.interpret:
    # ``tl.max``/``tl.sum`` are jitted library functions (a re-patch per call); the
    # interpreter maps ``tl.reduce`` with these combine functions straight onto numpy.
    def rowmax(x):
        return tl.reduce(x, 1, tl.standard._elementwise_max)

    def rowsum(x):
        return tl.reduce(x, 1, tl.standard._sum_combine)

    def total(x):
        return tl.reduce(x, 0, tl.standard._sum_combine)
else:

    @triton.jit
    def rowmax(x):
        return tl.max(x, 1)

    @triton.jit
    def rowsum(x):
        return tl.sum(x, 1)

    @triton.jit
    def total(x):
        return tl.sum(x, 0)


@device
def mma(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@device
def cast(x, dtype: tl.constexpr, FIX_BF16: tl.constexpr):
    if FIX_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@device
def tanh(x):
    # Cephes tanhf: an odd polynomial below 0.625 (where 1 - 2/(e^2x + 1) would cancel),
    # the exponential form above.  A few ulp in float32, on the GPU and in the interpreter
    # alike (libdevice's tanh does not run in the interpreter).
    a = tl.abs(x)
    z = x * x
    small = (
        (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
        - 3.33332819422e-1
    ) * z * x + x
    e = tl.exp(2.0 * tl.minimum(a, 20.0))
    big = 1.0 - 2.0 / (e + 1.0)
    big = tl.where(x < 0, -big, big)
    return tl.where(a < 0.625, small, big)


@device
def allowed(
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
    BM: tl.constexpr,
    BN: tl.constexpr,
    W: tl.constexpr,
    MB: tl.constexpr,
    MS: tl.constexpr,
    MD: tl.constexpr,
    MK: tl.constexpr,
    MT: tl.constexpr,
):
    """The mask on one tile, True = may attend (see masking.py for the family)."""
    ok = tl.full([BM, BN], 1, tl.int1)
    qpos = rows + q_offset
    kvpos = cols + kv_offset
    if MB:
        d = qpos[:, None] - kvpos[None, :]
        ok = (d >= band_lo) & (d <= band_hi)
        if MS:
            ok = ok | ((kvpos[None, :] < sink_n) & (d >= sink_lo))
    if MD:
        qi = tl.load(QIDS + b * s_qids + rows, mask=rows < Nq, other=-1)
        ki = tl.load(KVIDS + b * s_kvids + cols, mask=cols < Nk, other=-2)
        ok = ok & (qi[:, None] == ki[None, :])
    if MK:
        kp = tl.load(KEEP + b * s_keep + cols, mask=cols < Nk, other=0)
        ok = ok & (kp[None, :] != 0)
    if MT:
        t = tl.load(TID + i * n_kv_blocks + j)
        r = tl.arange(0, BM)
        c = tl.arange(0, BN)
        words = tl.load(TAB + t * s_tab_t + b * s_tab_b + h * s_tab_h + r[:, None] * W + (c // 32)[None, :])
        ok = ok & (((words >> (c % 32)[None, :]) & 1) != 0)
    return ok


@device
def score_tile(
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
    BM: tl.constexpr,
    BN: tl.constexpr,
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
):
    """``(s, t1, t2)``: the final score tile (natural units, -inf where masked) and the tanh
    values of the softcaps (for the backward)."""
    s = qk * scale
    t1 = s
    t2 = s
    if SOFTCAP == 1:
        t1 = tanh(s / cap)
        s = cap * t1
    if ALIBI != 0:
        slope = tl.load(SLOPES + h)
        dist = ((cols + kv_offset)[None, :] - (rows + q_offset)[:, None]).to(tl.float32)
        if ALIBI == 2:
            dist = -tl.abs(dist)
        s = s + slope * dist
    if RELBIAS:
        rel = tl.minimum(tl.maximum((cols + kv_offset)[None, :] - (rows + q_offset)[:, None], -R), R) + R
        s = s + tl.load(RTAB + h * s_rtab + rel)
    if SOFTCAP == 2:
        t2 = tanh(s / cap)
        s = cap * t2
    if MASKED:
        ok = allowed(
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
            BM,
            BN,
            W,
            MB,
            MS,
            MD,
            MK,
            MT,
        )
        s = tl.where(ok, s, float("-inf"))
    if not EVEN_N:
        s = tl.where((cols < Nk)[None, :], s, float("-inf"))
    return s, t1, t2


@device
def mod_grad(
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
    BM: tl.constexpr,
    ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI_GRAD: tl.constexpr,
    RELBIAS_GRAD: tl.constexpr,
):
    """dL/d(final score) ``g`` -> dL/d(scaled score); returns it and this tile's per-row
    contribution to dL/d(slopes[h])."""
    if SOFTCAP == 2:
        g = g * (1.0 - t2 * t2)
    dsl = tl.full([BM], 0.0, tl.float32)
    if ALIBI_GRAD:
        dist = ((cols + kv_offset)[None, :] - (rows + q_offset)[:, None]).to(tl.float32)
        if ALIBI == 2:
            dist = -tl.abs(dist)
        dsl = rowsum(g * dist)
    if RELBIAS_GRAD:
        rel = tl.minimum(tl.maximum((cols + kv_offset)[None, :] - (rows + q_offset)[:, None], -R), R) + R
        ok = (rows < Nq)[:, None] & (cols < Nk)[None, :] & (g != 0.0)
        tl.atomic_add(DRTAB + h * s_drtab + rel, g, mask=ok)
    if SOFTCAP == 1:
        g = g * (1.0 - t1 * t1)
    return g, dsl


# -- dropout: the counter-based keep-mask of attnlab.ops.dropout, bit for bit --------------
# 32-bit words in int64 lanes (the products wrap; their low 32 bits are exact), so the
# kernels draw the same bits as the tensor-op hash of the reference and the flash path.
@device
def _fmix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


@device
def _absorb(s, v):
    return _fmix32(((s ^ (v & 0xFFFFFFFF)) + 0x9E3779B9) & 0xFFFFFFFF)


@device
def dropout_tile(b, h, rows, cols, q_offset, kv_offset, key_r, key_c, thr, inv_keep):
    """``Z / (1 − p)`` for the tile ``rows × cols`` of query head ``h`` in batch ``b`` (float32):
    :class:`attnlab.ops.dropout.Dropout`'s hash of ``(seed, b, h, q_pos, kv_pos)``."""
    qp = rows.to(tl.int64) + q_offset
    kp = cols.to(tl.int64) + kv_offset
    r = _absorb(_absorb(_absorb(key_r, b), h), qp)
    c = _absorb(key_c, kp)
    u = _fmix32((_fmix32(r[:, None] ^ c[None, :]) + c[None, :]) & 0xFFFFFFFF)
    return tl.where(u >= thr, inv_keep, 0.0)
