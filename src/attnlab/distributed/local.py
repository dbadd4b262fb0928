"""The tile kernels a ring step runs on (local queries, one travelling K/V shard).

Forward: :func:`attnlab.attention` with ``return_lse=True`` (the flash backend: it
returns the LSE and skips the tiles the shard mask empties), in local coordinates
(``q_offset = kv_offset = 0``; :mod:`attnlab.distributed.views` maps to global positions).

Backward: the flash backward of :mod:`attnlab.ops.flash` run with the *global* output
and LSE of the local query rows.  With ``P = exp(S − LSE_global)`` and
``Δ = rowsum(dO ∘ O_global) − dLSE`` a shard's tiles give exactly that shard's share of
``dq`` and its whole ``dk``/``dv`` contribution from these queries, so the ring only
has to add shares — no forward is recomputed (this is how FlashAttention's ring
implementations do it).  This file is the only place that reaches into the flash
kernel's internals (``_Problem``, ``_backward``, ``_pick_block_mask``).
"""

from __future__ import annotations

import torch

from attnlab.ops import flash as _flash
from attnlab.ops.dispatch import attention
from attnlab.ops.tiles import choose_tiles

__all__ = ["tile_forward", "tile_backward", "mod_params"]


def mod_params(score_mod) -> list[torch.Tensor]:
    """The learnable tensors of a score mod, each once."""
    out = []
    if score_mod is not None and hasattr(score_mod, "parameters"):
        for p in score_mod.parameters():
            if not any(p is x for x in out):
                out.append(p)
    return out


def tile_forward(q, k, v, *, mask, score_mod, scale):
    """``(out, lse)`` of local queries over one K/V shard (no autograd graph)."""
    with torch.no_grad():
        return attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, q_offset=0, kv_offset=0,
                         return_lse=True, backend="auto")  # flash on CPU (it returns the LSE)


def tile_backward(q, k, v, out, lse, dout, dlse, *, mask, score_mod, scale, params):
    """``(dq, dk, dv, dparams)``: this K/V shard's share of the gradients, given the
    global ``out``/``lse`` of the local query rows and their incoming gradients."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if mask is not None:
        bm = _flash._pick_block_mask(mask, q.dtype, B, H, Nq, Nk, D, 0, 0, None, q.device)
        block = (bm.block_q, bm.block_k)
    else:
        bm, block = None, choose_tiles(q.dtype, D, B * H, q.device)
    pb = _flash._Problem(bm, score_mod, scale, 0, 0, Nq, Nk, *block)
    return _flash._backward(pb, q, k, v, out, lse, dout, dlse, params)
