"""The native backward's two schedules (backward.h): "fused", one pass over (b, kv head, chunk
of kv blocks) work items that own dK, dV and their dQ sums (five tile products), and "split",
the two atomics-free passes over kv blocks and q blocks (seven).  The kernel picks one by the
items' tile counts on the threads (ATTNLAB_NATIVE_BWD forces it) and the chunks by the
problem alone (ATTNLAB_NATIVE_BWD_CHUNKS forces them); each must meet the float64 oracle under
DESIGN.md's rule, keep hidden NaN out and exact zeros exact, and both give the same bits, for
any thread count."""

from __future__ import annotations

import os

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


def _assert_hidden_keys_change_nothing(Nq: int, Nk: int, cut: int):
    """Batch 0's keys from ``cut`` on are padding (NaN keys, inf values): the gradients equal
    those without them, and dK/dV there are exactly zero."""
    q, k, v = make_qkv(2, 2, 1, Nq, Nk, 32)
    m = masks.causal() & masks.padding([cut, Nk])
    ref = _grads(q, k, v, mask=m)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, cut:] = float("nan")
    v2[0, :, cut:] = float("inf")
    got = _grads(q, k2, v2, mask=m)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert torch.equal(a[:, :, :cut], b[:, :, :cut]) and torch.equal(a[1], b[1])
        assert torch.count_nonzero(a[0, :, cut:]) == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hidden_nan_has_no_effect_in_each_schedule(schedule, native_ext, monkeypatch):
    """A NaN / inf key or value no row may see sends the fast tiles' result non-finite; the
    careful path recomputes it: the same gradients as without them, zeros where no row looks."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
    _assert_hidden_keys_change_nothing(70, 90, 80)


# ---- chunks: a few (b, kv head) make several fused items; dQ summed chunk by chunk alike


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("c", ACC_CASES, ids=acc._id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_chunked_schedule_matches_oracle(schedule, c, dtype, native_ext, monkeypatch):
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD_CHUNKS", "3")  # at most the kv blocks: 2 to 4 here
    acc._run(c, dtype, native_ext)
    assert abs(native_ext.last_bwd_plan()) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_chunked_schedules_give_the_same_bits(chunks, dtype, native_ext, monkeypatch):
    """The fused pass's dQ slabs are added up in the order split's dQ item adds its chunks."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD_CHUNKS", str(chunks))
    q, k, v = make_qkv(2, 4, 2, 150, 170, 40, 24, dtype=dtype, seed=2)  # 3 kv blocks of 64
    for mask in (masks.causal() & masks.padding([120, 170]), masks.sliding_window(33), None):
        got = {}
        for schedule in SCHEDULES:
            monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
            got[schedule] = _grads(q, k, v, mask=mask)
            assert native_ext.last_bwd_plan() == (chunks if schedule == "fused" else -chunks)
        for a, b in zip(got["fused"], got["split"], strict=True):
            assert torch.equal(a, b)
            assert torch.count_nonzero(a) > 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_chunked_threads_give_the_same_bits(schedule, native_ext, monkeypatch):
    """Which thread runs which item, in which order, changes no bit (a slow thread included)."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", schedule)
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD_CHUNKS", "3")
    q, k, v = make_qkv(1, 4, 2, 150, 200, 48, 40, seed=9)
    kw = {"mask": masks.causal() & masks.padding([170])}
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _grads(q, k, v, **kw)
        torch.set_num_threads(2)
        two = _grads(q, k, v, **kw)
        monkeypatch.setenv("ATTNLAB_NATIVE_SLOW", "3")  # thread 1 at a quarter of its speed
        slow = _grads(q, k, v, **kw)
    finally:
        torch.set_num_threads(n)
    for a, b, c in zip(one, two, slow, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("chunks", [1, 3])
def test_chunked_hidden_nan_has_no_effect(chunks, native_ext, monkeypatch):
    """A chunk whose kv block or dQ sum is not finite runs that block or q block carefully."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", "fused")
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD_CHUNKS", str(chunks))
    _assert_hidden_keys_change_nothing(150, 200, 170)


@pytest.mark.parametrize("c", [mods.CASES[1], mods.CASES[2]], ids=mods._id)
def test_chunked_score_mods_match_oracle(c, native_ext, monkeypatch):
    """A softcap runs chunked; ALiBi's slope gradients (summed per (b, h, q block) slot) keep
    one item per head whatever ATTNLAB_NATIVE_BWD_CHUNKS says."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", "fused")
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD_CHUNKS", "3")
    mods._run(c, torch.float32)
    assert native_ext.last_bwd_plan() == (2 if c[7] == "softcap" else 1)  # softcap: 97 keys, 2 kv blocks


@pytest.mark.parametrize("threads", [1, 2])
def test_few_heads_are_cut_into_chunks(threads, native_ext, monkeypatch):
    """The chunks come from the problem, never the thread count: 2 kv heads of 16 kv blocks make
    4 chunks each (chunks of 4 blocks); 32 kv heads make enough items as they are; score mods
    with a learnable parameter keep one item per head (their gradient slots)."""
    if threads > (os.cpu_count() or 1):
        pytest.skip("needs 2 CPUs")
    monkeypatch.delenv("ATTNLAB_NATIVE_BWD", raising=False)
    monkeypatch.delenv("ATTNLAB_NATIVE_BWD_CHUNKS", raising=False)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        q, k, v = make_qkv(1, 4, 2, 1024, 1024, 64, seed=1)
        _grads(q, k, v, mask=masks.sliding_window(128))
        assert native_ext.last_bwd_plan() == 4  # fused, 4 chunks
        q, k, v = make_qkv(1, 32, 32, 256, 256, 64, seed=1)
        _grads(q, k, v, mask=masks.causal())
        assert native_ext.last_bwd_plan() == 1
    finally:
        torch.set_num_threads(n)
