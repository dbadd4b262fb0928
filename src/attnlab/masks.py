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

Masks combine with ``&``, ``|`` and ``~``.  ``mask.block_mask(B, H, Nq, Nk, ...)``
classifies every (q-block, kv-block) tile as empty, full or partial — exactly for
the built-ins, by evaluating the predicate once for ``custom`` masks — and caches
the result per shape, so the flash kernel skips empty tiles and evaluates no mask
on full ones.

>>> import torch, attnlab
>>> from attnlab import masks
>>> m = masks.causal() & ~masks.sliding_window(2)   # causal, but not the last 2 tokens
>>> m(torch.tensor(0), torch.tensor(0), torch.tensor([[4]]), torch.arange(5)).int().tolist()
[[1, 1, 1, 0, 0]]
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Callable

import torch

from attnlab.ops.blockmask import EMPTY, FULL, PARTIAL, BlockMask
from attnlab.validate import MAX_INT, ArgumentTypeError, integer, problem_positions, tensor_check

__all__ = [
    "Mask", "BlockMask", "causal", "sliding_window", "prefix_lm", "document", "padding",
    "tree", "sink_window", "custom", "key_padding", "band", "dense", "varlen",
]

_CACHE_SIZE = 16  # BlockMasks kept per mask (the flash backend tries up to 9 tilings)
# Chunk (in elements) used when a predicate must be evaluated to classify tiles.
_EVAL_CHUNK = 1 << 24


def _states(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
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
    checked.checks_positions = True
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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        v = cls.__dict__.get("validate")
        if v is not None and not getattr(v, "checks_positions", False):
            cls.validate = _checks_positions(v)

    def predicate(self, b, h, q_pos, kv_pos) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, b, h, q_pos, kv_pos) -> torch.Tensor:
        return self.predicate(b, h, q_pos, kv_pos)

    def key(self):
        """``(spec, tensors, ints)``: this mask by structure and parameters, what compiled code
        and the ``attnlab::flash_*`` custom ops read (:func:`mask_key`); None for ``custom``."""
        return mask_key(self)

    # -- tile classification -------------------------------------------------------
    def classify(self, B, H, q_lo, q_hi, kv_lo, kv_hi):
        """Exact tile states, or ``None`` when only evaluation can tell.

        ``q_lo``/``q_hi`` are ``(nqb, 1)`` and ``kv_lo``/``kv_hi`` are ``(1, nkb)`` int64
        tensors of inclusive absolute positions.  Returns int8 states broadcastable to
        ``(B, H, nqb, nkb)``.  ``EMPTY``/``FULL`` must be certain; ``PARTIAL`` is always safe.
        """
        return None

    def validate(self, B: int, H: int, Nq: int, Nk: int, q_offset: int, kv_offset: int) -> None:
        """Raise ``ValueError`` if this mask cannot describe that problem."""
        problem_positions(Nq, Nk, q_offset, kv_offset, where=lambda: f"mask {self!r}")

    validate.checks_positions = True

    def block_mask(self, B: int, H: int, Nq: int, Nk: int, *, q_offset: int | None = None,
                   kv_offset: int = 0, block: tuple[int, int] = (128, 512)) -> BlockMask:
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
        key = (B, H, Nq, Nk, q_offset, kv_offset, bq, bk)
        cache = self.__dict__.setdefault("_bm_cache", OrderedDict())
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        self.validate(B, H, Nq, Nk, q_offset, kv_offset)
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        q_lo = (torch.arange(nqb) * bq + q_offset).view(-1, 1)
        q_hi = (torch.clamp(torch.arange(1, nqb + 1) * bq, max=Nq) - 1 + q_offset).view(-1, 1)
        kv_lo = (torch.arange(nkb) * bk + kv_offset).view(1, -1)
        kv_hi = (torch.clamp(torch.arange(1, nkb + 1) * bk, max=Nk) - 1 + kv_offset).view(1, -1)
        states = None if nqb == 0 or nkb == 0 else self.classify(B, H, q_lo, q_hi, kv_lo, kv_hi)
        if nqb == 0 or nkb == 0:  # no tile at all
            states = torch.zeros(1, 1, nqb, nkb, dtype=torch.int8)
        elif states is None:
            states = self._classify_by_eval(B, H, Nq, Nk, q_offset, kv_offset, bq, bk)
        states = _as_4d(states.to(torch.int8))
        Bm = B if states.shape[0] != 1 else 1
        Hm = H if states.shape[1] != 1 else 1
        states = states.expand(Bm, Hm, nqb, nkb).contiguous()
        bm = BlockMask(self, states, B, H, Nq, Nk, q_offset, kv_offset, bq, bk)
        cache[key] = bm
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
        return bm

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
            rows.append(_states(f, ~a))
        return torch.cat(rows, dim=-2)

    # -- algebra -------------------------------------------------------------------
    def __and__(self, other: "Mask") -> "Mask":
        return _And(self, _check_mask(other, "&"))

    def __or__(self, other: "Mask") -> "Mask":
        return _Or(self, _check_mask(other, "|"))

    def __invert__(self) -> "Mask":
        return _Not(self)


def _check_mask(m, op):
    if not isinstance(m, Mask):
        raise TypeError(f"mask {op}: expected an attnlab mask, got {type(m).__name__}")
    return m


class _And(Mask):
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

    def validate(self, *shape):
        self.a.validate(*shape), self.b.validate(*shape)

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


class _Or(_And):
    def predicate(self, b, h, q, kv):
        return self.a.predicate(b, h, q, kv) | self.b.predicate(b, h, q, kv)

    def classify(self, B, H, ql, qh, kl, kh):
        sa, sb = self.a.classify(B, H, ql, qh, kl, kh), self.b.classify(B, H, ql, qh, kl, kh)
        if sa is None or sb is None:
            return None
        return torch.maximum(sa, sb)

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


class _Not(Mask):
    def __init__(self, a):
        self.a = a
        self.cheap_classify = a.cheap_classify

    def predicate(self, b, h, q, kv):
        return ~self.a.predicate(b, h, q, kv)

    def classify(self, B, H, ql, qh, kl, kh):
        s = self.a.classify(B, H, ql, qh, kl, kh)
        return None if s is None else (FULL - s).to(torch.int8)

    def validate(self, *shape):
        self.a.validate(*shape)

    def __repr__(self):
        return f"~{self.a!r}"


# ----------------------------------------------------------------------------- built-ins
class _Causal(Mask):
    cheap_classify = True

    sdpa_causal = True  # lets the sdpa backend recognise it (ops never import this module)

    def predicate(self, b, h, q, kv):
        return kv <= q

    def classify(self, B, H, ql, qh, kl, kh):
        return _states(kh <= ql, kl > qh)

    def __repr__(self):
        return "causal()"


def causal() -> Mask:
    """``kv_pos <= q_pos``.  Aligned by absolute position (bottom-right by default)."""
    return _Causal()


def _nonneg_int(x, name):
    return integer(x, name, lo=0)


class _SlidingWindow(Mask):
    cheap_classify = True

    def __init__(self, w):
        self.w = w

    def predicate(self, b, h, q, kv):
        return (kv <= q) & (q - kv < self.w)

    def classify(self, B, H, ql, qh, kl, kh):
        return _states((kh <= ql) & (qh - kl < self.w), (kl > qh) | (ql - kh >= self.w))

    def __repr__(self):
        return f"sliding_window({self.w})"


def sliding_window(w: int, *, right: int = 0) -> Mask:
    """Causal window of ``w`` tokens including the query itself: ``q_pos - w < kv_pos <= q_pos``.

    ``right=r`` also lets a query see the ``r`` keys after it (``kv_pos <= q_pos + r``):
    flash-attn's ``window_size=(w - 1, r)``, i.e. :func:`band` ``(w - 1, r)``."""
    w = integer(w, "sliding_window(w)")
    if w < 1:
        raise ValueError(f"sliding_window(w): w must be >= 1, got {w} (w <= 0 masks everything)")
    right = integer(right, "sliding_window(right)", lo=0)
    if right:
        from attnlab.masks_extra import band
        return band(w - 1, right)
    return _SlidingWindow(w)


class _PrefixLM(Mask):
    cheap_classify = True

    def __init__(self, n):
        self.n = n

    def predicate(self, b, h, q, kv):
        return (kv < self.n) | (kv <= q)

    def classify(self, B, H, ql, qh, kl, kh):
        return _states((kh < self.n) | (kh <= ql), (kl >= self.n) & (kl > qh))

    def __repr__(self):
        return f"prefix_lm({self.n})"


def prefix_lm(n: int) -> Mask:
    """Bidirectional over the first ``n`` positions, causal after: ``kv_pos < n or kv_pos <= q_pos``."""
    return _PrefixLM(_nonneg_int(n, "prefix_lm(n)"))


class _SinkWindow(Mask):
    cheap_classify = True

    def __init__(self, sinks, window):
        self.sinks, self.window = sinks, window

    def predicate(self, b, h, q, kv):
        return (kv <= q) & ((kv < self.sinks) | (q - kv < self.window))

    def classify(self, B, H, ql, qh, kl, kh):
        full = (kh <= ql) & ((kh < self.sinks) | (qh - kl < self.window))
        empty = (kl > qh) | ((kl >= self.sinks) & (ql - kh >= self.window))
        return _states(full, empty)

    def __repr__(self):
        return f"sink_window({self.sinks}, {self.window})"


def sink_window(sinks: int, window: int) -> Mask:
    """StreamingLLM's pattern: causal, and either one of the first ``sinks`` positions or
    within the last ``window`` tokens (query included)."""
    sinks = _nonneg_int(sinks, "sink_window(sinks)")
    if (window := _nonneg_int(window, "sink_window(window)")) == 0 and sinks == 0:
        raise ValueError("sink_window: sinks=0 and window=0 masks everything")
    return _SinkWindow(sinks, window)


def _int_tensor(x, name, what):
    """``x`` as a tensor of integers (not bool, float or complex); a Python value too large
    for int64 raises ``ValueError`` naming ``name``."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (OverflowError, RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{name}: expected {what} that fit in int64, got {x!r:.80} ({e})") from None
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise ArgumentTypeError(f"{name}: expected integer {what}, got dtype {x.dtype}")
    return x


def _ids_tensor(x, name):
    x = _int_tensor(x, name, "ids")
    if x.dim() not in (1, 2):
        raise ValueError(f"{name}: expected shape (N,) or (B, N), got {tuple(x.shape)}")
    x = x.to(torch.long)
    return x.unsqueeze(0) if x.dim() == 1 else x


def _block_minmax(ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """Min and max of ``ids[:, lo[i]:hi[i]+1]`` for each block i: (B', nblocks)."""
    starts, ends = lo.flatten(), hi.flatten() + 1
    n = ids.shape[-1]
    size = int((ends - starts).max()) if starts.numel() else 0
    idx = (starts.view(-1, 1) + torch.arange(size).view(1, -1))
    valid = idx < ends.view(-1, 1)
    idx = torch.where(valid, idx, starts.view(-1, 1)).clamp(max=n - 1)
    vals = ids[:, idx]  # (B', nb, size); invalid slots repeat the block's first id
    return vals.amin(-1), vals.amax(-1)


class _Document(Mask):
    cheap_classify = True

    def __init__(self, q_ids, kv_ids):
        self.q_ids, self.kv_ids = q_ids, kv_ids

    def predicate(self, b, h, q, kv):
        qi = self.q_ids[:, q.reshape(-1)].view(self.q_ids.shape[0], 1, -1, 1)
        ki = self.kv_ids[:, kv.reshape(-1)].view(self.kv_ids.shape[0], 1, 1, -1)
        return qi == ki

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        kv_name = "ids" if self.kv_ids is self.q_ids else "kv_ids"
        for name, ids, lo, n in (("ids", self.q_ids, q_offset, Nq), (kv_name, self.kv_ids, kv_offset, Nk)):
            if ids.shape[0] not in (1, B):
                raise ValueError(f"document({name}): batch dim {ids.shape[0]} does not match B={B}")
            if n and (lo < 0 or lo + n > ids.shape[-1]):
                raise ValueError(
                    f"document({name}): ids cover positions 0..{ids.shape[-1] - 1} but the problem needs "
                    f"positions {lo}..{lo + n - 1} (ids are looked up by absolute position)")

    def classify(self, B, H, ql, qh, kl, kh):
        qmin, qmax = _block_minmax(self.q_ids, ql, qh)  # (B', nqb)
        kmin, kmax = _block_minmax(self.kv_ids, kl, kh)  # (B', nkb)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        empty = (qmax < kmin) | (kmax < qmin)
        return _states(full, empty)

    def __repr__(self):
        return f"document(<{tuple(self.kv_ids.shape)} ids>)"


def document(ids, kv_ids=None) -> Mask:
    """Packed sequences: attend only within the same document.

    ``ids`` is ``(N,)`` or ``(B, N)`` integer document ids looked up by **absolute
    position**; with ``kv_ids`` given, ``ids`` are the queries' and ``kv_ids`` the
    keys' (cross attention between two packings).  Combine with ``causal()`` for
    packed causal training: ``document(ids) & causal()``.
    Tiles are classified from per-tile min/max ids: exact when the ids are
    non-decreasing along the sequence (the usual packing), conservative (partial,
    still correct) otherwise.
    """
    q = _ids_tensor(ids, "document(ids)")
    k = q if kv_ids is None else _ids_tensor(kv_ids, "document(kv_ids)")
    return _Document(q, k)


class _Padding(Mask):
    cheap_classify = True

    def __init__(self, lengths):
        self.lengths = lengths

    def _len(self):
        return self.lengths.view(-1, 1, 1, 1)

    def predicate(self, b, h, q, kv):
        return kv < self._len()

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        if self.lengths.shape[0] != B:
            raise ValueError(f"padding(kv_lengths): got {self.lengths.shape[0]} lengths for batch size B={B}")

    def classify(self, B, H, ql, qh, kl, kh):
        L = self._len()
        return _states((kh < L).expand(-1, -1, ql.shape[0], -1), (kl >= L).expand(-1, -1, ql.shape[0], -1))

    def __repr__(self):
        return f"padding({self.lengths.tolist()})"


def padding(kv_lengths) -> Mask:
    """Right padding: batch element ``b`` may attend keys at positions ``< kv_lengths[b]``.

    Rows whose every key is padding are fully masked: output 0, LSE ``-inf``.  A
    length may exceed the keys of one call (a KV shard or a split of the cache sees
    only part of the sequence).
    """
    t = _int_tensor(kv_lengths, "padding(kv_lengths)", "lengths")
    if t.dim() != 1:
        raise ValueError(f"padding(kv_lengths): expected shape (B,), got {tuple(t.shape)}")
    if not tensor_check((t >= 0).all(), "padding(kv_lengths): lengths must be >= 0"):
        raise ValueError(f"padding(kv_lengths): lengths must be >= 0, got {t.tolist()}")
    return _Padding(t.to(torch.long))


class _KeyPadding(Mask):
    cheap_classify = True

    def __init__(self, keep):
        self.keep = keep  # (B, N) bool, looked up by absolute kv position

    def predicate(self, b, h, q, kv):
        return self.keep[:, kv.reshape(-1)].view(self.keep.shape[0], 1, 1, -1)

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        if self.keep.shape[0] != B:
            raise ValueError(f"key_padding(keep): got {self.keep.shape[0]} rows for batch size B={B}")
        if Nk and (kv_offset < 0 or kv_offset + Nk > self.keep.shape[1]):
            raise ValueError(f"key_padding(keep): keep covers key positions 0..{self.keep.shape[1] - 1} but the "
                             f"problem has keys at {kv_offset}..{kv_offset + Nk - 1} (looked up by absolute position)")

    def classify(self, B, H, ql, qh, kl, kh):
        # number of kept keys in each kv tile, from a prefix sum: O(B * tiles)
        c = torch.nn.functional.pad(self.keep.to(torch.int32).cumsum(-1), (1, 0))
        lo, hi = kl.flatten(), kh.flatten() + 1
        n = c[:, hi] - c[:, lo]  # (B, nkb)
        full = (n == (hi - lo)).view(B, 1, 1, -1)
        empty = (n == 0).view(B, 1, 1, -1)
        return _states(full, empty).expand(B, 1, ql.shape[0], lo.numel())

    def sdpa_bool_mask(self, B, Nq, Nk, kv_offset):
        """The same mask as a boolean SDPA ``attn_mask`` of shape ``(B, 1, 1, Nk)``."""
        return self.keep[:, kv_offset:kv_offset + Nk].view(B, 1, 1, Nk)

    def __repr__(self):
        return f"key_padding(<{tuple(self.keep.shape)}, {int(self.keep.sum())} kept>)"


def key_padding(keep) -> Mask:
    """Keys marked ``False`` in ``keep`` (``(B, N)`` bool, True = a real token) are hidden.

    The usual ``attention_mask`` of a tokenizer, for right *or* left padding.  ``keep``
    is looked up by absolute key position.  Query rows are not masked: a padded query
    still attends the real keys (its output is ignored downstream); a sequence with no
    real token gives fully masked rows (output 0).

    >>> import torch
    >>> m = key_padding(torch.tensor([[False, True, True]]))   # one left-padded sequence
    >>> m(torch.tensor(0), torch.tensor(0), torch.tensor([[2]]), torch.arange(3)).tolist()
    [[[[False, True, True]]]]
    """
    t = torch.as_tensor(keep)
    if t.dtype != torch.bool:
        if t.dtype.is_floating_point or t.is_complex():
            raise TypeError(f"key_padding(keep): expected a bool or 0/1 integer tensor, got dtype {t.dtype}")
        if not tensor_check(((t == 0) | (t == 1)).all(), "key_padding(keep): integer masks must hold only 0 and 1"):
            raise ValueError("key_padding(keep): integer masks must hold only 0 and 1")
        t = t.bool()
    if t.dim() != 2:
        raise ValueError(f"key_padding(keep): expected shape (B, N), got {tuple(t.shape)}")
    return _KeyPadding(t)


class _Tree(Mask):
    def __init__(self, anc, prefix_len):
        self.anc, self.prefix_len = anc, prefix_len

    def predicate(self, b, h, q, kv):
        T, P = self.anc.shape[0], self.prefix_len
        if T == 0:
            return kv <= q
        qt, kt = q - P, kv - P
        in_tree = (qt >= 0) & (kt >= 0)
        a = self.anc[qt.clamp(0, T - 1), kt.clamp(0, T - 1)]
        return torch.where(in_tree, a, kv <= q)

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        end = self.prefix_len + self.anc.shape[0]
        if q_offset + Nq > end or kv_offset + Nk > end:
            raise ValueError(f"tree: the tree covers positions up to {end - 1} but the problem reaches "
                             f"q position {q_offset + Nq - 1} / kv position {kv_offset + Nk - 1}")

    def __repr__(self):
        return f"tree(<{self.anc.shape[0]} nodes>, prefix_len={self.prefix_len})"


def tree(parents, prefix_len: int = 0) -> Mask:
    """Tree attention for speculative decoding.

    ``parents[t]`` is the index of node ``t``'s parent (``-1`` for a root; parents come
    before children).  Node ``t`` sits at absolute position ``prefix_len + t`` and
    attends every prefix position and its own ancestors (itself included); positions
    before ``prefix_len`` are causal.  Tiles are classified by evaluation (exact).
    """
    p = parents if isinstance(parents, torch.Tensor) else torch.as_tensor(parents)
    if p.numel() == 0 and p.dim() == 1:
        p = p.long()  # an empty tree: only the causal prefix
    if p.dtype.is_floating_point or p.dtype == torch.bool or p.is_complex() or p.dim() != 1:
        raise ArgumentTypeError(f"tree(parents): expected a 1-D integer tensor, got {p.dtype} {tuple(p.shape)}")
    prefix_len = _nonneg_int(prefix_len, "tree(prefix_len)")
    T = p.numel()
    idx = torch.arange(T)
    if ((p >= idx) | (p < -1)).any():
        bad = int(torch.nonzero((p >= idx) | (p < -1))[0])
        raise ValueError(f"tree(parents): parents[{bad}]={int(p[bad])}; each parent must be -1 or an earlier node")
    anc = torch.eye(T, dtype=torch.bool)
    for t in range(T):
        if p[t] >= 0:
            anc[t] |= anc[int(p[t])]
    return _Tree(anc, prefix_len)


class _Custom(Mask):
    def __init__(self, fn, name):
        self.fn, self.name = fn, name

    def predicate(self, b, h, q, kv):
        out = self.fn(b, h, q, kv)
        if isinstance(out, bool):
            out = torch.tensor(out, device=q.device if isinstance(q, torch.Tensor) else None)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise TypeError(f"custom mask {self.name}: fn must return a bool tensor (or a Python bool), got "
                            f"{type(out).__name__ if not isinstance(out, torch.Tensor) else out.dtype}")
        # every consumer (flash tiles, classifier, dense SDPA mask, reference) gets the grids' full shape
        grid = torch.broadcast_shapes(*(torch.as_tensor(t).shape for t in (b, h, q, kv)))
        if tuple(out.shape) != tuple(grid):
            try:
                ok = torch.broadcast_shapes(out.shape, grid) == grid
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(f"custom mask {self.name}: fn returned shape {tuple(out.shape)}, which does not "
                                 f"broadcast to the position grids' shape {tuple(grid)} (B, H, Nq, Nk); return a "
                                 "bool tensor broadcastable to it, e.g. computed from b, h, q_pos and kv_pos")
            # leading dims of size 1, as broadcasting reads them; size-1 batch/head dims are
            # kept (a view), as the built-ins return them, so no consumer pays B·H times
            out = out.reshape((1,) * (len(grid) - out.dim()) + tuple(out.shape))
        return out

    def __repr__(self):
        return f"custom({self.name})"


def custom(fn: Callable) -> Mask:
    """Any predicate ``fn(b, h, q_pos, kv_pos) -> bool tensor`` (True = may attend).

    The result may be any bool tensor that broadcasts to the shape of the position grids
    (``(B, H, Nq, Nk)`` for a whole problem, a tile's shape inside a kernel): a 0-d
    ``torch.tensor(True)`` (FlexAttention's ``noop_mask``) or a Python ``bool`` included;
    it is reshaped (a view) to the grids' rank with leading size-1 dims, as broadcasting
    reads it, so every backend sees the same mask.
    A result that does not broadcast raises ``ValueError`` naming both shapes; a result
    of another dtype (int, float) raises ``TypeError``.

    >>> import torch
    >>> m = custom(lambda b, h, q, kv: torch.tensor(True))
    >>> m(torch.zeros(2, 1, 1, 1, dtype=torch.long), torch.zeros(1, 3, 1, 1, dtype=torch.long),
    ...   torch.arange(4).view(1, 1, 4, 1), torch.arange(5).view(1, 1, 1, 5)).shape
    torch.Size([1, 1, 1, 1])

    Tiles are classified by evaluating ``fn`` over the whole problem once per shape
    (cached), as FlexAttention's ``create_block_mask`` does.
    """
    if not callable(fn):
        raise TypeError(f"custom(fn): fn must be callable, got {type(fn).__name__}")
    return _Custom(fn, getattr(fn, "__name__", "fn"))


# ----------------------------------------------------------------------------- structural keys
# A built-in mask is described to compiled code (torch.compile, torch.export, the
# ``attnlab::flash_*`` custom ops of :mod:`attnlab.ops.library`) by its *structure*: a
# string such as ``and(causal,sliding_window(i0))`` plus the tensors (``t0``, ``t1``, ...)
# and ints (``i0``, ...) it reads.  Ints travel as op inputs (SymInts under dynamic
# shapes), so a new window size is a new input, not a new string: dynamo guards on the
# structure, never on the object's identity or its caches.


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
    if t is _DenseBool:
        return f"dense({kb.tensor(mask.allowed)},{kb.int(mask.q_offset)},{kb.int(mask.kv_offset)})"
    if t in (_And, _Or):
        a, b = _key_into(mask.a, kb), _key_into(mask.b, kb)
        if a is None or b is None:
            return None
        return f"{'and' if t is _And else 'or'}({a},{b})"
    if t is _Not:
        a = _key_into(mask.a, kb)
        return None if a is None else f"not({a})"
    return None


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


def mask_from_key(spec: str, tensors, ints) -> "Mask":
    """The mask :func:`mask_key` described (no validation: the original was validated)."""
    def leaf(x):
        if x[0] == "t":
            return tensors[int(x[1:])]
        if x[0] == "i":
            return ints[int(x[1:])]
        raise ValueError(f"structural key: bad leaf {x!r}")

    def build(node):
        name, args = (node, []) if isinstance(node, str) else node
        if name == "causal":
            return _Causal()
        if name in ("and", "or"):
            a, b = build(args[0]), build(args[1])
            return _And(a, b) if name == "and" else _Or(a, b)
        if name == "not":
            return _Not(build(args[0]))
        vals = [leaf(a) for a in args]
        ctor = {"sliding_window": _SlidingWindow, "prefix_lm": _PrefixLM, "sink_window": _SinkWindow,
                "document": _Document, "padding": _Padding, "key_padding": _KeyPadding, "tree": _Tree,
                "dense": _DenseBool}.get(name)
        if ctor is None:
            raise ValueError(f"structural key: unknown mask {name!r}")
        return ctor(*vals)

    return build(parse_key(spec))


class _DenseBool(Mask):
    """A custom mask evaluated once over the whole problem (what compiled code passes to the
    flash op in place of a Python predicate): ``allowed`` broadcastable to ``(B, H, Nq, Nk)``,
    indexed by row/column (absolute positions minus the problem's offsets)."""

    def __init__(self, allowed, q_offset, kv_offset):
        self.allowed, self.q_offset, self.kv_offset = allowed, q_offset, kv_offset

    def predicate(self, b, h, q, kv):
        a = self.allowed
        bi = b if a.shape[0] > 1 else torch.zeros_like(b)
        hi = h if a.shape[1] > 1 else torch.zeros_like(h)
        qi = q - self.q_offset if a.shape[2] > 1 else torch.zeros_like(q)
        ki = kv - self.kv_offset if a.shape[3] > 1 else torch.zeros_like(kv)
        return a[bi, hi, qi, ki]

    def __repr__(self):
        return f"dense(<{tuple(self.allowed.shape)}>)"


def dense_mask(mask, B, H, Nq, Nk, q_offset, kv_offset, device) -> "Mask":
    """``mask`` evaluated on the whole ``(B, H, Nq, Nk)`` problem (bool, broadcast dims kept
    at 1) as a mask with a structural key: O(Nq·Nk) memory, traced by ``torch.compile``."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    qp = (torch.arange(Nq, device=device) + q_offset).view(1, 1, Nq, 1)
    kp = (torch.arange(Nk, device=device) + kv_offset).view(1, 1, 1, Nk)
    a = torch.as_tensor(mask.predicate(b, h, qp, kp), device=device)
    while a.dim() < 4:
        a = a.unsqueeze(0)
    return _DenseBool(a.expand(a.shape[0], a.shape[1], Nq, Nk), q_offset, kv_offset)
from attnlab.masks_extra import band, dense, varlen  # noqa: E402  (new kinds live there: file size)
