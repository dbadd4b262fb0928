"""The native backward's two schedules (backward.h): "fused", one pass over (b, kv head) work
items that owns dK, dV and dQ (five tile products), and "split", the two atomics-free passes
over kv blocks and q blocks (seven).  The kernel picks one by the thread count
(ATTNLAB_NATIVE_BWD forces it); each must meet the float64 oracle under DESIGN.md's rule,
keep hidden NaN out and exact zeros exact, and both give the same bits."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from tests.ops.conftest import make_qkv
from tests.ops.native import test_native_accuracy as acc, test_native_scoremods as mods

SCHEDULES = ("fused", "split")

# a window, GQA with Dv != D; padding beside causal; a sliced band of kv blocks with offsets
# and fully masked rows; D = 111 (padded to 112); rows that see no key at all
ACC_CASES = [acc.CASES[i] for i in (2, 8, 17, 18, 16, 10)]
MOD_CASES = [mods.CASES[i] for i in (2, 3, 4)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("c", ACC_CASES, ids=acc._id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_schedule_matches_oracle(schedule, c, dtype, native_ext, monkeypatch):
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
    acc._run(c, dtype, native_ext)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("c", MOD_CASES, ids=mods._id)
def test_schedule_score_mods_match_oracle(schedule, c, native_ext, monkeypatch):
    """The slope / table gradients are summed per (b, h, q block) slot in both schedules."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
    mods._run(c, torch.float32)


def _grads(q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attnlab.attention(q, k, v, backend="native", **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(out.dtype)
    return torch.autograd.grad(out, (q, k, v), g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_schedules_give_the_same_bits(dtype, native_ext, monkeypatch):
    """Every tile's S, P, dS and products are computed alike and summed in the same order."""
    q, k, v = make_qkv(2, 4, 2, 150, 170, 40, 24, dtype=dtype, seed=2)
    for mask in (masks.causal() & masks.padding([120, 170]), masks.sliding_window(33), None):
        got = {}
        for schedule in SCHEDULES:
            monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
            got[schedule] = _grads(q, k, v, mask=mask)
        for a, b in zip(got["fused"], got["split"], strict=True):
            assert torch.equal(a, b)
            assert torch.count_nonzero(a) > 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hidden_nan_has_no_effect_in_each_schedule(schedule, native_ext, monkeypatch):
    """A NaN / inf key or value no row may see sends the fast tiles' result non-finite; the
    careful path recomputes it: the same gradients as without them, zeros where no row looks."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
    q, k, v = make_qkv(2, 2, 1, 70, 90, 32)
    m = masks.causal() & masks.padding([80, 90])
    ref = _grads(q, k, v, mask=m)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 80:] = float("nan")
    v2[0, :, 80:] = float("inf")
    got = _grads(q, k2, v2, mask=m)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert torch.equal(a[:, :, :80], b[:, :, :80]) and torch.equal(a[1], b[1])
        assert torch.count_nonzero(a[0, :, 80:]) == 0
