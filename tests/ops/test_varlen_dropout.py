"""Dropout in attnlab.varlen_attention: the counter-based keep-mask of the packed problem
(``dropout_mask(1, H, total_q, total_k, q_offset=0)``), regenerated per tile in the backward.
Equal to a per-sequence oracle given that mask (forward and gradients, DESIGN.md rule),
reproducible for a seed, and keeping ``1 - p`` of the visible pairs."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.ops.dropout import dropout_mask
from tests.helpers import assert_close_rule
from tests.ops.test_varlen import LK, LQ, _cu, _packed

F64 = torch.float64
P = 0.3


def _varlen(q, k, v, backend="flash", seed=7, causal=True, p=P):
    return attnlab.varlen_attention(
        q, k, v, _cu(LQ), _cu(LK), causal=causal, dropout_p=p, dropout_seed=seed, backend=backend
    )


def _oracle(q, k, v, seed=7, p=P):
    """Per sequence: ``(P ∘ Z / (1 - p)) V`` with Z the packed problem's keep-mask slice."""
    H, G = q.shape[1], q.shape[1] // k.shape[1]
    z = dropout_mask(1, H, sum(LQ), sum(LK), p=p, seed=seed, q_offset=0)[0]
    cq, ck = _cu(LQ), _cu(LK)
    outs = []
    for s in range(len(LQ)):
        qs = q[cq[s] : cq[s + 1]].transpose(0, 1)[None]
        ks, vs = (t[ck[s] : ck[s + 1]].transpose(0, 1)[None] for t in (k, v))
        pr = attnlab.attention_probs(qs, ks, mask=masks.causal())[0]
        zs = z[:, cq[s] : cq[s + 1], ck[s] : ck[s + 1]]
        outs.append(((pr * zs / (1 - p)) @ vs[0].repeat_interleave(G, 0)).transpose(0, 1))
    return torch.cat(outs)


def _grads(fn, q, k, v):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return (out.detach(), *torch.autograd.grad((out * w).sum(), leaves))


def test_varlen_dropout_equals_the_oracle_given_the_same_keep_mask_forward_and_backward():
    q, k, v = _packed(LQ, LK)
    got = _grads(lambda q, k, v: _varlen(q, k, v), q, k, v)
    ref = _grads(lambda q, k, v: _varlen(q, k, v, backend="reference"), q, k, v)
    want = _grads(_oracle, q, k, v)
    for name, g, r, w in zip(("out", "dq", "dk", "dv"), got, ref, want, strict=True):
        assert_close_rule(g, r, w, F64, factor=2.0 if name == "out" else 3.0, what=name)
    no_drop = attnlab.varlen_attention(q, k, v, _cu(LQ), _cu(LK), causal=True)
    assert (got[0] - no_drop).abs().max() > 0.1  # dropout did something


def test_varlen_dropout_is_reproducible_for_a_seed_and_fresh_per_call_without_one():
    q, k, v = _packed(LQ, LK)
    a, b, c = _varlen(q, k, v, seed=3), _varlen(q, k, v, seed=3), _varlen(q, k, v, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(0)
    d = _varlen(q, k, v, seed=None)
    e = _varlen(q, k, v, seed=None)
    torch.manual_seed(0)
    assert torch.equal(d, _varlen(q, k, v, seed=None)) and not torch.equal(d, e)
    f = _varlen(q, k, v, seed=torch.Generator().manual_seed(9))
    assert torch.equal(f, _varlen(q, k, v, seed=torch.Generator().manual_seed(9)))


def test_varlen_dropout_keeps_one_minus_p_of_the_visible_pairs_and_no_hidden_one():
    """With V the identity (each key its own one-hot value) the output row is ``P ∘ Z / (1 - p)``:
    the kept pairs can be read off it."""
    H = 2
    tk = sum(LK)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(LQ), H, 4, dtype=F64, generator=g)
    k = torch.randn(tk, H, 4, dtype=F64, generator=g)
    v = torch.eye(tk, dtype=F64).unsqueeze(1).expand(tk, H, tk).contiguous()
    out = _varlen(q, k, v, seed=11, causal=False).transpose(0, 1)  # (H, total_q, total_k)
    probs = attnlab.varlen_attention(q, k, v, _cu(LQ), _cu(LK)).transpose(0, 1)  # P itself (no dropout)
    visible = probs > 0
    kept = out > 0
    z = dropout_mask(1, H, sum(LQ), tk, p=P, seed=11, q_offset=0)[0]
    assert torch.equal(kept, visible & z)  # exactly the packed keep-mask, nothing across sequences
    torch.testing.assert_close(out[kept], probs[kept] / (1 - P), atol=1e-12, rtol=1e-12)
    n = int(visible.sum())
    rate = int(kept.sum()) / n
    assert abs(rate - (1 - P)) < 5 * math.sqrt(P * (1 - P) / n), (rate, n)  # 5 sigma of a binomial


def test_varlen_dropout_bad_arguments_are_refused():
    q, k, v = _packed(LQ, LK)
    with pytest.raises(ValueError, match="dropout_p"):
        _varlen(q, k, v, p=-0.1)
    with pytest.raises(TypeError, match="dropout_seed"):
        _varlen(q, k, v, seed="7")
