"""The mask base class: the predicate, exact tile classification and BlockMask building.

See :mod:`attnlab.masks` for the conventions (absolute positions, True = attend).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from attnlab.masks import cache
from attnlab.masks.blockmask import EMPTY, FULL, PARTIAL, BlockMask
from attnlab.validate import MAX_INT, ArgumentTypeError, integer, problem_positions

__all__ = ["Mask"]

# Chunk (in elements) used when a predicate must be evaluated to classify tiles.
_EVAL_CHUNK = 1 << 24


def tile_states(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    s = torch.full(torch.broadcast_shapes(full.shape, empty.shape), PARTIAL, dtype=torch.int8)
    s = torch.where(full, torch.tensor(FULL, dtype=torch.int8), s)
    return torch.where(empty, torch.tensor(EMPTY, dtype=torch.int8), s)


def _as_4d(s: torch.Tensor) -> torch.Tensor:
    while s.dim() < 4:
        s = s.unsqueeze(0)
    return s


def _checks_positions(validate):
    """Wrap a subclass's ``validate`` so that the problem's positions are bounded first."""

    @functools.wraps(validate)
    def checked(self, B, H, Nq, Nk, q_offset, kv_offset):
        problem_positions(Nq, Nk, q_offset, kv_offset, where=lambda: f"mask {self!r}")
        return validate(self, B, H, Nq, Nk, q_offset, kv_offset)

    checked.__dict__["checks_positions"] = True
    return checked


class Mask:
    """Base class.  Subclasses implement :meth:`predicate` and, when they can,
    :meth:`classify`; they may override :meth:`validate` to check a problem shape.

    Every ``validate`` (the base one and any override) first checks that the problem's
    absolute positions lie in ``[-2**62, 2**62)``, so that positions and their differences
    are exact in int64: offsets near ``2**63`` raise ``ValueError`` instead of wrapping."""

    #: True when :meth:`classify` is exact and costs O(tiles), so the flash backend
    #: may classify several candidate tilings and keep the cheapest.
    cheap_classify = False

    #: The public name of a built-in kind (``"causal"``, ``"and"``, ...): the name its
    #: structural key and the distributed fingerprint use; None for user subclasses.
    kind: str | None = None
    #: kind -> the class that defines it (the first to claim a kind keeps it): how
    #: :func:`attnlab.masks.mask_from_key` rebuilds a mask; a subclass that does not
    #: name its own kind has no structural key (it may behave differently).
    KINDS: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):
            Mask.KINDS.setdefault(cls.__dict__["kind"], cls)
        v = cls.__dict__.get("validate")
        if v is not None and not getattr(v, "checks_positions", False):
            setattr(cls, "validate", _checks_positions(v))  # noqa: B010 - mypy refuses a method assignment

    def predicate(self, b, h, q_pos, kv_pos) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, b, h, q_pos, kv_pos) -> torch.Tensor:
        return self.predicate(b, h, q_pos, kv_pos)

    def key_parts(self):
        """This mask's constructor arguments as ``(how, value)`` pairs, in order, so that
        ``type(self)(*values)`` rebuilds an equal mask; ``how`` is ``"int"``, ``"opt"`` (an
        int or None), ``"tensor"`` or ``"mask"`` (a sub-mask).  None (the default): no
        structural key (``custom``, user subclasses)."""
        return None

    def lower(self):
        """This mask as a :class:`~attnlab.masks.MaskStructure` (band, sinks, padding,
        document ids, ...) that kernels read, or ``None`` when it has none (``custom``,
        ``tree``, most ``|``/``~``).  Kernels never recognise masks any other way."""
        return

    def key(self):
        """``(spec, tensors, ints)``: this mask by structure and parameters, what compiled code
        and the ``attnlab::flash_*`` custom ops read (:func:`mask_key`); None for ``custom``."""
        from attnlab.masks.keys import mask_key

        return mask_key(self)

    # -- tile classification -------------------------------------------------------
    def classify(self, B, H, q_lo, q_hi, kv_lo, kv_hi):
        """Exact tile states, or ``None`` when only evaluation can tell.

        ``q_lo``/``q_hi`` are ``(nqb, 1)`` and ``kv_lo``/``kv_hi`` are ``(1, nkb)`` int64
        tensors of inclusive absolute positions.  Returns int8 states broadcastable to
        ``(B, H, nqb, nkb)``.  ``EMPTY``/``FULL`` must be certain; ``PARTIAL`` is always safe.
        """
        return

    def validate(self, B: int, H: int, Nq: int, Nk: int, q_offset: int, kv_offset: int) -> None:
        """Raise ``ValueError`` if this mask cannot describe that problem."""
        problem_positions(Nq, Nk, q_offset, kv_offset, where=lambda: f"mask {self!r}")

    validate.__dict__["checks_positions"] = True

    def block_mask(
        self,
        B: int,
        H: int,
        Nq: int,
        Nk: int,
        *,
        q_offset: int | None = None,
        kv_offset: int = 0,
        block: tuple[int, int] = (128, 512),
    ) -> BlockMask:
        """Classify every tile of a ``(B, H, Nq, Nk)`` problem; cached per shape.

        ``q_offset`` defaults to ``kv_offset + Nk - Nq`` (bottom-right), as in
        :func:`attnlab.attention`.
        """
        B, H = integer(B, "block_mask(B)", lo=1), integer(H, "block_mask(H)", lo=1)
        Nq, Nk = integer(Nq, "block_mask(Nq)", lo=0), integer(Nk, "block_mask(Nk)", lo=0)
        kv_offset = integer(kv_offset, "block_mask(kv_offset)", lo=-MAX_INT)
        if q_offset is None:
            q_offset = kv_offset + Nk - Nq
        q_offset = integer(q_offset, "block_mask(q_offset)", lo=-MAX_INT)
        if not isinstance(block, (tuple, list)) or len(block) != 2:
            raise ArgumentTypeError(f"block: expected a pair (block_q, block_k) of ints, got {block!r}")
        bq, bk = (integer(x, f"block: tile size {x!r}", lo=1, hi=1 << 30) for x in block)
        key = (cache.mask_id(self), B, H, Nq, Nk, q_offset, kv_offset, bq, bk)
        hit = cache.block_masks.get(key)
        if hit is not None:
            return hit
        self.validate(B, H, Nq, Nk, q_offset, kv_offset)
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        q_lo = (torch.arange(nqb) * bq + q_offset).view(-1, 1)
        q_hi = (torch.clamp(torch.arange(1, nqb + 1) * bq, max=Nq) - 1 + q_offset).view(-1, 1)
        kv_lo = (torch.arange(nkb) * bk + kv_offset).view(1, -1)
        kv_hi = (torch.clamp(torch.arange(1, nkb + 1) * bk, max=Nk) - 1 + kv_offset).view(1, -1)
        states = None if nqb == 0 or nkb == 0 else self.classify(B, H, q_lo, q_hi, kv_lo, kv_hi)
        if states is None and nqb and nkb and (s := self.lower()) is not None:
            states = s.classify(B, H, q_lo, q_hi, kv_lo, kv_hi)  # a mask that lowers but has no classifier
        if nqb == 0 or nkb == 0:  # no tile at all
            states = torch.zeros(1, 1, nqb, nkb, dtype=torch.int8)
        elif states is None:
            states = self._classify_by_eval(B, H, Nq, Nk, q_offset, kv_offset, bq, bk)
        states = _as_4d(states.to(torch.int8))
        Bm = B if states.shape[0] != 1 else 1
        Hm = H if states.shape[1] != 1 else 1
        states = states.expand(Bm, Hm, nqb, nkb).contiguous()
        bm = BlockMask(self, states, B, H, Nq, Nk, q_offset, kv_offset, bq, bk)
        return cache.block_masks.put(key, bm)

    def _classify_by_eval(self, B, H, Nq, Nk, q_offset, kv_offset, bq, bk) -> torch.Tensor:
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(H).view(1, H, 1, 1)
        kv = (torch.arange(Nk) + kv_offset).view(1, 1, 1, Nk)
        pad_k = nkb * bk - Nk
        rows = []
        rows_per_chunk = max(1, _EVAL_CHUNK // max(1, B * H * max(Nk, 1) * bq))
        for i0 in range(0, nqb, rows_per_chunk):
            i1 = min(nqb, i0 + rows_per_chunk)
            qs, qe = i0 * bq, min(Nq, i1 * bq)
            qp = (torch.arange(qs, qe) + q_offset).view(1, 1, -1, 1)
            m = torch.as_tensor(self.predicate(b, h, qp, kv), dtype=torch.bool)
            m = m.expand(*m.shape[:2], qe - qs, Nk)
            # pad rows/cols so tiles reshape evenly; padding counts as "allowed" for
            # `all` and "forbidden" for `any`, i.e. it never changes a verdict
            pad_q = (i1 - i0) * bq - (qe - qs)
            anyv = torch.nn.functional.pad(m, (0, pad_k, 0, pad_q), value=False)
            allv = torch.nn.functional.pad(m, (0, pad_k, 0, pad_q), value=True)
            sh = (*m.shape[:2], i1 - i0, bq, nkb, bk)
            a = anyv.reshape(sh).any(-1).any(-2)
            f = allv.reshape(sh).all(-1).all(-2)
            rows.append(tile_states(f, ~a))
        return torch.cat(rows, dim=-2)

    # -- algebra -------------------------------------------------------------------
    def __and__(self, other: Mask) -> Mask:
        from attnlab.masks.combinators import And

        return And(self, _check_mask(other, "&"))

    def __or__(self, other: Mask) -> Mask:
        from attnlab.masks.combinators import Or

        return Or(self, _check_mask(other, "|"))

    def __invert__(self) -> Mask:
        from attnlab.masks.combinators import Not

        return Not(self)


def _check_mask(m, op):
    if not isinstance(m, Mask):
        raise TypeError(f"mask {op}: expected an attnlab mask, got {type(m).__name__}")
    return m


def describe(mask: object) -> str:
    """``repr(mask)`` for messages, or its class name while ``torch.compile`` traces (a
    dataclass's repr guards against recursion by thread id, which does not trace: a BlockMask in
    a reason string broke a ``fullgraph=True`` compile)."""
    if torch.compiler.is_compiling():
        return f"<{type(mask).__name__}>"
    return repr(mask)
