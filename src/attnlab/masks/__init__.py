"""Masks: which (query, key) pairs may attend.

A mask is an object with an elementwise predicate and, for the built-ins, an exact
block classifier::

    mask(b, h, q_pos, kv_pos) -> bool tensor      True = may attend

``b``, ``h``, ``q_pos`` and ``kv_pos`` are int64 tensors that broadcast against each
other (``b`` is ``(B,1,1,1)``, ``h`` is ``(1,H,1,1)``, ``q_pos`` is ``(1,1,n,1)``,
``kv_pos`` is ``(1,1,1,m)``).  Positions are **absolute**: query row ``i`` sits at
``q_offset + i`` and key column ``j`` at ``kv_offset + j``.  With the default
``q_offset = kv_offset + Nk - Nq`` the queries are the newest tokens
(bottom-right alignment), so ``causal()`` with 2 queries over 5 keys is::

             kv_pos ->  0 1 2 3 4
    q_pos 3 (row 0)     1 1 1 1 0
    q_pos 4 (row 1)     1 1 1 1 1

Masks combine with ``&``, ``|`` and ``~``.  ``mask.lower()`` describes a built-in by
structure (:class:`MaskStructure`: band, sinks, padding, document ids, ...), which is
how every kernel recognises it; ``None`` for ``custom``, ``tree`` and most ``|``/``~``.  ``mask.block_mask(B, H, Nq, Nk, ...)``
classifies every (q-block, kv-block) tile as empty, full or partial — exactly for
the built-ins, by evaluating the predicate once for ``custom`` masks — and caches
the result per shape, so the flash kernel skips empty tiles and evaluates no mask
on full ones.

>>> import torch, attnlab
>>> from attnlab import masks
>>> m = masks.causal() & ~masks.sliding_window(2)   # causal, but not the last 2 tokens
>>> m(torch.tensor(0), torch.tensor(0), torch.tensor([[4]]), torch.arange(5)).int().tolist()
[[1, 1, 1, 0, 0]]

The package, one concept a module: :mod:`~attnlab.masks.base` (the :class:`Mask` base,
tile classification), :mod:`~attnlab.masks.builtins`, :mod:`~attnlab.masks.extra`
(band, dense, varlen, per-batch query offsets), :mod:`~attnlab.masks.combinators`
(``& | ~``), :mod:`~attnlab.masks.blockmask` (:class:`BlockMask`),
:mod:`~attnlab.masks.structure` (:class:`MaskStructure`, its reference evaluator),
:mod:`~attnlab.masks.keys` (structural keys for compiled code) and
:mod:`~attnlab.masks.cache` (the bounded caches the kernels keep).
"""

from __future__ import annotations

from attnlab.masks.base import Mask, describe
from attnlab.masks.blockmask import EMPTY, FULL, PARTIAL, BlockMask
from attnlab.masks.builtins import (
    causal,
    custom,
    document,
    key_padding,
    padding,
    prefix_lm,
    sink_window,
    sliding_window,
    tree,
)
from attnlab.masks.combinators import And, Not, Or  # noqa: F401  (their kinds, for mask_from_key)
from attnlab.masks.extra import band, check_dense, dense, dense_mask, per_batch_q_offset, varlen
from attnlab.masks.keys import KeyBuilder, mask_from_key, mask_key, parse_key
from attnlab.masks.structure import MaskStructure

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMask",
    "KeyBuilder",
    "Mask",
    "MaskStructure",
    "band",
    "causal",
    "check_dense",
    "custom",
    "dense",
    "dense_mask",
    "describe",
    "document",
    "key_padding",
    "mask_from_key",
    "mask_key",
    "padding",
    "parse_key",
    "per_batch_q_offset",
    "prefix_lm",
    "sink_window",
    "sliding_window",
    "tree",
    "varlen",
]
