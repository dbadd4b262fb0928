"""Per-head attention statistics in one tiled pass, at O(N) memory.

:func:`head_stats` reads ``q`` and ``k`` the way :func:`attnlab.attention` does and
returns, for every query row, a few numbers that describe its attention pattern
without ever holding the ``Nq × Nk`` pattern, so a 32,768-token context can be
analysed on a CPU machine (the pattern alone would be 4 GiB per head in float32)::

    q      (B, H,   Nq, D)      H % Hkv == 0; query head h reads kv head h // (H // Hkv)
    k      (B, Hkv, Nk, D)      K is never repeated per query head
    every HeadStats field       (B, H, Nq), float32 (float64 for float64 inputs); valid is bool

    entropy     -Σ_j p_j log p_j                        (nats; 0 for a one-hot row)
    sink_mass   Σ p_j over keys at kv_pos < sink_tokens  (attention sinks, StreamingLLM)
    prev_mass   p at the key kv_pos = q_pos - 1          (previous-token heads; 0 if not there)
    max_weight  max_j p_j = exp(max_j s_j - lse)
    key_mass    Σ p_j over a user set of key positions   (None unless key_positions is given)
    lse         log Σ_j exp(s_j), natural log            (as attention(..., return_lse=True))
    valid       the row sees at least one key            (False: stats 0, lse -inf, never NaN)

where ``s = mask(score_mod(scale · q kᵀ))`` and ``p = softmax(s)`` exactly as in
:func:`attnlab.attention` (same masks, score mods, GQA and absolute positions).

Positions are absolute: query row ``i`` sits at ``q_pos = q_offset + i`` (default
``q_offset = kv_offset + Nk - Nq``, the queries are the newest tokens) and key
column ``j`` at ``kv_pos = kv_offset + j``.  ``causal()``, Nq = 2 over Nk = 5,
``sink_tokens=1``::

                     kv_pos ->  0  1  2  3  4
    row 0 (q_pos 3)             S  x  P  x  .      S: sink key (kv_pos < sink_tokens)
    row 1 (q_pos 4)             S  x  x  P  x      P: previous token (kv_pos = q_pos - 1)
                                                   x: visible, .: masked

How: one pass over the (q-block, kv-block) tiles the mask's BlockMask does not
empty, as in the flash forward (the shared tile engine, :mod:`attnlab.ops.tiling`),
keeping per row the running max ``m`` (= the row max of s), ``l = Σ exp(s - m)``,
``t = Σ exp(s - m)·(s - m)`` and ``Σ exp(s - m)`` over each key subset, all
rescaled by ``exp(m_old - m_new)`` when the max grows (``t`` also gains
``(m_old - m_new)·l``).  At the end ``lse = m + log l``, ``entropy = log l - t/l``
(no cancellation between large scores), ``max_weight = 1/l`` and each mass is its
sum over ``l``.  Working memory: one score tile and its exponentials, ``O(B·H·Nq)``
for the results, one transposed copy of K (as the flash forward makes), and the
BlockMask's cache of evaluated partial tiles (at most ``BlockMask.TILE_CACHE_BYTES``).
Measured at N = 32768, one head, D = 64, causal: about 55 MiB, of which 32 MiB is
that cache (``attnlab bench interp``; the pattern alone is 4096 MiB).
:func:`stats_from_probs` computes the same statistics from a materialized pattern
(the reference the tests check against).

>>> import torch
>>> from attnlab import masks
>>> from attnlab.interp.stats import head_stats
>>> q, k = torch.zeros(1, 1, 4, 8), torch.randn(1, 1, 4, 8)   # equal scores: uniform rows
>>> st = head_stats(q, k, mask=masks.causal())
>>> st.entropy                                                # log(number of visible keys)
tensor([[[0.0000, 0.6931, 1.0986, 1.3863]]])
>>> st.sink_mass, st.prev_mass
(tensor([[[1.0000, 0.5000, 0.3333, 0.2500]]]), tensor([[[0.0000, 0.5000, 0.3333, 0.2500]]]))
>>> st.per_head(skip_first=1)["prev_mass"]                  # mean over rows 1..3, per head
tensor([0.3611])
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from attnlab.masks import BlockMask
from attnlab.ops.args import normalize, offsets
from attnlab.ops.reference import acc_dtype
from attnlab.ops.tiles import choose_tiles
from attnlab.ops.tiling import (
    LOG2E,
    NEG_INF,
    TileProblem,
    fast_tile,
    mm_dtype,
    pick_block_mask,
    rescale,
    rows,
    score_tile,
)
from attnlab.validate import integer

__all__ = ["HeadStats", "head_stats", "stats_from_probs"]

_STATS = ("entropy", "sink_mass", "prev_mass", "max_weight", "key_mass")  # what per_head averages


@dataclass
class HeadStats:
    """Per-row attention statistics, each ``(B, H, Nq)``; see :mod:`attnlab.interp.stats`.

    Float fields are float32 (float64 for float64 inputs); ``valid`` is bool.  Rows
    with no visible key have every statistic 0, ``lse = -inf`` and ``valid = False``.
    ``key_mass`` is None when no ``key_positions`` were given; ``lse`` is None when
    built by :func:`stats_from_probs` without an ``lse`` (a pattern alone does not
    determine it).
    """

    entropy: torch.Tensor
    sink_mass: torch.Tensor
    prev_mass: torch.Tensor
    max_weight: torch.Tensor
    key_mass: torch.Tensor | None
    lse: torch.Tensor | None
    valid: torch.Tensor

    def per_head(self, skip_first: int = 0) -> dict[str, torch.Tensor]:
        """Mean of each statistic per head: a dict of ``(H,)`` tensors.

        For head ``h`` and statistic ``x`` the mean is taken over every batch element
        ``b`` and every query row ``i >= skip_first`` (a row *index*, not an absolute
        position) with ``valid[b, h, i]``; each such row weighs the same.  Fully masked
        rows are left out (they are not "attention with zero mass").  Keys:
        ``entropy``, ``sink_mass``, ``prev_mass``, ``max_weight``, ``key_mass`` (only
        when present) and ``rows``, the int64 count of rows averaged per head.  A head
        with no such row gets 0 for every mean (and ``rows`` 0), never NaN.  ``lse``
        is not averaged.

        ``skip_first=1`` drops row 0, which has no previous token when the queries
        start at position 0 (its ``prev_mass`` is 0 by definition).
        """
        skip_first = integer(skip_first, "skip_first", lo=0)
        sel = self.valid.clone()
        sel[..., : int(skip_first)] = False
        rows = sel.sum(dim=(0, 2))
        denom = rows.clamp_min(1)
        out = {}
        for name in _STATS:
            x = getattr(self, name)
            if x is None:
                continue
            s = torch.where(sel, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=(0, 2))
            out[name] = s / denom.to(x.dtype)
        out["rows"] = rows
        return out

    def to(self, arg) -> HeadStats:
        """A copy with every float field moved by ``tensor.to(arg)`` (a dtype or a device);
        ``valid`` stays bool (it follows a device move)."""
        if not isinstance(arg, (torch.dtype, torch.device, str)):
            raise TypeError(f"to: expected a torch.dtype or device, got {type(arg).__name__}")
        if isinstance(arg, torch.dtype) and not arg.is_floating_point:
            raise TypeError(f"to: expected a floating dtype, got {arg}")
        kw = {}
        for f in fields(self):
            x = getattr(self, f.name)
            if x is None or (f.name == "valid" and isinstance(arg, torch.dtype)):
                kw[f.name] = x
            else:
                kw[f.name] = x.to(arg)
        return HeadStats(**kw)


# ----------------------------------------------------------------------------- arguments
def _key_weights(key_positions, B, Nk, kv_offset, dtype, device):
    """``key_positions`` as 0/1 weights over the key columns, ``(Bw, Nk)`` with Bw in {1, B}.

    A bool ``(Nk,)`` or ``(B, Nk)`` tensor marks key *columns* (column j is position
    ``kv_offset + j``); an integer tensor ``(P,)`` lists absolute key positions.
    """
    if key_positions is None:
        return None
    kp = key_positions if isinstance(key_positions, torch.Tensor) else torch.as_tensor(key_positions)
    if kp.dtype == torch.bool:
        if kp.dim() == 1 and kp.shape[0] == Nk:
            kp = kp.unsqueeze(0)
        elif not (kp.dim() == 2 and kp.shape == (B, Nk)):
            raise ValueError(
                f"key_positions: a bool tensor must have shape (Nk,)=({Nk},) or (B, Nk)=({B}, {Nk}), "
                f"got {tuple(kp.shape)}"
            )
        return kp.to(device=device, dtype=dtype)
    if kp.dtype.is_floating_point or kp.is_complex():
        raise TypeError(
            f"key_positions: expected a bool tensor over the keys or an integer tensor of absolute "
            f"positions, got dtype {kp.dtype}"
        )
    if kp.dim() != 1:
        raise ValueError(f"key_positions: integer positions must be 1-D (P,), got shape {tuple(kp.shape)}")
    kp = kp.to(torch.long)
    bad = (kp < kv_offset) | (kp >= kv_offset + Nk)
    if bad.any():
        raise ValueError(
            f"key_positions: position {int(kp[bad][0])} is outside the keys, which sit at absolute "
            f"positions {kv_offset}..{kv_offset + Nk - 1}"
        )
    w = torch.zeros(1, Nk, dtype=dtype, device=device)
    w[0, (kp - kv_offset).to(device)] = 1
    return w


def _block_arg(x, name):
    return None if x is None else integer(x, name, lo=1, what="tile size")


# ----------------------------------------------------------------------------- fast path
def head_stats(
    q,
    k,
    *,
    mask=None,
    score_mod=None,
    scale=None,
    q_offset=None,
    kv_offset=0,
    sink_tokens=1,
    key_positions=None,
    block_q=None,
    block_k=None,
) -> HeadStats:
    """Per-row attention statistics of ``softmax(mask(score_mod(scale·q kᵀ)))`` in one
    tiled pass, never materializing the ``(Nq, Nk)`` pattern.

    Args:
        q: ``(B, H, Nq, D)``; k: ``(B, Hkv, Nk, D)`` with ``H % Hkv == 0`` (GQA/MQA).
        mask, score_mod, scale, q_offset, kv_offset: as in :func:`attnlab.attention`
            (a Mask or a BlockMask built for this shape; absolute positions).
        sink_tokens: keys at absolute position ``< sink_tokens`` are the sink
            (``sink_mass``); 0 makes ``sink_mass`` 0.
        key_positions: the keys whose total weight is ``key_mass``: a bool tensor
            over the key columns, ``(Nk,)`` or ``(B, Nk)`` (column j = position
            ``kv_offset + j``), or an integer tensor of absolute positions ``(P,)``.
        block_q, block_k: tile sizes; default the flash backend's choice.  A
            BlockMask's own sizes are used (passing others is an error).

    Returns a :class:`HeadStats` of ``(B, H, Nq)`` tensors in float32 (float64 for
    float64 inputs).  Runs without autograd.
    """
    pr = normalize(
        q, k, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, kv_offset=kv_offset, shared_kv_batch=True
    )
    B, H, Hkv, Nq, Nk, D = pr.B, pr.H, pr.Hkv, pr.Nq, pr.Nk, pr.D
    scale, q_offset, kv_offset = pr.scale, pr.q_offset, pr.kv_offset
    sink_tokens = integer(sink_tokens, "sink_tokens", lo=0)
    bq, bk = _block_arg(block_q, "block_q"), _block_arg(block_k, "block_k")
    acc = acc_dtype(q.dtype)
    w = _key_weights(key_positions, B, Nk, kv_offset, acc, q.device)

    if isinstance(mask, BlockMask):  # a BlockMask: its tiling is the plan
        if (bq or mask.block_q, bk or mask.block_k) != (mask.block_q, mask.block_k):
            raise ValueError(
                f"block_q, block_k: ({bq}, {bk}) differ from the BlockMask's tiles "
                f"({mask.block_q}, {mask.block_k}); pass the Mask itself to choose tiles"
            )
        block_mask = mask
    elif mask is not None and Nq > 0 and Nk > 0:
        block = None if bq is None and bk is None else _fill_block(bq, bk, q.dtype, D, B * H, q.device)
        block_mask = pick_block_mask(mask, q.dtype, B, H, Nq, Nk, D, q_offset, kv_offset, block, q.device)
    else:
        block_mask = None
    if block_mask is not None:
        bq, bk = block_mask.block_q, block_mask.block_k
    else:
        bq, bk = _fill_block(bq, bk, q.dtype, D, B * H, q.device)

    pb = TileProblem(block_mask, score_mod, scale, q_offset, kv_offset, Nq, Nk, bq, bk)
    BH, G = B * Hkv, H // Hkv
    out = {
        name: torch.zeros(BH, G, Nq, dtype=acc, device=q.device)
        for name in ("entropy", "sink_mass", "prev_mass", "max_weight", "lse")
    }
    out["lse"].fill_(NEG_INF)
    if w is not None:
        out["key_mass"] = torch.zeros(BH, G, Nq, dtype=acc, device=q.device)
    valid = torch.zeros(BH, G, Nq, dtype=torch.bool, device=q.device)
    if Nq and Nk:
        with torch.no_grad():
            mmd = mm_dtype(q.dtype, q.device)
            qf = q.reshape(1, BH, G, Nq, D)  # the flash loop's (B, Hkv, G, N, D) row layout, B*Hkv folded; a view
            kT = k.reshape(BH, Nk, D).to(mmd).transpose(1, 2).contiguous()  # (BH, D, Nk): plain GEMMs
            b, h = pb.grids(B, H, q.device)
            w_any = None if w is None else [bool(w[:, s : s + bk].any()) for s in range(0, Nk, bk)]
            for i in range(len(pb.plan)):
                _stats_row(pb, i, qf, kT, out, valid, b, h, Nq, Nk, acc, mmd, B, H, sink_tokens, w, w_any)
    shaped = {name: x.view(B, H, Nq) for name, x in out.items()}
    return HeadStats(
        entropy=shaped["entropy"],
        sink_mass=shaped["sink_mass"],
        prev_mass=shaped["prev_mass"],
        max_weight=shaped["max_weight"],
        key_mass=shaped.get("key_mass"),
        lse=shaped["lse"],
        valid=valid.view(B, H, Nq),
    )


def _fill_block(bq, bk, dtype, D, BH, device):
    dq, dk = choose_tiles(dtype, D, BH, device)
    return (bq or dq, bk or dk)


def _stats_row(pb, i, qf, kT, out, valid, b, h, Nq, Nk, acc, mmd, B, H, sink_tokens, w, w_any):
    """One q-block row: the online accumulation over its visited kv-blocks, then the
    per-row statistics written into ``out[...][:, :, qs:qe]`` (rows with no visited
    tile keep the fully-masked defaults)."""
    row = pb.plan[i]
    if not row:
        return
    BH, G = qf.shape[1], qf.shape[2]
    qs, qe = pb.q_block(i, Nq)
    n = qe - qs
    dev = qf.device
    Qi = rows(qf, qs, qe, mmd)

    def zeros():
        return torch.zeros((BH, G * n, 1), dtype=acc, device=dev)

    m = torch.full((BH, G * n, 1), NEG_INF, dtype=acc, device=dev)
    l, t, sink, prev = zeros(), zeros(), zeros(), zeros()
    key = None if w is None else zeros()
    # the previous-token key of row r sits at column prev0 + r (may be out of range)
    prev0 = pb.q_offset + qs - 1 - pb.kv_offset
    r_idx = torch.arange(n, device=dev)
    for j, needs_mask in row:
        ks, ke = pb.kv_block(j, Nk)
        S = torch.bmm(Qi, kT[:, :, ks:ke])
        X = S.to(acc) if S.dtype != acc else S
        may_be_inf = needs_mask or pb.score_mod is not None
        if fast_tile(pb, needs_mask):  # no mod, no mask: fold the scale into the shift (one pass)
            m_new, m_safe, alpha = rescale(m, X.amax(-1, keepdim=True).mul_(pb.scale))
            Dt = torch.add(m_safe.neg(), X, alpha=pb.scale, out=X)  # s - m'
        else:
            X, _, _ = score_tile(pb, X, b, h, qs, qe, ks, ke, needs_mask, acc, B, H)
            m_new, m_safe, alpha = rescale(m, X.amax(-1, keepdim=True))  # alpha: 0 while no key was visible
            Dt = X.sub_(m_safe)  # s - m', -inf where masked
        delta = m.masked_fill(m == NEG_INF, 0.0) - m_safe
        P = torch.mul(Dt, LOG2E).exp2_()  # exp(s - m'): 0 where masked
        # t: Σ P·(s - m'); masked entries have P = 0, so (s - m') := 0 there (0·-inf is NaN)
        if may_be_inf:
            Dt.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0)
        t_tile = Dt.mul_(P).sum(-1, keepdim=True)
        t.add_(delta * l).mul_(alpha).add_(t_tile)  # uses the old l: rescale first
        l.mul_(alpha).add_(P.sum(-1, keepdim=True))
        sink.mul_(alpha)
        n_sink = min(ke, sink_tokens - pb.kv_offset) - ks
        if n_sink > 0:
            sink.add_(P[:, :, :n_sink].sum(-1, keepdim=True))
        prev.mul_(alpha)
        lo = prev0 - ks  # column of row 0's previous token inside this tile
        if lo + n - 1 >= 0 and lo < ke - ks:
            c = r_idx + lo
            inside = (c >= 0) & (c < ke - ks)
            idx = c.clamp(0, ke - ks - 1).view(1, 1, n, 1).expand(BH, G, n, 1)
            got = P.view(BH, G, n, ke - ks).gather(-1, idx) * inside.view(1, 1, n, 1)
            prev.add_(got.view(BH, G * n, 1))
        if key is not None:
            key.mul_(alpha)
            if w_any[j]:
                ws = w[:, ks:ke]
                key.add_(torch.matmul(P.view(ws.shape[0], -1, ke - ks), ws.unsqueeze(-1)).view(BH, G * n, 1))
        m = m_new
    ok = l > 0
    l_safe = l.masked_fill(~ok, 1.0)
    log_l = torch.log(l_safe)

    def put(name, x):
        out[name][:, :, qs:qe] = x.view(BH, G, n)

    put("lse", torch.where(ok, m + log_l, torch.full_like(l, NEG_INF)))
    put("entropy", log_l - t / l_safe)  # 0 where not ok: l_safe = 1, t = 0
    put("max_weight", torch.where(ok, 1.0 / l_safe, torch.zeros_like(l)))
    put("sink_mass", sink / l_safe)
    put("prev_mass", prev / l_safe)
    if key is not None:
        put("key_mass", key / l_safe)
    valid[:, :, qs:qe] = ok.view(BH, G, n)


# ----------------------------------------------------------------------------- reference
def stats_from_probs(probs, *, q_offset=None, kv_offset=0, sink_tokens=1, key_positions=None, lse=None) -> HeadStats:
    """The same statistics as :func:`head_stats`, from a materialized pattern.

    ``probs``: ``(B, H, Nq, Nk)`` rows that sum to 1, or are all 0 for a fully
    masked row (what :func:`attnlab.attention_probs` and
    :func:`attnlab.ops.reference.reference_probs` return).  Positions as in
    :func:`head_stats` (``q_offset`` defaults to ``kv_offset + Nk - Nq``).  ``lse``
    ``(B, H, Nq)``, when given, is passed through (validated and set to -inf on
    empty rows); the pattern alone does not determine it, so without it
    ``HeadStats.lse`` is None.  Memory: O(B·H·Nq·Nk), for checking and small problems.
    """
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs: expected a torch.Tensor, got {type(probs).__name__}")
    if probs.dim() != 4 or not probs.dtype.is_floating_point:
        raise ValueError(f"probs: expected a floating (B, H, Nq, Nk) tensor, got {probs.dtype} {tuple(probs.shape)}")
    B, H, Nq, Nk = probs.shape
    q_offset, kv_offset = offsets(q_offset, kv_offset, Nq, Nk)
    sink_tokens = integer(sink_tokens, "sink_tokens", lo=0)
    p = probs.to(acc_dtype(probs.dtype))
    w = _key_weights(key_positions, B, Nk, kv_offset, p.dtype, p.device)
    valid = (p > 0).any(-1)
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    n_sink = max(0, min(Nk, sink_tokens - kv_offset))
    sink = p[..., :n_sink].sum(-1)
    col = torch.arange(Nq, device=p.device) + q_offset - 1 - kv_offset
    inside = (col >= 0) & (col < Nk)
    if Nk:
        idx = col.clamp(0, Nk - 1).view(1, 1, Nq, 1).expand(B, H, Nq, 1)
        prev = torch.where(inside.view(1, 1, Nq), p.gather(-1, idx).squeeze(-1), zero)
        max_w = p.amax(-1)
    else:
        prev = max_w = torch.zeros(B, H, Nq, dtype=p.dtype, device=p.device)
    key = None if w is None else (p * w.view(w.shape[0], 1, 1, Nk)).sum(-1)
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or lse.shape != (B, H, Nq):
            raise ValueError(
                f"lse: expected a tensor of shape (B, H, Nq)={(B, H, Nq)}, got "
                f"{tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__}"
            )
        lse = torch.where(valid, lse.to(p.dtype), torch.full_like(entropy, NEG_INF))
    return HeadStats(
        entropy=entropy, sink_mass=sink, prev_mass=prev, max_weight=max_w, key_mass=key, lse=lse, valid=valid
    )
