"""The caches the kernels keep for masks, in one bounded place.

Classified tiles (:class:`~attnlab.masks.BlockMask` per mask and shape), the flash
backend's tile-size pick per problem and the Triton kernels' per-device plans used to
be attributes written onto the mask and BlockMask objects; they live here now, with the
masks the flash custom ops rebuild from keys, each an LRU of bounded length.  Keys hold the object they describe alive (the cached value
refers to it), so an ``id`` in a key is never reused while its entry exists.

:func:`mask_id` keys a built-in mask without tensors by its structural key (so a
``masks.causal()`` built anew on every call reuses its tiles) and any other mask by
identity.  Nothing here is read inside a ``torch.compile``'d graph: compiled code hands
masks to the ``attnlab::flash_*`` custom ops by structural key, and those ops run eagerly.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["LRU", "block_masks", "clear", "mask_id", "plans", "rebuilt", "tile_picks", "varlen"]


class LRU:
    """A dict of at most ``size`` entries; the least recently used goes first."""

    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict = OrderedDict()

    def get(self, key):
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key, value):
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)
        return value

    def clear(self):
        self._d.clear()

    def __len__(self):
        return len(self._d)


#: BlockMasks by (mask_id, B, H, Nq, Nk, q_offset, kv_offset, block_q, block_k).  The
#: flash backend classifies up to 9 tilings of one problem: 64 covers about 7 problems
#: (each BlockMask keeps at most ``BlockMask.TILE_CACHE_BYTES`` of evaluated tiles).
block_masks = LRU(64)
#: The flash backend's tile pick by (mask_id, problem, dtype, device): (mask, block).
tile_picks = LRU(256)
#: Triton plans by (id(block_mask), device): the Plan (which holds its BlockMask).
plans = LRU(64)
#: Masks the ``attnlab::flash_*`` custom ops rebuilt from structural keys, by (spec, ints,
#: tensor identities): (mask, tensors), so the tensors stay alive while their key is cached.
rebuilt = LRU(32)
#: Exact varlen BlockMasks (:mod:`attnlab.ops.varlen_tiles`) by (cu_seqlens bytes, window, H, D,
#: dtype, device): every layer and the backward of one packed batch reuse one.
varlen = LRU(4)


def mask_id(mask):
    """A hashable identity for ``mask``: its structural key when it has no tensors (equal
    masks share tiles), else ``("id", id(mask))``."""
    k = mask.key() if type(mask).__module__.startswith("attnlab.masks") else None
    if k is not None and not k[1]:
        return ("key", k[0], tuple(int(i) for i in k[2]))
    return ("id", id(mask))


def clear():
    """Empty every cache (tests; freeing memory)."""
    for c in (block_masks, tile_picks, plans, rebuilt, varlen):
        c.clear()
