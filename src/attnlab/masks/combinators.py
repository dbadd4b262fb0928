"""``&``, ``|`` and ``~`` of masks: predicates, tile states and structures combine."""

from __future__ import annotations

import torch

from attnlab.masks.base import Mask
from attnlab.masks.blockmask import FULL
from attnlab.masks.structure import and_structures, or_structures

__all__ = ["And", "Not", "Or"]


class And(Mask):
    """``a & b``."""

    kind = "and"

    def key_parts(self):
        return (("mask", self.a), ("mask", self.b))

    def __init__(self, a, b):
        self.a, self.b = a, b
        self.cheap_classify = a.cheap_classify and b.cheap_classify

    def predicate(self, b, h, q, kv):
        return self.a.predicate(b, h, q, kv) & self.b.predicate(b, h, q, kv)

    def classify(self, B, H, ql, qh, kl, kh):
        sa, sb = self.a.classify(B, H, ql, qh, kl, kh), self.b.classify(B, H, ql, qh, kl, kh)
        if sa is None or sb is None:
            return None
        return torch.minimum(sa, sb)  # EMPTY < PARTIAL < FULL

    def lower(self):
        return and_structures(self.a.lower(), self.b.lower())

    def validate(self, *shape):
        self.a.validate(*shape), self.b.validate(*shape)

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


class Or(And):
    """``a | b``."""

    kind = "or"

    def predicate(self, b, h, q, kv):
        return self.a.predicate(b, h, q, kv) | self.b.predicate(b, h, q, kv)

    def classify(self, B, H, ql, qh, kl, kh):
        sa, sb = self.a.classify(B, H, ql, qh, kl, kh), self.b.classify(B, H, ql, qh, kl, kh)
        if sa is None or sb is None:
            return None
        return torch.maximum(sa, sb)

    def lower(self):
        return or_structures(self.a.lower(), self.b.lower())

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


class Not(Mask):
    """``~a``."""

    kind = "not"

    def key_parts(self):
        return (("mask", self.a),)

    def __init__(self, a):
        self.a = a
        self.cheap_classify = a.cheap_classify

    def predicate(self, b, h, q, kv):
        return ~self.a.predicate(b, h, q, kv)

    def classify(self, B, H, ql, qh, kl, kh):
        s = self.a.classify(B, H, ql, qh, kl, kh)
        return None if s is None else (FULL - s).to(torch.int8)

    def lower(self):
        # only the trivial case: ~~m is m (the complement of a band is two bands)
        return self.a.a.lower() if isinstance(self.a, Not) else None

    def validate(self, *shape):
        self.a.validate(*shape)

    def __repr__(self):
        return f"~{self.a!r}"
