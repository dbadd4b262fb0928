"""Parity with torch: ``scaled_dot_product_attention`` and FlexAttention (eager, CPU).

Alignment: attnlab's ``causal()`` is bottom-right by default (``q_offset = Nk - Nq``);
SDPA's ``is_causal`` is top-left, so with ``Nq != Nk`` they agree only when attnlab is
given ``q_offset=0``.  FlexAttention's ``mask_mod``/``score_mod`` see row/column
*indices*; the FlexAttention side below is written independently (not through attnlab's
predicates) and shifts indices by the offsets.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks, scores
from tests.ops.conftest import assert_close_rule, dense_allowed, gen, make_qkv, max_err, run_case

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
BACKENDS = ["reference", "flash", "auto"]
# float64 results of the same math in different summation orders: a few hundred ulps at
# unit scale.  float32: the two libraries' own roundings, measured ~1e-6 at these shapes.
TOL = {F64: dict(atol=1e-12, rtol=1e-10), F32: dict(atol=2e-5, rtol=1e-4)}


def _grads(fn, q, k, v, seed=0):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    w = torch.randn(out.shape, generator=gen(seed), dtype=F64).to(out.dtype)
    dq, dk, dv = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out.detach(), dq, dk, dv


def _assert_same(got, want, dtype, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, name=name: f"{what} {name}: {m}")


# ------------------------------------------------------------------------------------ SDPA
@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 4, 33, 33, 40), (1, 8, 2, 97, 97, 64), (2, 4, 1, 1, 50, 59), (1, 2, 2, 50, 20, 111)],
    ids=["mha", "gqa", "mqa-decode", "nq>nk"],
)
def test_sdpa_no_mask(dtype, backend, shape):
    B, H, Hkv, Nq, Nk, D = shape
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, dtype=dtype, seed=1)
    want = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv), q, k, v)
    got = _grads(lambda q, k, v: attnlab.attention(q, k, v, backend=backend), q, k, v)
    _assert_same(got, want, dtype, f"{backend} vs SDPA")


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", [*BACKENDS, "sdpa"])
@pytest.mark.parametrize("nq_nk", [(45, 45), (20, 45), (45, 20)], ids=["square", "nq<nk", "nq>nk"])
def test_sdpa_is_causal(dtype, backend, nq_nk):
    """attnlab causal() with q_offset=0 == SDPA is_causal (top-left), for every Nq/Nk."""
    Nq, Nk = nq_nk
    q, k, v = make_qkv(2, 8, 2, Nq, Nk, 64, dtype=dtype, seed=2)
    want = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), q, k, v)
    got = _grads(lambda q, k, v: attnlab.attention(q, k, v, mask=masks.causal(), q_offset=0, backend=backend), q, k, v)
    _assert_same(got, want, dtype, f"{backend} causal(q_offset=0) vs SDPA is_causal")
    if Nq == Nk:  # the default offset is then 0 as well
        got = _grads(lambda q, k, v: attnlab.attention(q, k, v, mask=masks.causal(), backend=backend), q, k, v)
        _assert_same(got, want, dtype, f"{backend} default causal vs SDPA is_causal")


@pytest.mark.parametrize("nq_nk", [(20, 45), (45, 20)], ids=["nq<nk", "nq>nk"])
def test_default_causal_is_bottom_right_not_sdpa_top_left(nq_nk):
    Nq, Nk = nq_nk
    q, k, v = make_qkv(1, 2, 2, Nq, Nk, 16, dtype=F64, seed=3)
    ours = attnlab.attention(q, k, v, mask=masks.causal(), backend="flash")
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert max_err(ours, top_left) > 1e-3, "bottom-right and top-left causal must differ when Nq != Nk"
    # bottom-right == SDPA with an explicit tril mask shifted by Nk - Nq
    allowed = torch.ones(Nq, Nk, dtype=torch.bool).tril(diagonal=Nk - Nq)
    rows = allowed.any(-1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(ours[..., rows, :], want[..., rows, :], **TOL[F64])
    assert (ours[..., ~rows, :] == 0).all()
    # the sdpa backend runs it with an explicit mask where every row sees a key, and refuses
    # (rather than silently using top-left alignment) where a row would see none
    if Nk >= Nq:
        torch.testing.assert_close(attnlab.attention(q, k, v, mask=masks.causal(), backend="sdpa"), ours, **TOL[F64])
    else:
        with pytest.raises(ValueError, match="first rows see no key"):
            attnlab.attention(q, k, v, mask=masks.causal(), backend="sdpa")


IDS = torch.tensor([0] * 30 + [1] * 40 + [2] * 27)


def _attnlab_mask(name):
    return {
        "sliding_window": masks.sliding_window(11),
        "document": masks.document(IDS),
        "document&causal": masks.document(IDS) & masks.causal(),
        "prefix_lm": masks.prefix_lm(17),
        "sink_window": masks.sink_window(3, 8),
        "padding": masks.padding([97, 61]),
        "custom": masks.custom(lambda b, h, q, kv: ((q - kv) % 4 != 1) & (kv <= q + b)),
    }[name]


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", ["reference", "flash", "flash-bm", "auto"])
@pytest.mark.parametrize(
    "maskname", ["sliding_window", "document", "document&causal", "prefix_lm", "sink_window", "padding", "custom"]
)
@pytest.mark.parametrize("nq", [97, 40])
def test_sdpa_bool_mask_from_predicate(dtype, backend, maskname, nq):
    """SDPA with attn_mask = attnlab's predicate on the (B, H, Nq, Nk) grid, GQA via enable_gqa."""
    B, H, Hkv, Nk, D = 2, 8, 2, 97, 40
    q, k, v = make_qkv(B, H, Hkv, nq, Nk, D, dtype=dtype, seed=4)
    mask = _attnlab_mask(maskname)
    allowed = dense_allowed(mask, B, H, nq, Nk, Nk - nq)
    want = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True), q, k, v)
    if backend == "flash-bm":
        bm = mask.block_mask(B, H, nq, Nk, block=(16, 32))
        fn = lambda q, k, v: attnlab.attention(q, k, v, mask=bm, backend="flash")  # noqa: E731
    else:
        fn = lambda q, k, v: attnlab.attention(q, k, v, mask=mask, backend=backend)  # noqa: E731
    got = _grads(fn, q, k, v)
    empty = ~allowed.any(-1)
    assert (got[0][empty] == 0).all() and (want[0][empty] == 0).all()
    _assert_same(got, want, dtype, f"{maskname}/{backend} vs SDPA attn_mask")


@pytest.mark.parametrize("backend", ["flash", "auto"])
def test_sdpa_bfloat16_under_the_rule(backend):
    """bfloat16: attnlab and SDPA both measured against the float64 oracle (DESIGN rule)."""
    q, k, v = make_qkv(1, 8, 2, 64, 64, 64, dtype=BF16, seed=5)
    oracle = run_case(q.double(), k.double(), v.double(), backend="reference", lse=False, mask=masks.causal())
    ref = run_case(q, k, v, backend="reference", lse=False, mask=masks.causal())
    got = run_case(q, k, v, backend=backend, lse=False, mask=masks.causal())
    sd = _grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), q, k, v, seed=1
    )
    for key, _i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        factor = 2.0 if key == "out" else 3.0
        assert_close_rule(got[key], ref[key], oracle[key], BF16, factor=factor, what=f"attnlab {key}")
    assert_close_rule(sd[0], ref["out"], oracle["out"], BF16, factor=2.0, what="torch SDPA out")


# ------------------------------------------------------------------------------ FlexAttention
def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001  # pragma: no cover - depends on the torch build
        pytest.skip(f"FlexAttention is not importable in this torch build: {e!r}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch.randn(1, 1, 8, 4)
            bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 8, 8, device="cpu")
            flex_attention(q, q, q, block_mask=bm)
    except Exception as e:  # noqa: BLE001  # pragma: no cover - depends on the torch build
        pytest.skip(f"FlexAttention eager does not run on CPU here: {e!r}")
    return flex_attention, create_block_mask


def _run_flex(q, k, v, mask_mod, score_mod, B, H):
    flex_attention, create_block_mask = _flex()
    Nq, Nk = q.shape[2], k.shape[2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        bm = None if mask_mod is None else create_block_mask(mask_mod, B, H, Nq, Nk, device="cpu")
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            out, aux = flex_attention(
                q,
                k,
                v,
                block_mask=bm,
                score_mod=score_mod,
                enable_gqa=q.shape[1] != k.shape[1],
                return_aux=AuxRequest(lse=True),
            )
            lse = aux.lse
        except ImportError:  # older API
            out, lse = flex_attention(
                q, k, v, block_mask=bm, score_mod=score_mod, enable_gqa=q.shape[1] != k.shape[1], return_lse=True
            )
    return out, lse


def _flex_case(name, Nq, Nk, qo, ko):
    """(attnlab mask, flex mask_mod on indices) -- written independently of attnlab."""
    ids = IDS
    if name == "none":
        return None, None
    if name == "causal":
        return masks.causal(), lambda b, h, qi, ki: ki + ko <= qi + qo
    if name == "sliding_window":
        return masks.sliding_window(11), lambda b, h, qi, ki: (ki + ko <= qi + qo) & (qi + qo - (ki + ko) < 11)
    if name == "document&causal":
        return (
            masks.document(ids) & masks.causal(),
            lambda b, h, qi, ki: (ids[qi + qo] == ids[ki + ko]) & (ki + ko <= qi + qo),
        )
    if name == "padding":
        lengths = torch.tensor([97, 0])
        return masks.padding(lengths), lambda b, h, qi, ki: ki + ko < lengths[b]
    raise KeyError(name)


def _flex_mod(name, H):
    slopes = torch.linspace(0.05, 0.4, H, dtype=F64)
    table = torch.randn(H, 9, generator=gen(8), dtype=F64)
    if name == "none":
        return None, None
    if name == "alibi":
        return scores.alibi(slopes), lambda s, b, h, qi, ki, qo, ko: s + slopes[h] * ((ki + ko) - (qi + qo))
    if name == "relative_bias":
        return (
            scores.relative_bias(table),
            lambda s, b, h, qi, ki, qo, ko: s + table[h, ((ki + ko) - (qi + qo)).clamp(-4, 4) + 4],
        )
    if name == "softcap":
        return scores.softcap(1.5), lambda s, b, h, qi, ki, qo, ko: 1.5 * torch.tanh(s / 1.5)
    raise KeyError(name)


FLEX_CASES = [
    ("square-mha", m, s)
    for m in ("none", "causal", "sliding_window", "document&causal", "padding")
    for s in ("none", "alibi", "relative_bias", "softcap")
] + [("nq<nk-gqa", m, s) for m in ("causal", "document&causal", "padding") for s in ("none", "alibi")]


@pytest.mark.parametrize("dims,maskname,modname", FLEX_CASES, ids=["-".join(c) for c in FLEX_CASES])
def test_flex_attention_eager(dims, maskname, modname):
    Nq, Nk, H, Hkv = {"square-mha": (97, 97, 4, 4), "nq<nk-gqa": (40, 97, 4, 2)}[dims]
    B, D = 2, 32
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, dtype=F64, seed=9)
    qo, ko = Nk - Nq, 0
    mask, mask_mod = _flex_case(maskname, Nq, Nk, qo, ko)
    mod, fmod = _flex_mod(modname, H)
    score_mod = None if fmod is None else (lambda s, b, h, qi, ki: fmod(s, b, h, qi, ki, qo, ko))
    want_out, want_lse = _run_flex(q, k, v, mask_mod, score_mod, B, H)
    for backend in ("reference", "flash"):
        out, lse = attnlab.attention(q, k, v, mask=mask, score_mod=mod, return_lse=True, backend=backend)
        torch.testing.assert_close(out, want_out.to(out.dtype), **TOL[F64])
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse.to(lse.dtype)))
        torch.testing.assert_close(lse, want_lse.to(lse.dtype), **TOL[F64])


def test_flex_attention_backward_on_cpu():
    """FlexAttention has no CPU backward in this torch; gradients are covered against SDPA
    and the float64 oracle instead.  Skips with the reason if so; compares if it works."""
    flex_attention, _create_block_mask = _flex()
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, dtype=F64, seed=10)
    q.requires_grad_(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q, k, v)
    except NotImplementedError as e:
        pytest.skip(f"FlexAttention backward is unavailable on CPU: {e}")
    (dq,) = torch.autograd.grad(out.sum(), q)
    q2 = q.detach().clone().requires_grad_(True)
    (dq2,) = torch.autograd.grad(attnlab.attention(q2, k, v, backend="flash").sum(), q2)
    torch.testing.assert_close(dq2, dq, **TOL[F64])
