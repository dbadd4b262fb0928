"""The tile map a kernel reads: which (q-block, kv-block) tiles are empty, full or partial.

Built by ``mask.block_mask(...)`` (:class:`attnlab.masks.Mask`); the kernels
(``attnlab.ops``) read its states and, on partial tiles only, call
``block_mask.mask(b, h, q_pos, kv_pos)``.

Tile states::

    EMPTY   = 0   no (q, kv) pair in the tile may attend -> the tile is skipped
    PARTIAL = 1   some may -> the mask predicate is evaluated elementwise
    FULL    = 2   all may  -> computed with no mask evaluation at all

``states`` has shape ``(Bm, Hm, n_q_blocks, n_kv_blocks)`` with ``Bm`` in ``{1, B}``
and ``Hm`` in ``{1, H}`` (a mask that does not depend on the batch or head keeps 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnlab.masks.base import Mask

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(eq=False)
class BlockMask:
    """A mask classified into tiles for one problem shape; build it once, reuse it.

    Build with ``mask.block_mask(B, H, Nq, Nk, q_offset=..., kv_offset=..., block=(bq, bk))``
    (see :mod:`attnlab.masks`).  Passing a BlockMask as ``mask=`` to
    :func:`attnlab.attention` skips classification; its shape is checked against q/k.
    """

    mask: Mask  # the elementwise predicate
    states: torch.Tensor  # int8 (Bm, Hm, nqb, nkb)
    B: int
    H: int
    Nq: int
    Nk: int
    q_offset: int
    kv_offset: int
    block_q: int
    block_k: int
    _plan: list | None = field(default=None, repr=False)
    _tiles: dict = field(default_factory=dict, repr=False)
    _tile_bytes: int = field(default=0, repr=False)

    #: Evaluated partial tiles are kept (forward, backward and later calls reuse them)
    #: up to this many bytes per BlockMask; beyond it they are evaluated each time.
    TILE_CACHE_BYTES = 32 << 20

    @property
    def n_q_blocks(self) -> int:
        return self.states.shape[-2]

    @property
    def n_kv_blocks(self) -> int:
        return self.states.shape[-1]

    def plan(self) -> list[list[tuple[int, bool]]]:
        """Per q-block, the kv-blocks to visit as ``(kv_block, needs_mask)``.

        A tile is visited when it is non-empty for some (b, h); it needs the mask
        unless it is full for every (b, h).  Cached on first use.
        """
        if self._plan is None:
            s = self.states
            nonempty = (s != EMPTY).flatten(0, 1).any(0)
            allfull = (s == FULL).flatten(0, 1).all(0)
            plan = []
            for i in range(s.shape[-2]):
                js = torch.nonzero(nonempty[i]).flatten().tolist()
                plan.append([(j, not bool(allfull[i, j])) for j in js])
            self._plan = plan
        return self._plan

    def masked_out(self, b: torch.Tensor, h: torch.Tensor, qs: int, qe: int, ks: int, ke: int) -> torch.Tensor:
        """``~mask`` on the tile of rows ``qs:qe`` and columns ``ks:ke`` (True = masked out),
        broadcastable to ``(B, H, qe-qs, ke-ks)``; cached within ``TILE_CACHE_BYTES``."""
        dev = b.device
        key = (qs, qe, ks, ke, str(dev))
        t = self._tiles.get(key)
        if t is None:
            qp = (torch.arange(qs, qe, device=dev) + self.q_offset).view(1, 1, -1, 1)
            kp = (torch.arange(ks, ke, device=dev) + self.kv_offset).view(1, 1, 1, -1)
            t = ~torch.as_tensor(self.mask(b, h, qp, kp), dtype=torch.bool, device=dev)
            if self._tile_bytes + t.numel() <= self.TILE_CACHE_BYTES:
                self._tiles[key] = t
                self._tile_bytes += t.numel()
        return t

    def density(self) -> float:
        """Fraction of tiles visited (1.0 = dense)."""
        p = self.plan()
        total = self.n_q_blocks * self.n_kv_blocks
        return sum(len(r) for r in p) / total if total else 0.0

    def cost(self, rows: int, partial_factor: float = 1.6, tile_overhead: float = 65536.0) -> float:
        """Estimated work of a flash pass in score-element units, used to pick tile sizes.

        Each visited tile costs ``tile_overhead`` (Python's per-tile cost, measured as
        about that many score elements of work) plus its elements times
        ``rows = B·H``, times ``partial_factor`` where the mask must be evaluated.
        """
        area = rows * self.block_q * self.block_k
        total = 0.0
        for row in self.plan():
            for _, needs_mask in row:
                total += tile_overhead + area * (partial_factor if needs_mask else 1.0)
        return total

    def check_shape(self, B: int, H: int, Nq: int, Nk: int, q_offset: int, kv_offset: int) -> None:
        got = (B, H, Nq, Nk, q_offset, kv_offset)
        built = (self.B, self.H, self.Nq, self.Nk, self.q_offset, self.kv_offset)
        if got != built:
            raise ValueError(
                "mask: this BlockMask was built for (B, H, Nq, Nk, q_offset, kv_offset)="
                f"{built} but attention got {got}; build one for this shape with "
                "mask.block_mask(B, H, Nq, Nk, q_offset=..., kv_offset=...) or pass the Mask itself"
            )
