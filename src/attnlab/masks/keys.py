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

import torch

from attnlab.masks.base import Mask
from attnlab.masks.builtins import (
    _Causal,
    _Document,
    _KeyPadding,
    _Padding,
    _PrefixLM,
    _SinkWindow,
    _SlidingWindow,
    _Tree,
)
from attnlab.masks.combinators import And, Not, Or
from attnlab.masks.extra import _Band, _Dense, _ShiftedMask, _Varlen

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
    that has none (``custom``, or a user subclass of :class:`Mask`)."""
    t = type(mask)
    if t is _Causal:
        return "causal"
    if t is _SlidingWindow:
        return f"sliding_window({kb.int(mask.w)})"
    if t is _PrefixLM:
        return f"prefix_lm({kb.int(mask.n)})"
    if t is _SinkWindow:
        return f"sink_window({kb.int(mask.sinks)},{kb.int(mask.window)})"
    if t is _Document:
        return f"document({kb.tensor(mask.q_ids)},{kb.tensor(mask.kv_ids)})"
    if t is _Padding:
        return f"padding({kb.tensor(mask.lengths)})"
    if t is _KeyPadding:
        return f"key_padding({kb.tensor(mask.keep)})"
    if t is _Tree:
        return f"tree({kb.tensor(mask.anc)},{kb.int(mask.prefix_len)})"
    if t is _Dense:
        return f"dense({kb.tensor(mask.t)},{kb.int(mask.q_offset)},{kb.int(mask.kv_offset)})"
    if t is _Band:
        return f"band({_opt(kb, mask.left)},{_opt(kb, mask.right)})"
    if t is _Varlen:
        return (f"varlen({kb.tensor(mask.cu_q)},{kb.tensor(mask.cu_k)},{_opt(kb, mask.left)},"
                f"{_opt(kb, mask.right)})")
    if t is _ShiftedMask:
        a = _key_into(mask.inner, kb)
        return None if a is None else f"shift({a},{kb.tensor(mask.qo)})"
    if t in (And, Or):
        a, b = _key_into(mask.a, kb), _key_into(mask.b, kb)
        if a is None or b is None:
            return None
        return f"{'and' if t is And else 'or'}({a},{b})"
    if t is Not:
        a = _key_into(mask.a, kb)
        return None if a is None else f"not({a})"
    return None


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
        if name == "causal":
            return _Causal()
        if name in ("and", "or"):
            a, b = build(args[0]), build(args[1])
            return And(a, b) if name == "and" else Or(a, b)
        if name == "not":
            return Not(build(args[0]))
        if name == "shift":
            return _ShiftedMask(build(args[0]), leaf(args[1]))
        vals = [leaf(a) for a in args]
        ctor = {"sliding_window": _SlidingWindow, "prefix_lm": _PrefixLM, "sink_window": _SinkWindow,
                "document": _Document, "padding": _Padding, "key_padding": _KeyPadding, "tree": _Tree,
                "dense": _Dense, "band": _Band, "varlen": _Varlen}.get(name)
        if ctor is None:
            raise ValueError(f"structural key: unknown mask {name!r}")
        return ctor(*vals)

    return build(parse_key(spec))


