"""How a mask reaches the Triton kernels (host side, torch only: no triton import).

Two things travel from a mask to a kernel.

**Which tiles to visit** comes from the :class:`~attnlab.masks.BlockMask` built
at the kernel's own tile sizes.  :func:`block_lists` turns its states into compact
per-(b, h, row-block) lists (FlexAttention's ``kv_num_blocks``/``kv_indices``)::

    lists[bm, hm, i] = [n_partial, n_full, j_0 ... j_{n_partial-1}, j'_0 ... j'_{n_full-1}, (unused)]

so a kernel loops over the PARTIAL tiles with the mask evaluated and then over the
FULL tiles with no mask code at all; EMPTY tiles never appear.  The same function on
the transposed states gives the per-kv-block lists of q-blocks that the dK/dV kernel
walks.  ``Bm``/``Hm`` stay 1 when the mask does not depend on the batch or head (the
kernel reads them with stride 0).

**What is allowed inside a partial tile** comes in one of two forms:

* *Lowered* (:func:`lower_mask`): the built-ins are compiled into the kernel as
  constexpr variants of one small family::

      allowed = ([lo <= q_pos - kv_pos <= hi]  |  [kv_pos < sink_n  &  q_pos - kv_pos >= sink_lo])
                & [q_ids[q] == kv_ids[kv]]  &  keep[b, kv]

  ``causal`` is the band ``[0, ∞]``, ``sliding_window(w)`` is ``[0, w-1]``,
  ``prefix_lm(n)`` adds the clause ``kv < n``, ``sink_window(s, w)`` is the band
  ``[0, w-1]`` or ``kv < s & q >= kv``; ``document`` is the id comparison (ids sliced to
  the problem's absolute positions), ``padding``/``key_padding`` are a per-(batch, key)
  ``keep`` vector; ``&`` of these merges (two bands intersect, keep vectors AND).
  Nothing is materialized beyond O(B·N) ids.
* *Table* (:func:`tile_table`): any other mask (``custom``, ``tree``, ``|``, ``~``, a
  combination the family cannot express) is evaluated once per BlockMask on its
  partial tiles only, bit-packed into int32 words (one bit per (q, kv) pair), and the
  kernel reads the bits of the tile it is on.  Memory is (partial tiles) × BM × BN / 8
  bytes per distinct (b, h) the predicate depends on, and nothing for empty or full
  tiles.

Why both: the compiled family costs nothing on the host and nothing in memory, and it
covers what training and serving mostly use (causal, windows, packed documents,
padding); a Python predicate cannot run inside a Triton kernel, so ``custom`` masks need
the table, which FlexAttention avoids only by compiling the predicate with Inductor.
The lowered masks are recognised by their structure (:meth:`attnlab.masks.Mask.lower`,
:class:`~attnlab.masks.MaskStructure`; fields outside :data:`LOWERED_FIELDS` such as
varlen's band positions or a dense tensor take the table path), never by class, so a
subclass or a new mask that lowers to a band is compiled in; a mask that does not lower
is never wrong, it only takes the table path.

Plans (lists, lowered spec, table) are cached per BlockMask and device in
:mod:`attnlab.masks.cache`, so the forward, the backward and later calls with the same
BlockMask build nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnlab.masks import FULL, PARTIAL, BlockMask, Mask, cache as mask_cache

INT_MAX = 2**31 - 1
INT_MIN = -(2**31)
POS_LIMIT = 2**30  # absolute positions (and offsets) must stay within ±2^30 (int32 arithmetic)


# ----------------------------------------------------------------------------- tile lists
def block_lists(states: torch.Tensor) -> torch.Tensor:
    """``(Bm, Hm, nr, nc)`` tile states -> int32 ``(Bm, Hm, nr, 2 + nc)`` visit lists:
    ``[n_partial, n_full, partial column blocks..., full column blocks..., rest]``."""
    key = torch.where(states == PARTIAL, 0, torch.where(states == FULL, 1, 2)).to(torch.int8)
    order = torch.sort(key, dim=-1, stable=True).indices
    n_part = (states == PARTIAL).sum(-1, keepdim=True)
    n_full = (states == FULL).sum(-1, keepdim=True)
    return torch.cat([n_part, n_full, order], dim=-1).to(torch.int32).contiguous()


# ----------------------------------------------------------------------------- lowered masks
@dataclass
class MaskSpec:
    """What a kernel evaluates on a partial tile.  ``None`` fields are compiled out."""

    band: tuple[int, int] | None = None  # lo <= q_pos - kv_pos <= hi
    sink: tuple[int, int] | None = None  # | (kv_pos < n & q_pos - kv_pos >= lo); only with band
    q_ids: torch.Tensor | None = None  # int32 (B' , Nq): document id of each query row
    kv_ids: torch.Tensor | None = None  # int32 (B'', Nk): document id of each key column
    keep: torch.Tensor | None = None  # int8 (B', Nk): 1 = key visible
    table: torch.Tensor | None = None  # int32 (T, Bp, Hp, BM, W) bit-packed partial tiles
    tile_id: torch.Tensor | None = None  # int32 (nqb, nkb): index into table, -1 = none

    @property
    def kind(self) -> str:
        if self.table is not None:
            return "table"
        parts = [name for name, x in (("band", self.band), ("doc", self.q_ids), ("keep", self.keep)) if x is not None]
        return "+".join(parts) or "none"


def _int32(x) -> int:
    return max(INT_MIN, min(INT_MAX, int(x)))


#: The structure fields the compiled family implements; any other takes the table path.
LOWERED_FIELDS = frozenset({"left", "right", "sinks", "sinks_right", "kv_len", "q_ids", "kv_ids", "key_keep"})


def _lower(m):
    """A mask as a dict of family terms (positions not yet applied), or None: read from
    its :class:`~attnlab.masks.MaskStructure`, never from its class."""
    s = m.lower() if isinstance(m, Mask) else None
    if s is None or not s.fields() <= LOWERED_FIELDS:
        return None
    out: dict[str, Any] = {}
    if s.has_band:  # left/right on q - kv: -right <= q - kv <= left
        out["band"] = (INT_MIN if s.right is None else _int32(-s.right), INT_MAX if s.left is None else _int32(s.left))
        if s.sinks:
            out["sink"] = (_int32(s.sinks), INT_MIN if s.sinks_right is None else _int32(-s.sinks_right))
    if s.q_ids is not None:
        out["doc"] = (s.q_ids, s.kv_ids)
    keep = []
    if s.kv_len is not None:
        keep.append(("lengths", s.kv_len))
    if s.key_keep is not None:
        keep.append(("keep", s.key_keep))
    if keep:
        out["keep"] = keep
    return out


def lower_mask(mask, B, Nq, Nk, q_offset, kv_offset, device) -> MaskSpec | None:
    """The mask as a :class:`MaskSpec` the kernels compile in, or None (use the table)."""
    terms = _lower(mask)
    if terms is None:
        return None
    spec = MaskSpec(band=terms.get("band"), sink=terms.get("sink"))
    if "doc" in terms:
        q_ids, kv_ids = terms["doc"]
        if any(t.numel() and int(t.abs().max()) > INT_MAX for t in (q_ids, kv_ids)):
            return None  # ids beyond int32: the table path compares them exactly
        spec.q_ids = q_ids[:, q_offset : q_offset + Nq].to(device=device, dtype=torch.int32).contiguous()
        spec.kv_ids = kv_ids[:, kv_offset : kv_offset + Nk].to(device=device, dtype=torch.int32).contiguous()
        if spec.q_ids.shape[-1] != Nq or spec.kv_ids.shape[-1] != Nk:
            return None  # ids do not cover the problem: let the predicate decide (and raise)
    if "keep" in terms:
        keep: torch.Tensor | None = None
        kv_pos = torch.arange(Nk, device="cpu") + kv_offset
        for what, t in terms["keep"]:
            if what == "lengths":
                k = kv_pos.view(1, -1) < t.to("cpu").view(-1, 1)
            else:
                k = t[:, kv_offset : kv_offset + Nk].to("cpu")
                if k.shape[-1] != Nk:
                    return None
            keep = k if keep is None else keep & k
        if keep is not None:  # terms["keep"] is never empty
            spec.keep = keep.to(device=device, dtype=torch.int8).contiguous()
    return spec


# ----------------------------------------------------------------------------- partial-tile table
def tile_table(bm, device) -> MaskSpec:
    """The bits of ``bm.mask`` on the partial tiles of ``bm`` (:meth:`BlockMask.partial_bits`,
    evaluated once per BlockMask on the CPU, shared with the native kernel) on ``device``."""
    table, tile_id = bm.partial_bits()
    return MaskSpec(table=table.to(device).contiguous(), tile_id=tile_id.to(device).contiguous())


# ----------------------------------------------------------------------------- per-BlockMask plan
class Plan:
    """Everything a kernel needs from one BlockMask on one device, built lazily and cached."""

    def __init__(self, bm, device):
        self.bm, self.device = bm, device
        self._kv_lists = self._q_lists = self._spec = None

    @property
    def kv_lists(self) -> torch.Tensor:
        """Per q-block: the kv-blocks to visit (forward and dQ)."""
        if self._kv_lists is None:
            self._kv_lists = block_lists(self.bm.states).to(self.device)
        return self._kv_lists

    @property
    def q_lists(self) -> torch.Tensor:
        """Per kv-block: the q-blocks to visit (dK/dV)."""
        if self._q_lists is None:
            self._q_lists = block_lists(self.bm.states.transpose(-1, -2)).to(self.device)
        return self._q_lists

    @property
    def spec(self) -> MaskSpec:
        if self._spec is None:
            bm = self.bm
            spec = lower_mask(bm.mask, bm.B, bm.Nq, bm.Nk, bm.q_offset, bm.kv_offset, self.device)
            self._spec = spec if spec is not None else tile_table(bm, self.device)
        return self._spec


def plan_for(mask, B, H, Nq, Nk, q_offset, kv_offset, tiles, device) -> Plan:
    """The cached :class:`Plan` for ``mask`` (a Mask or a BlockMask) at ``tiles = (BM, BN)``.

    A BlockMask built at other tile sizes is re-classified from its mask (cached on the
    mask, as every BlockMask is)."""
    if isinstance(mask, BlockMask):
        bm = (
            mask
            if (mask.block_q, mask.block_k) == tuple(tiles)
            else mask.mask.block_mask(B, H, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, block=tuple(tiles))
        )
    else:
        bm = mask.block_mask(B, H, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, block=tuple(tiles))
    key = (id(bm), str(device))  # the Plan holds bm: its id is not reused while cached
    plan = mask_cache.plans.get(key)
    return plan if plan is not None else mask_cache.plans.put(key, Plan(bm, device))
