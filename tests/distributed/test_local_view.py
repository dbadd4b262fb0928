"""The ring's per-step kernels (distributed/local.py, views.py) in one process, no group.

A ring over ``P`` shards is simulated here exactly as ring.py runs it: for each rank's
queries, every shard's keys through ``tile_forward`` (shard views of the mask and score
mod), merged with ``merge_states``; then ``tile_backward`` per shard with the global
output and LSE, the shares summed.  A score mod's *captured* tensors (a closure's bias)
must get the gradient ``attention()`` gives them.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.distributed.layouts import shard_positions
from attnlab.distributed.local import mod_params, tile_backward, tile_forward
from attnlab.distributed.views import ShardMask, ShardScoreMod
from attnlab.ops.merge import merge_states
from tests.helpers import assert_close_rule

B, H, N, D, P = 1, 2, 12, 8, 2


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
    table = torch.randn(H, generator=g, dtype=torch.float64)

    def mod(s, b, h, qp, kp):  # reads `bias` from its closure: no parameters() declares it
        return s + bias[h] * torch.tanh((qp - kp).to(s.dtype) / 4) + table[h]

    return q, k, v, bias, mod


def _ring_in_process(q, k, v, mask, mod, layout):
    """Per rank: (positions, dq share, dparams) — the ring's arithmetic without messages."""
    params = mod_params(mod, dtype=torch.float64, device=q.device)
    pos = [shard_positions(N, P, r, layout) for r in range(P)]
    dq = torch.zeros_like(q)
    dparams = [torch.zeros_like(p) for p in params]
    scale = D**-0.5
    for r in range(P):
        qr = q[:, :, pos[r]]
        views = [(ShardMask(mask, pos[r], pos[s], N), ShardScoreMod(mod, pos[r], pos[s], N)) for s in range(P)]
        o = l = None
        for s in range(P):
            m, sm = views[s]
            o_s, l_s = tile_forward(qr, k[:, :, pos[s]], v[:, :, pos[s]], mask=m, score_mod=sm, scale=scale)
            o, l = (o_s, l_s) if o is None else merge_states([o, o_s], [l, l_s])
        dout = torch.ones_like(o)
        for s in range(P):
            m, sm = views[s]
            dq_s, _, _, dp = tile_backward(
                qr,
                k[:, :, pos[s]],
                v[:, :, pos[s]],
                o.to(q.dtype),
                l,
                dout,
                None,
                mask=m,
                score_mod=sm,
                scale=scale,
                params=params,
            )
            dq[:, :, pos[r]] += dq_s
            for acc, g in zip(dparams, dp, strict=True):
                acc += g
    return params, dparams, dq


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_closure_captured_bias_gets_the_gradient_attention_gives_it(layout):
    q, k, v, bias, mod = _problem()
    mask = masks.causal()
    params, dparams, dq = _ring_in_process(q, k, v, mask, mod, layout)
    assert any(p is bias for p in params), "the captured bias is not routed to the tiled backward"
    got = dparams[next(i for i, p in enumerate(params) if p is bias)]

    def grad_via(backend):
        qq = q.clone().requires_grad_()
        out = attnlab.attention(qq, k, v, mask=mask, score_mod=mod, backend=backend)
        return torch.autograd.grad(out.sum(), [bias, qq])

    flash_b, flash_q = grad_via("flash")
    ref_b, ref_q = grad_via("reference")
    assert float(ref_b.abs().max()) > 0.1  # the bias matters to the output
    assert_close_rule(got, flash_b, ref_b, torch.float64, factor=3.0, what=f"{layout} dbias")
    assert_close_rule(dq, flash_q, ref_q, torch.float64, factor=3.0, what=f"{layout} dq")


def test_shard_views_list_declared_and_captured_tensors():
    _, _, _, bias, mod = _problem()
    slopes = torch.ones(H, dtype=torch.float64, requires_grad=True)
    pos = shard_positions(N, P, 0, "zigzag")
    assert [p is bias for p in ShardScoreMod(mod, pos, pos, N).parameters()] == [True]
    both = scores.compose(scores.alibi(slopes), scores.custom(mod))
    got = mod_params(both, dtype=torch.float64)
    assert got[0] is slopes and any(p is bias for p in got)  # declared first, then captured, each once
    assert len(got) == 2
