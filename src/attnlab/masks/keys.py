"""Structural keys: a built-in mask described to compiled code by structure and parameters.

A built-in mask is described to compiled code (torch.compile, torch.export, the
``attnlab::flash_*`` custom ops of :mod:`attnlab.ops.library`) by its *structure*: a
string such as ``and(causal,sliding_window(i0))`` plus the tensors (``t0``, ``t1``, ...)
and ints (``i0``, ...) it reads.  Ints travel as op inputs (SymInts under dynamic
shapes), so a new window size is a new input, not a new string: dynamo guards on the
structure, never on the object's identity or its caches.  An unbounded side of a band
is ``n`` in the string (structure, not data).  Keys match the exact built-in classes:
a user subclass (which may override the predicate) has none.
"""

from __future__ import annotations

import re

import torch

from attnlab.masks.base import Mask

__all__ = ["KeyBuilder", "mask_from_key", "mask_key", "parse_key"]


class KeyBuilder:
    """Collects the tensors and ints of a structural key (see :meth:`Mask.key`)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.ints: list = []

    def tensor(self, t: torch.Tensor) -> str:
        for j, x in enumerate(self.tensors):
            if x is t:
                return f"t{j}"
        self.tensors.append(t)
        return f"t{len(self.tensors) - 1}"

    def int(self, x) -> str:
        self.ints.append(x)
        return f"i{len(self.ints) - 1}"


def _key_into(mask, kb: KeyBuilder) -> str | None:
    """The structural key of ``mask`` (tensors/ints added to ``kb``), or None for a mask
    that has none (``custom``, or a user subclass of :class:`Mask`).  Each built-in
    describes itself (:meth:`Mask.key_parts`); nothing here knows the classes."""
    t = type(mask)
    if t.kind is None or Mask.KINDS.get(t.kind) is not t:
        return None
    parts = mask.key_parts()
    if parts is None:
        return None
    enc = []
    for how, x in parts:
        if how == "mask":
            a = _key_into(x, kb)
            if a is None:
                return None
            enc.append(a)
        elif how == "tensor":
            enc.append(kb.tensor(x))
        elif how == "int":
            enc.append(kb.int(x))
        elif how == "opt":
            enc.append(_opt(kb, x))
        else:
            raise ValueError(f"{t.__name__}.key_parts: unknown part kind {how!r}")
    return t.kind if not enc else f"{t.kind}({','.join(enc)})"


def _opt(kb: KeyBuilder, x) -> str:
    """An int that may be None (an unbounded side): ``n`` for None is structure, not data."""
    return "n" if x is None else kb.int(x)


def mask_key(mask):
    """``(spec, tensors, ints)`` describing ``mask`` by structure and parameters, or None
    (a ``custom`` mask: a Python callable has no key).  :func:`mask_from_key` rebuilds an
    equal mask from it."""
    kb = KeyBuilder()
    spec = _key_into(mask, kb)
    return None if spec is None else (spec, kb.tensors, kb.ints)


def parse_key(spec: str):
    """``"and(causal,sliding_window(i0))"`` -> ``("and", ["causal", ("sliding_window", ["i0"])])``:
    a call is ``(name, [args])``, anything without arguments a string."""
    pos = 0

    def term():
        nonlocal pos
        start = pos
        while pos < len(spec) and spec[pos] not in "(),":
            pos += 1
        name = spec[start:pos]
        args = []
        if pos < len(spec) and spec[pos] == "(":
            pos += 1
            while True:
                args.append(term())
                if spec[pos] == ",":
                    pos += 1
                    continue
                if spec[pos] == ")":
                    pos += 1
                    break
            return (name, args)
        return name  # a leaf: t<j>, i<j>, a number, or a name without arguments

    out = term()
    if pos != len(spec):
        raise ValueError(f"structural key {spec!r}: trailing text at {pos}")
    return out


_LEAF = re.compile(r"[ti]\d+|n")  # a tensor, an int, or None; anything else names a mask


def mask_from_key(spec: str, tensors, ints) -> Mask:
    """The mask :func:`mask_key` described (no validation: the original was validated)."""

    def leaf(x):
        if x[0] == "t":
            return tensors[int(x[1:])]
        if x[0] == "i":
            return ints[int(x[1:])]
        if x == "n":
            return None
        raise ValueError(f"structural key: bad leaf {x!r}")

    def build(node):
        name, args = (node, []) if isinstance(node, str) else node
        cls = Mask.KINDS.get(name)
        if cls is None:
            raise ValueError(f"structural key: unknown mask {name!r}")
        return cls(*(leaf(a) if isinstance(a, str) and _LEAF.fullmatch(a) else build(a) for a in args))

    return build(parse_key(spec))
