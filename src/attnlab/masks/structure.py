"""The structured description of a mask, what kernels read instead of class names.

Every built-in mask lowers itself (:meth:`attnlab.masks.Mask.lower`) to a
:class:`MaskStructure`, or to ``None`` when it has no such description (``custom``,
``tree``, most ``|``/``~``).  The SDPA mapping, the Triton kernels, the flash tile
classifier and the native kernel read the structure; a consumer that meets a field it
does not implement falls back (to the BlockMask / evaluated path), never guesses::

    s = mask.lower()
    if s is None or not s.fields() <= {"left", "right", "sinks", "kv_len"}:
        ...  # the generic path

The meaning of every field is :meth:`MaskStructure.predicate` (the math reference) and
/work/wt/MASK_STRUCTURE.md (the contract shared with the kernels).  For absolute
positions ``q = q_offset + row`` (``+ q_shift[b]``) and ``kv = kv_offset + col``::

    mask = band_or_sink AND pad AND doc AND keep AND dense
    qp, kp       = q_pos[q] if q_pos is not None else q,  kv_pos[kv] if kv_pos is not None else kv
    band_or_sink = ((left is None or qp - kp <= left) and (right is None or kp - qp <= right))
                   or (kp < sinks and (sinks_right is None or kp - qp <= sinks_right))
    pad          = kv_len is None   or kv < kv_len[b]
    doc          = q_ids is None    or q_ids[b', q] == kv_ids[b', kv]          (b' = b, or 0 for size 1)
    keep         = key_keep is None or key_keep[b', kv]
    dense        = dense is None    or dense[b', h', q - dense_q_offset, kv - dense_kv_offset]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["ALL", "MaskStructure", "and_structures", "or_structures"]


@dataclass(frozen=True, eq=False)
class MaskStructure:
    """A mask as a band (with sinks), padding lengths, document ids, a key keep-vector,
    band positions, a dense tensor and per-batch query shifts; see the module docstring.

    Fields (all optional; the all-default structure is the all-true mask):

    * ``left``, ``right``: the band ``qp - kp <= left`` and ``kp - qp <= right``
      (``None`` = unbounded).  ``causal()`` is ``(None, 0)``, ``sliding_window(w)`` is
      ``(w - 1, 0)``, ``band(l, r)`` is ``(l, r)``.
    * ``sinks``, ``sinks_right``: keys ``kp < sinks`` are visible too, where also
      ``kp - qp <= sinks_right`` (``None`` = any query).  ``prefix_lm(n)`` is
      ``(None, 0, sinks=n)``; ``sink_window(s, w)`` is ``(w - 1, 0, sinks=s, sinks_right=0)``
      (its sinks are causal).
    * ``kv_len``: int64 ``(B,)``, ``padding(kv_lengths)``: ``kv < kv_len[b]``.
    * ``q_ids``, ``kv_ids``: int64 ``(B|1, Lq)``, ``(B|1, Lk)`` ids by absolute position,
      ``document(ids[, kv_ids])`` (and varlen's sequence ids).
    * ``key_keep``: bool ``(B|1, Lk)`` by absolute key position, ``key_padding(keep)``.
    * ``q_pos``, ``kv_pos``: int64 ``(Lq,)``, ``(Lk,)``: the positions the band and the
      sinks read, per absolute position (``varlen``: per-sequence local positions).
    * ``dense``, ``dense_q_offset``, ``dense_kv_offset``: bool ``(B|1, H|1, Nq|1, Nk|1)``
      indexed by row ``q - dense_q_offset`` and column ``kv - dense_kv_offset``
      (``masks.dense``, SDPA's ``attn_mask``); the only field that depends on the head.
    * ``q_shift``: int64 ``(B,)``: batch ``b``'s queries sit at ``q + q_shift[b]``
      (``per_batch_q_offset``); every other field reads the shifted position.
    """

    left: int | None = None
    right: int | None = None
    sinks: int = 0
    kv_len: torch.Tensor | None = None
    q_ids: torch.Tensor | None = None
    kv_ids: torch.Tensor | None = None
    key_keep: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    kv_pos: torch.Tensor | None = None
    # added by the masks package (MASK_STRUCTURE.md lists them)
    sinks_right: int | None = None
    dense: torch.Tensor | None = None
    dense_q_offset: int = 0
    dense_kv_offset: int = 0
    q_shift: torch.Tensor | None = None

    def fields(self) -> frozenset[str]:
        """Names of the fields that are not at their default (``frozenset()``: all-true)."""
        out = []
        for name, d in _DEFAULTS.items():
            v = getattr(self, name)
            if (v is not None) if d is None else (v != d):
                out.append(name)
        return frozenset(out)

    def replace(self, **kw) -> MaskStructure:
        return dataclasses.replace(self, **kw)

    @property
    def has_band(self) -> bool:
        """Whether the band/sink clause can hide anything."""
        return self.left is not None or self.right is not None

    # -- the math reference ---------------------------------------------------------
    def predicate(self, b, h, q, kv) -> torch.Tensor:
        """The mask at broadcasting int64 grids of batch, head and absolute positions
        (as :meth:`attnlab.masks.Mask.predicate`)."""
        b, h, q, kv = (torch.as_tensor(x, dtype=torch.long) for x in (b, h, q, kv))

        if self.q_shift is not None:
            q = q + self.q_shift[b]
        ok = torch.ones((), dtype=torch.bool)
        if self.has_band:
            qp = q if self.q_pos is None else self.q_pos[q]
            kp = kv if self.kv_pos is None else self.kv_pos[kv]
            band = ok
            if self.left is not None:
                band = band & (qp - kp <= self.left)
            if self.right is not None:
                band = band & (kp - qp <= self.right)
            if self.sinks:
                sink = kp < self.sinks
                if self.sinks_right is not None:
                    sink = sink & (kp - qp <= self.sinks_right)
                band = band | sink
            ok = ok & band
        if self.kv_len is not None:
            ok = ok & (kv < self.kv_len[b])
        q_ids, kv_ids = self.q_ids, self.kv_ids
        if q_ids is not None and kv_ids is not None:  # set together
            bq = b if q_ids.shape[0] > 1 else torch.zeros_like(b)
            bk = b if kv_ids.shape[0] > 1 else torch.zeros_like(b)
            ok = ok & (q_ids[bq, q] == kv_ids[bk, kv])
        if self.key_keep is not None:
            bk = b if self.key_keep.shape[0] > 1 else torch.zeros_like(b)
            ok = ok & self.key_keep[bk, kv]
        if self.dense is not None:
            d = self.dense
            idx = [b, h, q - self.dense_q_offset, kv - self.dense_kv_offset]
            idx = [x if d.shape[i] > 1 else torch.zeros_like(x) for i, x in enumerate(idx)]
            ok = ok & d[tuple(idx)]
        return ok

    def evaluate(self, B: int, Nq: int, Nk: int, q_offset: int, kv_offset: int, H: int = 1) -> torch.Tensor:
        """The mask of a ``(B, ·, Nq, Nk)`` problem as a bool tensor ``(B|1, H|1, Nq, Nk)``
        (the head dim is 1 unless ``dense`` has heads; pass ``H`` then).  Row ``i`` is the
        query at absolute position ``q_offset + i``, column ``j`` the key at ``kv_offset + j``."""
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(H).view(1, H, 1, 1)
        q = (torch.arange(Nq) + q_offset).view(1, 1, Nq, 1)
        kv = (torch.arange(Nk) + kv_offset).view(1, 1, 1, Nk)
        out = self.predicate(b, h, q, kv)
        while out.dim() < 4:
            out = out.unsqueeze(0)
        Bo = B if out.shape[0] > 1 else 1
        Ho = H if out.shape[1] > 1 else 1
        return out.expand(Bo, Ho, Nq, Nk)

    # -- tile classification --------------------------------------------------------
    #: The fields :meth:`classify` reads; with any other the tiles need evaluation.
    CLASSIFIED = frozenset({"left", "right", "sinks", "sinks_right", "kv_len", "key_keep", "q_ids", "kv_ids"})

    def classify(self, B, H, ql, qh, kl, kh):
        """Exact tile states from the structure (as :meth:`attnlab.masks.Mask.classify`:
        inclusive absolute bounds ``ql, qh (nqb, 1)``, ``kl, kh (1, nkb)``; int8 states
        broadcastable to ``(B, H, nqb, nkb)``), or None when a field needs evaluation."""
        if not self.fields() <= self.CLASSIFIED:
            return None
        from attnlab.masks.base import tile_states
        from attnlab.masks.builtins import block_minmax

        full = torch.ones((1, 1, ql.shape[0], kl.shape[1]), dtype=torch.bool)
        empty = torch.zeros_like(full)
        if self.has_band:  # q - kv ranges over [ql - kh, qh - kl] in a tile
            bf, be = torch.ones_like(full), torch.zeros_like(full)
            if self.left is not None:
                bf, be = bf & (qh - kl <= self.left), be | (ql - kh > self.left)
            if self.right is not None:
                bf, be = bf & (kh - ql <= self.right), be | (kl - qh > self.right)
            if self.sinks:
                sf, se = kh < self.sinks, kl >= self.sinks
                if self.sinks_right is not None:
                    sf, se = sf & (kh - ql <= self.sinks_right), se | (kl - qh > self.sinks_right)
                bf, be = bf | sf, be & se
            full, empty = full & bf, empty | be
        if self.kv_len is not None:
            L = self.kv_len.view(-1, 1, 1, 1)
            full, empty = full & (kh < L), empty | (kl >= L)
        if self.key_keep is not None:
            c = torch.nn.functional.pad(self.key_keep.to(torch.int32).cumsum(-1), (1, 0))
            lo, hi = kl.flatten(), kh.flatten() + 1
            n = (c[:, hi] - c[:, lo]).view(c.shape[0], 1, 1, -1)
            full, empty = full & (n == (hi - lo)), empty | (n == 0)
        q_ids, kv_ids = self.q_ids, self.kv_ids
        if q_ids is not None and kv_ids is not None:  # set together
            qmin, qmax = block_minmax(q_ids, ql, qh)
            kmin, kmax = block_minmax(kv_ids, kl, kh)
            qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
            kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
            full = full & (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
            empty = empty | (qmax < kmin) | (kmax < qmin)
        return tile_states(full, empty)

    def __repr__(self):
        parts = []
        for name in sorted(self.fields()):
            v = getattr(self, name)
            parts.append(f"{name}=<{tuple(v.shape)}>" if isinstance(v, torch.Tensor) else f"{name}={v!r}")
        return f"MaskStructure({', '.join(parts)})"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MaskStructure)}

#: The all-true mask.
ALL = MaskStructure()


# ----------------------------------------------------------------------------- combinations
def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _same(x, y) -> bool:
    return x is y or (x is not None and y is not None and x.shape == y.shape and bool(torch.equal(x, y)))


def _band_part(s: MaskStructure) -> dict:
    return dict(left=s.left, right=s.right, sinks=s.sinks, sinks_right=s.sinks_right, q_pos=s.q_pos, kv_pos=s.kv_pos)


def _and_band(a: MaskStructure, b: MaskStructure) -> dict | None:
    if not a.has_band:
        return _band_part(b)
    if not b.has_band:
        return _band_part(a)
    if not (_same(a.q_pos, b.q_pos) and _same(a.kv_pos, b.kv_pos)):
        return None  # bands on different positions
    if a.sinks and b.sinks:
        return None  # (band | sink) & (band | sink) is not one band with sinks
    if b.sinks:
        a, b = b, a
    out = dict(_band_part(a), left=_min(a.left, b.left), right=_min(a.right, b.right))
    if a.sinks:
        # (A | S) & B = (A & B) | (S & B): S & B is a sink clause only while B has no left bound
        if b.left is not None:
            return None
        out["sinks_right"] = _min(a.sinks_right, b.right)
    return out


def _one(x, y):
    """The one of two optional fields that is set; ``KeyError`` when both are."""
    if x is not None and y is not None:
        raise KeyError
    return x if x is not None else y


def and_structures(a: MaskStructure | None, b: MaskStructure | None) -> MaskStructure | None:
    """The structure of ``A & B``, or ``None`` when the parts do not combine into one."""
    if a is None or b is None:
        return None
    if not ((a.q_shift is None and b.q_shift is None) or _same(a.q_shift, b.q_shift)):
        return None
    band = _and_band(a, b)
    if band is None:
        return None
    kv_len = a.kv_len if b.kv_len is None else b.kv_len if a.kv_len is None else torch.minimum(a.kv_len, b.kv_len)
    keep = a.key_keep if b.key_keep is None else b.key_keep
    if a.key_keep is not None and b.key_keep is not None:
        if a.key_keep.shape[-1] != b.key_keep.shape[-1]:
            return None
        keep = a.key_keep & b.key_keep
    try:
        q_ids = _one(a.q_ids, b.q_ids)  # two id comparisons, or two dense tensors, do not merge
        _one(a.dense, b.dense)
    except KeyError:
        return None
    kv_ids = a.kv_ids if a.q_ids is not None else b.kv_ids
    d = a if a.dense is not None else b
    return MaskStructure(
        kv_len=kv_len,
        q_ids=q_ids,
        kv_ids=kv_ids,
        key_keep=keep,
        dense=d.dense,
        dense_q_offset=d.dense_q_offset,
        dense_kv_offset=d.dense_kv_offset,
        q_shift=a.q_shift if a.q_shift is not None else b.q_shift,
        **band,
    )


def or_structures(a: MaskStructure | None, b: MaskStructure | None) -> MaskStructure | None:
    """``A | B`` lowers only when one side is all-true (then it is all-true)."""
    if a is not None and not a.fields():
        return a
    if b is not None and not b.fields():
        return b
    return None
