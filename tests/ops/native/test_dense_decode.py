"""Decode steps on dense keys through the native decode kernel (attnlab.ops.native.dense_decode):
parity with the float64 oracle under DESIGN.md's rule (error <= 2x the same-dtype
reference's, plus FLOOR) for output and LSE over dtypes, MHA / GQA / MQA, keys shared by the
batch, offsets, every mask the decode kernel evaluates and rows that see no key; that the
route really runs (and where it must not); and attnlab's non-finite contract, which the route
keeps by handing a non-finite answer to the tile kernel."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.ops.dispatch import choose_backend
from attnlab.ops.native import (
    build,
    decode_ops,
    dense_decode,
    ops as native_ops,  # noqa: F401  (registers torch.ops.attnlab.native_fwd)
)
from tests.helpers import assert_close_rule, max_err


@pytest.fixture(scope="module", autouse=True)
def native_ext():
    if build.load() is None:
        pytest.skip(f"the native extension cannot be built here: {build.status()}")


@pytest.fixture
def routed(monkeypatch):
    """Counts the decode kernel's calls through the route and the tile kernel's."""
    seen = {"decode": 0, "tile": 0}
    real_paged = decode_ops.paged_op

    def paged_op():
        op = real_paged()

        def spy(*a):
            seen["decode"] += 1
            return op(*a)

        return spy

    monkeypatch.setattr(decode_ops, "paged_op", paged_op)
    real_fwd = torch.ops.attnlab.native_fwd

    def fwd(*a):
        seen["tile"] += 1
        return real_fwd(*a)

    monkeypatch.setattr(torch.ops.attnlab, "native_fwd", fwd)
    return seen


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check(q, k, v, dtype, **kw):
    """The routed answer (out, LSE) against the float64 oracle under DESIGN's rule."""
    with torch.no_grad():
        out, lse = attnlab.attention(q, k, v, backend="native", return_lse=True, **kw)
        ref, ref_lse = attnlab.attention(q, k, v, backend="reference", return_lse=True, **kw)
        o64, l64 = attnlab.attention(q.double(), k.double(), v.double(), backend="reference", return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_rule(out, ref, o64, dtype, what="out")
    assert_close_rule(lse, ref_lse, l64, dtype, what="lse")
    return out, lse


MASKS = {
    "none": lambda Nk: None,
    "causal": lambda Nk: masks.causal(),
    "window": lambda Nk: masks.sliding_window(37),
    "sinks": lambda Nk: masks.sink_window(4, 50),
    "padding": lambda Nk: masks.padding(torch.tensor([Nk, 1, Nk - 7])),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(6, 6), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_a_decode_step_matches_the_oracle(dtype, heads, mask, routed):
    H, Hkv = heads
    Nk, D = 301, 40
    q, k, v = (
        rand(3, H, 1, D, seed=1, dtype=dtype),
        rand(3, Hkv, Nk, D, seed=2, dtype=dtype),
        rand(3, Hkv, Nk, 24, seed=3, dtype=dtype),
    )
    check(q, k, v, dtype, mask=MASKS[mask](Nk), q_offset=Nk - 1)
    assert routed == {"decode": 1, "tile": 0}


@pytest.mark.parametrize("Nq", [1, 2, 4])
def test_float32_takes_up_to_four_rows_and_their_causal_diagonal(Nq, routed):
    Nk = 200
    q, k, v = rand(2, 4, Nq, 32, seed=4), rand(2, 2, Nk, 32, seed=5), rand(2, 2, Nk, 32, seed=6)
    # rows end at keys 149..152 of 200: each hides a different tail (kv_offset 0, q_offset 150 - Nq + 1)
    check(q, k, v, torch.float32, mask=masks.causal(), q_offset=153 - Nq)
    assert routed == {"decode": 1, "tile": 0}


def test_offsets_shared_keys_and_per_batch_positions(routed):
    Nk = 90
    q, k, v = rand(3, 4, 1, 32, seed=7), rand(1, 4, Nk, 32, seed=8), rand(1, 4, Nk, 32, seed=9)
    # keys shared by the batch (batch 1), keys at 1000.., a window at absolute positions
    check(q, k, v, torch.float32, mask=masks.sliding_window(30), q_offset=1070, kv_offset=1000)
    assert routed == {"decode": 1, "tile": 0}
    # per-batch query positions arrive as a mask's per-batch shift (attnlab.ops.conventions),
    # which the decode kernel does not evaluate: the tile kernel runs them
    q_offset = torch.tensor([1020, 1050, 1089])
    check(q, k, v, torch.float32, mask=masks.sliding_window(30), q_offset=q_offset, kv_offset=1000)
    assert routed == {"decode": 1, "tile": 1}


def test_a_row_that_sees_no_key_gives_zeros_and_minus_inf(routed):
    q, k, v = rand(2, 2, 1, 16, seed=10), rand(2, 2, 40, 16, seed=11), rand(2, 2, 40, 16, seed=12)
    with torch.no_grad():
        out, lse = attnlab.attention(
            q, k, v, mask=masks.padding(torch.tensor([0, 40])), backend="native", return_lse=True
        )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == float("-inf")).all())
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    assert routed["decode"] == 1


def test_a_nan_value_the_row_cannot_see_changes_nothing(routed):
    # One row: the decode kernel visits only the keys it sees (its window), so a NaN/inf just
    # outside changes nothing.  Four float32 rows under causal: the kernel visits their union,
    # and its P·V adds 0 · v for a key hidden from a row (0 · NaN = NaN): the route sees the
    # non-finite answer and hands the step to the tile kernel, whose careful path skips hidden
    # keys -- rows 0-2 stay exact, row 3 (which sees the NaN) is NaN.
    Nk = 120
    q, k, v = rand(2, 4, 4, 32, seed=13), rand(2, 4, Nk, 32, seed=14), rand(2, 4, Nk, 32, seed=15)
    kn, vn = k.clone(), v.clone()
    vn[:, :, 89] = float("nan")  # just outside the window of 30 of a query at 119 (visible: 90..119)
    kn[:, :, 88] = float("inf")
    m = masks.sliding_window(30)
    with torch.no_grad():
        out = attnlab.attention(q[:, :, :1], kn, vn, mask=m, q_offset=Nk - 1, backend="native")
        clean = attnlab.attention(q[:, :, :1], k, v, mask=m, q_offset=Nk - 1, backend="reference")
    assert max_err(out, clean) < 1e-5
    assert routed == {"decode": 1, "tile": 0}
    vn, kn = v.clone(), k.clone()
    vn[:, :, 119] = float("nan")  # seen by the row at 119 only
    with torch.no_grad():
        out = attnlab.attention(q, kn, vn, mask=masks.causal(), q_offset=Nk - 4, backend="native")
        clean = attnlab.attention(q, k, v, mask=masks.causal(), q_offset=Nk - 4, backend="reference")
    assert routed == {"decode": 2, "tile": 1}
    assert max_err(out[:, :, :3], clean[:, :, :3]) < 1e-5
    assert bool(torch.isnan(out[:, :, 3]).all())


def test_a_nan_the_row_can_see_propagates():
    Nk = 64
    q, k, v = rand(1, 2, 1, 16, seed=16), rand(1, 2, Nk, 16, seed=17), rand(1, 2, Nk, 16, seed=18)
    v[0, 1, 60, 2] = float("nan")  # visible to head 1's query: its whole row is NaN (every channel
    with torch.no_grad():  # of its output mixes the same P... only channel 2 is NaN in the math)
        out = attnlab.attention(q, k, v, q_offset=Nk - 1, backend="native")
        ref = attnlab.attention(q, k, v, q_offset=Nk - 1, backend="reference")
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and bool(torch.isnan(out[0, 1, 0, 2]))
    assert max_err(out[0, 0], ref[0, 0]) < 1e-5


def test_no_route_where_a_gradient_is_wanted_or_too_many_rows(routed):
    q, k, v = rand(1, 2, 1, 16, seed=19).requires_grad_(), rand(1, 2, 50, 16, seed=20), rand(1, 2, 50, 16, seed=21)
    out = attnlab.attention(q, k, v, backend="native")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert routed["decode"] == 0
    with torch.no_grad():
        attnlab.attention(
            rand(1, 2, 2, 16, seed=22, dtype=torch.bfloat16), k.bfloat16(), v.bfloat16(), backend="native"
        )
        attnlab.attention(rand(1, 2, 5, 16, seed=23), k, v, backend="native")
    assert routed["decode"] == 0 and routed["tile"] == 3
    why = dense_decode.plan(q.detach(), k, v, masks.document(torch.zeros(50, dtype=torch.long)), None, 0.25, 0, 0)[1]
    assert why is not None and "mask" in why


def test_auto_runs_a_float32_decode_step_on_the_decode_kernel(routed):
    # SDPA's route checks every input for NaN/inf first (one more pass over K and V)
    q, k, v = rand(1, 8, 1, 64, seed=24), rand(1, 2, 512, 64, seed=25), rand(1, 2, 512, 64, seed=26)
    with torch.no_grad():
        assert choose_backend(q, k, None, None, 511, 0, False, v=v, scale=0.125) == "native"
        out = attnlab.attention(q, k, v, q_offset=511)
    assert routed["decode"] == 1
    torch.testing.assert_close(
        out, torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), rtol=1e-5, atol=2e-6
    )
    # with a gradient wanted, SDPA as before
    assert choose_backend(q.requires_grad_(), k, None, None, 511, 0, False, v=v) == "sdpa"
