"""The tile engine: the pieces of the tiled online-softmax loop that every tiled pass shares.

The flash forward and backward (:mod:`attnlab.ops.flash`), the per-head statistics
(:mod:`attnlab.interp.stats`) and a ring step's backward (:mod:`attnlab.distributed.local`)
walk the same tiles the same way; this module is what they share, so that a statistic
or a shard's gradient sees exactly the scores the attention op computes.

The kernel layout.  ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)``
with ``G = H / Hkv`` (GQA) are flattened so that the ``G`` query heads that read one kv
head are the rows of one matmul (K/V are never repeated)::

    qf  (B, Hkv, G, Nq, D)     a view of q                          (prepare)
    kT  (B*Hkv, D, Nk)         K transposed, the one copy           (prepare)
    Q_i (B*Hkv, G*n, D)        rows qs:qe of qf, n = qe - qs        (rows)
    S   (B*Hkv, G*n, m)        Q_i K_jᵀ for keys ks:ke, m = ke - ks (one bmm)

The tile loop.  A :class:`TileProblem` holds the plan: for q-block ``i`` (rows
``qs:qe = i·bq : min(Nq, (i+1)·bq)``, :meth:`TileProblem.q_block`) the list
``plan[i]`` of ``(j, needs_mask)`` kv-blocks the BlockMask does not empty (keys
``ks:ke``, :meth:`TileProblem.kv_block`); an empty list is a row of blocks with no
visible key.  ``needs_mask`` is True on partial tiles only (full tiles evaluate no mask)::

    for i, row in enumerate(pb.plan):
        qs, qe = pb.q_block(i, Nq);  Q_i = rows(qf, qs, qe, mm_dtype(...))
        for j, needs_mask in row:
            ks, ke = pb.kv_block(j, Nk)
            X = bmm(Q_i, kT[:, :, ks:ke])                   # float32 accumulators (acc)
            X = score_tile(pb, X, ...)                      # mask(mod(scale·X)), -inf hidden
            m_new, m_safe, alpha = rescale(m, X.amax(-1))   # the LSE merge step
            P = exp(X - m_safe);  l = l·alpha + rowsum P; ...
        empty, l_safe, lse = finish(m, l)                   # lse = m + log l; -inf where l = 0

(:func:`fast_tile` says when a tile has neither mask nor mod, so the scale can be
folded into the shift: :func:`exp_shifted_fast`.)  Positions are absolute: row ``r`` of
q-block ``i`` is at ``q_offset + qs + r``, key column ``c`` of kv-block ``j`` at
``kv_offset + ks + c``; masks and score mods receive those.
"""

from __future__ import annotations

import torch

from attnlab.masks import cache as mask_cache
from attnlab.ops.finite import traced
from attnlab.ops.modparams import check_tile_graph, marker
from attnlab.ops.tiles import tile_candidates

__all__ = [
    "LOG2E",
    "FUSED_MAX",
    "NEG_INF",
    "TileProblem",
    "mm_dtype",
    "score_dtype",
    "prepare",
    "rows",
    "fast_tile",
    "exp_shifted_fast",
    "score_tile",
    "drop_tile",
    "rescale",
    "finish",
    "fused_ok",
    "pick_block_mask",
]

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634  # exp(x) = exp2(x·log2 e), and exp2 is the cheaper kernel
# The fused ``scale·x − m`` of the fast path rounds once more than ``x·scale − m`` and can
# land above 0 by about ulp(|m|); past this bound on |scale·q·k| (where ulp(|m|) reaches
# 2^-4) the exact unfused path runs, so a huge finite ``scale`` cannot overflow exp2.
FUSED_MAX = float(2**19)


def mm_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the tile matmuls run in: ``dtype``, except float16 on the CPU (float32)."""
    # CPU float16 matmul has no fast kernel (about 1 GFLOP/s here); compute it in float32.
    if dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return dtype


def score_dtype(mmd: torch.dtype) -> torch.dtype:
    """The dtype of the ``S = QKᵀ`` and ``dP = dO·Vᵀ`` matmuls: float32 for bf16/fp16 operands.

    A CPU bf16 ``torch.bmm`` returns bf16 (torch has no ``out_dtype=float32`` there), so the
    score and dP tiles would be rounded to bf16 before the softmax (DESIGN.md: "rounding S
    or dP to the input dtype is a bug"); their operands are upcast once (Q/dO per q-block,
    Kᵀ/Vᵀ per call) and the products run in float32, as flash-attn's fp32 accumulators."""
    return torch.float32 if mmd in (torch.bfloat16, torch.float16) else mmd


class TileProblem:
    """Everything a tiled pass needs besides the tensors (kept out of autograd's inputs).

    ``block_mask``: a BlockMask at tiles ``(bq, bk)`` or None (every tile visited, none
    masked); ``score_mod``: the mod or None; ``scale``: a float; ``q_offset``/``kv_offset``:
    the absolute positions of query row 0 and key column 0; ``Nq``, ``Nk``: the problem's
    lengths.  ``plan[i]`` lists the ``(j, needs_mask)`` kv-blocks q-block ``i`` visits.
    """

    def __init__(self, block_mask, score_mod, scale, q_offset, kv_offset, Nq, Nk, bq, bk):
        self.block_mask, self.score_mod = block_mask, score_mod
        self.scale, self.q_offset, self.kv_offset = scale, q_offset, kv_offset
        self.bq, self.bk = bq, bk
        self.fused_ok = True  # |scale·q·k| <= FUSED_MAX: the fused fast path is exact enough
        self.mod_clone = False  # the mod writes into its input: hand it a copy under autograd
        self.check_graph = None  # the params handed to autograd: the forward's first modded tile checks
        # under autograd that the mod reads no other tensor requiring grad (it would lose its gradient)
        self.dropout = None  # an attnlab.ops.dropout.Dropout: its keep-mask is regenerated per tile
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        if block_mask is None:
            self.plan = [[(j, False) for j in range(nkb)] for _ in range(nqb)]
        else:
            self.plan = block_mask.plan()

    def grids(self, B, H, device):
        """The batch and head index grids a mask or mod receives: ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``."""
        return torch.arange(B, device=device).view(B, 1, 1, 1), torch.arange(H, device=device).view(1, H, 1, 1)

    def q_block(self, i: int, Nq: int) -> tuple[int, int]:
        """The query rows ``qs:qe`` of q-block ``i``."""
        return i * self.bq, min(Nq, (i + 1) * self.bq)

    def kv_block(self, j: int, Nk: int) -> tuple[int, int]:
        """The key columns ``ks:ke`` of kv-block ``j``."""
        return j * self.bk, min(Nk, (j + 1) * self.bk)


def prepare(q, k, v, mmd):
    """Flatten to the kernel's 3-D layout (no per-head copies of K/V).

    q -> (B, Hkv, G, Nq, D) view (any strides: a (B, N, H, D) layout's transpose too);
    kT -> (B*Hkv, D, Nk) (the one copy: K transposed, so every ``Q_i K_jᵀ`` is a plain
    row-major GEMM);  k -> (B*Hkv, Nk, D) a view of kT;  v -> (B*Hkv, Nk, Dv), a view
    where the strides allow it (always for (B, H, N, D) and for B = 1), else a copy.
    Returns ``(qf, kf, kT, vf)`` with kT, kf and vf in ``mmd``.
    """
    B, H, _Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    qf = q.unflatten(1, (Hkv, H // Hkv))
    kT = k.transpose(2, 3).reshape(B * Hkv, D, Nk).to(mmd).contiguous()
    kf = kT.transpose(1, 2)
    vf = v.reshape(B * Hkv, Nk, Dv).to(mmd)
    if vf.stride(-1) != 1:
        vf = vf.contiguous()
    return qf, kf, kT, vf


def rows(xf, qs, qe, dtype):
    """Rows ``qs:qe`` of a ``(B, Hkv, G, N, D)`` tensor as ``(B*Hkv, G*n, D)`` in ``dtype``."""
    B, Hkv, G, _, D = xf.shape
    return xf[:, :, :, qs:qe].reshape(B * Hkv, G * (qe - qs), D).to(dtype)


def fast_tile(pb, needs_mask) -> bool:
    """True when the tile has no mask to apply and no mod, a positive scale, and the fused
    scale-and-shift is exact enough (:data:`FUSED_MAX`): :func:`exp_shifted_fast` applies."""
    return pb.score_mod is None and not needs_mask and pb.scale > 0 and getattr(pb, "fused_ok", True)


def exp_shifted_fast(pb, X, shift):
    """``exp(scale·X − shift)`` in place on X (acc dtype), no mask and no mod.

    ``X (B*Hkv, G*n, m)``, ``shift (B*Hkv, G*n, 1)``.  One fused scale-and-shift pass, then
    ``2^(log2e·x)``: exp2 is ~3x cheaper than exp in torch on CPU.  The shift is
    subtracted in natural units *before* the change of base, so large scores lose no more
    precision than the reference's ``exp(s − m)``.
    """
    return torch.add(shift.neg(), X, alpha=pb.scale, out=X).mul_(LOG2E).exp2_()


def score_tile(pb, S, b, h, qs, qe, ks, ke, needs_mask, acc, B, H, with_grad=False, careful=False):
    """The exact score tile ``mask(mod(scale · S))`` as ``(B*Hkv, G*n, m)`` in ``acc``;
    ``S`` is the raw ``Q_i K_jᵀ`` tile, already in ``acc`` and consumed (overwritten).

    The mod and the mask see it as ``(B, H, n, m)`` with ``b (B,1,1,1)``, ``h (1,H,1,1)``
    (:meth:`TileProblem.grids`) and absolute positions ``q_pos (1,1,n,1)``,
    ``kv_pos (1,1,1,m)``; hidden entries become ``-inf`` (on ``needs_mask`` tiles only).

    Returns ``(X, leaf, mod_out)``; with ``with_grad`` the score mod runs under
    autograd and ``leaf``/``mod_out`` carry its graph (``mod_out`` may not require grad:
    a mod that ignores its input).  With ``careful`` (non-finite inputs) a masked score
    that is not finite reaches the mod as 0: its output there is discarded, and its
    gradients stay finite.
    """
    n, m = qe - qs, ke - ks
    leaf = mod_out = None
    X = S.mul_(pb.scale)
    X4 = X.view(B, H, n, m)
    dev = X.device
    qp = (torch.arange(qs, qe, device=dev) + pb.q_offset).view(1, 1, n, 1)
    kp = (torch.arange(ks, ke, device=dev) + pb.kv_offset).view(1, 1, 1, m)
    mo = None
    if careful and needs_mask and pb.score_mod is not None:
        mo = pb.block_mask.masked_out(b, h, qs, qe, ks, ke)
        X4 = X4.masked_fill(mo & ~torch.isfinite(X4), 0.0)
    if pb.score_mod is not None:
        check = pb.check_graph is not None and not with_grad
        if with_grad or check:
            leaf = X4.requires_grad_(True)
            before = marker(X4.device) if check else None
            with torch.enable_grad():
                mod_out = _call_mod_under_grad(pb, leaf, b, h, qp, kp)
            Y = mod_out
            if isinstance(mod_out, torch.Tensor):
                Y = mod_out.detach().clone()  # later in-place ops must not touch the graph's tensors
                if check:
                    check_tile_graph(pb.score_mod, mod_out, leaf, pb.check_graph, before)
            if check:
                pb.check_graph = leaf = mod_out = None
        else:
            Y = pb.score_mod(X4, b, h, qp, kp)
        if not isinstance(Y, torch.Tensor) or Y.shape != (B, H, n, m):
            raise ValueError(
                f"score_mod: returned {tuple(getattr(Y, 'shape', ()))} for a score tile of shape "
                f"{(B, H, n, m)}; a score mod must be elementwise"
            )
        X4 = Y.to(acc) if Y.dtype != acc else Y
    if needs_mask:
        X4 = X4.masked_fill_(pb.block_mask.masked_out(b, h, qs, qe, ks, ke) if mo is None else mo, NEG_INF)
    return X4.reshape(S.shape), leaf, mod_out


def drop_tile(pb, B, H, qs, qe, ks, ke, acc, shape, dev):
    """The dropout tile ``Z / (1 − p)`` in the kernel's ``(B*Hkv, G*n, m)`` layout, from the
    counters (b, h, q_pos, kv_pos): the same bits whatever the tiling, forward or backward."""
    qp = torch.arange(qs, qe, device=dev) + pb.q_offset
    kp = torch.arange(ks, ke, device=dev) + pb.kv_offset
    return pb.dropout.scale_tile(B, H, qp, kp, acc).view(shape)


def _call_mod_under_grad(pb, leaf, b, h, qp, kp):
    """The mod on a leaf that requires grad; a mod that writes into its input gets a copy
    (autograd refuses in-place writes to a leaf), remembered for the later tiles."""
    if not pb.mod_clone:
        try:
            return pb.score_mod(leaf, b, h, qp, kp)
        except RuntimeError as e:
            if "in-place" not in str(e) and "inplace" not in str(e):
                raise
            pb.mod_clone = True
    return pb.score_mod(leaf.clone(), b, h, qp, kp)


def rescale(m, tile_max):
    """The LSE merge step of the online softmax: ``(m_new, m_safe, alpha)``.

    ``m (rows, 1)`` is the running row max so far (``-inf`` while no key was visible),
    ``tile_max (rows, 1)`` the max of the new tile's final scores.  ``m_new = max(m,
    tile_max)``; ``m_safe`` is ``m_new`` with ``-inf`` replaced by 0 (so ``exp(s − m_safe)``
    is 0, not NaN, on rows that still see nothing); ``alpha = exp(m − m_safe)`` rescales
    what was accumulated (0 while the row had no visible key).
    """
    m_new = torch.maximum(m, tile_max)
    m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)
    return m_new, m_safe, torch.exp(m - m_safe)


def finish(m, l):
    """The end of a row: ``(empty, l_safe, lse)`` from the running max ``m`` and sum ``l``
    (``(rows, 1)`` each).  ``empty = l == 0`` (the row saw no key); ``l_safe`` is ``l`` with 1
    where empty (so ``acc / l_safe`` is 0 for accumulators that stayed 0); ``lse = m + log l``,
    natural log, ``-inf`` where empty.  A NaN ``l`` (a visible NaN score) is not empty: it
    propagates, as the contract wants."""
    empty = l == 0
    l_safe = l.masked_fill(empty, 1.0)
    return empty, l_safe, torch.where(empty, torch.full_like(l, NEG_INF), m + torch.log(l_safe))


def fused_ok(q, k, scale) -> bool:
    """``|scale·q·k| <= FUSED_MAX`` for every pair (Cauchy-Schwarz on the row norms); one
    pass over q and k.  False for non-finite q/k, which then take the exact path too."""
    if q.numel() == 0 or k.numel() == 0:
        return True
    if traced(q, k):  # under torch.func: no value-dependent choice (the exact path is always right)
        return False
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        nq = torch.linalg.vector_norm(q, dim=-1, dtype=f).amax()
        nk = torch.linalg.vector_norm(k, dim=-1, dtype=f).amax()
        return bool(nq * nk * abs(scale) <= FUSED_MAX)


def pick_block_mask(mask, dtype, B, H, Nq, Nk, D, q_offset, kv_offset, block, device):
    """The BlockMask for ``mask`` on a ``(B, H, Nq, Nk)`` problem of head dim ``D``: at
    ``block = (bq, bk)`` if given; else, when the mask classifies cheaply, the candidate
    tiling (:func:`attnlab.ops.tiles.tile_candidates`) with the lowest estimated cost."""
    kw = dict(q_offset=q_offset, kv_offset=kv_offset)
    if block is not None:
        return mask.block_mask(B, H, Nq, Nk, block=block, **kw)
    cands = tile_candidates(dtype, D, B * H, device)
    if not getattr(mask, "cheap_classify", False):
        return mask.block_mask(B, H, Nq, Nk, block=cands[0], **kw)
    key = (mask_cache.mask_id(mask), B, H, Nq, Nk, q_offset, kv_offset, tuple(cands))  # the choice per problem
    hit = mask_cache.tile_picks.get(key)
    if hit is not None:
        return hit
    bms = [mask.block_mask(B, H, Nq, Nk, block=c, **kw) for c in cands]
    return mask_cache.tile_picks.put(key, min(bms, key=lambda bm: bm.cost(B * H)))
