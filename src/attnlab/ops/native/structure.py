"""What the native kernel reads of a mask: its structured description
(:class:`attnlab.masks.MaskStructure`, from :meth:`Mask.lower`).

The kernel implements ``left``, ``right``, ``sinks``, ``sinks_right``, ``kv_len``, the
document ids ``q_ids``/``kv_ids``, the key keep-vector ``key_keep``, the band positions
``q_pos``/``kv_pos`` (varlen packing) and the per-batch query shifts ``q_shift``
(``masking.h``).  For absolute positions ``q = q_offset + i (+ q_shift[b])``,
``kv = kv_offset + j`` and band positions ``qp = q_pos[q]`` (or ``q``), ``kp = kv_pos[kv]``
(or ``kv``)::

    visible = (((left is None or qp - kp <= left) and (right is None or kp - qp <= right))
               or (kp < sinks and (sinks_right is None or kp - qp <= sinks_right)))
              and (kv_len is None or kv < kv_len[b])
              and (q_ids is None or q_ids[b', q] == kv_ids[b', kv])
              and (key_keep is None or key_keep[b', kv])

A mask with any other field (``dense``) or no structure at all (``custom``, ``tree``, most
``|``/``~``) runs on the kernel through a BlockMask at its tiles: EMPTY tiles skipped, FULL
tiles with no mask code, PARTIAL tiles read from :meth:`BlockMask.partial_bits` (the
predicate evaluated once per BlockMask on the partial tiles only, bit-packed).
"""

from __future__ import annotations

from attnlab.masks import BlockMask, MaskStructure

#: the fields the attention kernel (``kernel.cpp`` + ``masking.h``) evaluates
IMPLEMENTED = frozenset(
    {"left", "right", "sinks", "sinks_right", "kv_len", "q_ids", "kv_ids", "key_keep", "q_pos", "kv_pos", "q_shift"}
)
#: the fields the paged / quantized decode kernel (``decode.cpp``) evaluates: bands, sinks and
#: lengths only -- a document or key-keep mask over a cache takes the split-KV path
DECODE_IMPLEMENTED = frozenset({"left", "right", "sinks", "sinks_right", "kv_len"})

__all__ = ["DECODE_IMPLEMENTED", "IMPLEMENTED", "band_of", "structure_of"]


def structure_of(mask) -> MaskStructure | None:
    """``mask``'s structure: all-true for ``None``, a BlockMask's mask's, ``None`` when the mask
    does not lower (``custom``, ``tree``, most ``|``/``~``)."""
    if mask is None:
        return MaskStructure()
    if isinstance(mask, BlockMask):
        mask = mask.mask
    return mask.lower()


def band_of(s: MaskStructure) -> list[int]:
    """The six ints the native kernels take for a structure's band and sinks' reach:
    ``[has left, left, has right, right, has sinks_right, sinks_right]`` (0 where absent)."""
    sr = getattr(s, "sinks_right", None)
    return [
        int(s.left is not None),
        0 if s.left is None else int(s.left),
        int(s.right is not None),
        0 if s.right is None else int(s.right),
        int(sr is not None),
        0 if sr is None else int(sr),
    ]
