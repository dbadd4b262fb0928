"""The edges of every backend of ``attnlab.attention`` (split from test_accuracy.py, the same
float64-oracle rule): fully masked rows (output 0, LSE -inf, zero gradients, never NaN), empty
sequences, non-contiguous inputs, gradcheck of the flash kernel and ``merge_states``, and
masking that is no finite sentinel.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.ops import flash_attention, merge_states
from tests.ops.conftest import (
    DTYPE_IDS,
    call,
    compare_backend,
    dense_allowed,
    gen,
    loss_weights,
    make_qkv,
    max_err,
    randn,
    run_case,
)

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
MT = (16, 32)  # tiles that make every shape below multi-tile


# ------------------------------------------------------------------------ fully masked rows
ALL_BACKENDS = ["reference", "flash", "flash-tiles", "flash-bm", "auto"]


def _masked_case(name):
    """(shape, mask, q_offset or (q_offset, kv_offset), rows: bool (B, H, Nq) that must be fully masked)."""
    if name == "padding-zero":
        B, H, Nq, Nk = 2, 2, 40, 50
        mask = masks.padding([30, 0])
        rows = torch.zeros(B, H, Nq, dtype=torch.bool)
        rows[1] = True
        return (B, H, 1, Nq, Nk), mask, None, rows
    if name == "causal-nq>nk":  # bottom-right: the first Nq - Nk queries precede every key
        B, H, Nq, Nk = 1, 2, 50, 20
        rows = torch.zeros(B, H, Nq, dtype=torch.bool)
        rows[..., :30] = True
        return (B, H, 2, Nq, Nk), masks.causal(), None, rows
    if name == "~causal":  # the last query (position Nk-1) sees no later key
        B, H, Nq, Nk = 1, 2, 37, 37
        rows = torch.zeros(B, H, Nq, dtype=torch.bool)
        rows[..., -1] = True
        return (B, H, 1, Nq, Nk), ~masks.causal(), None, rows
    if name == "window-kvoff":  # keys start at position 40: queries 0..39 see nothing
        B, H, Nq, Nk = 1, 2, 60, 45
        rows = torch.zeros(B, H, Nq, dtype=torch.bool)
        rows[..., :40] = True
        return (B, H, 1, Nq, Nk), masks.sliding_window(8) & masks.causal(), (0, 40), rows
    if name == "custom-head":  # head 1 masks its even rows completely
        B, H, Nq, Nk = 1, 2, 33, 41
        fn = masks.custom(lambda b, h, q, kv: ~((h == 1) & (q % 2 == 0)) & (kv >= 0))
        rows = torch.zeros(B, H, Nq, dtype=torch.bool)
        rows[:, 1, (torch.arange(Nq) + Nk - Nq) % 2 == 0] = True
        return (B, H, 1, Nq, Nk), fn, None, rows
    raise KeyError(name)


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", ["padding-zero", "causal-nq>nk", "~causal", "window-kvoff", "custom-head"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("raw_lse", [False, True], ids=["lse-finite-loss", "raw-lse-loss"])
def test_fully_masked_rows(dtype, name, backend, raw_lse):
    (B, H, Hkv, Nq, Nk), mask, qo, rows = _masked_case(name)
    qo, ko = qo if isinstance(qo, tuple) else (qo, 0)
    D = 24
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, dtype=dtype, seed=12)
    w, c = loss_weights(B, H, Nq, D)
    c = c.abs() + 0.1  # raw -inf LSE in the loss: keep it -inf (not nan) with positive weights
    lse = backend != "auto" or not raw_lse
    kw = dict(block=MT) if backend in ("flash-tiles", "flash-bm") else {}
    res = run_case(
        q, k, v, backend=backend, lse=lse, mask=mask, q_offset=qo, kv_offset=ko, w=w, c=c, raw_lse_loss=raw_lse, **kw
    )
    for key in ("out", "dq", "dk", "dv"):
        assert not torch.isnan(res[key]).any(), f"NaN in {key}"
        assert torch.isfinite(res[key]).all(), f"non-finite {key}"
    assert (res["out"][rows] == 0).all(), "fully masked rows must give exactly 0"
    assert (res["dq"][rows] == 0).all(), "fully masked rows must get exactly 0 gradient"
    if res["lse"] is not None:
        assert torch.isneginf(res["lse"][rows]).all(), "fully masked rows must have LSE exactly -inf"
        assert torch.isfinite(res["lse"][~rows]).all()
    assert (res["out"][~rows] != 0).any(dim=-1).all(), "visible rows must not be zeroed"
    # keys no query may see get exactly zero gradient
    allowed = dense_allowed(mask, B, H, Nq, Nk, ko + Nk - Nq if qo is None else qo, ko)
    G = H // Hkv
    unseen = ~allowed.view(B, Hkv, G, Nq, Nk).any(2).any(2)  # (B, Hkv, Nk)
    assert (res["dk"][unseen] == 0).all() and (res["dv"][unseen] == 0).all()
    # and the rest matches the oracle under the rule
    if not raw_lse and backend != "reference":
        compare_backend(
            q,
            k,
            v,
            backend=backend,
            lse=lse,
            mask=mask,
            q_offset=qo,
            kv_offset=ko,
            w=w,
            c=c,
            cache_key=("masked", name, dtype),
            what=f"{name}/{backend}",
            **kw,
        )


@pytest.mark.parametrize("backend", ["reference", "flash", "auto", "sdpa"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["nk0", "nq0", "both0"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "causal"])
def test_empty_sequences(backend, dtype, case, masked):
    Nq, Nk = {"nk0": (5, 0), "nq0": (0, 7), "both0": (0, 0)}[case]
    B, H, Hkv, D, Dv = 2, 4, 2, 16, 8
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, Dv, dtype=dtype)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mask = masks.causal() if masked else None
    want_lse = backend != "sdpa"
    res = attnlab.attention(
        q, k, v, mask=mask, q_offset=0 if backend == "sdpa" else None, return_lse=want_lse, backend=backend
    )
    out, lse = res if want_lse else (res, None)
    assert out.shape == (B, H, Nq, Dv) and out.dtype == dtype
    assert (out == 0).all()
    if lse is not None:
        assert lse.shape == (B, H, Nq)
        assert lse.dtype == (F64 if dtype == F64 else F32)
        assert torch.isneginf(lse).all()
    loss = out.double().sum() + (0 if lse is None else torch.where(torch.isinf(lse), 0, lse).sum())
    loss = loss + q.sum() * 0  # keep q in the graph when out is empty
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v), allow_unused=True)
    for g_, t in ((dq, q), (dk, k), (dv, v)):
        if g_ is not None:
            assert g_.shape == t.shape
            assert (g_ == 0).all() and not torch.isnan(g_).any()


# -------------------------------------------------------------------------- non-contiguous
def _noncontig(q, k, v, how):
    if how == "bnhd":  # built in (B, N, H, D) layout, transposed to (B, H, N, D)
        return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if how == "sliced":  # a view into larger buffers (strided in every dim)

        def big(t):
            B, H, N, D = t.shape
            buf = torch.zeros(B + 1, H * 2, N + 3, D + 5, dtype=t.dtype)
            view = buf[1:, ::2, 2 : N + 2, 3 : D + 3]
            view.copy_(t)
            return view

        return tuple(big(t) for t in (q, k, v))
    if how == "expanded-kv":  # k/v heads broadcast with stride 0 (MQA style)
        return q, k[:, :1].expand_as(k), v[:, :1].expand_as(v)
    raise KeyError(how)


@pytest.mark.parametrize("how", ["bnhd", "sliced", "expanded-kv"])
@pytest.mark.parametrize("backend", ["reference", "flash", "flash-tiles", "sdpa", "auto"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_noncontiguous_inputs(how, backend, dtype):
    q, k, v = make_qkv(2, 4, 2, 33, 45, 40, 24, dtype=dtype, seed=13)
    qn, kn, vn = _noncontig(q, k, v, how)
    assert not (qn.is_contiguous() and kn.is_contiguous() and vn.is_contiguous())
    qc, kc, vc = (t.contiguous() for t in (qn, kn, vn))
    mask = None if backend == "sdpa" else masks.sliding_window(11)
    kw = dict(mask=mask, lse=backend not in ("sdpa", "auto"))
    if backend == "flash-tiles":
        kw["block"] = MT
    a = run_case(qn, kn, vn, backend=backend, **kw)
    b = run_case(qc, kc, vc, backend=backend, **kw)
    for key in ("out", "lse", "dq", "dk", "dv"):
        if a.get(key) is None:
            continue
        # same math on the same values; only the matmul kernels' blocking may differ
        tol = 0.0 if dtype == F64 else 4 * torch.finfo(dtype).eps * max(1.0, b[key].abs().max().item())
        assert max_err(a[key], b[key]) <= tol, f"{key}: non-contiguous differs from contiguous"
    if backend != "reference":
        compare_backend(qn, kn, vn, backend=backend, what=f"{how}/{backend}", **kw)


# ------------------------------------------------------------------------------- gradcheck
def test_gradcheck_flash_mask_and_learnable_mod():
    g = gen(21)
    B, H, Hkv, Nq, Nk, D, Dv = 1, 2, 1, 11, 13, 5, 3
    q = randn((B, H, Nq, D), F64, g).requires_grad_(True)
    k = randn((B, Hkv, Nk, D), F64, g).requires_grad_(True)
    v = randn((B, Hkv, Nk, Dv), F64, g).requires_grad_(True)
    table = randn((H, 5), F64, g, 0.3).requires_grad_(True)
    gain = (torch.rand(H, generator=g, dtype=F64) + 0.5).requires_grad_(True)
    mask = masks.sliding_window(6) | masks.prefix_lm(2)

    def f(q, k, v, table, gain):
        mod = scores.compose(scores.relative_bias(table), scores.custom(lambda s, b, h, qp, kp: s * gain[h], [gain]))
        out, lse = flash_attention(q, k, v, mask=mask, score_mod=mod, scale=0.7, q_offset=Nk - Nq, block=(4, 3))
        return out, lse

    _out, lse = f(q, k, v, table, gain)
    assert torch.isfinite(lse).all(), "this problem must have no fully masked row (gradcheck needs finite lse)"
    assert torch.autograd.gradcheck(f, (q, k, v, table, gain), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_flash_with_empty_rows_masked_out():
    """Rows that are fully masked: gradcheck the finite part (out, and lse where finite)."""
    g = gen(22)
    q = randn((1, 2, 9, 4), F64, g).requires_grad_(True)
    k = randn((1, 2, 6, 4), F64, g).requires_grad_(True)
    v = randn((1, 2, 6, 4), F64, g).requires_grad_(True)
    mask = masks.causal()  # bottom-right with Nq > Nk: first 3 rows are empty

    def f(q, k, v):
        out, lse = flash_attention(q, k, v, mask=mask, scale=0.5, q_offset=-3, block=(2, 4))
        return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_merge_states():
    g = gen(23)
    outs = [randn((2, 3, 4), F64, g).requires_grad_(True) for _ in range(3)]
    lses = [randn((2, 3), F64, g).requires_grad_(True) for _ in range(3)]
    assert torch.autograd.gradcheck(lambda *t: merge_states(list(t[:3]), list(t[3:])), (*outs, *lses))


# -------------------------------------------------------------------------- finite sentinels
@pytest.mark.parametrize("backend", ["reference", "flash", "flash-tiles"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=DTYPE_IDS.get)
def test_masking_is_not_a_finite_sentinel(backend, dtype):
    """With every allowed score at -1e30, a finite sentinel (-1e9, finfo.min/2) would win;
    -inf masking gives the plain average of the visible values."""
    B, H, Nq, Nk, D = 1, 2, 20, 20, 8
    q, k, v = make_qkv(B, H, H, Nq, Nk, D, dtype=dtype, seed=14)
    mod = scores.custom(lambda s, b, h, qp, kp: torch.full_like(s, -1e30))
    out, lse = call(q, k, v, backend=backend, mask=masks.causal(), score_mod=mod, block=(4, 8))
    want = v.double().cumsum(2) / torch.arange(1, Nk + 1, dtype=F64).view(1, 1, -1, 1)
    torch.testing.assert_close(out.double(), want, atol=1e-5 if dtype == F32 else 1e-12, rtol=0)
    want_lse = -1e30 + torch.log(torch.arange(1, Nk + 1, dtype=F64))
    torch.testing.assert_close(
        lse.double().expand(B, H, Nq), want_lse.expand(B, H, Nq), atol=0, rtol=4 * torch.finfo(lse.dtype).eps
    )
