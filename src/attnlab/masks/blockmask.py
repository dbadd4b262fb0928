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
    _bits: tuple | None = field(default=None, repr=False)

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

    @property
    def has_partial_bits(self) -> bool:
        """Whether :meth:`partial_bits` is evaluated and cached already: then reading it costs no
        predicate call, and a ``torch.compile``'d call can hand the tiles to the native kernel
        (evaluating a predicate does not trace; call ``partial_bits()`` once before compiling)."""
        return self._bits is not None

    def partial_bits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bits, tile_id)``: the predicate on the partial tiles only, bit-packed; evaluated
        once and cached on this BlockMask (the forward, the backward and later calls reuse it).

        ``tile_id`` is int32 ``(nqb, nkb)``: the index into ``bits`` of every tile that is
        PARTIAL for some (b, h), -1 elsewhere.  ``bits`` is int32
        ``(T, Bp, Hp, block_q, ceil(block_k / 32))`` (``Bp``/``Hp`` 1 where the predicate does not
        depend on the batch / head): bit ``c % 32`` of word ``c // 32`` of row ``r`` is the mask
        at tile row ``r``, tile column ``c`` (:func:`pack_bits`).  Positions past the problem are
        clamped to its last row / column (a kernel never reads them).  Memory:
        (partial tiles) x block_q x block_k / 8 bytes per (b, h) the predicate depends on, CPU.
        """
        if self._bits is None:
            self._bits = _partial_bits(self)
        return self._bits

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


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool ``(..., n)`` -> int32 ``(..., ceil(n / 32))``: bit ``c % 32`` of word ``c // 32``."""
    n = bits.shape[-1]
    W = -(-n // 32)
    if W * 32 != n:
        bits = torch.nn.functional.pad(bits, (0, W * 32 - n))
    w = bits.reshape(*bits.shape[:-1], W, 32).to(torch.int64)
    words = (w << torch.arange(32, dtype=torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def _partial_bits(bm: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`BlockMask.partial_bits`: one predicate call per q-block row with the grids the
    masks expect (``b`` (B,1,1,1), ``h`` (1,H,1,1), positions (1,1,BM,1) and (1,1,1,m))."""
    s = bm.states
    nqb, nkb = s.shape[-2], s.shape[-1]
    BM, BN = bm.block_q, bm.block_k
    partial = (s == PARTIAL).flatten(0, 1).any(0)  # (nqb, nkb): partial for some (b, h)
    tile_id = torch.full((nqb, nkb), -1, dtype=torch.int32)
    b = torch.arange(bm.B).view(-1, 1, 1, 1)
    h = torch.arange(bm.H).view(1, -1, 1, 1)
    chunks, count = [], 0
    for i in range(nqb):
        js = torch.nonzero(partial[i]).flatten()
        if js.numel() == 0:
            continue
        rows = (i * BM + torch.arange(BM)).clamp(max=bm.Nq - 1)
        cols = (js.view(-1, 1) * BN + torch.arange(BN).view(1, -1)).clamp(max=bm.Nk - 1).flatten()
        r = torch.as_tensor(
            bm.mask(b, h, (rows + bm.q_offset).view(1, 1, BM, 1), (cols + bm.kv_offset).view(1, 1, 1, -1)),
            dtype=torch.bool,
        ).cpu()
        while r.dim() < 4:
            r = r.unsqueeze(0)
        r = r.expand(r.shape[0], r.shape[1], BM, cols.numel())
        chunks.append(r.reshape(r.shape[0], r.shape[1], BM, js.numel(), BN).permute(3, 0, 1, 2, 4))
        tile_id[i, js] = torch.arange(count, count + js.numel(), dtype=torch.int32)
        count += js.numel()
    if not chunks:
        return torch.zeros(1, 1, 1, BM, -(-BN // 32), dtype=torch.int32), tile_id
    Bp = max(c.shape[1] for c in chunks)
    Hp = max(c.shape[2] for c in chunks)
    bits = torch.cat([pack_bits(c.expand(-1, Bp, Hp, BM, BN)) for c in chunks]).contiguous()
    return bits, tile_id
