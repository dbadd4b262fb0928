"""Masks and score mods seen from a shard: local indices in, global positions out.

A ring step attends rank ``r``'s queries to rank ``s``'s keys.  For the contiguous
layout those are runs of consecutive positions, and ``q_offset``/``kv_offset`` would
say it all; for zigzag (two runs) and striped (every ``P``-th token) they are not.
One mechanism serves all three: the local call uses local indices
(``q_offset = kv_offset = 0``) and the user's mask and score mod are wrapped so that
local query row ``i`` is looked up at global position ``q_pos[i]`` and local key ``j`` at
``kv_pos[j]``::

    ShardMask(mask, q_pos, kv_pos, seq_len)(b, h, i, j)
        = mask(b, h, q_pos[i], kv_pos[j])  and  q_pos[i] < seq_len  and  kv_pos[j] < seq_len

(padded slots never attend and are never attended; the wrapped mask only ever sees
real positions).  Tiles are classified by the wrapped mask's own exact classifier on
the *hull* of each tile's global positions, ``[pos[lo], pos[hi]]`` (positions increase
along a shard): a tile that is empty (full) over the hull is empty (full) over the
positions it actually holds, so the flash kernel still skips empty tiles and
evaluates no mask on full ones — exactly so for contiguous and zigzag runs, and
conservatively (more tiles partial) across a zigzag seam or for striped shards.

:class:`HeadView` does the same for heads (Ulysses gives each rank a slice of heads:
local head ``h`` is global head ``h0 + h``).

:func:`need_matrix` says, before any message moves, which (query shard, key shard)
pairs the mask leaves non-empty; the ring neither computes nor forwards what no later
rank needs.
"""

from __future__ import annotations

import torch

from attnlab.distributed.local import mod_params
from attnlab.masks import EMPTY, FULL, PARTIAL, Mask
from attnlab.scores import ScoreMod

__all__ = ["ShardMask", "ShardScoreMod", "HeadView", "HeadScoreMod", "need_matrix", "runs"]


def tile_states(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    s = torch.full(torch.broadcast_shapes(full.shape, empty.shape), PARTIAL, dtype=torch.int8, device=full.device)
    s = torch.where(full, torch.tensor(FULL, dtype=torch.int8, device=full.device), s)
    return torch.where(empty, torch.tensor(EMPTY, dtype=torch.int8, device=full.device), s)


class ShardMask(Mask):
    """``mask`` (or ``None``: everything) for queries at ``q_pos`` and keys at ``kv_pos``."""

    def __init__(self, inner, q_pos: torch.Tensor, kv_pos: torch.Tensor, seq_len: int):
        self.inner, self.q_pos, self.kv_pos, self.seq_len = inner, q_pos, kv_pos, seq_len
        self.cheap_classify = True if inner is None else inner.cheap_classify

    def predicate(self, b, h, qi, kj):
        qp, kp = self.q_pos[qi], self.kv_pos[kj]
        N = self.seq_len
        ok = (qp < N) & (kp < N)
        if self.inner is None:
            return ok
        return torch.as_tensor(self.inner(b, h, qp.clamp(max=N - 1), kp.clamp(max=N - 1)), dtype=torch.bool) & ok

    def classify(self, B, H, ql, qh, kl, kh):
        N = self.seq_len
        gql, gqh = self.q_pos[ql], self.q_pos[qh]
        gkl, gkh = self.kv_pos[kl], self.kv_pos[kh]
        valid = tile_states((gqh < N) & (gkh < N), (gql >= N) | (gkl >= N))
        if self.inner is None:
            return valid
        s = self.inner.classify(
            B, H, gql.clamp(max=N - 1), gqh.clamp(max=N - 1), gkl.clamp(max=N - 1), gkh.clamp(max=N - 1)
        )
        return None if s is None else torch.minimum(s.to(torch.int8), valid)

    def validate(self, *shape):
        """Nothing to check per call: the plan validated the mask over the whole sequence."""

    def __repr__(self):
        return f"ShardMask({self.inner!r}, seq_len={self.seq_len})"


class ShardScoreMod(ScoreMod):
    """``mod`` evaluated at the global positions of local rows/columns (padding clamped)."""

    def __init__(self, inner, q_pos, kv_pos, seq_len: int):
        self.inner, self.q_pos, self.kv_pos, self.seq_len = inner, q_pos, kv_pos, seq_len
        self.device = q_pos.device

    def apply(self, score, b, h, qi, kj):
        N = self.seq_len
        return self.inner(score, b, h, self.q_pos[qi].clamp(max=N - 1), self.kv_pos[kj].clamp(max=N - 1))

    def parameters(self):
        """The inner mod's tensors requiring grad, declared or captured (:func:`.local.mod_params`)."""
        return mod_params(self.inner, device=self.device)

    def validate(self, B, H):
        if hasattr(self.inner, "validate"):
            self.inner.validate(B, H)


class HeadView(Mask):
    """``mask`` for heads ``h0 .. h0 + n - 1`` of ``H`` (local head ``h`` is global ``h0 + h``)."""

    def __init__(self, inner, h0: int, n: int, H: int):
        self.inner, self.h0, self.n, self.H = inner, h0, n, H
        self.cheap_classify = inner.cheap_classify

    def predicate(self, b, h, q, kv):
        return self.inner(b, h + self.h0, q, kv)

    def classify(self, B, H, ql, qh, kl, kh):
        s = self.inner.classify(B, self.H, ql, qh, kl, kh)
        if s is None:
            return None
        while s.dim() < 4:
            s = s.unsqueeze(0)
        return s[:, self.h0 : self.h0 + self.n] if s.shape[1] == self.H and self.H > 1 else s

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        self.inner.validate(B, self.H, Nq, Nk, q_offset, kv_offset)

    def __repr__(self):
        return f"HeadView({self.inner!r}, heads {self.h0}..{self.h0 + self.n - 1} of {self.H})"


class HeadScoreMod(ScoreMod):
    def __init__(self, inner, h0: int, H: int, device=None):
        self.inner, self.h0, self.H, self.device = inner, h0, H, device

    def apply(self, score, b, h, q, kv):
        return self.inner(score, b, h + self.h0, q, kv)

    def parameters(self):
        """The inner mod's tensors requiring grad, declared or captured (:func:`.local.mod_params`)."""
        return mod_params(self.inner, device=self.device)

    def validate(self, B, H):
        if hasattr(self.inner, "validate"):
            self.inner.validate(B, self.H)


def runs(pos: torch.Tensor, seq_len: int, max_runs: int = 8) -> list[tuple[int, int]]:
    """The real positions of a shard as inclusive runs ``(lo, hi)`` of consecutive
    positions, or their hull when there are more than ``max_runs`` runs (striped)."""
    p = pos[pos < seq_len].tolist()
    if not p:
        return []
    out, lo, prev = [], p[0], p[0]
    for x in p[1:]:
        if x != prev + 1:
            out.append((lo, prev))
            lo = x
        prev = x
    out.append((lo, prev))
    return out if len(out) <= max_runs else [(p[0], p[-1])]


def need_matrix(mask, positions: list[torch.Tensor], seq_len: int, B: int, H: int) -> list[list[bool]]:
    """``need[r][s]``: may any query of shard ``r`` attend any key of shard ``s``?

    Decided from the mask's classifier on runs of real positions (no predicate is
    evaluated); masks that cannot classify cheaply count as needing every pair.
    The answer is a pure function of the arguments, so every rank computes the same.
    """
    P = len(positions)
    rs = [runs(p.cpu(), seq_len) for p in positions]
    need = [[bool(rs[r]) and bool(rs[s]) for s in range(P)] for r in range(P)]
    if mask is None or not getattr(mask, "cheap_classify", False):
        return need
    flat = [(r, lo, hi) for r in range(P) for lo, hi in rs[r]]
    if not flat:
        return need
    owner = torch.tensor([f[0] for f in flat])
    lo = torch.tensor([f[1] for f in flat])
    hi = torch.tensor([f[2] for f in flat])
    states = mask.classify(B, H, lo.view(-1, 1), hi.view(-1, 1), lo.view(1, -1), hi.view(1, -1))
    if states is None:
        return need
    while states.dim() < 4:
        states = states.unsqueeze(0)
    states = torch.broadcast_to(states, (*states.shape[:2], len(flat), len(flat)))
    nonempty = (states != EMPTY).flatten(0, 1).any(0).long()  # (runs, runs)
    hit = torch.zeros(P, P, dtype=torch.long)
    hit.index_put_(
        (owner.view(-1, 1).expand_as(nonempty), owner.view(1, -1).expand_as(nonempty)), nonempty, accumulate=True
    )
    return [[need[r][s] and bool(hit[r, s] > 0) for s in range(P)] for r in range(P)]
