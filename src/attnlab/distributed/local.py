"""The tile kernels a ring step runs on (local queries, one travelling K/V shard).

Forward: :func:`attnlab.attention` with ``return_lse=True`` (the flash backend: it
returns the LSE and skips the tiles the shard mask empties), in local coordinates
(``q_offset = kv_offset = 0``; :mod:`attnlab.distributed.views` maps to global positions).

Backward: the flash backward (:func:`attnlab.ops.flash.flash_backward`) run with the
*global* output and LSE of the local query rows, on the tile plan of the shared tile
engine (:mod:`attnlab.ops.tiling`: ``TileProblem``, ``pick_block_mask``).  With
``P = exp(S − LSE_global)`` and ``Δ = rowsum(dO ∘ O_global) − dLSE`` a shard's tiles give
exactly that shard's share of ``dq`` and its whole ``dk``/``dv`` contribution from these
queries, so the ring only has to add shares — no forward is recomputed (this is how
FlashAttention's ring implementations do it).

Score-mod parameters: :func:`mod_params` routes every tensor requiring grad that the mod
reads, declared (``parameters()``) or captured (a closure, a bound ``self``, a module:
:func:`attnlab.ops.modparams.score_mod_params`), so their gradients survive the ring as
they do in :func:`attnlab.attention`.
"""

from __future__ import annotations

import torch

from attnlab.ops.dispatch import attention
from attnlab.ops.flash import flash_backward
from attnlab.ops.modparams import score_mod_params
from attnlab.ops.tiles import choose_tiles
from attnlab.ops.tiling import TileProblem, pick_block_mask

__all__ = ["tile_forward", "tile_backward", "mod_params"]


def mod_params(score_mod, *, dtype=torch.float32, device=None) -> list[torch.Tensor]:
    """The tensors of a score mod that the tiled backward must differentiate, each once:
    its declared ``parameters()`` first (as before), then every tensor requiring grad it
    captures (:func:`attnlab.ops.modparams.score_mod_params`, probed on a 1×1 score of
    ``dtype`` on ``device``).  Raises ``ValueError`` for a mod that reads a tensor
    requiring grad that cannot be routed (pass it with ``scores.custom(fn, params=[...])``)."""
    out: list[torch.Tensor] = []
    if score_mod is None:
        return out
    if hasattr(score_mod, "parameters"):
        for p in score_mod.parameters():
            if not any(p is x for x in out):
                out.append(p)
    for p in score_mod_params(score_mod, dtype=dtype, device=torch.device("cpu") if device is None else device):
        if not any(p is x for x in out):
            out.append(p)
    return out


def tile_forward(q, k, v, *, mask, score_mod, scale):
    """``(out, lse)`` of local queries over one K/V shard (no autograd graph)."""
    with torch.no_grad():
        return attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=0,
            kv_offset=0,
            return_lse=True,
            backend="auto",
        )  # flash on CPU (it returns the LSE)


def tile_backward(q, k, v, out, lse, dout, dlse, *, mask, score_mod, scale, params):
    """``(dq, dk, dv, dparams)``: this K/V shard's share of the gradients, given the
    global ``out``/``lse`` of the local query rows and their incoming gradients
    (``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)``, ``out``/``dout``
    ``(B, H, Nq, Dv)``, ``lse``/``dlse`` ``(B, H, Nq)``; ``params`` from :func:`mod_params`)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if mask is not None:
        bm = pick_block_mask(mask, q.dtype, B, H, Nq, Nk, D, 0, 0, None, q.device)
        block = (bm.block_q, bm.block_k)
    else:
        bm, block = None, choose_tiles(q.dtype, D, B * H, q.device)
    pb = TileProblem(bm, score_mod, scale, 0, 0, Nq, Nk, *block)
    return flash_backward(pb, q, k, v, out, lse, dout, dlse, params)
