"""The tile map of a packed varlen problem: exact tile states and tiles chosen for it.

:func:`attnlab.masks.varlen` classifies a tile that spans two sequences as PARTIAL.  Under
a causal or windowed band many of those are in fact EMPTY: the tail rows of sequence A
and the head rows of sequence B against later keys of B see nothing (A cannot see B, B's
first rows cannot see B's later keys).  On the issue's ragged batch (16 sequences over
64..2048, causal, 128×128 tiles) that is 190 of 512 partial tiles, 18% of the visited
area, each also paying a mask evaluation.  Here every tile is classified exactly from
per-sequence intervals, in closed form (no mask evaluation)::

    for a tile of packed rows [q0, q1] and columns [k0, k1] and each sequence s:
        rows of s in the tile   [a, b] = [max(q0, cu_q[s]), min(q1, cu_q[s+1] - 1)]
        columns of s            [c, d] = [max(k0, cu_k[s]), min(k1, cu_k[s+1] - 1)]
        local positions         qa..qb = a..b - cu_q[s] + (Lk_s - Lq_s),  kc..kd = c..d - cu_k[s]
        s sees something        a <= b, c <= d, qa - kd <= left, kc - qb <= right
        s fills the tile        [a, b] = [q0, q1], [c, d] = [k0, k1], qb - kc <= left, kd - qa <= right
    EMPTY = no s sees something;  FULL = some s fills it;  else PARTIAL

and the tile sizes are the candidates' cheapest under :meth:`BlockMask.cost` of the exact
map.  The result is cached by the sequence lengths, window, heads and dtype, so the layers
of a model (which share ``cu_seqlens``) and the backward reuse the map and the evaluated
masks of its partial tiles.
"""

from __future__ import annotations

import torch

from attnlab.masks import EMPTY, FULL, PARTIAL, BlockMask, cache as mask_cache
from attnlab.ops.tiles import tile_candidates

_CHUNK = 1 << 22  # tile-rows x tile-cols x sequences evaluated at once


def exact_states(cu_q, cu_k, left, right, Nq, Nk, bq, bk) -> torch.Tensor:
    """int8 ``(1, 1, nqb, nkb)`` tile states of the packed varlen problem (module doc).
    ``cu_q``/``cu_k``: int64 CPU ``(S + 1,)``; ``left``/``right``: ints or None (unbounded)."""
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    S = cu_q.numel() - 1
    shift = ((cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])).view(1, 1, S)  # bottom-right alignment
    k0 = (torch.arange(nkb) * bk).view(1, nkb, 1)
    k1 = torch.clamp((torch.arange(nkb) + 1) * bk, max=Nk).view(1, nkb, 1) - 1
    c = torch.maximum(k0, cu_k[:-1].view(1, 1, S))
    d = torch.minimum(k1, cu_k[1:].view(1, 1, S) - 1)
    kc, kd = c - cu_k[:-1].view(1, 1, S), d - cu_k[:-1].view(1, 1, S)
    cols, cols_all = c <= d, (c == k0) & (d == k1)
    out = torch.empty(nqb, nkb, dtype=torch.int8)
    rows_per = max(1, _CHUNK // max(1, nkb * S))
    for i0 in range(0, nqb, rows_per):
        i1 = min(nqb, i0 + rows_per)
        q0 = (torch.arange(i0, i1) * bq).view(-1, 1, 1)
        q1 = torch.clamp((torch.arange(i0, i1) + 1) * bq, max=Nq).view(-1, 1, 1) - 1
        a = torch.maximum(q0, cu_q[:-1].view(1, 1, S))
        b = torch.minimum(q1, cu_q[1:].view(1, 1, S) - 1)
        qa, qb = a - cu_q[:-1].view(1, 1, S) + shift, b - cu_q[:-1].view(1, 1, S) + shift
        sees = (a <= b) & cols
        fills = (a == q0) & (b == q1) & cols_all
        if left is not None:
            sees = sees & (qa - kd <= left)
            fills = fills & (qb - kc <= left)
        if right is not None:
            sees = sees & (kc - qb <= right)
            fills = fills & (kd - qa <= right)
        st = torch.full((i1 - i0, nkb), PARTIAL, dtype=torch.int8)
        st[~sees.any(-1)] = EMPTY
        st[fills.any(-1)] = FULL
        out[i0:i1] = st
    return out.view(1, 1, nqb, nkb)


def varlen_block_mask(mask, H: int, D: int, dtype: torch.dtype, device=None) -> BlockMask:
    """The BlockMask of a :func:`attnlab.masks.varlen` mask for a ``B = 1`` packed problem with
    ``H`` query heads: exact states (:func:`exact_states`), the cheapest candidate tiles,
    cached by the mask's lengths and window (module doc)."""
    cu_q, cu_k = mask.cu_q, mask.cu_k
    Nq, Nk = int(cu_q[-1]), int(cu_k[-1])
    key = (cu_q.numpy().tobytes(), cu_k.numpy().tobytes(), mask.left, mask.right, H, D, dtype, str(device))
    hit = mask_cache.varlen.get(key)
    if hit is not None:
        return hit
    best = None
    for bq, bk in tile_candidates(dtype, D, H, device):
        st = exact_states(cu_q, cu_k, mask.left, mask.right, Nq, Nk, bq, bk)
        bm = BlockMask(mask, st, 1, H, Nq, Nk, 0, 0, bq, bk)
        if best is None or bm.cost(H) < best.cost(H):
            best = bm
    return mask_cache.varlen.put(key, best)


__all__ = ["exact_states", "varlen_block_mask"]
