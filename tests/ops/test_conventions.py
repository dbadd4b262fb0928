"""Peer calling conventions mapped onto attention() (ops/conventions.py, issue 15):
layout='bnhd', tensor masks (bool / additive / learnable), Bkv = 1, tensor scale,
per-batch q_offset, (B, H) ALiBi slopes, and the layout hint in GQA errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import attnlab
from attnlab import masks, scores
from attnlab.ops import dispatch
from tests.helpers import FLOOR, assert_close_rule, assert_tiles_sound, mask_dense, max_err

F64 = torch.float64


def _qkv(B=2, H=4, Hkv=2, Nq=9, Nk=13, D=8, Dv=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, Nq, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype),
        torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=dtype),
    )


def _sdpa(q, k, v, **kw):
    G = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), **kw)


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize("backend", ["flash", "reference", "auto"])
def test_bnhd_layout_matches_bhnd(backend):
    q, k, v = _qkv(Dv=6)
    m = masks.causal()
    out, lse = attnlab.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=m, return_lse=True, layout="bnhd", backend=backend
    )
    ref, rlse = attnlab.attention(q, k, v, mask=m, return_lse=True, backend="reference")
    assert out.shape == (2, 9, 4, 6) and lse.shape == (2, 4, 9)
    assert max_err(out, ref.transpose(1, 2)) <= FLOOR[F64] and max_err(lse, rlse) <= FLOOR[F64]


def test_bnhd_gradients_match():
    q, k, v = (t.requires_grad_() for t in _qkv())
    qb, kb, vb = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    attnlab.attention(q, k, v, mask=masks.causal(), backend="flash").pow(2).sum().backward()
    attnlab.attention(qb, kb, vb, mask=masks.causal(), backend="flash", layout="bnhd").pow(2).sum().backward()
    for a, b in ((q, qb), (k, kb), (v, vb)):
        assert max_err(b.grad.transpose(1, 2), a.grad) <= 1e-12


def test_bnhd_reaches_the_kernel_as_views(monkeypatch):
    """No .contiguous() copy at the entry: the flash kernel gets views of the caller's storage."""
    seen = {}
    real = dispatch.flash_op  # the flash kernel's entry (the attnlab::flash_* custom ops)

    def spy(q, k, v, *a, **kw):
        seen["ptrs"] = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        seen["contig"] = q.is_contiguous()
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(dispatch, "flash_op", spy)
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv(B=1))
    attnlab.attention(q, k, v, layout="bnhd", backend="flash")
    assert seen["ptrs"] == (q.data_ptr(), k.data_ptr(), v.data_ptr()) and not seen["contig"]


def _allocated(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn()
    return sum(e.cpu_memory_usage for e in p.events() if e.cpu_memory_usage > 0)


def test_bnhd_allocates_no_more_than_bhnd_when_strides_allow():
    """B = 1 (and so varlen): the flash kernel reads the (B, N, H, D) strides directly —
    its tracked allocations equal those of the same call in (B, H, N, D)."""
    q, k, v = _qkv(B=1, Nq=200, Nk=200, D=16, dtype=torch.float32)
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with torch.no_grad():
        calls = (
            lambda: attnlab.attention(qb, kb, vb, mask=masks.causal(), layout="bnhd", backend="flash"),
            lambda: attnlab.attention(q, k, v, mask=masks.causal(), backend="flash"),
        )
        for c in calls:  # warm: the mask's tile classification is cached by structure after one call
            c()
        a, b = (_allocated(c) for c in calls)
    assert a == b, f"bnhd allocated {a} bytes, bhnd {b}"


def test_layout_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"layout: expected 'bhnd'.*'bnhd'.*got 'nhd'"):
        attnlab.attention(q, k, v, layout="nhd")
    with pytest.raises(ValueError, match=r"q: layout='bnhd' expects 4 dims \(B, N, H, D\)"):
        attnlab.attention(q[0], k, v, layout="bnhd")


def test_bnhd_tensor_without_layout_names_the_layout():
    """(B, N, H, D) tensors read as (B, H, N, D) give inconsistent heads: the error says so."""
    q = torch.randn(1, 5, 4, 8)  # (B, N=5, H=4, D)
    k = torch.randn(1, 7, 2, 8)  # (B, N=7, Hkv=2, D)
    with pytest.raises(ValueError, match=r"\(B, H, N, D\).*layout='bnhd'"):
        attnlab.attention(q, k, k)


# ----------------------------------------------------------------------------- tensor masks
@pytest.mark.parametrize("shape", [(9, 13), (2, 1, 9, 13), (1, 4, 1, 13), (2, 4, 9, 13)])
@pytest.mark.parametrize("backend", ["flash", "reference", "auto"])
def test_bool_tensor_mask_matches_sdpa(shape, backend):
    q, k, v = _qkv()
    t = torch.rand(shape, generator=torch.Generator().manual_seed(1)) > 0.4
    t[..., 0] = True  # SDPA gives NaN on fully masked rows; attnlab 0 (tested below)
    out = attnlab.attention(q, k, v, mask=t, backend=backend)
    assert max_err(out, _sdpa(q, k, v, attn_mask=t)) <= 1e-12


def test_bool_tensor_mask_fully_masked_rows_are_zero():
    q, k, v = (x.requires_grad_() for x in _qkv())
    t = torch.ones(9, 13, dtype=torch.bool)
    t[3] = False
    out, lse = attnlab.attention(q, k, v, mask=t, return_lse=True, backend="flash")
    assert (out[:, :, 3] == 0).all() and torch.isneginf(lse[:, :, 3]).all()
    out.sum().backward()
    assert (q.grad[:, :, 3] == 0).all() and all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_dense_mask_tiles_are_classified_and_empty_ones_skipped():
    t = torch.zeros(64, 64, dtype=torch.bool)
    t[:32, :32] = t[32:, 32:] = True  # two blocks on the diagonal
    t[40, 5] = True  # one stray pair: a partial tile
    m = masks.dense(t, q_offset=0)
    bm = m.block_mask(1, 1, 64, 64, q_offset=0, block=(16, 16))
    assert_tiles_sound(bm.states.expand(1, 1, -1, -1), mask_dense(m, 1, 1, 64, 64, 0, 0), 16, 16, "dense", exact=True)
    assert bm.density() == 9 / 16


def test_additive_float_mask_matches_sdpa_and_minus_inf_hides():
    q, k, v = _qkv()
    bias = torch.randn(1, 4, 9, 13, dtype=F64)
    bias[..., 5:8] = float("-inf")
    out = attnlab.attention(q, k, v, mask=bias, backend="flash")
    assert max_err(out, _sdpa(q, k, v, attn_mask=bias)) <= 1e-12


@pytest.mark.parametrize("shape", [(9, 13), (2, 4, 9, 13), (1, 4, 1, 13)])
def test_learnable_additive_bias_gets_its_gradient(shape):
    """FlexAttention's learnable-bias tests (test_flex_attention.py::test_learnable_bias*): the
    gradient of a bias read by the flash backward equals autograd through the materialized oracle."""
    q, k, v = _qkv(dtype=torch.float32)
    bias = torch.randn(shape, requires_grad=True)
    out = attnlab.attention(q, k, v, mask=bias, backend="flash")
    (g,) = torch.autograd.grad(out.pow(2).sum(), bias)
    b64 = bias.detach().double().requires_grad_()
    ref = _sdpa(q.double(), k.double(), v.double(), attn_mask=b64)
    (g64,) = torch.autograd.grad(ref.pow(2).sum(), b64)
    b32 = bias.detach().requires_grad_()
    (g32,) = torch.autograd.grad(attnlab.attention(q, k, v, mask=b32, backend="reference").pow(2).sum(), b32)
    assert g.shape == bias.shape
    assert_close_rule(g, g32, g64, torch.float32, factor=3.0, what="d bias")


def test_tensor_mask_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask: shape \(9, 12\) does not broadcast"):
        attnlab.attention(q, k, v, mask=torch.ones(9, 12, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask: a tensor mask must be bool"):
        attnlab.attention(q, k, v, mask=torch.ones(9, 13, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scores.bias\(t\): holds NaN"):
        attnlab.attention(q, k, v, mask=torch.full((9, 13), float("nan"), dtype=F64))


# ----------------------------------------------------------------------------- Bkv = 1, scale, q_offset
@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_kv_batch_broadcast_without_copies(backend, monkeypatch):
    q, k, v = _qkv(B=3)
    k1, v1 = k[:1], v[:1]
    out = attnlab.attention(q, k1, v1, mask=masks.causal(), backend=backend)
    ref = attnlab.attention(
        q, k1.expand_as(k).contiguous(), v1.expand_as(v).contiguous(), mask=masks.causal(), backend="reference"
    )
    assert max_err(out, ref) <= 1e-12
    seen = {}
    real = dispatch.flash_op  # the flash kernel's entry (the attnlab::flash_* custom ops)
    monkeypatch.setattr(
        dispatch,
        "flash_op",
        lambda q, k, v, *a, **kw: seen.setdefault("k", (k.data_ptr(), k.stride(0))) and real(q, k, v, *a, **kw),
    )
    attnlab.attention(q, k1, v1, backend="flash")
    assert seen["k"] == (k1.data_ptr(), 0)  # a stride-0 view of the caller's K


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_tensor_scale_is_learnable(backend):
    q, k, v = _qkv()
    s = torch.tensor(0.7, dtype=F64, requires_grad=True)
    out = attnlab.attention(q, k, v, scale=s, mask=masks.causal(), backend=backend)
    assert max_err(out, attnlab.attention(q, k, v, scale=0.7, mask=masks.causal(), backend="reference")) <= 1e-12
    (g,) = torch.autograd.grad(out.pow(2).sum(), s)
    eps = 1e-6
    fd = [
        attnlab.attention(q, k, v, scale=0.7 + d, mask=masks.causal(), backend="reference").pow(2).sum()
        for d in (eps, -eps)
    ]
    assert abs(float(g) - float(fd[0] - fd[1]) / (2 * eps)) < 1e-6


def test_tensor_scale_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale: a tensor scale must be one float value"):
        attnlab.attention(q, k, v, scale=torch.tensor([0.1, 0.2]))


@pytest.mark.parametrize(
    "mask", [masks.causal(), masks.causal() & masks.padding([11, 13, 6]), masks.sliding_window(4), None]
)
def test_per_batch_q_offsets_ragged_decode(mask):
    """Each sequence's new token at its own position: equal to one call per batch element."""
    q, k, v = _qkv(B=3, Nq=1)
    qo = torch.tensor([10, 12, 5])
    mod = scores.alibi(torch.tensor([0.5, 0.25, 0.1, 0.05], dtype=F64))
    out = attnlab.attention(q, k, v, mask=mask, score_mod=mod, q_offset=qo, backend="flash")
    for b in range(3):
        m = masks.causal() & masks.padding([[11, 13, 6][b]]) if mask is not None and "padding" in repr(mask) else mask
        ref = attnlab.attention(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], mask=m, score_mod=mod, q_offset=int(qo[b]), backend="reference"
        )
        assert max_err(out[b : b + 1], ref) <= 1e-12


def test_q_offset_tensor_errors():
    q, k, v = _qkv(B=3, Nq=1)
    with pytest.raises(ValueError, match=r"q_offset: a tensor q_offset must be \(B,\)=3 integers"):
        attnlab.attention(q, k, v, mask=masks.causal(), q_offset=torch.tensor([1, 2]))


# ----------------------------------------------------------------------------- per-(b, h) ALiBi
def test_alibi_per_batch_head_slopes():
    q, k, v = _qkv(B=2)
    sl = torch.rand(2, 4, dtype=F64, generator=torch.Generator().manual_seed(3))
    out = attnlab.attention(q, k, v, mask=masks.causal(), score_mod=scores.alibi(sl), backend="flash")
    for b in range(2):
        ref = attnlab.attention(
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            mask=masks.causal(),
            score_mod=scores.alibi(sl[b]),
            backend="reference",
        )
        assert max_err(out[b : b + 1], ref) <= 1e-12
    with pytest.raises(ValueError, match=r"alibi\(slopes\): \(B, H\) slopes of shape \(3, 4\) for batch size B=2"):
        attnlab.attention(q, k, v, score_mod=scores.alibi(torch.ones(3, 4, dtype=F64)))
