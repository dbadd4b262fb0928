"""More mask kinds: a band with a right extent (flash-attn's ``window_size=(left, right)``),
dense tensor masks (SDPA's ``attn_mask``), packed variable-length sequences and
per-batch query offsets.

Positions are absolute as everywhere in attnlab (:mod:`attnlab.masks`); a *dense* mask
is the exception that proves the rule: it is indexed by query **row** and key
**column**, like torch SDPA's ``attn_mask``, so it is bound to the problem's offsets
(``attention(mask=tensor)`` binds them for you).
"""

from __future__ import annotations

import torch

from attnlab.masks.base import Mask, tile_states
from attnlab.masks.builtins import block_minmax
from attnlab.masks.structure import MaskStructure
from attnlab.validate import integer

__all__ = ["band", "check_dense", "dense", "dense_mask", "per_batch_q_offset", "varlen"]


class _Band(Mask):
    """``q_pos - left <= kv_pos <= q_pos + right``; ``None`` = unbounded on that side."""

    cheap_classify = True
    kind = "band"

    def key_parts(self):
        return (("opt", self.left), ("opt", self.right))

    def __init__(self, left, right):
        self.left, self.right = left, right

    def lower(self):
        return MaskStructure(left=self.left, right=self.right)

    def predicate(self, b, h, q, kv):
        ok = torch.ones((), dtype=torch.bool, device=q.device if isinstance(q, torch.Tensor) else None)
        if self.left is not None:
            ok = ok & (q - kv <= self.left)
        if self.right is not None:
            ok = ok & (kv - q <= self.right)
        return ok

    def classify(self, B, H, ql, qh, kl, kh):
        full = torch.ones((ql.shape[0], kl.shape[1]), dtype=torch.bool)
        empty = torch.zeros_like(full)
        if self.left is not None:
            full = full & (qh - kl <= self.left)
            empty = empty | (ql - kh > self.left)
        if self.right is not None:
            full = full & (kh - ql <= self.right)
            empty = empty | (kl - qh > self.right)
        return tile_states(full, empty)

    def __repr__(self):
        return f"band({self.left}, {self.right})"


def band(left, right) -> _Band:
    """flash-attn's ``window_size=(left, right)``: a query at ``q_pos`` sees keys
    ``q_pos - left <= kv_pos <= q_pos + right`` (itself included).  ``None`` (flash-attn's
    ``-1``) leaves that side unbounded.

    ``band(l, 0)`` is ``sliding_window(l + 1)`` (attnlab's window counts the query
    itself); ``band(None, 0)`` is ``causal()``; ``band(l, r)`` is
    ``sliding_window(l + 1, right=r)``.  Positions are absolute (bottom-right aligned by
    default, as flash-attn's window is)."""
    lr: list[int | None] = []
    for name, x in (("left", left), ("right", right)):
        if x is None or (isinstance(x, int) and not isinstance(x, bool) and x == -1):
            lr.append(None)  # flash-attn's -1 = infinite
            continue
        lr.append(integer(x, f"band({name})", lo=0))
    return _Band(*lr)


def _lookup(t, b, h, qi, ki):
    """``t[b, h, qi, ki]`` with size-1 dims of ``t`` broadcast (index 0)."""
    idx = [b, h, qi, ki]
    idx = [x if t.shape[d] > 1 else torch.zeros((), dtype=torch.long, device=t.device) for d, x in enumerate(idx)]
    return t[tuple(torch.as_tensor(x, device=t.device) for x in idx)]


def _as_4d(t):
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def check_dense(t, B, H, Nq, Nk, name="mask"):
    """``t`` (<= 4 dims) must broadcast to ``(B, H, Nq, Nk)`` (SDPA's rule); returns it as 4-D."""
    if t.dim() > 4:
        raise ValueError(f"{name}: a dense mask has at most 4 dims (B, H, Nq, Nk), got shape {tuple(t.shape)}")
    t4 = _as_4d(t)
    want = (B, H, Nq, Nk)
    if any(s not in (1, w) for s, w in zip(t4.shape, want, strict=True)):
        raise ValueError(
            f"{name}: shape {tuple(t.shape)} does not broadcast to (B, H, Nq, Nk)={want}; "
            "each dim must be 1 or the problem's (a (B, N, H, D) layout? the mask stays (B, H, Nq, Nk))"
        )
    return t4


class _Dense(Mask):
    """A bool ``(B?, H?, Nq, Nk)`` tensor (True = attend), indexed by row and column."""

    kind = "dense"

    def key_parts(self):
        return (("tensor", self.t), ("int", self.q_offset), ("int", self.kv_offset))

    def __init__(self, t, q_offset, kv_offset):
        self.t, self.q_offset, self.kv_offset = t, q_offset, kv_offset

    def lower(self):
        return MaskStructure(dense=self.t, dense_q_offset=self.q_offset, dense_kv_offset=self.kv_offset)

    def predicate(self, b, h, q, kv):
        return _lookup(self.t, b, h, q - self.q_offset, kv - self.kv_offset)

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        check_dense(self.t, B, H, Nq, Nk)
        if (q_offset, kv_offset) != (self.q_offset, self.kv_offset):
            raise ValueError(
                f"masks.dense: built for q_offset={self.q_offset}, kv_offset={self.kv_offset} but the "
                f"problem has q_offset={q_offset}, kv_offset={kv_offset}; a dense mask is indexed by "
                "row and column, build it with the problem's offsets"
            )

    def __repr__(self):
        return f"dense(<{tuple(self.t.shape)} bool>)"


def dense(t, *, q_offset: int, kv_offset: int = 0) -> Mask:
    """A boolean tensor mask (True = may attend), broadcastable to ``(B, H, Nq, Nk)``,
    indexed by query **row** and key **column** (torch SDPA's ``attn_mask`` convention).
    ``q_offset``/``kv_offset``: the offsets of the problem it is for (the row ``i`` is
    the query at absolute position ``q_offset + i``); ``attention(..., mask=tensor)``
    builds it with the right ones.  Tiles are classified by evaluating it once per
    shape (cached on the mask), so the flash path skips the empty ones.  For an additive
    float mask pass it as ``attention(mask=float_tensor)`` (:func:`attnlab.scores.bias`)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
        raise TypeError(
            f"masks.dense(t): expected a bool tensor (True = attend), got "
            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}; an additive float mask "
            "is scores.bias(t)"
        )
    q_offset = integer(q_offset, "masks.dense(q_offset)")
    kv_offset = integer(kv_offset, "masks.dense(kv_offset)")
    if t.dim() > 4:
        raise ValueError(f"masks.dense(t): at most 4 dims (B, H, Nq, Nk), got shape {tuple(t.shape)}")
    return _Dense(_as_4d(t), q_offset, kv_offset)


class _ShiftedMask(Mask):
    """``inner`` seen from per-batch query positions ``q_offset[b] + i`` (the kernel runs
    with ``q_offset = 0``).  Classified by evaluation (cached per shape)."""

    kind = "shift"

    def key_parts(self):
        return (("mask", self.inner), ("tensor", self.qo))

    def __init__(self, inner, qo):
        self.inner, self.qo = inner, qo
        # the offsets' range, read once here (validate then reads no tensor value, so compiled
        # code that gets this mask passes it to the flash op with no graph break); built
        # inside a compiled region it is read when the op rebuilds the mask from its key
        self._range = (
            None if torch.compiler.is_compiling() else (int(qo.min()), int(qo.max())) if qo.numel() else (0, 0)
        )

    def lower(self):
        s = self.inner.lower()
        return None if s is None or s.q_shift is not None else s.replace(q_shift=self.qo)

    def predicate(self, b, h, q, kv):
        qo = self.qo.to(q.device)
        rows = []
        for i in range(qo.shape[0]):  # one batch at a time: built-ins index ids by position
            r = torch.as_tensor(self.inner(b, h, q + qo[i], kv))
            r = r.reshape((1,) * (4 - r.dim()) + tuple(r.shape))
            rows.append(r[i : i + 1] if r.shape[0] > 1 else r)
        shape = torch.broadcast_shapes(*(r.shape for r in rows))
        return torch.cat([r.expand(1, *shape[1:]) for r in rows], 0)

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        if self.qo.shape[0] != B:
            raise ValueError(f"q_offset: {self.qo.shape[0]} per-batch offsets for batch size B={B}")
        for o in sorted(set(self._range or ())):
            self.inner.validate(B, H, Nq, Nk, q_offset + o, kv_offset)

    def __repr__(self):
        return f"{self.inner!r} at q_offset={self.qo.tolist()}"


def per_batch_q_offset(mask: Mask, q_offset: torch.Tensor) -> Mask:
    """``mask`` for a problem whose batch element ``b`` has its queries at absolute positions
    ``q_offset[b] + i`` (ragged decoding: each sequence's new token at its own length).
    Run the problem with ``q_offset=0``; ``attention(q_offset=tensor)`` does this for you."""
    return _ShiftedMask(mask, q_offset.to(torch.long))


def _cu_arg(cu, name):
    if not isinstance(cu, torch.Tensor) or cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.dim() != 1:
        raise ValueError(
            f"{name}: expected a 1-D integer tensor (num_seqs + 1,) of cumulative lengths, got "
            f"{cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__}"
            f"{' ' + str(tuple(cu.shape)) if isinstance(cu, torch.Tensor) else ''}"
        )
    cu = cu.to(device="cpu", dtype=torch.long)
    if cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"{name}: must start at 0, got {cu.tolist()[:8]}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name}: must be non-decreasing (cumulative sequence lengths), got {cu.tolist()[:16]}")
    return cu


class _Varlen(Mask):
    """Packed sequences with per-sequence positions (flash-attn's varlen convention)."""

    cheap_classify = True
    kind = "varlen"

    def key_parts(self):
        return (("tensor", self.cu_q), ("tensor", self.cu_k), ("opt", self.left), ("opt", self.right))

    def lower(self):
        band = self.left is not None or self.right is not None
        return MaskStructure(
            left=self.left,
            right=self.right,
            q_ids=self.q_ids.view(1, -1),
            kv_ids=self.k_ids.view(1, -1),
            q_pos=self.q_loc if band else None,
            kv_pos=self.k_loc if band else None,
        )

    def __init__(self, cu_q, cu_k, left, right):
        self.cu_q, self.cu_k, self.left, self.right = cu_q, cu_k, left, right
        lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        ns = lq.numel()
        self.q_ids = torch.repeat_interleave(torch.arange(ns), lq)
        self.k_ids = torch.repeat_interleave(torch.arange(ns), lk)
        # local positions, bottom-right aligned within each sequence (flash-attn's causal)
        self.q_loc = torch.arange(int(cu_q[-1])) - cu_q[:-1][self.q_ids] + (lk - lq)[self.q_ids]
        self.k_loc = torch.arange(int(cu_k[-1])) - cu_k[:-1][self.k_ids]
        self._dev = {}
        self._n = (int(cu_q[-1]), int(cu_k[-1]))  # read once: validate reads no tensor value

    def _on(self, device):
        key = str(device)
        if key not in self._dev:
            self._dev[key] = tuple(t.to(device) for t in (self.q_ids, self.k_ids, self.q_loc, self.k_loc))
        return self._dev[key]

    def _band(self, qp, kp):
        ok = torch.ones((), dtype=torch.bool, device=qp.device)
        if self.left is not None:
            ok = ok & (qp - kp <= self.left)
        if self.right is not None:
            ok = ok & (kp - qp <= self.right)
        return ok

    def predicate(self, b, h, q, kv):
        qi, ki, ql, kl = self._on(q.device)
        return (qi[q] == ki[kv]) & self._band(ql[q], kl[kv])

    def local_positions(self, q, kv):
        """(sequence index of each query, local query position, local key position)."""
        qi, _, ql, kl = self._on(q.device)
        return qi[q], ql[q], kl[kv]

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        if (Nq, Nk, q_offset, kv_offset) != (*self._n, 0, 0) or B != 1:
            raise ValueError(
                f"masks.varlen: built for {self._n[0]} packed queries and {self._n[1]} "
                f"packed keys (B=1, q_offset=kv_offset=0), got B={B}, Nq={Nq}, Nk={Nk}, "
                f"q_offset={q_offset}, kv_offset={kv_offset}"
            )

    def classify(self, B, H, ql, qh, kl, kh):
        qmin, qmax = block_minmax(self.q_ids.view(1, -1), ql, qh)
        kmin, kmax = block_minmax(self.k_ids.view(1, -1), kl, kh)
        qmin, qmax = qmin.view(-1, 1), qmax.view(-1, 1)
        kmin, kmax = kmin.view(1, -1), kmax.view(1, -1)
        same = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        disjoint = (qmax < kmin) | (kmax < qmin)
        # within one sequence the local positions are the packed ones shifted by a constant
        qlo, qhi = self.q_loc[ql.flatten()].view(-1, 1), self.q_loc[qh.flatten()].view(-1, 1)
        klo, khi = self.k_loc[kl.flatten()].view(1, -1), self.k_loc[kh.flatten()].view(1, -1)
        full = torch.ones_like(same)
        empty = torch.zeros_like(same)
        if self.left is not None:
            full = full & (qhi - klo <= self.left)
            empty = empty | (qlo - khi > self.left)
        if self.right is not None:
            full = full & (khi - qlo <= self.right)
            empty = empty | (klo - qhi > self.right)
        return tile_states(same & full, disjoint | (same & empty))

    def __repr__(self):
        return f"varlen({self.cu_q.numel() - 1} seqs, window=({self.left}, {self.right}))"


def varlen(cu_seqlens_q, cu_seqlens_k=None, *, window=(None, None)) -> _Varlen:
    """Packed variable-length sequences (flash-attn's ``cu_seqlens``): query ``t`` of sequence
    ``s`` sees only keys of sequence ``s``, and within it the ``window=(left, right)`` band
    (:func:`band`; ``None`` or ``-1`` unbounded; ``(None, 0)`` is causal) on **per-sequence,
    bottom-right aligned** positions: the last query of a sequence sits at its last key,
    as in flash-attn's ``flash_attn_varlen_func``.  For a problem with ``B = 1``,
    ``Nq = cu_seqlens_q[-1]``, ``Nk = cu_seqlens_k[-1]`` and ``q_offset = kv_offset = 0``
    (:func:`attnlab.varlen_attention` runs it).  Tiles are classified exactly from
    per-tile sequence ids, so tiles across two sequences are skipped."""
    cu_q = _cu_arg(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else _cu_arg(cu_seqlens_k, "cu_seqlens_k")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, got "
            f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
        )
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected (left, right), got {window!r}")
    b = band(*window)
    return _Varlen(cu_q, cu_k, b.left, b.right)


def dense_mask(mask, B, H, Nq, Nk, q_offset, kv_offset, device) -> Mask:
    """``mask`` evaluated on the whole ``(B, H, Nq, Nk)`` problem (bool, broadcast dims kept
    at 1) as a :func:`dense` mask, which has a structural key: O(Nq·Nk) memory, what
    compiled code hands the flash op in place of a Python predicate (traced)."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    qp = (torch.arange(Nq, device=device) + q_offset).view(1, 1, Nq, 1)
    kp = (torch.arange(Nk, device=device) + kv_offset).view(1, 1, 1, Nk)
    a = torch.as_tensor(mask.predicate(b, h, qp, kp), device=device)
    while a.dim() < 4:
        a = a.unsqueeze(0)
    return _Dense(a.expand(a.shape[0], a.shape[1], Nq, Nk), q_offset, kv_offset)
