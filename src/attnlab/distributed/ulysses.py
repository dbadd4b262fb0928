"""Ulysses attention (DeepSpeed-Ulysses): trade sequence shards for head shards.

On each of ``P`` ranks::

    q (B, H, C, D) sequence shard ──all-to-all──> (B, H/P, N, D) every position, H/P heads
    attention(...) with any attnlab backend, in global positions (mask and score mod
                     see global positions and global head indices)
    out (B, H/P, N, Dv) ──all-to-all──> (B, H, C, Dv) back to the sequence shard

One all-to-all carries q, k and v together (and one carries their gradients back).
After it, the shards of every layout are put back in global order and the padding is
dropped, so the local call is the plain single-process problem on ``N`` tokens.

Heads: ``H % P == 0`` is required (else a ``ValueError`` says so).  K/V heads go where
their query heads are: with ``Hkv % P == 0`` each rank gets ``Hkv/P`` of them; with
fewer K/V heads than ranks (GQA/MQA, ``P % Hkv == 0``) each K/V head is replicated to
the ``P/Hkv`` ranks that need it; in any other case each rank receives, per local
query head, the K/V head it reads (correct, more traffic).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from attnlab.distributed.args import check_call, handshake
from attnlab.distributed.comm import Comm
from attnlab.distributed.layouts import padded_len, shard_positions
from attnlab.distributed.local import mod_params
from attnlab.distributed.profile import Timer
from attnlab.distributed.views import HeadScoreMod, HeadView
from attnlab.masks import Mask
from attnlab.ops.dispatch import BACKENDS, attention
from attnlab.ops.reference import acc_dtype

__all__ = ["ulysses_attention", "kv_heads_for"]


def kv_heads_for(H: int, Hkv: int, P: int, rank: int) -> tuple[list[int], int]:
    """The K/V heads rank ``rank`` receives (global indices, local order) and the number of
    local query heads that share each of them (the local GQA group)."""
    if H % P:
        raise ValueError(
            f"ulysses_attention: H={H} query heads cannot be split over {P} ranks (H % P = {H % P}); "
            "use a group whose size divides H, or ring_attention (it does not split heads)"
        )
    Hl, G = H // P, H // Hkv
    lo = rank * Hl
    if G % Hl == 0:  # every local query head reads the same K/V head (replicated when Hkv < P)
        return [lo // G], Hl
    if Hl % G == 0:  # whole GQA groups per rank
        return list(range(lo // G, (lo + Hl) // G)), G
    return [h // G for h in range(lo, lo + Hl)], 1  # one K/V head per local query head


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its adjoint is the same all-to-all."""

    @staticmethod
    def forward(ctx, x, comm, what):
        ctx.comm, ctx.what = comm, what
        return comm.all_to_all(torch.empty_like(x), x.contiguous(), what)

    @staticmethod
    def backward(ctx, g):
        what = f"the gradients of {ctx.what}".replace(", forward)", ", backward)")
        return ctx.comm.all_to_all(torch.empty_like(g), g.contiguous(), what), None, None


def _head_free(mask) -> bool:
    """True when no part of ``mask`` can depend on the head index (built-ins other than custom)."""
    if mask is None:
        return True
    if not isinstance(mask, Mask) or type(mask).__module__ != "attnlab.masks" or type(mask).__name__ == "_Custom":
        return False
    return all(_head_free(getattr(mask, c)) for c in ("a", "b") if hasattr(mask, c))


def ulysses_attention(
    q,
    k,
    v,
    *,
    group=None,
    mask=None,
    score_mod=None,
    scale=None,
    layout: str = "contiguous",
    seq_len: int | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    timeout=None,
):
    """Attention of a sequence sharded over ``group`` by head-parallel all-to-alls.

    Same inputs, outputs and conventions as :func:`attnlab.distributed.ring_attention`
    (shards in ``layout``, global positions, padded rows 0 / ``-inf``), plus
    ``backend`` for the local attention (any of :data:`attnlab.BACKENDS`).
    """
    comm = Comm(group, timeout, "ulysses_attention")
    P, r = comm.world, comm.rank
    error, N = None, seq_len
    try:
        scale, N = check_call(
            "ulysses_attention",
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            layout=layout,
            seq_len=seq_len,
            return_lse=return_lse,
            world=P,
        )
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        kv_idx, _ = kv_heads_for(q.shape[1], k.shape[1], P, r)  # raises for H % P != 0
        params: Sequence[torch.Tensor] = mod_params(
            score_mod, dtype=acc_dtype(q.dtype), device=q.device
        )  # declared or captured
    except (ValueError, TypeError) as e:  # every rank learns of it in the handshake, not by a timeout
        error = e
        params = ()
    handshake(
        comm,
        "ulysses_attention",
        q,
        k,
        v,
        seq_len=N,
        layout=layout,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        return_lse=return_lse,
        backend=backend,
        params=params,
        error=error,
    )
    N = cast(int, N)  # the handshake raised on every rank unless check_call resolved it
    B, H, C, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    Hl, nkv = H // P, len(kv_idx)
    timer = Timer("ulysses", 0, True)
    b0 = comm.bytes_sent

    # -- sequence shards -> head shards: one all-to-all for q, k and v -------------------
    with timer.wait():
        parts = []
        for dst in range(P):
            idx = torch.tensor(kv_heads_for(H, Hkv, P, dst)[0], device=q.device)
            parts += [
                q[:, dst * Hl : (dst + 1) * Hl].reshape(-1),
                k.index_select(1, idx).reshape(-1),
                v.index_select(1, idx).reshape(-1),
            ]
        got = _AllToAll.apply(torch.cat(parts), comm, "the q/k/v all-to-all (sequence to heads, forward)")
        nq, nk, nv = B * Hl * C * D, B * nkv * C * D, B * nkv * C * Dv
        got = got.view(P, nq + nk + nv)
        qs = got[:, :nq].reshape(P, B, Hl, C, D)
        ks = got[:, nq : nq + nk].reshape(P, B, nkv, C, D)
        vs = got[:, nq + nk :].reshape(P, B, nkv, C, Dv)
    pos = torch.cat([shard_positions(N, P, s, layout, device=q.device) for s in range(P)])
    order = torch.argsort(pos)[:N]  # concatenated shard order -> global order, padding dropped

    def to_global(x):  # (P, B, h, C, d) -> (B, h, N, d)
        return x.permute(1, 2, 0, 3, 4).reshape(x.shape[1], x.shape[2], P * C, x.shape[-1]).index_select(2, order)

    qg, kg, vg = to_global(qs), to_global(ks), to_global(vs)

    # -- local attention over the whole sequence, heads r*Hl .. (r+1)*Hl-1 -----------------
    m = mask if _head_free(mask) else HeadView(mask, r * Hl, Hl, H)
    mod = None if score_mod is None else HeadScoreMod(score_mod, r * Hl, H, device=q.device)
    with timer.compute():
        res = attention(
            qg,
            kg,
            vg,
            mask=m,
            score_mod=mod,
            scale=scale,
            q_offset=0,
            kv_offset=0,
            return_lse=return_lse,
            backend=backend,
        )
    out, lse = res if return_lse else (res, None)

    # -- head shards -> sequence shards ----------------------------------------------------
    pad = padded_len(N, P, layout) - N

    def to_shards(x, fill):  # (B, h, N, d) -> flat (P, B, h, C, d) ordered by destination rank
        if pad:
            x = torch.cat([x, x.new_full((*x.shape[:2], pad, *x.shape[3:]), fill)], dim=2)
        x = x.index_select(2, pos)  # the shards' positions are a permutation of 0 .. padded_len-1
        return x.reshape(x.shape[0], x.shape[1], P, C, *x.shape[3:]).movedim(2, 0).reshape(-1)

    with timer.wait():
        back = _AllToAll.apply(to_shards(out, 0), comm, "the output all-to-all (heads to sequence, forward)")
        o = back.view(P, B, Hl, C, Dv).permute(1, 0, 2, 3, 4).reshape(B, H, C, Dv)
        if return_lse and lse is not None:
            lb = _AllToAll.apply(
                to_shards(lse.unsqueeze(-1), float("-inf")), comm, "the LSE all-to-all (heads to sequence, forward)"
            )
            lse = lb.view(P, B, Hl, C).permute(1, 0, 2, 3).reshape(B, H, C)
    timer.done(comm.bytes_sent - b0)
    return (o, lse) if return_lse else o
