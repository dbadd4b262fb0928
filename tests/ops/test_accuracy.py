"""Every backend of ``attnlab.attention`` against the float64 oracle (DESIGN.md tolerance rule).

The oracle is ``backend="reference"`` on ``.double()`` inputs; it is itself checked
against an independent dense implementation (``naive_attention``).  A fast path's error
must be at most 2x the same-dtype reference's error for the output and LSE and 3x for
gradients, plus the dtype floor (``tests/helpers.py``).  Gradients are those of
``(out*w).sum() + (lse_finite*c).sum()``, so the LSE's backward is covered too.

Multi-tile code paths are forced on small shapes with ``block=(16, 32)`` (called
``flash-tiles`` when ``flash_attention`` is called directly, ``flash-bm`` when a BlockMask
of those tiles goes through ``attention(backend="flash")``).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.ops import flash_attention
from tests.ops.conftest import (
    DTYPE_IDS,
    DTYPES,
    FLOOR,
    compare_backend,
    dense_allowed,
    gen,
    loss_weights,
    make_qkv,
    max_err,
    naive_attention,
    randn,
    run_case,
)

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
MT = (16, 32)  # tiles that make every shape below multi-tile

# ------------------------------------------------------------------------------------ shapes
# (B, H, Hkv, Nq, Nk, D, Dv)
SHAPES = {
    "mha-97x97-d64": (1, 2, 2, 97, 97, 64, 64),
    "gqa-33x97-d40": (2, 8, 2, 33, 97, 40, 40),
    "mqa-97x33-d59-dv24": (1, 4, 1, 97, 33, 59, 24),
    "decode-1x97-d111": (1, 2, 2, 1, 97, 111, 111),
    "nk1-97x1-d128-mqa": (1, 2, 1, 97, 1, 128, 128),
    "tiny-1x1-d64-dv32": (2, 2, 2, 1, 1, 64, 32),
    "d128-20x45-dv64": (1, 3, 3, 20, 45, 128, 64),
}


def _degenerate(Nk, mask, q_offset):
    """Every row sees at most one key: softmax is constant, so the output's share of dq, dk is 0."""
    return Nk == 1


# With a single visible key, dS = P*(dP - Delta) with P = 1 and Delta = rowsum(dO*O) - dLSE:
# the output's share of dS is dP - rowsum(dO*O), exactly 0 in exact arithmetic, and the
# materialized reference gets its 0 by a different route (softmax backward), so the 3x
# rule would demand bit-exact cancellation from the fast path.  Allow, on top of the rule,
# the rounding of that cancellation: CANCEL_ULPS * eps * |dO_i|.|v_j| per score, propagated
# through dq = scale * dS k and dk = scale * dS^T q (a worst-case linear bound).
CANCEL_ULPS = 4.0


def _check_degenerate_grads(fast, ref, oracle, q, k, v, dtype, what):
    eps = torch.finfo(dtype).eps
    B, H, Nq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    G = H // Hkv
    w, _ = loss_weights(B, H, Nq, Dv)
    vr = v.double().abs().repeat_interleave(G, 1)
    A = CANCEL_ULPS * eps * torch.einsum("bhqd,bhkd->bhqk", w.abs(), vr) / math.sqrt(D)
    slack = {
        "dq": torch.einsum("bhqk,bhkd->bhqd", A, k.double().abs().repeat_interleave(G, 1)).max().item(),
        "dk": torch.einsum("bhqk,bhqd->bhkd", A, q.double().abs()).max().item() * G,
    }
    for key in ("dq", "dk"):
        e_fast, e_ref = max_err(fast[key], oracle[key]), max_err(ref[key], oracle[key])
        bound = 3 * e_ref + FLOOR[dtype] + slack[key]
        assert e_fast <= bound, f"{what} {key}: error {e_fast:.3e} > {bound:.3e} (3x ref {e_ref:.3e} + slack)"


def _sdpa_ok(mask, q_offset, Nq, Nk, mod=None, lse=False):
    if mod is not None or lse:
        return False
    if mask is None:
        return True
    qo = Nk - Nq if q_offset is None else q_offset
    return qo == 0 or (qo > 0 and Nq * Nk <= 1 << 20)  # bottom-right chunks: a dense bool mask


CORE_MASKS = ["none", "causal", "causal-q0"]


# "causal-q0" only where it differs from the default alignment (Nq != Nk)
SHAPE_MASKS = [
    (sh, m) for sh in SHAPES for m in CORE_MASKS if not (m == "causal-q0" and SHAPES[sh][3] == SHAPES[sh][4])
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("shape, maskname", SHAPE_MASKS, ids=str)
@pytest.mark.parametrize("backend", ["flash", "flash-tiles", "sdpa", "auto", "auto-lse", "auto-nograd"])
def test_dense_and_causal(dtype, shape, maskname, backend):
    B, H, Hkv, Nq, Nk, D, Dv = SHAPES[shape]
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, Dv, dtype=dtype, seed=zlib.crc32(shape.encode()) % 1000)
    mask = None if maskname == "none" else masks.causal()
    q_offset = 0 if maskname == "causal-q0" else None
    lse = backend in ("flash", "flash-tiles", "auto-lse")
    grad = backend != "auto-nograd"
    be = {"auto-lse": "auto", "auto-nograd": "auto"}.get(backend, backend)
    if be == "sdpa" and not _sdpa_ok(mask, q_offset, Nq, Nk):
        with pytest.raises(ValueError, match="sdpa"):
            attnlab.attention(q, k, v, mask=mask, q_offset=q_offset, backend="sdpa")
        return
    kw = dict(block=MT) if be == "flash-tiles" else {}
    degenerate = grad and _degenerate(Nk, mask, q_offset)
    fast, ref, oracle = compare_backend(
        q,
        k,
        v,
        backend=be,
        grad=grad,
        lse=lse,
        mask=mask,
        q_offset=q_offset,
        cache_key=(shape, dtype, maskname),
        skip=("dq", "dk") if degenerate else (),
        what=f"{backend}",
        **kw,
    )
    if degenerate:
        _check_degenerate_grads(fast, ref, oracle, q, k, v, dtype, backend)


def test_large_scores_are_stable_across_tiles():
    """Scores of size ~100 (no overflow thanks to the running max) across many tiles."""
    q, k, v = make_qkv(1, 2, 1, 45, 97, 64, dtype=F32, seed=3, qk_scale=4.0)
    for be, kw in (("flash-tiles", dict(block=MT)), ("flash", {}), ("auto", {})):
        compare_backend(q, k, v, backend=be, mask=masks.causal(), lse=be != "auto", what=be, **kw)


# ------------------------------------------------------------------------- the oracle itself
@pytest.mark.parametrize("maskname", ["none", "causal", "sliding", "document", "padding0", "not-causal"])
@pytest.mark.parametrize("mod", ["none", "relative_bias", "alibi"])
def test_reference_matches_independent_naive(maskname, mod):
    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 23, 37, 16
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, 12, dtype=F64, seed=7)
    ids = torch.tensor([0] * 10 + [1] * 20 + [2] * 7)
    mask = {
        "none": None,
        "causal": masks.causal(),
        "sliding": masks.sliding_window(5),
        "document": masks.document(ids),
        "padding0": masks.padding([20, 0]),
        "not-causal": ~masks.causal(),
    }[maskname]
    g = gen(11)
    table = randn((H, 7), F64, g)
    slopes = torch.rand(H, generator=g, dtype=F64)
    smod = {"none": None, "relative_bias": scores.relative_bias(table), "alibi": scores.alibi(slopes)}[mod]
    qo = Nk - Nq
    h = torch.arange(H).view(1, H, 1, 1)
    qp = (torch.arange(Nq) + qo).view(1, 1, Nq, 1)
    kp = torch.arange(Nk).view(1, 1, 1, Nk)
    bias = None
    if mod == "relative_bias":
        bias = table[h, (kp - qp).clamp(-3, 3) + 3]
    elif mod == "alibi":
        bias = slopes.view(1, H, 1, 1) * (kp - qp)
    allowed = dense_allowed(mask, B, H, Nq, Nk, qo)
    want_out, want_lse = naive_attention(q, k, v, allowed, bias=bias)
    out, lse = attnlab.attention(q, k, v, mask=mask, score_mod=smod, return_lse=True, backend="reference")
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)
    # and the flash backend in float64 agrees with the independent implementation too
    out, lse = flash_attention(q, k, v, mask=mask, score_mod=smod, scale=1 / math.sqrt(D), q_offset=qo, block=(8, 8))
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)


# The same-dtype reference must itself be accurate, or the 2x rule would mean nothing.
# Outputs here are O(1); these bounds are ~4 ulps of the dtype at unit scale (f32: 2^-23,
# bf16: 2^-8, f16: 2^-11) times a small growth factor for the D- and N-long sums.
REF_TOL = {F32: 1e-5, BF16: 6e-2, F16: 8e-3}


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=DTYPE_IDS.get)
def test_same_dtype_reference_error_is_small(dtype):
    q, k, v = make_qkv(2, 4, 2, 33, 97, 64, dtype=dtype, seed=5)
    o = run_case(q.double(), k.double(), v.double(), backend="reference", mask=masks.causal())
    r = run_case(q, k, v, backend="reference", mask=masks.causal())
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert max_err(r[key], o[key]) <= REF_TOL[dtype] * max(1.0, o[key].abs().max().item()), key


# ------------------------------------------------------------------------------------ masks
IDS = torch.tensor([0] * 30 + [1] * 40 + [2] * 27)
IDS_B = torch.stack([IDS, torch.tensor([0] * 10 + [1] * 80 + [2] * 7)])
KV_IDS = torch.tensor([0] * 50 + [1] * 20 + [2] * 27)
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 5, -1, 7, 8])


def _headmod(b, h, q, kv):
    return ((q + kv + h) % 3) != 0


def _mask(name):
    return {
        "causal": lambda: masks.causal(),
        "sliding_window": lambda: masks.sliding_window(13),
        "prefix_lm": lambda: masks.prefix_lm(20),
        "document": lambda: masks.document(IDS),
        "document-batched": lambda: masks.document(IDS_B),
        "document-kv-ids": lambda: masks.document(IDS, KV_IDS),
        "document&causal": lambda: masks.document(IDS) & masks.causal(),
        "padding": lambda: masks.padding([50, 97]),
        "padding-zero": lambda: masks.padding([50, 0]),
        "tree": lambda: masks.tree(PARENTS, prefix_len=87),
        "sink_window": lambda: masks.sink_window(4, 9),
        "custom": lambda: masks.custom(_headmod),
        "causal&~window": lambda: masks.causal() & ~masks.sliding_window(5),
        "window|prefix": lambda: masks.sliding_window(5) | masks.prefix_lm(3),
        "~causal": lambda: ~masks.causal(),
        "(sink|doc)&pad": lambda: (masks.sink_window(2, 6) | masks.document(IDS)) & masks.padding([97, 60]),
        "custom&causal": lambda: masks.custom(_headmod) & masks.causal(),
    }[name]()


MASKS = [
    "causal",
    "sliding_window",
    "prefix_lm",
    "document",
    "document-batched",
    "document-kv-ids",
    "document&causal",
    "padding",
    "padding-zero",
    "tree",
    "sink_window",
    "custom",
    "causal&~window",
    "window|prefix",
    "~causal",
    "(sink|doc)&pad",
    "custom&causal",
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("maskname", MASKS)
@pytest.mark.parametrize("backend", ["flash-bm", "flash-tiles", "flash", "auto"])
def test_masks(dtype, maskname, backend):
    B, H, Hkv, Nq, Nk, D, Dv = 2, 4, 2, 70, 97, 40, 24
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, Dv, dtype=dtype, seed=1)
    kw = dict(block=MT) if backend in ("flash-bm", "flash-tiles") else {}
    compare_backend(
        q,
        k,
        v,
        backend=backend,
        mask=_mask(maskname),
        cache_key=("mask", maskname, dtype),
        what=f"{maskname}/{backend}",
        **kw,
    )


@pytest.mark.parametrize("dtype", [F16, F64], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("maskname", ["document&causal", "padding-zero", "tree", "sink_window"])
def test_masks_other_dtypes(dtype, maskname):
    q, k, v = make_qkv(2, 4, 2, 70, 97, 40, 24, dtype=dtype, seed=2)
    for be in ("flash-bm", "flash"):
        kw = dict(block=MT) if be == "flash-bm" else {}
        compare_backend(
            q,
            k,
            v,
            backend=be,
            mask=_mask(maskname),
            cache_key=("mask2", maskname, dtype),
            what=f"{maskname}/{be}",
            **kw,
        )


@pytest.mark.parametrize("case", ["q0-kvoff", "q-after", "qlong", "kvoff-default"])
def test_offsets(case):
    """Explicit q_offset / kv_offset with Nq != Nk (both directions)."""
    (Nq, Nk, q_offset, kv_offset) = {
        "q0-kvoff": (40, 97, 0, 5),
        "q-after": (33, 60, 70, 3),
        "qlong": (97, 40, 0, 0),
        "kvoff-default": (40, 97, None, 17),
    }[case]
    q, k, v = make_qkv(2, 4, 2, Nq, Nk, 40, 24, dtype=F32, seed=4)
    for mname in ("causal", "sliding_window", "sink_window", "causal&~window"):
        for be in ("flash-bm", "flash", "auto"):
            kw = dict(block=MT) if be == "flash-bm" else {}
            compare_backend(
                q,
                k,
                v,
                backend=be,
                mask=_mask(mname),
                q_offset=q_offset,
                kv_offset=kv_offset,
                what=f"{case}/{mname}/{be}",
                cache_key=("off", case, mname),
                **kw,
            )


# ------------------------------------------------------------------------------- score mods
def _mod(name, H):
    """(factory(param) -> score_mod, initial param or None)."""
    g = gen(zlib.crc32(name.encode()) % 997)
    if name == "relative_bias":
        return (lambda p: scores.relative_bias(p)), randn((H, 9), F64, g, 0.5)
    if name == "alibi":
        return (lambda p: scores.alibi(p)), torch.rand(H, generator=g, dtype=F64) * 0.2
    if name == "alibi-symmetric":
        return (lambda p: scores.alibi(p, symmetric=True)), torch.rand(H, generator=g, dtype=F64) * 0.2
    if name == "custom":

        def make(p):
            return scores.custom(lambda s, b, h, q, kv: s * p[h] + 0.01 * (q - kv).to(s.dtype), [p])

        return make, torch.rand(H, generator=g, dtype=F64) + 0.5
    if name == "softcap":
        return (lambda p: scores.softcap(2.0)), None
    if name == "compose":
        return (lambda p: scores.compose(scores.relative_bias(p), scores.softcap(3.0))), randn((H, 5), F64, g)
    raise KeyError(name)


MODS = ["relative_bias", "alibi", "alibi-symmetric", "custom", "softcap", "compose"]


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("modname", MODS)
@pytest.mark.parametrize("maskname", ["none", "causal", "sliding_window"])
@pytest.mark.parametrize("backend", ["flash-tiles", "flash", "auto"])
def test_score_mods(dtype, modname, maskname, backend):
    B, H, Hkv, Nq, Nk, D, Dv = 2, 4, 2, 70, 97, 40, 24
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, Dv, dtype=dtype, seed=6)
    factory, param = _mod(modname, H)
    mask = None if maskname == "none" else _mask(maskname)
    kw = dict(block=MT) if backend == "flash-tiles" else {}
    fast, _, oracle = compare_backend(
        q,
        k,
        v,
        backend=backend,
        mask=mask,
        mod_factory=factory,
        param=param,
        cache_key=("mod", modname, maskname, dtype),
        what=f"{modname}/{backend}",
        **kw,
    )
    if param is not None:
        assert oracle["dparam"].abs().max() > 0, "the parameter gradient must not vanish in this problem"
        assert fast["dparam"].shape == param.shape


def test_score_mod_f16():
    q, k, v = make_qkv(1, 4, 2, 70, 97, 40, 24, dtype=F16, seed=8)
    factory, param = _mod("relative_bias", 4)
    for be, kw in (("flash-tiles", dict(block=MT)), ("flash", {})):
        compare_backend(
            q,
            k,
            v,
            backend=be,
            mask=masks.causal(),
            mod_factory=factory,
            param=param,
            cache_key=("f16mod",),
            what=be,
            **kw,
        )


# ------------------------------------------------------------------------------ length 1025
@pytest.mark.parametrize("case", ["causal-1025-f32", "decode-1x1025", "1025x97-q0", "causal-1025-bf16-gqa"])
def test_length_1025(case):
    B, H, Hkv, Nq, Nk, D, dtype, mask, qo = {
        "causal-1025-f32": (1, 1, 1, 1025, 1025, 64, F32, masks.causal(), None),
        "decode-1x1025": (1, 2, 2, 1, 1025, 128, F32, masks.sliding_window(300), None),
        "1025x97-q0": (1, 2, 1, 1025, 97, 40, F32, masks.causal(), 0),
        "causal-1025-bf16-gqa": (1, 2, 1, 1025, 1025, 64, BF16, masks.causal(), None),
    }[case]
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, dtype=dtype, seed=9)
    for be in ("flash", "auto"):
        compare_backend(
            q,
            k,
            v,
            backend=be,
            mask=mask,
            q_offset=qo,
            cache_key=("1025", case),
            lse=be == "flash",
            what=f"{case}/{be}",
        )


# ------------------------------------------------------------------------------ scale
@pytest.mark.parametrize("scale", [0.05, -0.3, 1.0])
@pytest.mark.parametrize("backend", ["flash", "flash-tiles", "sdpa", "auto"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_explicit_scale(scale, backend, dtype):
    """``scale=`` overrides 1/sqrt(D), including negative scales (the running max must
    still be the max of the *scaled* scores)."""
    q, k, v = make_qkv(1, 4, 2, 40, 97, 64, dtype=dtype, seed=15)
    kw = dict(block=MT) if backend == "flash-tiles" else {}
    for mask in (None, masks.causal()):
        if backend == "sdpa" and mask is not None:
            continue
        compare_backend(
            q,
            k,
            v,
            backend=backend,
            mask=mask,
            scale=scale,
            lse=backend in ("flash", "flash-tiles"),
            what=f"scale={scale}/{backend}/{mask}",
            **kw,
        )


# ------------------------------------------------------------- large-magnitude modded scores
def test_large_offset_score_mod_keeps_reference_accuracy():
    def mod(p):
        return scores.custom(lambda s, b, h, qp, kp: s - 1000.0)

    for seed in range(3):
        q, k, v = make_qkv(1, 2, 1, 64, 97, 32, dtype=F32, seed=seed)
        compare_backend(q, k, v, backend="flash", mask=masks.causal(), mod_factory=mod, what=f"seed {seed}")


# A peaky softmax (scale 3 with D = 64: scores up to ~70): the reference normalizes the
# materialized probabilities exactly; a backward that recomputes P = exp(S - LSE) must keep
# |S|-sized roundings out of the exponent to stay within 3x of it.
def _peaky(backend, seeds=range(5)):
    for seed in seeds:
        q, k, v = make_qkv(1, 4, 2, 40, 97, 64, dtype=F32, seed=seed)
        compare_backend(q, k, v, backend=backend, scale=3.0, lse=backend == "flash", what=f"seed {seed}")


def test_peaky_softmax_flash():
    _peaky("flash")


# Named exception: torch's own CPU SDPA backward (what backend='sdpa', and 'auto' for
# float32 requests that map onto it, run) is less accurate than the 3x rule on a peaky
# softmax: at scale=3 its dv error reaches ~4x the bound (dq/dk ~1.2x), measured.
# attnlab keeps SDPA there because it is the fastest (docs/benchmarks.md); this test
# pins how far torch's kernel is allowed to drift before we reconsider.
SDPA_PEAKY_GRAD_FACTOR = 15.0  # = 3x rule * ~5 (measured excess 4x, plus margin)


def test_peaky_softmax_sdpa():
    from tests.helpers import assert_close_rule
    from tests.ops.conftest import run_case

    for seed in range(5):
        q, k, v = make_qkv(1, 4, 2, 40, 97, 64, dtype=F32, seed=seed)
        fast = run_case(q, k, v, backend="sdpa", scale=3.0, lse=False)
        ref = run_case(q, k, v, backend="reference", scale=3.0, lse=False)
        oracle = run_case(q.double(), k.double(), v.double(), backend="reference", scale=3.0, lse=False)
        assert_close_rule(fast["out"], ref["out"], oracle["out"], F32, factor=2.0, what=f"seed {seed} out")
        for key in ("dq", "dk", "dv"):
            assert_close_rule(
                fast[key],
                ref[key],
                oracle[key],
                F32,
                factor=SDPA_PEAKY_GRAD_FACTOR,
                what=f"seed {seed} {key} (torch SDPA, named exception)",
            )
