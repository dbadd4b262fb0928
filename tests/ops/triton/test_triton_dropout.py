"""Dropout in the Triton kernels (interpreter, CPU): the kernels hash the same counters
as :mod:`attnlab.ops.dropout`, so with one seed they meet the DESIGN.md rule against
the float64 reference *with dropout*, forward and backward, at any tiling."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks, scores
from tests.helpers import assert_close_rule
from tests.ops.conftest import loss_weights, make_qkv
from tests.ops.triton.conftest import BF16, F32, TRITON

pytestmark = TRITON


def _run(q, k, v, backend, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attnlab.attention(q, k, v, return_lse=True, backend=backend, **kw)
    w, c = loss_weights(*out.shape)
    loss = (out.double() * w).sum() + (torch.where(torch.isinf(lse), 0, lse).double() * c).sum()
    return dict(
        zip(
            ("out", "lse", "dq", "dk", "dv"),
            (out.detach(), lse.detach(), *torch.autograd.grad(loss, (q, k, v))),
            strict=True,
        )
    )


CASES = {  # (B, H, Hkv, Nq, Nk, D, Dv), mask, score mod
    "gqa-causal": ((1, 4, 2, 19, 24, 16, 16), masks.causal(), None),
    "mqa-window-alibi": ((1, 2, 1, 20, 45, 40, 24), masks.sliding_window(7), scores.alibi(torch.tensor([0.5, 0.25]))),
    "none-negative-offsets": ((1, 2, 2, 17, 17, 16, 16), None, None),
}


@pytest.mark.parametrize("tiles", [None, 16], ids=["tiles32", "tiles16"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_dropout_meets_the_rule_with_the_same_seed(case, tiles, request):
    if tiles:
        request.getfixturevalue("tiles16")
    shape, mask, mod = CASES[case]
    q, k, v = make_qkv(*shape, dtype=F32, seed=2)
    kw = dict(mask=mask, score_mod=mod, dropout_p=0.3, dropout_seed=2**63 + 5)
    if case.startswith("none"):
        kw.update(q_offset=-4, kv_offset=-9)
    oracle = _run(q.double(), k.double(), v.double(), "reference", **kw)
    ref = _run(q, k, v, "reference", **kw)
    fast = _run(q, k, v, "triton", **kw)
    for key in fast:
        assert_close_rule(
            fast[key], ref[key], oracle[key], F32, factor=2.0 if key in ("out", "lse") else 3.0, what=f"{case} {key}"
        )


def test_triton_dropout_bf16_and_reproducible():
    q, k, v = make_qkv(1, 2, 2, 24, 24, 16, dtype=BF16, seed=3)
    kw = dict(mask=masks.causal(), dropout_p=0.5, dropout_seed=8)
    oracle = _run(q.double(), k.double(), v.double(), "reference", **kw)
    ref = _run(q, k, v, "reference", **kw)
    fast = _run(q, k, v, "triton", **kw)
    for key in fast:
        assert_close_rule(
            fast[key], ref[key], oracle[key], BF16, factor=2.0 if key in ("out", "lse") else 3.0, what=key
        )
    assert torch.equal(fast["out"], attnlab.attention(q, k, v, backend="triton", **kw))
