"""The view a :class:`attnlab.cache.paged.PagedCache` update returns: :class:`PagedKV`
attends each selected sequence's keys as runs of adjacent blocks ("pieces") read from the
pools in place, skips the pieces a mask hides, and merges the rest exactly
(:func:`attnlab.ops.decode.split_kv_attention`, :func:`attnlab.merge_states`).

Each batch row is attended alone, at its own ``q_offset``; masks and score mods that depend
on the batch index are called with the row's index in the selection (``_RowMask``,
``_RowScoreMod``).  A view goes stale (:class:`StaleViewError`) once its sequence releases
blocks.  The layout and the cache's API are in :mod:`attnlab.cache.paged`.
"""

from __future__ import annotations

import torch

from attnlab.cache.base import KV, DenseKV
from attnlab.masks import EMPTY, FULL, PARTIAL, BlockMask, Mask
from attnlab.ops.args import scale_arg
from attnlab.ops.decode import split_kv_attention
from attnlab.ops.merge import merge_states
from attnlab.ops.native import decode_ops
from attnlab.scores import ScoreMod

__all__ = ["PagedKV", "StaleViewError"]


class StaleViewError(ValueError):
    """A :class:`PagedKV` was used after its sequence released blocks (``free``, ``evict``,
    ``truncate``, ``reset``): those blocks may now hold another sequence's keys."""


def _tile_state(mask, H, Nq, Nk, q_offset, kv_offset):
    """FULL or EMPTY when ``mask`` says so exactly for all of a (queries x piece) tile, else PARTIAL."""
    if mask is None:
        return FULL
    mask.validate(1, H, Nq, Nk, q_offset, kv_offset)
    s = mask.classify(
        1,
        H,
        torch.tensor([[q_offset]]),
        torch.tensor([[q_offset + Nq - 1]]),
        torch.tensor([[kv_offset]]),
        torch.tensor([[kv_offset + Nk - 1]]),
    )
    if s is None:
        return PARTIAL
    s = torch.as_tensor(s)
    return FULL if bool((s == FULL).all()) else EMPTY if bool((s == EMPTY).all()) else PARTIAL


def _pick(t, row, B):
    """Row ``row`` of a ``(B, ...)`` result of a batch-dependent mask or score mod."""
    if isinstance(t, torch.Tensor) and t.dim() == 4 and B > 1 and t.shape[0] == B:
        return t[row : row + 1]
    return t


class _RowMask(Mask):
    """``inner`` seen from batch row ``row`` of ``B`` while one row is attended alone."""

    def __init__(self, inner, row, B):
        self.inner, self.row, self.B = inner, row, B
        self.cheap_classify = getattr(inner, "cheap_classify", False)

    def predicate(self, b, h, q, kv):
        return _pick(torch.as_tensor(self.inner.predicate(b + self.row, h, q, kv)), self.row, self.B)

    def classify(self, B, H, ql, qh, kl, kh):
        s = self.inner.classify(self.B, H, ql, qh, kl, kh)
        return None if s is None else _pick(s, self.row, self.B)

    def validate(self, B, H, Nq, Nk, q_offset, kv_offset):
        self.inner.validate(self.B, H, Nq, Nk, q_offset, kv_offset)

    def __repr__(self):
        return f"row {self.row} of {self.inner!r}"


class _RowScoreMod(ScoreMod):
    def __init__(self, inner, row, B):
        self.inner, self.row, self.B = inner, row, B

    def apply(self, score, b, h, q, kv):
        return _pick(self.inner(score, b + self.row, h, q, kv), self.row, self.B)

    def parameters(self):
        return self.inner.parameters() if hasattr(self.inner, "parameters") else []

    def validate(self, B, H):
        if hasattr(self.inner, "validate"):
            self.inner.validate(self.B, H)


class PagedKV(KV):
    """One layer's view after :meth:`PagedCache.update`: per row, the block table, the first
    held position, and the held length before/after the update.  Reads the pools in place."""

    def __init__(self, cache, layer, rows, states=(), seqs=()):
        self.cache, self.layer, self.rows = cache, layer, rows  # rows: [(table, start, before, after)]
        # the sequences' states and generations now: a release of blocks after this makes the view stale
        self._stamp = [(q, s, s.generation) for q, s in zip(seqs, states, strict=True)]
        starts = {start + before for _, start, before, _ in rows}
        self.q_offset = starts.pop() if len(starts) == 1 else None  # None: ragged (see q_offsets)
        self.q_offsets = [start + before for _, start, before, _ in rows]
        self._native: tuple | None = None

    def pieces(self, row: int) -> list:
        """``(k, v, kv_offset)`` per run of adjacent blocks of ``row``: views of the pools,
        ``k (1, Hkv, n, D)``, ``v (1, Hkv, n, Dv)``, keys at ``kv_offset .. kv_offset+n-1``.
        Raises :class:`StaleViewError` once the sequence has released blocks since the view."""
        self.check_fresh()
        table, start, _, L = self.rows[row]
        K, V = self.cache.k_pool[self.layer], self.cache.v_pool[self.layer]
        Hkv, _, bs, D = K.shape
        Dv = V.shape[3]
        nb = -(-L // bs)
        out, i = [], 0
        while i < nb:
            j = i + 1
            while j < nb and table[j] == table[j - 1] + 1:
                j += 1
            b0, m, cnt = table[i], j - i, min(L, j * bs) - i * bs
            k = K[:, b0 : b0 + m].view(Hkv, m * bs, D)[:, :cnt].unsqueeze(0)
            v = V[:, b0 : b0 + m].view(Hkv, m * bs, Dv)[:, :cnt].unsqueeze(0)
            out.append((k, v, start + i * bs))
            i = j
        return out

    def check_fresh(self) -> None:
        """Raise :class:`StaleViewError` if a selected sequence was freed, evicted, truncated
        or reset since this view was made (its blocks may hold another sequence's keys now)."""
        for q, s, gen in self._stamp:
            if s.generation != gen:
                raise StaleViewError(
                    f"PagedKV: this view of layer {self.layer} was made before sequence {q} released blocks "
                    "(free, evict, truncate or reset); they may now hold another sequence's keys.  Take a new "
                    "view (cache.select(...).update(...)) after changing the cache"
                )

    def attend(self, q, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False):
        """Attention of ``q (B, H, Nq, D)`` over each row's held keys, its queries at the row's
        own positions.  On CPU, with the native extension built, no score mod, a mask the
        native kernel implements and no gradient wanted, one native call reads every row's
        blocks through the block tables (:mod:`attnlab.ops.native.decode_ops`); otherwise
        (and as its reference) :meth:`attend_split` walks the pieces row by row."""
        self.check_fresh()
        B = len(self.rows)
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != B:
            raise ValueError(
                f"PagedKV.attend: expected q (B={B}, H, Nq, D) for the {B} selected sequences, got "
                f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
            )
        if isinstance(mask, BlockMask):
            mask = mask.mask  # a BlockMask was built for a dense shape: its predicate is what counts
        K, V = self.cache.k_pool[self.layer], self.cache.v_pool[self.layer]
        if q.shape[3] == K.shape[3] and q.shape[1] % K.shape[0] == 0:
            s, _why = decode_ops.plan(q, K.dtype, mask, score_mod, backend, B, (K, V), scale)
            if s is not None:
                out, lse = self._attend_native(q, s, scale_arg(scale, q.shape[3]))
                return (out, lse) if return_lse else out
        return self.attend_split(q, mask=mask, score_mod=score_mod, scale=scale, backend=backend, return_lse=return_lse)

    def native_args(self) -> tuple:
        """``(tables (B, max_blocks) int32, lens, kv_start, q_pos)`` of the selected rows, as the
        native decode kernel reads them (built once per view)."""
        if self._native is None:
            width = max(len(t) for t, _, _, _ in self.rows)
            tables = torch.zeros(len(self.rows), width, dtype=torch.int32)
            for r, (t, _, _, _) in enumerate(self.rows):
                tables[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
            lens = torch.tensor([after for _, _, _, after in self.rows], dtype=torch.long)
            starts = torch.tensor([start for _, start, _, _ in self.rows], dtype=torch.long)
            self._native = (tables, lens, starts, torch.tensor(self.q_offsets, dtype=torch.long))
        return self._native

    def _attend_native(self, q, s, scale):
        K, V = self.cache.k_pool[self.layer], self.cache.v_pool[self.layer]
        tables, lens, starts, q_pos = self.native_args()
        kv_len = None if s.kv_len is None else s.kv_len.to(torch.long)
        return torch.ops.attnlab.native_paged_decode(
            q,
            K,
            V,
            tables,
            lens,
            starts,
            q_pos,
            kv_len,
            scale,
            decode_ops.band_of(s),
            int(s.sinks),
            int(decode_ops.SPLIT),
        )

    def attend_split(self, q, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False):
        """The split-KV path: each row alone, its pieces attended with :func:`attnlab.attention`
        and merged (any mask or score mod, autograd; the native path's reference)."""
        self.check_fresh()
        B = len(self.rows)
        if isinstance(mask, BlockMask):
            mask = mask.mask
        H, Nq, Dv = q.shape[1], q.shape[2], self.cache.v_pool[self.layer].shape[3]
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        outs, lses = [], []
        for r in range(B):
            qr, q_off = q[r : r + 1], self.q_offsets[r]
            m = mask if mask is None or B == 1 else self.cache._wrap(_RowMask, mask, r, B)
            mod = score_mod if score_mod is None or B == 1 else self.cache._wrap(_RowScoreMod, score_mod, r, B)
            # pieces the mask shows whole are attended without it, hidden ones are skipped
            full: list[tuple] = []
            partial: list[tuple] = []
            for piece in self.pieces(r) if Nq else ():
                state = _tile_state(m, H, Nq, piece[0].shape[2], q_off, piece[2])
                if state != EMPTY:
                    (full if state == FULL else partial).append(piece)
            kw = dict(score_mod=mod, scale=scale, q_offset=q_off, backend=backend, return_lse=True)
            parts = ([split_kv_attention(qr, full, mask=None, **kw)] if full else []) + (
                [split_kv_attention(qr, partial, mask=m, **kw)] if partial else []
            )
            if not parts:  # nothing visible: the op's answer for fully masked rows
                o = q.new_zeros(1, H, Nq, Dv)
                l = torch.full((1, H, Nq), float("-inf"), dtype=lse_dtype, device=q.device)
            elif len(parts) == 1:
                o, l = parts[0]
            else:
                o, l = merge_states([p[0] for p in parts], [p[1] for p in parts])
                o = o.to(q.dtype)
            outs.append(o)
            lses.append(l)
        out = torch.cat(outs) if B > 1 else outs[0]
        if return_lse:
            return out, (torch.cat(lses) if B > 1 else lses[0])
        return out

    def dense(self) -> DenseKV:
        """The same keys as dense tensors (a copy, for ``need_weights`` and checks).  Needs
        one ``q_offset`` and ``kv_offset`` for the batch: the selected sequences must hold
        the same positions; a ragged selection raises."""
        self.check_fresh()
        shapes = {(start, before, after) for _, start, before, after in self.rows}
        if len(shapes) != 1:
            raise ValueError(
                "PagedKV.dense(): the selected sequences are ragged (held positions "
                f"{[(s, s + a) for _, s, _, a in self.rows]}): a dense view needs one q_offset and kv_offset; "
                "select sequences of equal length, or one at a time, for need_weights / output_attentions"
            )
        start, before, _after = shapes.pop()
        K, V = self.cache.k_pool[self.layer], self.cache.v_pool[self.layer]
        ks, vs = [], []
        for table, _, _, L in self.rows:
            ks.append(self.cache._gather(K, table, L).unsqueeze(0))
            vs.append(self.cache._gather(V, table, L).unsqueeze(0))
        return DenseKV(torch.cat(ks), torch.cat(vs), kv_offset=start, q_offset=start + before)
