"""Sequence layouts: which global positions each rank holds, and sharding helpers.

A sequence of ``seq_len`` tokens is padded to ``padded_len`` and cut into ``P``
shards of ``C = padded_len / P`` tokens.  Rank ``r`` holds, in increasing order of
global position (P = 4 here, ``c = C/2`` for zigzag)::

    contiguous  [r·C, (r+1)·C)                       rank 0: 0..C-1      rank 3: 3C..4C-1
    zigzag      chunks r and 2P-1-r of size c        rank 0: chunks 0,7  rank 3: chunks 3,4
    striped     r, r+P, r+2P, ...                     rank 0: 0,4,8,...   rank 3: 3,7,11,...

Under a causal mask the contiguous layout gives rank ``P-1`` about ``2P-1`` times the
work of rank 0; zigzag pairs an early chunk with a late one and striped interleaves
every token, so both balance the triangle (:func:`work_per_rank` counts it).

Padding: ``padded_len`` is the next multiple of ``P`` (``2P`` for zigzag).  Padded
slots get the global positions ``seq_len, seq_len+1, ...``; ring and Ulysses attention
never let a real query see them, and give padded query rows output 0 and LSE ``-inf``.
:func:`shard_sequence` fills them with zeros; :func:`unshard_sequence` drops them.

>>> shard_positions(10, 2, 0, "zigzag").tolist(), shard_positions(10, 2, 1, "zigzag").tolist()
([0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8])
>>> x = torch.arange(10).view(1, 10)
>>> parts = [shard_sequence(x, dim=1, layout="striped", rank=r, world_size=3) for r in range(3)]
>>> [p.tolist() for p in parts]
[[[0, 3, 6, 9]], [[1, 4, 7, 0]], [[2, 5, 8, 0]]]
>>> unshard_sequence(parts, dim=1, seq_len=10, layout="striped").tolist()
[[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnlab.ops.sdpa import is_causal_mask
from attnlab.validate import int_in, integer

__all__ = [
    "LAYOUTS",
    "padded_len",
    "shard_len",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "work_per_rank",
    "balance",
]

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def padded_len(seq_len: int, world_size: int, layout: str) -> int:
    """``seq_len`` rounded up to a multiple of ``world_size`` (``2·world_size`` for zigzag)."""
    seq_len = integer(seq_len, "seq_len", lo=0)
    world_size = integer(world_size, "world_size", lo=1)
    m = world_size * (2 if check_layout(layout) == "zigzag" else 1)
    return -(-seq_len // m) * m


def shard_len(seq_len: int, world_size: int, layout: str) -> int:
    """Tokens per rank (padding included)."""
    return padded_len(seq_len, world_size, layout) // world_size


def shard_positions(seq_len: int, world_size: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """Global positions of rank ``rank``'s shard, increasing, as a LongTensor ``(C,)``;
    entries ``>= seq_len`` are padding."""
    world_size = integer(world_size, "world_size", lo=1)
    rank = int_in(rank, "rank", 0, world_size, interval=f"[0, world_size={world_size})")
    C = shard_len(seq_len, world_size, layout)
    i = torch.arange(C, device=device)
    if layout == "contiguous":
        return i + rank * C
    if layout == "striped":
        return rank + world_size * i
    c = C // 2
    return torch.where(i < c, rank * c + i, (2 * world_size - 1 - rank) * c + (i - c))


def _world_rank(group, rank, world_size):
    if rank is None or world_size is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("rank, world_size: pass both, or initialize torch.distributed (then the group's are used)")
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    return rank, world_size


def _dim(x: torch.Tensor, dim) -> int:
    note = f" (a dimension of a {x.dim()}-D tensor: the sequence dim)"
    return int_in(dim, "dim", -x.dim(), x.dim(), note=note) % x.dim()


def shard_sequence(
    x: torch.Tensor,
    *,
    dim: int,
    layout: str = "contiguous",
    rank: int | None = None,
    world_size: int | None = None,
    group=None,
) -> torch.Tensor:
    """This rank's shard of the whole sequence ``x`` along ``dim`` (zero-padded).

    ``rank``/``world_size`` default to the group's (``torch.distributed`` must then be
    initialized).  Every rank holds the whole ``x`` (token ids, or the inputs of a test);
    the result is a new tensor of length :func:`shard_len` along ``dim``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    d = _dim(x, dim)
    rank, world_size = _world_rank(group, rank, world_size)
    N = x.shape[d]
    pos = shard_positions(N, world_size, rank, check_layout(layout), device=x.device)
    valid = pos < N
    out = (
        x.index_select(d, pos.clamp(max=max(N - 1, 0)))
        if N
        else x.new_zeros((*x.shape[:d], pos.numel(), *x.shape[d + 1 :]))
    )
    if not bool(valid.all()):
        shape = [1] * x.dim()
        shape[d] = pos.numel()
        out = out.masked_fill(~valid.view(shape), 0)
    return out


def unshard_sequence(shards: Sequence[torch.Tensor], *, dim: int, seq_len: int, layout: str = "contiguous"):
    """Inverse of :func:`shard_sequence`: the whole sequence (length ``seq_len`` along
    ``dim``) from every rank's shard, in rank order; padding is dropped."""
    shards = list(shards)
    if not shards or not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError("shards: expected a non-empty sequence of tensors (one per rank, in rank order)")
    P = len(shards)
    d = _dim(shards[0], dim)
    C = shard_len(seq_len, P, check_layout(layout))
    for r, s in enumerate(shards):
        if s.shape[d] != C or s.shape[:d] != shards[0].shape[:d] or s.shape[d + 1 :] != shards[0].shape[d + 1 :]:
            raise ValueError(
                f"shards: shard {r} has shape {tuple(s.shape)}; expected length {C} along dim {dim} "
                f"(seq_len={seq_len}, {P} ranks, layout={layout!r}) and the shape of shard 0"
            )
    cat = torch.cat(shards, dim=d)
    pos = torch.cat([shard_positions(seq_len, P, r, layout, device=cat.device) for r in range(P)])
    order = torch.argsort(pos)[:seq_len]
    return cat.index_select(d, order)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, d, seq_len, layout):
        ctx.comm, ctx.d, ctx.seq_len, ctx.layout = comm, d, seq_len, layout
        allx = comm.all_gather(x, f"the shards of gather_sequence (shape {tuple(x.shape)})")
        return unshard_sequence(list(allx.unbind(0)), dim=d, seq_len=seq_len, layout=layout)

    @staticmethod
    def backward(ctx, g):
        comm = ctx.comm
        g = comm.all_reduce(g.contiguous().clone(), "the gradients of gather_sequence")
        return (
            shard_sequence(g, dim=ctx.d, layout=ctx.layout, rank=comm.rank, world_size=comm.world),
            None,
            None,
            None,
            None,
        )


def gather_sequence(
    x: torch.Tensor, *, dim: int, seq_len: int, layout: str = "contiguous", group=None, timeout=None
) -> torch.Tensor:
    """Every rank gets the whole sequence from the shards (an all-gather); differentiable
    (the backward sums the gradients of all ranks, as ``all_gather``'s adjoint does)."""
    from attnlab.distributed.comm import Comm

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    comm = Comm(group, timeout, "gather_sequence")
    d = _dim(x, dim)
    C = shard_len(seq_len, comm.world, check_layout(layout))
    if x.shape[d] != C:
        raise ValueError(
            f"x: shard length {x.shape[d]} along dim {dim}, expected {C} for seq_len={seq_len} over "
            f"{comm.world} ranks ({layout})"
        )
    return _Gather.apply(x, comm, d, seq_len, layout)


def work_per_rank(seq_len: int, world_size: int, layout: str, mask=None) -> list[int]:
    """Allowed (query, key) pairs each rank's queries have, over the whole sequence.

    ``mask=None`` counts every pair; ``"causal"`` (or a ``masks.causal()``) is counted in
    closed form; any other mask is evaluated (``O(seq_len²)``, for small problems).
    """
    P = integer(world_size, "world_size", lo=1)
    out = []
    for r in range(P):
        pos = shard_positions(seq_len, P, r, layout)
        pos = pos[pos < seq_len]
        if mask is None:
            out.append(int(pos.numel()) * seq_len)
        elif (isinstance(mask, str) and mask == "causal") or is_causal_mask(mask):
            out.append(int((pos + 1).sum()))
        else:
            kv = torch.arange(seq_len).view(1, 1, 1, -1)
            total = 0
            for chunk in pos.split(256):
                m = mask(
                    torch.tensor(0).view(1, 1, 1, 1), torch.tensor(0).view(1, 1, 1, 1), chunk.view(1, 1, -1, 1), kv
                )
                total += int(torch.broadcast_to(m, (1, 1, chunk.numel(), seq_len)).sum())
            out.append(total)
    return out


def balance(work: Sequence[int]) -> float:
    """``max / min`` of per-rank work (1.0 = perfectly balanced; ``inf`` if a rank has none)."""
    lo, hi = min(work), max(work)
    return float("inf") if lo == 0 else hi / lo
