"""What the native kernel reads of a mask: its structured description.

The field names are those of ``attnlab.masks.MaskStructure`` (``/work/wt/MASK_STRUCTURE.md``,
issue 14): ``left``, ``right``, ``sinks``, ``kv_len`` (and ``q_ids``, ``kv_ids``,
``key_keep``, ``q_pos``, ``kv_pos``, which this kernel does not implement: a structure that
sets them falls back to the torch-ops flash path), plus the masks package's ``sinks_right``.
For absolute positions ``qp``, ``kp``::

    visible = (((left is None or qp - kp <= left) and (right is None or kp - qp <= right))
               or (kp < sinks and (sinks_right is None or kp - qp <= sinks_right)))
              and (kv_len is None or kp < kv_len[b])

:func:`_structure_of` is a stop-gap adaptor until ``Mask.lower()`` lands: at merge,
replace its body by ``return None if mask is None ... else mask.lower()`` (it already
prefers ``mask.lower()`` when the mask has one).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dc_fields

import torch

IMPLEMENTED = frozenset({"left", "right", "sinks", "sinks_right", "kv_len"})


@dataclass(frozen=True, eq=False)
class Structure:
    """Mirror of ``attnlab.masks.MaskStructure`` (same names and meaning)."""

    left: int | None = None
    right: int | None = None
    sinks: int = 0
    kv_len: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None
    kv_ids: torch.Tensor | None = None
    key_keep: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    kv_pos: torch.Tensor | None = None
    sinks_right: int | None = None  # added by the masks package: the sinks obey kp - qp <= sinks_right

    def fields(self) -> frozenset[str]:
        return frozenset(f.name for f in dc_fields(self)
                         if (getattr(self, f.name) != 0 if f.name == "sinks" else getattr(self, f.name) is not None))


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _and(a: Structure | None, b: Structure | None) -> Structure | None:
    """The intersection, when it is one structure (sinks only with no band on the other side)."""
    if a is None or b is None:
        return None
    ta = a.left is None and a.right is None and a.sinks == 0
    tb = b.left is None and b.right is None and b.sinks == 0
    if a.sinks and b.sinks or (a.sinks and not tb) or (b.sinks and not ta):
        return None  # (band₁ ∪ sinks) ∩ band₂ is not band ∪ sinks
    kv_len = a.kv_len if b.kv_len is None else b.kv_len if a.kv_len is None else torch.minimum(a.kv_len, b.kv_len)
    return Structure(left=_min(a.left, b.left), right=_min(a.right, b.right), sinks=a.sinks or b.sinks,
                     sinks_right=a.sinks_right if a.sinks else b.sinks_right, kv_len=kv_len)


def _from_key(node, tensors, ints):
    name, args = (node, []) if isinstance(node, str) else node

    def val(x):
        return ints[int(x[1:])] if x[0] == "i" else tensors[int(x[1:])]

    if name == "causal":
        return Structure(right=0)
    if name == "sliding_window":
        return Structure(left=int(val(args[0])) - 1, right=0)
    if name == "prefix_lm":
        return Structure(right=0, sinks=int(val(args[0])))
    if name == "sink_window":
        s, w = int(val(args[0])), int(val(args[1]))
        # causal ∧ (kp < s ∨ qp − kp < w): the sinks are causal too (the masks package's sinks_right=0)
        return Structure(left=w - 1, right=0, sinks=s, sinks_right=0)
    if name == "padding":
        return Structure(kv_len=val(args[0]))
    if name == "and":
        return _and(_from_key(args[0], tensors, ints), _from_key(args[1], tensors, ints))
    return None  # document, key_padding, tree, dense, or, not: not implemented here


def _structure_of(mask) -> Structure | None:
    """TEMPORARY adaptor (swap for ``mask.lower()`` at merge; keep this one function).

    ``None`` mask -> the all-true structure; main's built-ins by their structural key
    (:func:`attnlab.masks.mask_key`): causal, sliding_window, prefix_lm, sink_window,
    padding, and ``&`` of those; ``band(l, r)`` by its
    ``left``/``right``; a BlockMask by its mask.  Anything else -> None (fall back)."""
    if mask is None:
        return Structure()
    if hasattr(mask, "plan") and hasattr(mask, "mask"):  # a BlockMask
        mask = mask.mask
    if hasattr(mask, "lower"):
        return mask.lower()
    if type(mask).__name__ == "_Band":  # masks_extra.band(l, r): no structural key on main
        return Structure(left=mask.left, right=mask.right)
    from attnlab.masks import mask_key, parse_key
    key = mask_key(mask)
    if key is None:
        return None
    spec, tensors, ints = key
    return _from_key(parse_key(spec), tensors, ints)


__all__ = ["IMPLEMENTED", "Structure"]
