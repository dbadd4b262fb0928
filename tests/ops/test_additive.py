"""Additive (Bahdanau) attention (attnlab.ops.additive, attnlab.nn.additive): the tiled op
against the materialised reference (outputs, LSE, gradients), gradcheck of the custom
backward, an explicit-loop oracle for the reference itself, fully masked rows, the
memory property (no (Nq, Nk, A) tensor kept for the backward), reduced precision under
the DESIGN.md rule, the module, and errors that name the argument."""

import math

import pytest
import torch

from attnlab import masks
from attnlab.nn.additive import AdditiveAttention
from attnlab.ops.additive import additive_attention, naive_additive_attention
from tests.helpers import check_rule

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny problems: a 2nd thread only spins


# float64 in, float64 sums: tiled and materialised forms differ only in summation order
# (online softmax vs one softmax), a few ulps of O(1) quantities.
TOL64 = 1e-10


def _inputs(
    B=2, H=4, Hkv=2, Nq=7, Nk=11, Dq=5, Dk=6, Dv=3, A=8, per_head=False, bias=True, seed=0, dtype=torch.float64
):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    lead = (H,) if per_head else ()
    return dict(
        q=r(B, H, Nq, Dq),
        k=r(B, Hkv, Nk, Dk),
        v=r(B, Hkv, Nk, Dv),
        w_q=r(*lead, A, Dq),
        w_k=r(*lead, A, Dk),
        v_a=r(*lead, A),
        bias=r(*lead, A) if bias else None,
    )


_ORDER = ("q", "k", "v", "w_q", "w_k", "v_a", "bias")


def _run(fn, t, grad=True, **kw):
    """Output, LSE and the gradients of a fixed random loss of (out, finite lse)."""
    leaves = {n: (x.detach().clone().requires_grad_(grad) if x is not None else None) for n, x in t.items()}
    out, lse = fn(*(leaves[n] for n in _ORDER[:6]), bias=leaves["bias"], return_lse=True, **kw)
    res = {"out": out.detach(), "lse": lse.detach()}
    if grad:
        g = torch.Generator().manual_seed(99)
        w = torch.randn(out.shape, generator=g, dtype=torch.float64)
        c = torch.randn(lse.shape, generator=g, dtype=torch.float64)
        loss = (out.double() * w).sum() + (torch.where(torch.isinf(lse), 0.0, lse).double() * c).sum()
        names = [n for n in _ORDER if leaves[n] is not None]
        for n, gr in zip(names, torch.autograd.grad(loss, [leaves[n] for n in names]), strict=True):
            res["d" + n] = gr
    return res


def _err(a, b):
    assert a.shape == b.shape
    same_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    d = torch.where(same_inf, 0.0, (a.double() - b.double()).abs())
    return float(d.max()) if d.numel() else 0.0


def _loop_oracle(q, k, v, w_q, w_k, v_a, bias, allowed):
    """Bahdanau's formula written out row by row and key by key (one head, one batch)."""
    out = torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64)
    for i in range(q.shape[0]):
        e = []
        for j in range(k.shape[0]):
            h = w_q @ q[i] + w_k @ k[j] + (bias if bias is not None else 0.0)
            e.append(float(v_a @ torch.tanh(h)) if allowed[i, j] else -math.inf)
        e = torch.tensor(e, dtype=torch.float64)
        if torch.isinf(e).all():
            continue
        a = torch.exp(e - e.max())
        out[i] = (a / a.sum()) @ v
    return out


CASES = {
    "none": lambda: None,
    "causal": masks.causal,
    "window": lambda: masks.sliding_window(3),
    "padding": lambda: masks.padding([4, 0]),  # batch 1 sees no key: fully masked rows
    "doc": lambda: masks.causal() & masks.custom(lambda b, h, q, kv: (q // 5) == (kv // 5)),
}


COMBOS = [(m, "gqa", ph) for m in CASES for ph in (False, True)] + [
    ("causal", "mha", False),
    ("window", "mqa", True),
    ("none", "mqa", False),
    ("padding", "mha", True),
]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (3, 1)}


IDS = [f"{m}-{h}-{'ph' if p else 'shared'}" for m, h, p in COMBOS]


@pytest.mark.parametrize("mask,heads,per_head", COMBOS, ids=IDS)
def test_tiled_equals_naive_with_gradients(mask, heads, per_head):
    H, Hkv = HEADS[heads]
    t = _inputs(H=H, Hkv=Hkv, per_head=per_head, bias=(mask != "none"), seed=len(mask) + H)
    m = CASES[mask]()
    ref = _run(naive_additive_attention, t, mask=m)
    for chunks in ((3, 2), (64, 64), (4, 7)):
        fast = _run(additive_attention, t, mask=m, chunk_size=chunks[0], q_chunk_size=chunks[1])
        assert fast.keys() == ref.keys()
        for key in ref:
            assert _err(fast[key], ref[key]) < TOL64, (mask, chunks, key)
    assert not any(torch.isnan(x).any() for x in ref.values())


def test_naive_matches_explicit_loops():
    t = _inputs(B=1, H=1, Hkv=1, Nq=4, Nk=6)
    # q_offset=-2: rows 0 and 1 sit before every key under causal(): fully masked
    allowed = (torch.arange(4).view(4, 1) - 2) >= torch.arange(6).view(1, 6)
    for m, qo, al in ((None, None, torch.ones(4, 6, dtype=torch.bool)), (masks.causal(), -2, allowed)):
        want = _loop_oracle(t["q"][0, 0], t["k"][0, 0], t["v"][0, 0], t["w_q"], t["w_k"], t["v_a"], t["bias"], al)
        for fn in (naive_additive_attention, additive_attention):
            got = fn(*(t[n] for n in _ORDER[:6]), bias=t["bias"], mask=m, q_offset=qo)[0, 0]
            assert _err(got, want) < TOL64


def test_gradcheck_tiled_backward():
    t = _inputs(B=1, H=2, Hkv=1, Nq=3, Nk=5, Dq=3, Dk=2, Dv=2, A=4, per_head=True)
    m = masks.causal()
    names = list(_ORDER)
    leaves = [t[n].clone().requires_grad_(True) for n in names]

    def f(*xs):
        d = dict(zip(names, xs, strict=True))
        out, lse = additive_attention(
            *(d[n] for n in names[:6]),
            bias=d["bias"],
            mask=m,
            q_offset=0,
            return_lse=True,
            chunk_size=2,
            q_chunk_size=2,
        )
        return out, lse

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)
    # shared weights, no mask, no bias
    t = _inputs(B=2, H=2, Hkv=2, Nq=2, Nk=3, Dq=2, Dk=3, Dv=2, A=3, bias=False)
    leaves = [t[n].clone().requires_grad_(True) for n in names[:6]]
    assert torch.autograd.gradcheck(
        lambda *xs: additive_attention(*xs, chunk_size=2, q_chunk_size=1), leaves, eps=1e-6, atol=1e-7
    )


def test_fully_masked_rows_are_zero_with_zero_gradients():
    t = _inputs(Nq=6, Nk=6)
    res = _run(additive_attention, t, mask=masks.causal(), q_offset=-3, chunk_size=4, q_chunk_size=4)
    # rows 0..2 sit at positions -3..-1: no key at or before them
    assert torch.equal(res["out"][:, :, :3], torch.zeros_like(res["out"][:, :, :3]))
    assert torch.isinf(res["lse"][:, :, :3]).all() and (res["lse"][:, :, :3] < 0).all()
    assert torch.isfinite(res["lse"][:, :, 3:]).all()
    assert torch.equal(res["dq"][:, :, :3], torch.zeros_like(res["dq"][:, :, :3]))
    assert not any(torch.isnan(x).any() for x in res.values())
    assert res["dq"][:, :, 3:].abs().sum() > 0
    # every key masked: all zeros, no NaN anywhere
    res = _run(additive_attention, t, mask=masks.causal() & ~masks.causal())
    assert torch.equal(res["out"], torch.zeros_like(res["out"]))
    assert all(torch.equal(res[k], torch.zeros_like(res[k])) for k in res if k.startswith("d"))


def test_blockmask_and_offsets():
    t = _inputs(Nq=5, Nk=9)
    m = masks.sliding_window(4)
    bm = m.block_mask(2, 4, 5, 9, q_offset=6, kv_offset=3, block=(2, 3))
    args = [t[n] for n in _ORDER[:6]]
    got = additive_attention(*args, bias=t["bias"], mask=bm, q_offset=6, kv_offset=3)
    want = naive_additive_attention(*args, bias=t["bias"], mask=m, q_offset=6, kv_offset=3)
    assert _err(got, want) < TOL64
    with pytest.raises(ValueError, match="BlockMask"):
        additive_attention(*args, mask=bm, q_offset=5, kv_offset=3)


def test_empty_sequences():
    t = _inputs(Nk=0)
    out = additive_attention(*(t[n] for n in _ORDER[:6]))
    assert out.shape == (2, 4, 7, 3) and torch.equal(out, torch.zeros_like(out))
    t = _inputs(Nq=0)
    assert additive_attention(*(t[n] for n in _ORDER[:6])).shape == (2, 4, 0, 3)


def test_backward_keeps_no_pairwise_tensor():
    """The naive form saves (B, H, Nq, Nk, A) for its backward; the tiled op saves O(N·A)."""
    B, H, Nq, Nk, A = 1, 2, 48, 40, 16
    t = _inputs(B=B, H=H, Hkv=H, Nq=Nq, Nk=Nk, A=A, dtype=torch.float32)
    pair = B * H * Nq * Nk * A

    def max_saved(fn, **kw):
        sizes = []
        leaves = [t[n].clone().requires_grad_(True) for n in _ORDER[:6]]
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            fn(*leaves, **kw).sum().backward()
        assert all(x.grad is not None for x in leaves)
        return max(sizes)

    assert max_saved(naive_additive_attention) >= pair
    assert max_saved(additive_attention, chunk_size=8, q_chunk_size=8) <= B * H * max(Nq, Nk) * A


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_reduced_precision_rule(dtype):
    t64 = _inputs(per_head=True, seed=3)
    t = {n: (x.to(dtype) if x is not None else None) for n, x in t64.items()}
    m = masks.causal()
    oracle = _run(naive_additive_attention, t64, mask=m)
    ref = _run(naive_additive_attention, t, mask=m)
    fast = _run(additive_attention, t, mask=m, chunk_size=4, q_chunk_size=3)
    assert fast["out"].dtype == dtype and fast["lse"].dtype == torch.float32
    check_rule(fast, ref, oracle, dtype, keys=tuple(oracle))


def test_module_matches_functional_and_trains():
    torch.manual_seed(0)
    att = AdditiveAttention(5, 6, 8)
    q, k, v = torch.randn(2, 7, 5), torch.randn(2, 9, 6), torch.randn(2, 9, 3)
    out = att(q, k, v, mask=masks.causal())
    want = naive_additive_attention(
        q[:, None], k[:, None], v[:, None], att.w_q, att.w_k, att.v_a, bias=att.bias, mask=masks.causal()
    )[:, 0]
    assert out.shape == (2, 7, 3) and torch.allclose(out, want, atol=1e-6)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in att.parameters())
    # per-head weights, 4-D layout, GQA; v=None uses the keys as values
    att = AdditiveAttention(4, d_attn=6, heads=4, bias=False)
    q, k = torch.randn(1, 4, 3, 4), torch.randn(1, 2, 5, 4)
    out, lse = att(q, k, return_lse=True)
    want = naive_additive_attention(q, k, k, att.w_q, att.w_k, att.v_a)
    assert out.shape == (1, 4, 3, 4) and lse.shape == (1, 4, 3) and torch.allclose(out, want, atol=1e-6)
    assert att.bias is None and att.w_q.shape == (4, 6, 4)
    with pytest.raises(ValueError, match="heads=4"):
        att(torch.randn(1, 3, 4), torch.randn(1, 5, 4))


def test_errors_name_the_argument():
    t = _inputs()
    args = [t[n] for n in _ORDER[:6]]

    def call(**over):
        a = dict(zip(_ORDER[:6], args, strict=True))
        kw = {key: over.pop(key) for key in list(over) if key not in a}
        a.update(over)
        return additive_attention(*(a[n] for n in _ORDER[:6]), **kw)

    with pytest.raises(ValueError, match=r"w_k: expected \(A=8, Dk=6\)"):
        call(w_k=torch.randn(7, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="w_q"):
        call(w_q=torch.randn(3, 8, 5, dtype=torch.float64))  # 3 heads, q has 4
    with pytest.raises(ValueError, match="v_a"):
        call(v_a=torch.randn(9, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        call(bias=torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        call(q=torch.randn(4, 7, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="kv heads must divide"):
        call(q=torch.randn(2, 3, 7, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        call(q=t["q"].float())
    with pytest.raises(TypeError, match="w_q: expected a floating tensor"):
        call(w_q=torch.ones(8, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="mask"):
        call(mask=torch.ones(7, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="chunk_size"):
        call(chunk_size=0)
    with pytest.raises(TypeError, match="q_offset"):
        call(q_offset=1.5)
    with pytest.raises(ValueError, match="d_attn"):
        AdditiveAttention(4, d_attn=0)
