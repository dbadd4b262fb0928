"""attnlab.interp.stats: the tiled one-pass head statistics against the materialized pattern.

The oracle is ``stats_from_probs(reference_probs(q.double(), k.double(), ...))``: the
float64 pattern of the reference backend, reduced to statistics by plain formulas
(``-Σ xlogy(p, p)``, sums of columns, a gather at ``q_pos - 1``).  The fast path must
match it

* in float64 to ``TOL64`` (both are exact up to summation order), and
* in float32 under the DESIGN.md rule: its error is at most 2x the error of the same
  statistics computed from the float32 reference pattern, plus the float32 floor
  (``tests.helpers.assert_close_rule``).

Small tiles (``BLOCKS``) make every problem cross many tiles, so the online rescaling,
the tile skipping and the per-tile sink / previous-token / key-set bookkeeping are all
exercised.  Scores are scaled up (``PEAK``) so rows are peaky and the running max
moves between tiles.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import masks, scores
from attnlab.interp.stats import HeadStats, head_stats, stats_from_probs
from attnlab.ops.reference import reference_probs
from tests.helpers import F32_ONLINE_STATS, F32_ONLINE_STATS_REL, F64_FLOOR, F64_SAME_SUMS, assert_close_rule, max_err

# Both sides compute the same sums in float64 in a different order (tiles vs whole rows)
# and entropy by a different formula (log l - t/l vs -Σ p log p): a few hundred ulps at
# most for rows of up to 1025 keys with |s| ~ 20.
TOL64 = 1e-12
FIELDS = ("entropy", "sink_mass", "prev_mass", "max_weight", "key_mass", "lse")
BLOCKS = (16, 32)
PEAK = 2.0  # q and k are N(0, PEAK²): scores of a few units to ~20, peaky softmax rows
B = 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the root conftest's one-thread fixture


def _ids(n):
    """Packed documents, non-decreasing ids over absolute positions 0..n-1 (lengths 7, 30, ...)."""
    cuts = [7, 37, 38, 80, 200, 700, 10**9]
    pos = torch.arange(n)
    return torch.bucketize(pos, torch.tensor(cuts), right=True)


def _keep(n):
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[0, :] = False  # batch 0 has no real token: every row fully masked
    keep[1, ::3] = False
    return keep


# name -> (H, Hkv, Nq, Nk, D, mask factory(Nk), score-mod factory(H), extra kwargs)
CASES = {
    "none_d40": (4, 4, 97, 97, 40, None, None, {}),
    "causal_d59": (4, 4, 97, 97, 59, lambda n: masks.causal(), None, {}),
    "sliding_window": (4, 4, 97, 97, 40, lambda n: masks.sliding_window(13), None, {}),
    "key_padding_empty_batch": (2, 2, 97, 97, 40, lambda n: masks.key_padding(_keep(n)) & masks.causal(), None, {}),
    "padding_empty_rows": (2, 2, 50, 50, 40, lambda n: masks.padding([0, 23]), None, {}),
    "document_causal": (2, 2, 97, 97, 40, lambda n: masks.document(_ids(n)) & masks.causal(), None, {}),
    "document": (2, 2, 97, 97, 40, lambda n: masks.document(_ids(n)), None, {}),
    "nq_lt_nk_default_offset": (4, 4, 17, 97, 40, lambda n: masks.causal(), None, {}),
    # keys at 8..104, queries at 3..19: rows 0..4 precede every key (fully masked); sink = 8, 9
    "q_offset_kv_offset": (
        4,
        4,
        17,
        97,
        40,
        lambda n: masks.causal(),
        None,
        dict(q_offset=3, kv_offset=8, sink_tokens=10),
    ),
    "nq_gt_nk_top_left": (2, 2, 97, 40, 40, lambda n: masks.causal(), None, dict(q_offset=0)),
    "gqa_8_2": (8, 2, 97, 97, 40, lambda n: masks.causal(), None, {}),
    "mqa_8_1": (8, 1, 97, 97, 59, lambda n: masks.sliding_window(20), None, {}),
    "alibi_causal": (
        4,
        4,
        97,
        97,
        40,
        lambda n: masks.causal(),
        lambda H: scores.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625])),
        {},
    ),
    "softcap_sliding": (4, 2, 97, 97, 59, lambda n: masks.sliding_window(30), lambda H: scores.softcap(5.0), {}),
    "negative_scale": (4, 2, 97, 97, 40, None, None, dict(scale=-0.3)),
    "negative_scale_causal": (4, 2, 97, 97, 40, lambda n: masks.causal(), None, dict(scale=-0.3)),
    "len1": (2, 1, 1, 1, 40, None, None, {}),
    "len1_causal": (2, 2, 1, 1, 59, lambda n: masks.causal(), None, {}),
    "decode_1_over_97": (4, 2, 1, 97, 40, lambda n: masks.causal(), None, {}),
    "len1025_causal": (2, 1, 1025, 1025, 40, lambda n: masks.causal(), None, dict(block=(64, 128), sink_tokens=4)),
    "len1025_none": (2, 2, 1025, 1025, 59, None, None, dict(block=(128, 64))),
    "key_bool_cols": (4, 2, 97, 97, 40, lambda n: masks.causal(), None, dict(key_positions=torch.arange(97) % 5 == 1)),
    "key_bool_batch": (
        4,
        2,
        97,
        97,
        40,
        lambda n: masks.sliding_window(40),
        None,
        dict(key_positions=torch.stack([torch.arange(97) < 10, torch.arange(97) % 2 == 0])),
    ),
    "key_long_positions_offset": (
        2,
        2,
        30,
        97,
        40,
        lambda n: masks.causal(),
        None,
        dict(kv_offset=5, key_positions=torch.tensor([5, 6, 50, 101])),
    ),
}


def _inputs(H, Hkv, Nq, Nk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Nq, D, generator=g, dtype=torch.float64) * PEAK).to(dtype)
    k = (torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64) * PEAK).to(dtype)
    return q, k


def _reference(
    q, k, *, mask=None, score_mod=None, scale=None, q_offset=None, kv_offset=0, sink_tokens=1, key_positions=None
):
    """stats_from_probs of the materialized reference pattern, in q's dtype's precision."""
    Nq, Nk, D = q.shape[2], k.shape[2], q.shape[3]
    qo = kv_offset + Nk - Nq if q_offset is None else q_offset
    p, lse = reference_probs(
        q,
        k,
        mask=mask,
        score_mod=score_mod,
        scale=D**-0.5 if scale is None else scale,
        q_offset=qo,
        kv_offset=kv_offset,
    )
    return stats_from_probs(
        p, q_offset=qo, kv_offset=kv_offset, sink_tokens=sink_tokens, key_positions=key_positions, lse=lse
    )


def _run(name, dtype):
    H, Hkv, Nq, Nk, D, mk, mod, extra = CASES[name]
    extra = dict(extra)
    bq, bk = extra.pop("block", BLOCKS)
    q, k = _inputs(H, Hkv, Nq, Nk, D, dtype)
    kw = dict(mask=mk(Nk) if mk else None, score_mod=mod(H) if mod else None, **extra)
    fast = head_stats(q, k, block_q=bq, block_k=bk, **kw)
    oracle = _reference(q.double(), k.double(), **kw)
    same = _reference(q, k, **kw)
    return fast, same, oracle


def _check_structure(st: HeadStats, ref: HeadStats):
    for f in FIELDS:
        x, r = getattr(st, f), getattr(ref, f)
        assert (x is None) == (r is None), f
        if x is None:
            continue
        assert x.shape == r.shape, f"{f}: shape {tuple(x.shape)} vs {tuple(r.shape)}"
        assert not torch.isnan(x).any(), f"{f}: NaN"
    assert st.valid.dtype == torch.bool
    assert torch.equal(st.valid, ref.valid), "valid differs from the reference"
    inv = ~st.valid
    for f in ("entropy", "sink_mass", "prev_mass", "max_weight", "key_mass"):
        x = getattr(st, f)
        if x is not None:
            assert (x[inv] == 0).all(), f"{f}: fully masked rows must be 0"
    assert (st.lse[inv] == float("-inf")).all() and torch.isfinite(st.lse[st.valid]).all()


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_materialized(name):
    fast, _, oracle = _run(name, torch.float64)
    assert fast.entropy.dtype == torch.float64
    _check_structure(fast, oracle)
    for f in FIELDS:
        if getattr(fast, f) is not None:
            e = max_err(getattr(fast, f), getattr(oracle, f))
            assert e <= TOL64, f"{name}.{f}: error {e:.3e} > {TOL64}"


@pytest.mark.parametrize("name", list(CASES))
def test_float32_within_reference_error(name):
    fast, same, oracle = _run(name, torch.float32)
    assert fast.entropy.dtype == torch.float32
    _check_structure(fast, oracle)
    for f in FIELDS:
        if getattr(fast, f) is not None:
            assert_close_rule(getattr(fast, f), getattr(same, f), getattr(oracle, f), torch.float32, what=f"{name}.{f}")


def test_bfloat16_within_reference_error():
    q, k = _inputs(4, 2, 97, 97, 64, torch.bfloat16)
    kw = dict(mask=masks.causal())
    fast = head_stats(q, k, block_q=16, block_k=32, **kw)
    assert fast.entropy.dtype == torch.float32  # statistics accumulate in float32
    same, oracle = _reference(q, k, **kw), _reference(q.double(), k.double(), **kw)
    for f in FIELDS:
        if getattr(fast, f) is not None:
            assert_close_rule(getattr(fast, f), getattr(same, f), getattr(oracle, f), torch.bfloat16, what=f)


def test_blockmask_and_noncontiguous_inputs():
    q, k = _inputs(4, 2, 97, 97, 40, torch.float64)
    q, k = q.transpose(2, 3).contiguous().transpose(2, 3), k[:, :, :, :]  # q non-contiguous
    assert not q.is_contiguous()
    m = masks.sliding_window(17)
    bm = m.block_mask(B, 4, 97, 97, block=(16, 16))
    fast = head_stats(q, k, mask=bm)
    oracle = _reference(q, k, mask=m)
    for f in ("entropy", "sink_mass", "prev_mass", "max_weight", "lse"):
        assert max_err(getattr(fast, f), getattr(oracle, f)) <= TOL64, f
    with pytest.raises(ValueError, match="block_q"):
        head_stats(q, k, mask=bm, block_q=32)


def test_default_tiles_match():
    """Without block sizes the flash backend's tiling is used; the answer is the same."""
    q, k = _inputs(2, 2, 300, 300, 40, torch.float64)
    fast = head_stats(q, k, mask=masks.causal())
    oracle = _reference(q, k, mask=masks.causal())
    for f in ("entropy", "sink_mass", "prev_mass", "max_weight", "lse"):
        assert max_err(getattr(fast, f), getattr(oracle, f)) <= TOL64, f


def test_fully_masked_rows_are_zero_never_nan():
    q, k = _inputs(2, 2, 33, 33, 40, torch.float32)
    st = head_stats(
        q, k, mask=masks.padding([0, 5]) & masks.causal(), key_positions=torch.tensor([0, 1]), block_q=8, block_k=8
    )
    assert not st.valid[0].any() and st.valid[1].all()
    for f in ("entropy", "sink_mass", "prev_mass", "max_weight", "key_mass"):
        x = getattr(st, f)
        assert not torch.isnan(x).any(), f
        assert (x[0] == 0).all(), f
    assert (st.lse[0] == float("-inf")).all()
    assert torch.isfinite(st.lse[1]).all()
    ph = st.per_head()
    assert ph["rows"].tolist() == [33, 33]  # batch 0's rows are not averaged
    for v in ph.values():
        assert not torch.isnan(v.double()).any()


def test_no_keys_at_all():
    q = torch.randn(1, 2, 5, 8)
    st = head_stats(q, torch.randn(1, 1, 0, 8))
    assert not st.valid.any() and (st.entropy == 0).all() and (st.lse == float("-inf")).all()
    assert head_stats(torch.randn(1, 2, 0, 8), torch.randn(1, 1, 4, 8)).entropy.shape == (1, 2, 0)
    assert (st.per_head()["entropy"] == 0).all()


@pytest.mark.parametrize("n", [1, 97, 1025])
def test_uniform_rows(n):
    """Equal scores: entropy log(visible keys), max weight = sink mass = 1/visible."""
    q, k = torch.zeros(1, 2, n, 16), torch.randn(1, 1, n, 16)
    st = head_stats(q, k, block_q=256, block_k=256)
    assert torch.allclose(st.entropy, torch.full_like(st.entropy, math.log(n)), **F32_ONLINE_STATS)
    assert torch.allclose(st.max_weight, torch.full_like(st.entropy, 1 / n), **F32_ONLINE_STATS_REL)
    st = head_stats(q, k, mask=masks.causal(), block_q=128, block_k=256)
    visible = torch.arange(1, n + 1, dtype=torch.float32)
    assert torch.allclose(st.entropy[0, 0], visible.log(), **F32_ONLINE_STATS)
    assert torch.allclose(st.sink_mass[0, 1], 1 / visible, **F32_ONLINE_STATS_REL)
    assert torch.allclose(st.prev_mass[0, 0, 1:], 1 / visible[1:], **F32_ONLINE_STATS_REL)
    assert st.prev_mass[0, 0, 0] == 0


def test_sink_tokens_and_key_positions_forms():
    q, k = _inputs(4, 2, 60, 60, 40, torch.float64)
    m = masks.sliding_window(25)
    st0 = head_stats(q, k, mask=m, sink_tokens=0, block_q=16, block_k=16)
    assert (st0.sink_mass == 0).all()
    st_all = head_stats(
        q, k, mask=m, sink_tokens=1000, key_positions=torch.ones(60, dtype=torch.bool), block_q=16, block_k=16
    )
    assert torch.allclose(st_all.sink_mass, torch.ones_like(st_all.sink_mass), **F64_FLOOR)
    assert torch.allclose(st_all.key_mass, torch.ones_like(st_all.key_mass), **F64_FLOOR)
    sel = torch.tensor([0, 3, 17, 41, 59])
    cols = torch.zeros(60, dtype=torch.bool)
    cols[sel] = True
    a = head_stats(q, k, mask=m, key_positions=sel, block_q=16, block_k=16).key_mass
    b = head_stats(q, k, mask=m, key_positions=cols, block_q=16, block_k=16).key_mass
    c = head_stats(q, k, mask=m, key_positions=cols.expand(B, 60), block_q=16, block_k=16).key_mass
    d = head_stats(q, k, mask=m, key_positions=sel.tolist(), block_q=16, block_k=16).key_mass
    assert (
        torch.allclose(a, b, **F64_SAME_SUMS)
        and torch.allclose(a, c, **F64_SAME_SUMS)
        and torch.allclose(a, d, **F64_SAME_SUMS)
    )
    assert a.max() > 0.05  # the set carries real weight, so the comparison means something


def test_empty_tiles_are_skipped():
    """With a sliding window, no tile the mask empties is ever scored: a recording score
    mod sees only tiles that hold at least one visible (q, kv) pair."""
    seen = []

    def record(s, b, h, qp, kp):
        seen.append((int(qp.min()), int(qp.max()), int(kp.min()), int(kp.max())))
        return s

    q, k = _inputs(2, 2, 97, 97, 40, torch.float64)
    w = 8
    st = head_stats(q, k, mask=masks.sliding_window(w), score_mod=scores.custom(record), block_q=16, block_k=16)
    n_tiles = 7 * 7
    assert 0 < len(seen) < n_tiles / 2
    for ql, qh, kl, kh in seen:
        assert not (kl > qh or ql - kh >= w), f"empty tile q {ql}..{qh} kv {kl}..{kh} was scored"
    assert st.valid.all()


def test_per_head_means():
    q, k = _inputs(4, 2, 40, 40, 40, torch.float64)
    st = head_stats(
        q, k, mask=masks.padding([0, 30]) & masks.causal(), key_positions=torch.tensor([2, 3]), block_q=16, block_k=16
    )
    for skip in (0, 1, 5):
        ph = st.per_head(skip_first=skip)
        assert set(ph) == {"entropy", "sink_mass", "prev_mass", "max_weight", "key_mass", "rows"}
        assert ph["rows"].tolist() == [40 - skip] * 4  # batch 0 is fully masked
        for f in ("entropy", "sink_mass", "prev_mass", "max_weight", "key_mass"):
            want = getattr(st, f)[1, :, skip:].mean(-1)
            assert ph[f].shape == (4,) and torch.allclose(ph[f], want, **F64_SAME_SUMS), (f, skip)
    assert (st.per_head(skip_first=100)["rows"] == 0).all()
    assert (st.per_head(skip_first=100)["entropy"] == 0).all()


def test_to_and_no_autograd():
    q, k = _inputs(2, 2, 10, 10, 8, torch.float64)
    q.requires_grad_(True)
    st = head_stats(q, k, mask=masks.causal())
    assert st.entropy.grad_fn is None and not st.entropy.requires_grad
    s32 = st.to(torch.float32)
    assert s32.entropy.dtype == torch.float32 and s32.valid.dtype == torch.bool and s32.key_mass is None
    assert torch.equal(s32.lse, st.lse.float())


def _q():
    return torch.randn(1, 4, 8, 16)


def _k():
    return torch.randn(1, 2, 8, 16)


ERRORS = [
    (lambda: head_stats(_q().numpy(), _k()), TypeError, "q"),
    (lambda: head_stats(_q(), _k()[0]), ValueError, "k"),
    (lambda: head_stats(_q(), torch.randn(1, 3, 8, 16)), ValueError, "H=4"),
    (lambda: head_stats(_q(), torch.randn(1, 2, 8, 12)), ValueError, "head dims"),
    (lambda: head_stats(_q(), _k().double()), TypeError, "dtype"),
    (lambda: head_stats(_q().int(), _k().int()), TypeError, "dtype"),
    (lambda: head_stats(_q(), _k(), mask=lambda *a: True), TypeError, "mask"),
    (lambda: head_stats(_q(), _k(), mask=masks.padding([1, 2])), ValueError, "padding"),
    (lambda: head_stats(_q(), _k(), score_mod=3), TypeError, "score_mod"),
    (lambda: head_stats(_q(), _k(), score_mod=scores.alibi(torch.ones(3))), ValueError, "alibi"),
    (lambda: head_stats(_q(), _k(), scale=0), ValueError, "scale"),
    (lambda: head_stats(_q(), _k(), q_offset=1.5), TypeError, "q_offset"),
    (lambda: head_stats(_q(), _k(), kv_offset="0"), TypeError, "kv_offset"),
    (lambda: head_stats(_q(), _k(), sink_tokens=-1), ValueError, "sink_tokens"),
    (lambda: head_stats(_q(), _k(), sink_tokens=1.0), TypeError, "sink_tokens"),
    (lambda: head_stats(_q(), _k(), key_positions=torch.ones(7, dtype=torch.bool)), ValueError, "key_positions"),
    (lambda: head_stats(_q(), _k(), key_positions=torch.ones(3, 8, dtype=torch.bool)), ValueError, "key_positions"),
    (lambda: head_stats(_q(), _k(), key_positions=torch.tensor([0.0, 1.0])), TypeError, "key_positions"),
    (lambda: head_stats(_q(), _k(), key_positions=torch.tensor([[0, 1]])), ValueError, "key_positions"),
    (lambda: head_stats(_q(), _k(), key_positions=torch.tensor([8])), ValueError, "key_positions"),
    (lambda: head_stats(_q(), _k(), kv_offset=2, key_positions=torch.tensor([1])), ValueError, "key_positions"),
    (lambda: head_stats(_q(), _k(), block_q=0), ValueError, "block_q"),
    (lambda: head_stats(_q(), _k(), block_k=2.5), TypeError, "block_k"),
    (lambda: head_stats(_q(), _k()).per_head(skip_first=-1), ValueError, "skip_first"),
    (lambda: head_stats(_q(), _k()).to(torch.int32), TypeError, "floating dtype"),
    (lambda: stats_from_probs(torch.rand(2, 3, 4)), ValueError, "probs"),
    (lambda: stats_from_probs([[1.0]]), TypeError, "probs"),
    (lambda: stats_from_probs(torch.rand(1, 1, 2, 2), lse=torch.zeros(1, 1, 3)), ValueError, "lse"),
    (lambda: stats_from_probs(torch.rand(1, 1, 2, 2), sink_tokens=-2), ValueError, "sink_tokens"),
]


@pytest.mark.parametrize("call,exc,name", ERRORS, ids=[f"{i}-{e[2]}" for i, e in enumerate(ERRORS)])
def test_argument_errors_name_the_argument(call, exc, name):
    with pytest.raises(exc, match=name):
        call()
