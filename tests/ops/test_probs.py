"""attention_probs' pattern path (one fused softmax) against the oracle's two-pass softmax."""

import math

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.ops.reference import reference_probs
from attnlab.positions import alibi_slopes

CASES = [
    ("none", None, None),
    ("causal", masks.causal(), None),
    ("window+alibi", masks.sliding_window(3), scores.alibi(alibi_slopes(4))),
    ("softcap, rows fully masked", masks.padding(torch.tensor([0, 5])), scores.softcap(2.0)),
    ("mod hides everything", None, lambda s, b, h, q, kv: torch.where(q < 7, s, float("-inf"))),
]


@pytest.mark.parametrize("name,mask,mod", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pattern_path_equals_the_two_pass_softmax(name, mask, mod, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 2, 11, 8, generator=g, dtype=dtype)
    p = attnlab.attention_probs(q, k, mask=mask, score_mod=mod)
    want, _ = reference_probs(q, k, mask=mask, score_mod=mod, scale=1 / math.sqrt(8), q_offset=2)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(p, want, atol=8 * eps, rtol=8 * eps)  # two roundings of one softmax
    assert not p.isnan().any()


def test_fully_masked_rows_are_zero_and_visible_nan_stays_nan():
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4)
    p = attnlab.attention_probs(q, k, mask=masks.padding(torch.tensor([0])))
    assert torch.equal(p, torch.zeros_like(p))
    q[0, 0, 1, 0] = float("nan")  # row 1 sees a NaN score: NaN, as on every backend
    p = attnlab.attention_probs(q, k, mask=masks.causal())
    assert p[0, 0, 1].isnan().all() and not p[0, 0, [0, 2]].isnan().any()
    k[0, 0, 4, 0] = float("nan")  # a NaN in a key that row 0 (q_pos 2) cannot see: no effect on it
    p = attnlab.attention_probs(torch.randn(1, 1, 3, 4), k, mask=masks.causal())
    assert not p[0, 0, :2].isnan().any() and p[0, 0, 2].isnan().all()
