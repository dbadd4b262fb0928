"""attnlab.varlen_attention (ops/varlen.py), flash-attn's flash_attn_varlen_func form:
parity with one attention call per sequence, forward and backward, and exact tile skipping."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks, scores
from tests.helpers import FLOOR, assert_close_rule, assert_tiles_sound, mask_dense, max_err, tile_truth

F64 = torch.float64
LQ = [5, 0, 17, 40, 3, 1]
LK = [9, 4, 17, 33, 60, 1]


def _cu(lens):
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def _packed(lq, lk, H=4, Hkv=2, D=16, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(sum(lq), H, D, generator=g, dtype=dtype),
        torch.randn(sum(lk), Hkv, D, generator=g, dtype=dtype),
        torch.randn(sum(lk), Hkv, D, generator=g, dtype=dtype),
    )


def _per_sequence(q, k, v, lq, lk, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """One attnlab.attention call per sequence ((1, H, L, D), bottom-right): the oracle."""
    cq, ck = _cu(lq), _cu(lk)
    outs, lses = [], []
    left, right = window
    if causal:
        right = 0
    for s in range(len(lq)):
        qs = q[cq[s] : cq[s + 1]].transpose(0, 1)[None]
        ks, vs = (t[ck[s] : ck[s + 1]].transpose(0, 1)[None] for t in (k, v))
        m = None if (left, right) == (-1, -1) else masks.band(left, right)
        mods = [scores.softcap(softcap)] if softcap else []
        if slopes is not None:
            mods.append(scores.alibi(slopes[s] if slopes.dim() == 2 else slopes, symmetric=True))
        mod = None if not mods else scores.compose(*mods)
        o, lse = attnlab.attention(qs, ks, vs, mask=m, score_mod=mod, return_lse=True, backend="reference")
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


CASES = {
    "full": {},
    "causal": dict(causal=True),
    "window": dict(window=(3, 2)),
    "left_only": dict(window=(7, -1)),
    "causal_window": dict(causal=True, window=(4, -1)),
    "softcap": dict(causal=True, softcap=2.0),
    "alibi_h": dict(causal=True, slopes="h"),
    "alibi_bh": dict(slopes="bh", window=(5, 5)),
}


def _kw(case, H=4):
    kw = dict(CASES[case])
    if kw.get("slopes") == "h":
        kw["slopes"] = torch.linspace(0.1, 0.8, H, dtype=F64)
    elif kw.get("slopes") == "bh":
        kw["slopes"] = torch.rand(len(LQ), H, generator=torch.Generator().manual_seed(5), dtype=F64)
    return kw


def _call(q, k, v, lq, lk, backend="flash", **kw):
    return attnlab.varlen_attention(
        q,
        k,
        v,
        _cu(lq),
        _cu(lk),
        max(lq),
        max(lk),
        causal=kw.get("causal", False),
        window_size=kw.get("window", (-1, -1)),
        softcap=kw.get("softcap", 0.0),
        alibi_slopes=kw.get("slopes"),
        return_lse=True,
        backend=backend,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_matches_per_sequence_attention(case):
    kw = _kw(case)
    q, k, v = (t.requires_grad_() for t in _packed(LQ, LK))
    out, lse = _call(q, k, v, LQ, LK, **kw)
    ref, rlse = _per_sequence(q, k, v, LQ, LK, **kw)
    assert out.shape == (sum(LQ), 4, 16) and lse.shape == (4, sum(LQ))
    assert max_err(out, ref) <= 1e-12 and max_err(lse, rlse) <= 1e-12
    fin = torch.isfinite(rlse)
    g = torch.autograd.grad(out.pow(2).sum() + lse[fin].sum(), (q, k, v))
    gr = torch.autograd.grad(ref.pow(2).sum() + rlse[fin].sum(), (q, k, v))
    for a, b in zip(g, gr, strict=True):
        assert max_err(a, b) <= 1e-11


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_low_precision_meets_the_rule(dtype):
    kw = _kw("causal")
    q, k, v = _packed(LQ, LQ, dtype=dtype)
    out, _ = _call(q, k, v, LQ, LQ, **kw)
    ref_same, _ = _per_sequence(q, k, v, LQ, LQ, **kw)
    oracle, _ = _per_sequence(q.double(), k.double(), v.double(), LQ, LQ, **kw)
    assert_close_rule(out, ref_same, oracle, dtype)


def test_varlen_reference_backend_and_flash_name():
    q, k, v = _packed(LQ, LK)
    a = attnlab.flash_attn_varlen_func(q, k, v, _cu(LQ), _cu(LK), max(LQ), max(LK), causal=True)
    b = attnlab.varlen_attention(q, k, v, _cu(LQ), _cu(LK), max(LQ), max(LK), causal=True, backend="reference")
    out, lse, probs = attnlab.varlen_attention(q, k, v, _cu(LQ), _cu(LK), causal=True, return_attn_probs=True)
    assert max_err(a, b) <= 1e-12 and max_err(out, a) <= FLOOR[F64] and probs is None and lse.shape == (4, sum(LQ))


@pytest.mark.parametrize("window", [(None, None), (None, 0), (3, 2), (7, None), (0, 0)])
@pytest.mark.parametrize("block", [(4, 8), (16, 16), (3, 5)])
def test_varlen_mask_tiles_exact_and_sparse(window, block):
    """Tiles across two sequences are EMPTY (skipped: no padding, no wasted tile), and the
    classification is exact for tiles inside one sequence."""
    m = masks.varlen(_cu(LQ), _cu(LK), window=window)
    Nq, Nk = sum(LQ), sum(LK)
    bm = m.block_mask(1, 1, Nq, Nk, q_offset=0, block=block)
    dense = mask_dense(m, 1, 1, Nq, Nk, 0, 0)
    assert_tiles_sound(bm.states.expand(1, 1, -1, -1), dense, *block, f"varlen {window}", exact=False)
    same_seq = mask_dense(masks.varlen(_cu(LQ), _cu(LK)), 1, 1, Nq, Nk, 0, 0)
    anyt, _ = tile_truth(same_seq, *block)
    assert (bm.states[0, 0][~anyt[0, 0]] == 0).all(), "a tile between two sequences is not skipped"
    if window == (None, None):
        assert_tiles_sound(bm.states.expand(1, 1, -1, -1), dense, *block, "varlen", exact=True)


def test_varlen_errors():
    q, k, v = _packed(LQ, LK)
    cq, ck = _cu(LQ), _cu(LK)
    with pytest.raises(ValueError, match=r"q: varlen expects 3 dims \(total_q, H, D\)"):
        attnlab.varlen_attention(q[None], k, v, cq, ck)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=.* must equal the packed lengths"):
        attnlab.varlen_attention(q[:-1], k, v, cq, ck)
    with pytest.raises(ValueError, match=r"max_seqlen_q=3 is shorter than the longest sequence \(40\)"):
        attnlab.varlen_attention(q, k, v, cq, ck, 3, 60)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: must be non-decreasing"):
        attnlab.varlen_attention(q, k, v, cq, torch.tensor([0, 9, 4, 30, 63, 123, 124]))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must hold the same number"):
        attnlab.varlen_attention(q, k, v, cq, ck[:-1])
    with pytest.raises(ValueError, match="dropout_p"):
        attnlab.varlen_attention(q, k, v, cq, ck, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes: 3 slopes for H=4"):
        attnlab.varlen_attention(q, k, v, cq, ck, alibi_slopes=torch.ones(3, dtype=F64))


def test_bench_varlen_runs_tiny():
    from attnlab.bench import varlen

    row = varlen.run(seqs=3, lo=8, hi=40, heads=2, dim=8, reps=1, memory=False)
    assert row["total_tokens"] == sum(row["lengths"]) and row["varlen_s"] > 0 and row["sdpa_padded_s"] > 0
    assert sorted(row["lengths"]) == [8, 24, 40]
