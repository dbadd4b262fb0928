"""Fault injection into the op's numbers: NaN/inf in hidden and visible inputs, extreme scales, merge.

Contracts (docs/reliability/numerics.md, attnlab.ops.finite):

* a key a row cannot see changes nothing in that row, whatever its key or value holds,
  forward and backward; gradients into such slots are exactly 0;
* NaN in an input a row can see gives NaN in that row, the same on every backend;
* a huge finite ``scale`` gives the reference's (finite) result;
* ``merge_states`` ignores ``-inf``-LSE parts whatever their output holds and lets
  ``+inf``-LSE parts dominate.

Every backend runs: reference, flash, sdpa, auto, and triton under the Triton
interpreter (``TRITON_INTERPRET=1``, set here before attnlab's kernels are first
imported; skipped without the triton package).  Shapes are tiny; 40 keys give the
Triton kernels two 32-wide tiles.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

if "attnlab.ops.triton.forward" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # as tests/ops/triton/conftest.py: before the kernels are defined

import attnlab
from attnlab import masks, merge_states
from attnlab.ops.decode import split_kv_attention
from attnlab.ops.triton import available as triton_available
from tests.helpers import FLOOR, assert_close_rule, max_err

BACKENDS = ["reference", "flash", "sdpa", "auto", "triton"]
F32 = torch.float32
B, H, HKV, N, D = 1, 2, 1, 40, 16  # GQA 2:1


def _backend(name):
    if name == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    return name


def _qkv(seed=0, Nq=N, Nk=N, dtype=torch.float64, Hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _run(q, k, v, backend, grad=False, w=None, **kw):
    """out (and dq, dk, dv of ``(out·w).sum()`` over the rows ``w`` weighs) on one backend."""
    q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    out = attnlab.attention(q, k, v, backend=backend, **kw)
    if not grad:
        return out.detach(), None
    loss = (torch.where(w != 0, out.double(), torch.zeros((), dtype=torch.float64)) * w).sum()
    gq, gk, gv = torch.autograd.grad(loss, [q, k, v])
    return out.detach(), (gq, gk, gv)


def _poison(t, idx, value=float("nan")):
    t = t.clone()
    t[:, :, idx] = value
    return t


# --------------------------------------------------------------------------- hidden keys
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_future_value_leaves_the_rows_that_cannot_see_it_alone(backend):
    """causal(): NaN/inf in the key and value of the last token.  Only the last row sees it
    (and is NaN, the visible-input policy); every other row is exactly what the clean
    problem gives."""
    backend = _backend(backend)
    q, k, v = _qkv(1)
    kb, vb = _poison(k, -1), _poison(v, -1)
    vb[:, :, -1, 0] = float("inf")
    out, _ = _run(q.float(), kb.float(), vb.float(), backend, mask=masks.causal())
    ref, _ = _run(q.float(), k.float(), v.float(), "reference", mask=masks.causal())
    oracle, _ = _run(q, k, v, "reference", mask=masks.causal())
    assert_close_rule(out[:, :, :-1], ref[:, :, :-1], oracle[:, :, :-1], F32, what=f"{backend}: rows before the NaN")
    assert torch.isnan(out[:, :, -1]).any(-1).all(), f"{backend}: the row that sees the NaN value must be NaN"


def _hidden_case(seed=2):
    """Keys 0..N-1, queries at positions -1..N-2 under causal(): row 0 sees no key, the last
    key is seen by no row.  The last key's k and v hold NaN/inf (an unwritten cache slot)."""
    q, k, v = _qkv(seed)
    kb, vb = _poison(k, -1), _poison(v, -1)
    kb[:, :, -1, 1] = float("-inf")
    vb[:, :, -1, 2] = float("inf")
    return q, k, v, kb, vb


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_no_row_sees_change_nothing_forward_and_backward(backend):
    backend = _backend(backend)
    q, k, v, kb, vb = _hidden_case()
    kw = dict(mask=masks.causal(), q_offset=-1)
    if backend == "sdpa":  # SDPA cannot express a row with no key: the same problem minus row 0
        q, kw = q[:, :, 1:], dict(mask=masks.causal(), q_offset=0)
    w = torch.randn(B, H, q.shape[2], D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out, (gq, gk, gv) = _run(q.float(), kb.float(), vb.float(), backend, grad=True, w=w, **kw)
    ref, (rq, rk, rv) = _run(q.float(), k.float(), v.float(), "reference", grad=True, w=w, **kw)
    oracle, (oq, ok, ov) = _run(q, k, v, "reference", grad=True, w=w, **kw)
    assert_close_rule(out, ref, oracle, F32, what=f"{backend} out")
    assert_close_rule(gq, rq, oq, F32, factor=3.0, what=f"{backend} dq")
    assert_close_rule(gk[:, :, :-1], rk[:, :, :-1], ok[:, :, :-1], F32, factor=3.0, what=f"{backend} dk")
    assert_close_rule(gv[:, :, :-1], rv[:, :, :-1], ov[:, :, :-1], F32, factor=3.0, what=f"{backend} dv")
    assert (gk[:, :, -1] == 0).all() and (gv[:, :, -1] == 0).all(), f"{backend}: hidden slot's grads must be 0"


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "sdpa"])
def test_a_row_that_sees_no_key_is_zero_with_neg_inf_lse_whatever_the_values_hold(backend):
    """Rows at positions -1, 0, 1, 2 under causal() over a cache whose slots from 3 on are
    unwritten (NaN values, inf keys): row 0 sees no key and gives out 0, LSE -inf, zero
    gradients; the others see keys 0..2 only.  (SDPA cannot express a row with no key.)"""
    backend = _backend(backend)
    q, k, v = _qkv(3, Nq=4)
    kb, vb = _poison(k, slice(3, None), float("inf")), _poison(v, slice(3, None))
    q, kb, vb = (t.float().requires_grad_(True) for t in (q, kb, vb))
    out, lse = attnlab.attention(q, kb, vb, mask=masks.causal(), q_offset=-1, return_lse=True, backend=backend)
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == float("-inf")).all(), f"{backend}: {out[0, 0, 0, :4]}"
    want = attnlab.attention(
        q.detach().double(), k[:, :, :3], v[:, :, :3], mask=masks.causal(), q_offset=-1, backend="reference"
    )
    assert max_err(out[:, :, 1:], want[:, :, 1:]) <= 1e-5, f"{backend}: rows 1..3"
    gq, gk, gv = torch.autograd.grad((out * 1.5).sum(), [q, kb, vb])
    assert (gq[:, :, 0] == 0).all(), f"{backend}: dq of a row with no key must be 0"
    assert (gk[:, :, 3:] == 0).all() and (gv[:, :, 3:] == 0).all(), f"{backend}: unwritten slots' grads must be 0"
    assert torch.isfinite(gq).all() and torch.isfinite(gk).all() and torch.isfinite(gv).all()


# --------------------------------------------------------------------------- visible inputs
#: float32 ulps an entry may differ by: a score q·k summed in another order (tiles, another BLAS)
#: differs by a few ulps, and the LSE at a huge scale carries that relative error
LSE_ULPS = 16


def _same_policy(out, oracle, what):
    """NaN exactly where the float64 reference has NaN, ±inf where it has ±inf, the rest close."""
    assert torch.equal(torch.isnan(out), torch.isnan(oracle)), f"{what}: NaN pattern differs from the reference"
    fin = torch.isfinite(oracle)
    assert torch.equal(out[~fin & ~torch.isnan(oracle)], oracle[~fin & ~torch.isnan(oracle)].to(out.dtype)), what
    # a few float32 ulps of the entry itself: at scale 1e30 an LSE is ~1e30, so only a relative bound means anything
    err = (out[fin].double() - oracle[fin].double()).abs()
    bound = 1e-4 + LSE_ULPS * torch.finfo(out.dtype).eps * oracle[fin].double().abs()
    assert bool((err <= bound).all()), f"{what}: finite entries differ from the reference"


CASES = {
    "nan-in-q-row-3": lambda q, k, v: (_poison(q, 3), k, v),
    "nan-in-visible-k-0": lambda q, k, v: (q, _poison(k, 0), v),
    "inf-in-visible-v-0": lambda q, k, v: (q, k, _poison(v, 0, float("inf"))),
}


def test_nan_inf_in_visible_inputs_follow_one_policy_on_every_backend():
    """IEEE propagation, as the math (and flash-attn) does: a NaN a row can see makes that
    row NaN; inf in a visible value gives what the weighted sum gives.  torch's CPU SDPA
    answers 0 for a NaN query: attnlab's sdpa/auto must not leak that."""
    bad = []
    for case, poison in CASES.items():
        q, k, v = poison(*_qkv(4, Nq=8, Nk=8, Hkv=H))  # torch's CPU SDPA zeroes a NaN query row here (MHA, N=8)
        for mask in (None, masks.causal()):
            oracle, _ = _run(q, k, v, "reference", mask=mask)
            for backend in BACKENDS:
                if backend == "triton" and not triton_available():
                    continue
                out, _ = _run(q.float(), k.float(), v.float(), backend, mask=mask)
                try:
                    _same_policy(out, oracle, f"{case}/{mask}/{backend}")
                except AssertionError as e:
                    bad.append(str(e).splitlines()[0])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_inputs_follow_the_policy_on_sdpa_and_auto(dtype):
    """The same policy in 16-bit floats, whose finiteness check is their min and max: torch's
    CPU bf16 SDPA answers a finite row for an inf key (measured), so sdpa and auto must see it."""
    cases = {
        **CASES,
        "inf-in-visible-k-0": lambda q, k, v: (q, _poison(k, 0, float("inf")), v),
        "neg-inf-in-visible-v-2": lambda q, k, v: (q, k, _poison(v, 2, float("-inf"))),
    }
    bad = []
    for case, poison in cases.items():
        q, k, v = (t.to(dtype) for t in poison(*_qkv(5, Nq=8, Nk=8, Hkv=H)))
        for mask in (None, masks.causal()):
            oracle, _ = _run(q.double(), k.double(), v.double(), "reference", mask=mask)
            for backend in ("sdpa", "auto"):
                out, _ = _run(q, k, v, backend, mask=mask)
                if not torch.equal(torch.isnan(out), torch.isnan(oracle)):
                    bad.append(f"{case}/{mask}/{backend}: NaN pattern differs from the reference")
    assert not bad, "\n".join(bad)


def test_the_finiteness_check_sees_every_non_finite_value_of_every_float_dtype():
    from attnlab.ops.finite import maybe_nonfinite

    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(3, 5, 7, dtype=torch.float64).to(dtype)
        assert not maybe_nonfinite(t, t[:0], torch.zeros(2, dtype=dtype))
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u[1, 2, 3] = bad
            assert maybe_nonfinite(t, u), (dtype, bad)
        w = torch.full((4,), float("inf"), dtype=dtype)  # every entry inf: min = max
        assert maybe_nonfinite(w) and maybe_nonfinite(-w)


# --------------------------------------------------------------------------- scale
def test_extreme_scales_give_the_reference_result_on_every_backend():
    """scale 1e9 and 1e30 (finite scores, a one-hot softmax): the reference's finite result,
    LSE included (flash once gave NaN and +inf LSE: the fused ``scale·x − m`` rounded above
    0).  3e38 (scores overflow to inf): NaN exactly where the reference has NaN.  1e-30
    (uniform softmax): the reference's result.  inf/NaN/0 are refused at the boundary."""
    q, k, v = _qkv(6)
    bad = []
    for scale in (1e9, 1e30, 3e38, 1e-30):
        for mask in (None, masks.causal()):
            o_ref, l_ref = attnlab.attention(
                q.float(), k.float(), v.float(), mask=mask, scale=scale, backend="reference", return_lse=True
            )
            for backend in BACKENDS:
                if backend == "triton" and not triton_available():
                    continue
                lse_ok = backend != "sdpa"
                res = attnlab.attention(
                    q.float(), k.float(), v.float(), mask=mask, scale=scale, backend=backend, return_lse=lse_ok
                )
                out, lse = res if lse_ok else (res, None)
                what = f"scale={scale}/{mask}/{backend}"
                try:
                    _same_policy(out, o_ref, what)
                    if lse is not None:
                        _same_policy(lse, l_ref, what + " lse")
                except AssertionError as e:
                    bad.append(str(e).splitlines()[0])
    assert not bad, "\n".join(bad)
    for scale in (math.inf, -math.inf, math.nan, 0.0):
        for backend in BACKENDS:
            with pytest.raises(ValueError, match="scale"):
                attnlab.attention(q.float(), k.float(), v.float(), scale=scale, backend=backend)


# --------------------------------------------------------------------------- merge
def test_merge_ignores_a_neg_inf_part_whatever_its_output_holds():
    g = torch.Generator().manual_seed(7)
    o1 = torch.randn(2, 3, 5, 4, generator=g, requires_grad=True)
    l1 = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    o2 = torch.full((2, 3, 5, 4), float("nan")).requires_grad_(True)
    o2.data[0, 0, 0] = float("inf")
    l2 = torch.full((2, 3, 5), float("-inf")).requires_grad_(True)
    out, lse = merge_states([o1, o2], [l1, l2])
    assert torch.equal(out, o1.detach()) and torch.allclose(lse, l1.detach(), atol=FLOOR[F32], rtol=0)
    g_o1, g_l1, g_o2, g_l2 = torch.autograd.grad((out * 1.5).sum() + lse.sum(), [o1, l1, o2, l2])
    assert (g_o2 == 0).all() and (g_l2 == 0).all(), "an empty part gets zero gradients"
    assert torch.allclose(g_o1, torch.full_like(g_o1, 1.5)) and torch.allclose(g_l1, torch.ones_like(g_l1))
    # every part empty: 0 and -inf, whatever the outputs hold
    out, lse = merge_states([o2, o2], [l2, l2])
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_merge_lets_pos_inf_lse_parts_dominate():
    """+inf LSE (a part with an infinite score): L = +inf, O = mean of the +inf parts' outputs;
    the finite parts (even holding NaN) and -inf parts contribute nothing."""
    g = torch.Generator().manual_seed(8)
    o = [torch.randn(1, 2, 3, 4, generator=g) for _ in range(3)]
    o[2][0, 0, 0] = float("nan")
    l = [torch.randn(1, 2, 3, generator=g) for _ in range(3)]
    l[0][0, 0, 0] = l[1][0, 0, 0] = float("inf")
    out, lse = merge_states(o, l)
    assert lse[0, 0, 0] == float("inf") and torch.isfinite(lse.flatten()[1:]).all()
    assert torch.allclose(out[0, 0, 0], (o[0][0, 0, 0] + o[1][0, 0, 0]) / 2)
    full, _ = merge_states([x[:, :, 1:] for x in o], [x[:, :, 1:] for x in l])
    assert torch.equal(out[:, :, 1:], full)


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_split_kv_decoding_over_a_cache_with_unwritten_slots(backend):
    """Split-KV decoding: the cache is written up to position 11; its slots from 12 on (the
    end of the first piece and all of the second) hold NaN and lie after the query under
    causal(): the result is attention over keys 0..11 alone."""
    q, k, v = _qkv(9, Nq=1, Nk=24)
    kb, vb = _poison(k, slice(12, None)), _poison(v, slice(12, None))
    pieces = [(kb[:, :, :16], vb[:, :, :16], 0), (kb[:, :, 16:], vb[:, :, 16:], 16)]
    out = split_kv_attention(q, pieces, mask=masks.causal(), q_offset=11, backend=backend)
    want = attnlab.attention(q, k[:, :, :12], v[:, :, :12], q_offset=11, backend="reference")
    assert max_err(out, want) <= FLOOR[torch.float64]


# --------------------------------------------------------------------------- property
_MASKS = {
    "causal": lambda n: masks.causal(),
    "sliding_window": lambda n: masks.sliding_window(max(1, n // 3)),
    "padding": lambda n: masks.padding([max(0, n - 5)]),
    "document": lambda n: masks.document(torch.arange(n) // 7),
}


@settings(max_examples=10, deadline=None, derandomize=True)
@given(data=st.data())
def test_property_poisoned_slots_change_nothing_for_the_rows_that_cannot_see_them(data):
    """Any mask of the family, any lengths, NaN/±inf written into any key and value slots:
    every row that sees none of them is the clean problem's row; if no row sees them,
    the gradients are the clean ones too and those slots' gradients are 0."""
    from tests.helpers import mask_dense

    backend = data.draw(st.sampled_from(["reference", "flash", "auto"]), label="backend")
    Nk = data.draw(st.integers(2, 40), label="Nk")
    Nq = data.draw(st.integers(1, Nk), label="Nq")
    name = data.draw(st.sampled_from(sorted(_MASKS)), label="mask")
    mask = _MASKS[name](Nk)
    qo = Nk - Nq
    seen = mask_dense(mask, B, H, Nq, Nk, qo, 0)  # (B, H, Nq, Nk)
    hidden_from_all = [j for j in range(Nk) if not seen[..., j].any()]
    slots = data.draw(st.lists(st.integers(0, Nk - 1), min_size=1, max_size=4, unique=True), label="slots")
    if hidden_from_all and data.draw(st.booleans(), label="only slots no row sees"):
        slots = hidden_from_all[: len(slots)]
    value = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="value")
    q, k, v = _qkv(data.draw(st.integers(0, 99), label="seed"), Nq=Nq, Nk=Nk)
    kb, vb = _poison(k, slots, value), _poison(v, slots, value)
    clean_rows = ~seen[..., slots].any(-1)  # (B, H, Nq): rows that see no poisoned slot
    w = torch.randn(B, H, Nq, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grad = bool(clean_rows.all())
    out, g = _run(q.float(), kb.float(), vb.float(), backend, grad=grad, w=w, mask=mask)
    ref, rg = _run(q.float(), k.float(), v.float(), "reference", grad=grad, w=w, mask=mask)
    oracle, og = _run(q, k, v, "reference", grad=grad, w=w, mask=mask)
    rows = clean_rows.unsqueeze(-1).expand_as(out)
    assert_close_rule(out[rows], ref[rows], oracle[rows], F32, what=f"{backend}/{name}: clean rows")
    if grad:
        keep = torch.ones(Nk, dtype=torch.bool)
        keep[slots] = False
        for name_, a, r, o in zip(("dq", "dk", "dv"), g, rg, og, strict=True):
            sel = (slice(None),) * 2 + ((slice(None),) if name_ == "dq" else (keep,))
            assert_close_rule(a[sel], r[sel], o[sel], F32, factor=3.0, what=f"{backend}/{name}: {name_}")
        assert (g[1][:, :, slots] == 0).all() and (g[2][:, :, slots] == 0).all(), "poisoned slots' grads must be 0"
