"""The exact tile map of packed varlen problems (ops/varlen_tiles.py): every tile's state
equals the truth from the dense mask (property test over lengths, windows and tiles), it
skips the cross-sequence tiles that masks.varlen marks partial but are empty, and it is
cached by content, so a model's layers share it."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

import attnlab
from attnlab import masks
from attnlab.bench.varlen import ragged_lengths
from attnlab.ops.varlen_tiles import exact_states, varlen_block_mask
from tests.helpers import assert_tiles_sound, mask_dense


def _cu(lens):
    return torch.tensor([0, *lens]).cumsum(0)


side = st.one_of(st.none(), st.integers(0, 12))


@settings(max_examples=60, deadline=None)
@given(
    lq=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    extra=st.lists(st.integers(-5, 12), min_size=6, max_size=6),
    left=side,
    right=side,
    bq=st.sampled_from([4, 8, 16]),
    bk=st.sampled_from([4, 8, 16]),
)
def test_exact_states_equal_the_dense_truth(lq, extra, left, right, bq, bk):
    lk = [max(0, a + e) for a, e in zip(lq, extra, strict=False)]
    if sum(lq) == 0 or sum(lk) == 0:
        return
    m = masks.varlen(_cu(lq), _cu(lk), window=(left, right))
    Nq, Nk = sum(lq), sum(lk)
    states = exact_states(m.cu_q, m.cu_k, m.left, m.right, Nq, Nk, bq, bk)
    assert_tiles_sound(states, mask_dense(m, 1, 1, Nq, Nk, 0, 0), bq, bk, "varlen exact", exact=True)


def test_the_ragged_batch_skips_empty_cross_sequence_tiles_the_mask_marks_partial():
    lens = ragged_lengths(16, 64, 2048)
    m = masks.varlen(_cu(lens), _cu(lens), window=(None, 0))
    N = sum(lens)
    bm_mask = m.block_mask(1, 8, N, N, block=(128, 128))
    ex = exact_states(m.cu_q, m.cu_k, m.left, m.right, N, N, 128, 128)
    assert ((bm_mask.states == 1) & (ex == 0)).sum() > 0.3 * (bm_mask.states == 1).sum()  # a third of them
    assert not ((bm_mask.states != 1) & (ex != bm_mask.states)).any()  # the exact verdicts agree


def test_the_map_is_shared_by_calls_with_equal_cu_seqlens():
    lens = [5, 9, 3]
    a = varlen_block_mask(masks.varlen(_cu(lens), window=(None, 0)), 2, 8, torch.float64)
    b = varlen_block_mask(masks.varlen(_cu(lens).to(torch.int32), window=(None, 0)), 2, 8, torch.float64)
    c = varlen_block_mask(masks.varlen(_cu(lens), window=(2, 0)), 2, 8, torch.float64)
    assert a is b and c is not a
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    out = attnlab.varlen_attention(q, k, v, _cu(lens), _cu(lens), causal=True)
    ref = attnlab.varlen_attention(q, k, v, _cu(lens), _cu(lens), causal=True, backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
