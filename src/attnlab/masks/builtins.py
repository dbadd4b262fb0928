"""The built-in masks: causal, windows, prefix LM, sinks, documents, padding, trees, custom.

Each is a :class:`~attnlab.masks.Mask` with an exact tile classifier and (but for
``tree`` and ``custom``) a :meth:`~attnlab.masks.Mask.lower` to the
:class:`~attnlab.masks.MaskStructure` that kernels read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnlab.masks.base import Mask, tile_states
from attnlab.masks.structure import MaskStructure
from attnlab.validate import ArgumentTypeError, integer, tensor_check

__all__ = [
    "causal",
    "custom",
    "document",
    "key_padding",
    "padding",
    "prefix_lm",
    "sink_window",
    "sliding_window",
    "tree",
]


class _Causal(Mask):
    cheap_classify = True
    kind = "causal"

    def key_parts(self):
        return ()

    def lower(self):
        return MaskStructure(left=None, right=0)

    def predicate(self, b, h, q, kv):
        return kv <= q

    def classify(self, B, H, ql, qh, kl, kh):
        return tile_states(kh <= ql, kl > qh)

    def __repr__(self):
        return "causal()"


def causal() -> Mask:
    """``kv_pos <= q_pos``.  Aligned by absolute position (bottom-right by default)."""
    return _Causal()


def _nonneg_int(x, name):
    return integer(x, name, lo=0)


class _SlidingWindow(Mask):
    cheap_classify = True
    kind = "sliding_window"

    def key_parts(self):
        return (("int", self.w),)

    def lower(self):
        return MaskStructure(left=self.w - 1, right=0)

    def __init__(self, w):
        self.w = w

    def predicate(self, b, h, q, kv):
        return (kv <= q) & (q - kv < self.w)

    def classify(self, B, H, ql, qh, kl, kh):
        return tile_states((kh <= ql) & (qh - kl < self.w), (kl > qh) | (ql - kh >= self.w))

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
        from attnlab.masks.extra import band

        return band(w - 1, right)
    return _SlidingWindow(w)


class _PrefixLM(Mask):
    cheap_classify = True
    kind = "prefix_lm"

    def key_parts(self):
        return (("int", self.n),)

    def lower(self):
        return MaskStructure(left=None, right=0, sinks=self.n)

    def __init__(self, n):
        self.n = n

    def predicate(self, b, h, q, kv):
        return (kv < self.n) | (kv <= q)

    def classify(self, B, H, ql, qh, kl, kh):
        return tile_states((kh < self.n) | (kh <= ql), (kl >= self.n) & (kl > qh))

    def __repr__(self):
        return f"prefix_lm({self.n})"


def prefix_lm(n: int) -> Mask:
    """Bidirectional over the first ``n`` positions, causal after: ``kv_pos < n or kv_pos <= q_pos``."""
    return _PrefixLM(_nonneg_int(n, "prefix_lm(n)"))


class _SinkWindow(Mask):
    cheap_classify = True
    kind = "sink_window"

    def key_parts(self):
        return (("int", self.sinks), ("int", self.window))

    def lower(self):  # the sinks are causal too: kv < sinks and kv <= q
        return MaskStructure(left=self.window - 1, right=0, sinks=self.sinks, sinks_right=0 if self.sinks else None)

    def __init__(self, sinks, window):
        self.sinks, self.window = sinks, window

    def predicate(self, b, h, q, kv):
        return (kv <= q) & ((kv < self.sinks) | (q - kv < self.window))

    def classify(self, B, H, ql, qh, kl, kh):
        full = (kh <= ql) & ((kh < self.sinks) | (qh - kl < self.window))
        empty = (kl > qh) | ((kl >= self.sinks) & (ql - kh >= self.window))
        return tile_states(full, empty)

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


def block_minmax(ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """Min and max of ``ids[:, lo[i]:hi[i]+1]`` for each block i: (B', nblocks)."""
    starts, ends = lo.flatten(), hi.flatten() + 1
    n = ids.shape[-1]
    size = int((ends - starts).max()) if starts.numel() else 0
    idx = starts.view(-1, 1) + torch.arange(size).view(1, -1)
    valid = idx < ends.view(-1, 1)
    idx = torch.where(valid, idx, starts.view(-1, 1)).clamp(max=n - 1)
    vals = ids[:, idx]  # (B', nb, size); invalid slots repeat the block's first id
    return vals.amin(-1), vals.amax(-1)


class _Document(Mask):
    cheap_classify = True
    kind = "document"

    def key_parts(self):
        return (("tensor", self.q_ids), ("tensor", self.kv_ids))

    def lower(self):
        return MaskStructure(q_ids=self.q_ids, kv_ids=self.kv_ids)

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
                    f"positions {lo}..{lo + n - 1} (ids are looked up by absolute position)"
                )

    def classify(self, B, H, ql, qh, kl, kh):
        qmin, qmax = block_minmax(self.q_ids, ql, qh)  # (B', nqb)
        kmin, kmax = block_minmax(self.kv_ids, kl, kh)  # (B', nkb)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        empty = (qmax < kmin) | (kmax < qmin)
        return tile_states(full, empty)

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
    kind = "padding"

    def key_parts(self):
        return (("tensor", self.lengths),)

    def lower(self):
        return MaskStructure(kv_len=self.lengths)

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
        return tile_states((kh < L).expand(-1, -1, ql.shape[0], -1), (kl >= L).expand(-1, -1, ql.shape[0], -1))

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
    kind = "key_padding"

    def key_parts(self):
        return (("tensor", self.keep),)

    def lower(self):
        return MaskStructure(key_keep=self.keep)

    def __init__(self, keep):
        self.keep = keep  # (B, N) bool, looked up by absolute kv position

    def predicate(self, b, h, q, kv):
        return self.keep[:, kv.reshape(-1)].view(self.keep.shape[0], 1, 1, -1)

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        if self.keep.shape[0] != B:
            raise ValueError(f"key_padding(keep): got {self.keep.shape[0]} rows for batch size B={B}")
        if Nk and (kv_offset < 0 or kv_offset + Nk > self.keep.shape[1]):
            raise ValueError(
                f"key_padding(keep): keep covers key positions 0..{self.keep.shape[1] - 1} but the "
                f"problem has keys at {kv_offset}..{kv_offset + Nk - 1} (looked up by absolute position)"
            )

    def classify(self, B, H, ql, qh, kl, kh):
        # number of kept keys in each kv tile, from a prefix sum: O(B * tiles)
        c = torch.nn.functional.pad(self.keep.to(torch.int32).cumsum(-1), (1, 0))
        lo, hi = kl.flatten(), kh.flatten() + 1
        n = c[:, hi] - c[:, lo]  # (B, nkb)
        full = (n == (hi - lo)).view(B, 1, 1, -1)
        empty = (n == 0).view(B, 1, 1, -1)
        return tile_states(full, empty).expand(B, 1, ql.shape[0], lo.numel())

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
    kind = "tree"

    def key_parts(self):
        return (("tensor", self.anc), ("int", self.prefix_len))

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
            raise ValueError(
                f"tree: the tree covers positions up to {end - 1} but the problem reaches "
                f"q position {q_offset + Nq - 1} / kv position {kv_offset + Nk - 1}"
            )

    def __repr__(self):
        return f"tree(<{self.anc.shape[0]} nodes>, prefix_len={self.prefix_len})"


def tree(parents, prefix_len: int = 0) -> Mask:
    """Tree attention for speculative decoding.

    ``parents[t]`` is the index of node ``t``'s parent (``-1`` for a root; parents come
    before children).  Node ``t`` sits at absolute position ``prefix_len + t`` and
    attends every prefix position and its own ancestors (itself included); positions
    before ``prefix_len`` are causal.  Tiles are classified by evaluation (exact).
    """
    if isinstance(parents, (list, tuple)) and all(type(x) is int for x in parents):
        plist = list(parents)  # Python ints: no tensor op, so torch.compile traces it with no graph break
    else:
        p = parents if isinstance(parents, torch.Tensor) else torch.as_tensor(parents)
        if p.numel() == 0 and p.dim() == 1:
            p = p.long()  # an empty tree: only the causal prefix
        if p.dtype.is_floating_point or p.dtype == torch.bool or p.is_complex() or p.dim() != 1:
            raise ArgumentTypeError(f"tree(parents): expected a 1-D integer tensor, got {p.dtype} {tuple(p.shape)}")
        plist = p.tolist()
    prefix_len = _nonneg_int(prefix_len, "tree(prefix_len)")
    T = len(plist)
    for t, x in enumerate(plist):
        if x >= t or x < -1:
            raise ValueError(f"tree(parents): parents[{t}]={x}; each parent must be -1 or an earlier node")
    rows: list[list[bool]] = []
    for t, x in enumerate(plist):  # a node's ancestors are its parent's, and itself
        row = list(rows[x]) if x >= 0 else [False] * T
        row[t] = True
        rows.append(row)
    anc = torch.tensor(rows, dtype=torch.bool).reshape(T, T)
    return _Tree(anc, prefix_len)


class _Custom(Mask):
    kind = "custom"

    def __init__(self, fn, name):
        self.fn, self.name = fn, name

    def predicate(self, b, h, q, kv):
        out = self.fn(b, h, q, kv)
        if isinstance(out, bool):
            out = torch.tensor(out, device=q.device if isinstance(q, torch.Tensor) else None)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise TypeError(
                f"custom mask {self.name}: fn must return a bool tensor (or a Python bool), got "
                f"{type(out).__name__ if not isinstance(out, torch.Tensor) else out.dtype}"
            )
        # every consumer (flash tiles, classifier, dense SDPA mask, reference) gets the grids' full shape
        grid = torch.broadcast_shapes(*(torch.as_tensor(t).shape for t in (b, h, q, kv)))
        if tuple(out.shape) != tuple(grid):
            try:
                ok = torch.broadcast_shapes(out.shape, grid) == grid
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"custom mask {self.name}: fn returned shape {tuple(out.shape)}, which does not "
                    f"broadcast to the position grids' shape {tuple(grid)} (B, H, Nq, Nk); return a "
                    "bool tensor broadcastable to it, e.g. computed from b, h, q_pos and kv_pos"
                )
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
