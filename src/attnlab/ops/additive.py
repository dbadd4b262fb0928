"""Additive (Bahdanau) attention: a small feed-forward network scores each (query, key) pair.

Bahdanau, Cho & Bengio (2015) score a decoder state ``s`` against an encoder
annotation ``h_j`` with ``e_j = v_aᵀ tanh(W_a s + U_a h_j)``; here, per query row ``i``
and key column ``j``::

    e_ij = v_aᵀ tanh(W_q q_i + W_k k_j + b)        (b optional)
    a_ij = softmax_j(e_ij)  over the keys the mask allows
    out_i = Σ_j a_ij v_j

There is no ``1/sqrt(D)`` scale: the score is bounded, ``|e_ij| ≤ Σ|v_a|``, because
``|tanh| ≤ 1``.  It is the "feed-forward compatibility" alternative the seeds mention;
dot-product attention replaced it because its scores are one matmul.

Shapes (the library contract; ``A = d_attn``)::

    q    (B, H,   Nq, Dq)       H % Hkv == 0; query head h reads kv head h // (H // Hkv)
    k    (B, Hkv, Nk, Dk)       (Dq and Dk may differ, as in the original encoder-decoder)
    v    (B, Hkv, Nk, Dv)
    w_q  (A, Dq)  or (H, A, Dq)  shared by all heads, or one per query head
    w_k  (A, Dk)  or (H, A, Dk)
    v_a  (A,)     or (H, A)
    bias (A,)     or (H, A)      optional
    out  (B, H,   Nq, Dv)        dtype of q; arithmetic in float32 (float64 for float64)
    lse  (B, H,   Nq)            with return_lse=True; -inf for a row with no visible key

Positions are absolute, as in :func:`attnlab.attention`: query row ``i`` sits at
``q_offset + i`` (default ``q_offset = kv_offset + Nk - Nq``, the queries are the newest
tokens) and key column ``j`` at ``kv_offset + j``::

               kv_pos: 0 1 2 3
    row 0 (q_pos 2)    x x x .      causal(), Nq = 2 over Nk = 4 (x = may attend)
    row 1 (q_pos 3)    x x x x

A row whose keys are all masked gives 0 (and ``lse = -inf``, zero gradients), never NaN.

Memory.  The naive form (:func:`naive_additive_attention`) materialises the
``(B, H, Nq, Nk, A)`` tensor ``tanh(W_q q_i + W_k k_j)``, and autograd keeps it for the
backward.  :func:`additive_attention` works on tiles of ``q_chunk_size`` query rows by
``chunk_size`` keys with an online softmax (as flash attention does), so it holds at most
a few ``(B, H, q_chunk_size, chunk_size, A)`` tiles at once, and its custom backward
recomputes each tile from the projections and the saved row log-sum-exp instead of
storing it.  Tiles a mask leaves empty are skipped, full ones are not masked (the
mask's block classifier, :mod:`attnlab.masks`).  Only the projections ``W_q q`` and
``W_k k``, ``O(N·A)``, are kept for the backward.  K/V are never repeated per query head.
"""

from __future__ import annotations

import torch

from attnlab.masks import BlockMask
from attnlab.ops.args import normalize
from attnlab.validate import FLOAT_DTYPES, integer

__all__ = ["additive_attention", "naive_additive_attention"]

_NEG_INF = float("-inf")


def additive_attention(
    q,
    k,
    v,
    w_q,
    w_k,
    v_a,
    *,
    bias=None,
    mask=None,
    q_offset=None,
    kv_offset=0,
    return_lse=False,
    chunk_size=64,
    q_chunk_size=64,
):
    """Additive attention ``softmax_j(v_aᵀ tanh(W_q q_i + W_k k_j + b)) · v``, tiled.

    Shapes and positions as in the module docstring (:mod:`attnlab.ops.additive`).

    Args:
        w_q, w_k, v_a: the scoring network; 2-D/1-D weights are shared by every head,
            3-D/2-D ones (leading dim ``H``) are per query head.
        bias: optional ``b`` inside the tanh, ``(A,)`` or ``(H, A)``.
        mask: an :mod:`attnlab.masks` mask (absolute positions) or a BlockMask built for
            this shape (its tile sizes then replace ``q_chunk_size``/``chunk_size``).
        return_lse: also return the natural-log log-sum-exp of each row's masked scores.
        chunk_size, q_chunk_size: keys and query rows per tile; the working set is a few
            ``(B, H, q_chunk_size, chunk_size, A)`` tensors in float32.

    Gradients reach ``q, k, v, w_q, w_k, v_a, bias`` (first order; the backward
    recomputes each tile).

    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 4, 5, 8, generator=g); k = torch.randn(2, 2, 7, 6, generator=g)
    >>> v = torch.randn(2, 2, 7, 3, generator=g)
    >>> w_q, w_k, v_a = torch.randn(16, 8, generator=g), torch.randn(16, 6, generator=g), torch.randn(16, generator=g)
    >>> out = additive_attention(q, k, v, w_q, w_k, v_a, chunk_size=3, q_chunk_size=2)
    >>> out.shape, torch.allclose(out, naive_additive_attention(q, k, v, w_q, w_k, v_a), atol=1e-5)
    (torch.Size([2, 4, 5, 3]), True)
    """
    B, H, Hkv, Nq, Nk, q_offset, kv_offset = _check(q, k, v, w_q, w_k, v_a, bias, mask, q_offset, kv_offset, return_lse)
    bq = integer(q_chunk_size, "q_chunk_size", lo=1)
    bk = integer(chunk_size, "chunk_size", lo=1)
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    pq = _project_q(q, w_q, bias, Hkv, acc)  # (B, Hkv, G, Nq, A)
    pk = _project_k(k, w_k, Hkv, G, acc)  # (B, Hkv, 1 or G, Nk, A)
    va = _vec(v_a, Hkv, G, acc)  # (Hkv, 1 or G, A)
    vv = v.to(acc).unsqueeze(2)  # (B, Hkv, 1, Nk, Dv)
    if isinstance(mask, BlockMask):
        bm, bq, bk = mask, mask.block_q, mask.block_k
    elif mask is not None and Nq > 0 and Nk > 0:
        bm = mask.block_mask(B, H, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, block=(bq, bk))
    else:
        bm = None
    plan = _Plan(bm, B, H, Hkv, Nq, Nk, bq, bk, q.device)
    out, lse = _AdditiveFn.apply(plan, pq, pk, vv, va)
    out = out.reshape(B, H, Nq, v.shape[-1]).to(q.dtype)
    if return_lse:
        return out, lse.reshape(B, H, Nq)
    return out


def naive_additive_attention(
    q, k, v, w_q, w_k, v_a, *, bias=None, mask=None, q_offset=None, kv_offset=0, return_lse=False
):
    """Reference for :func:`additive_attention` (same arguments, no tiling): materialises
    ``tanh(W_q q_i + W_k k_j + b)`` as ``(B, H, Nq, Nk, A)`` with K/V repeated per query
    head, evaluates the mask densely and differentiates with plain autograd.

    >>> import torch
    >>> q = torch.zeros(1, 1, 1, 2); k = torch.randn(1, 1, 3, 2); v = torch.arange(3.).view(1, 1, 3, 1)
    >>> w = torch.zeros(4, 2)           # every score is v_aᵀ tanh(0) = 0: a uniform average
    >>> naive_additive_attention(q, k, v, w, w, torch.ones(4)).item()
    1.0
    """
    B, H, Hkv, Nq, Nk, q_offset, kv_offset = _check(q, k, v, w_q, w_k, v_a, bias, mask, q_offset, kv_offset, return_lse)
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    pq = _project_q(q, w_q, bias, Hkv, acc).reshape(B, H, Nq, -1)
    pk = _project_k(k, w_k, Hkv, G, acc).expand(B, Hkv, G, Nk, -1).reshape(B, H, Nk, -1)
    va = _vec(v_a, Hkv, G, acc).expand(Hkv, G, -1).reshape(H, -1)
    vv = v.to(acc).repeat_interleave(G, dim=1)
    t = torch.tanh(pq[:, :, :, None, :] + pk[:, :, None, :, :])  # (B, H, Nq, Nk, A)
    s = (t * va[None, :, None, None, :]).sum(-1)  # (B, H, Nq, Nk)
    if isinstance(mask, BlockMask):
        mask = mask.mask
    if mask is not None:
        b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
        h = torch.arange(H, device=q.device).view(1, H, 1, 1)
        qp = (torch.arange(Nq, device=q.device) + q_offset).view(1, 1, Nq, 1)
        kp = (torch.arange(Nk, device=q.device) + kv_offset).view(1, 1, 1, Nk)
        allowed = torch.as_tensor(mask(b, h, qp, kp), dtype=torch.bool, device=q.device)
        s = s.masked_fill(~allowed, _NEG_INF)
    m = s.amax(-1, keepdim=True) if Nk else s.new_full((B, H, Nq, 1), _NEG_INF)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    out = ((e / l_safe) @ vv).to(q.dtype)
    if return_lse:
        lse = torch.where(empty, torch.full_like(l, _NEG_INF), m + torch.log(l_safe)).squeeze(-1)
        return out, lse
    return out


# --------------------------------------------------------------------------------------
# The tiled kernel.  Internal layout: pq (B, Hkv, G, Nq, A), pk (B, Hkv, Gk, Nk, A) with
# Gk in {1, G}, vv (B, Hkv, 1, Nk, Dv), va (Hkv, Gw, A) with Gw in {1, G}; out
# (B, Hkv, G, Nq, Dv) and lse (B, Hkv, G, Nq) in the accumulator dtype.


class _Plan:
    """Tiles to visit: per query block, ``[(kv_block, needs_mask), ...]``."""

    def __init__(self, bm, B, H, Hkv, Nq, Nk, bq, bk, device):
        self.bm, self.B, self.H, self.Hkv, self.bq, self.bk = bm, B, H, Hkv, bq, bk
        self.Nq, self.Nk = Nq, Nk
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        if bm is None:
            self.rows = [[(j, False) for j in range(nkb)] for _ in range(nqb)] if Nk else [[] for _ in range(nqb)]
        else:
            self.rows = bm.plan()
        self.b = torch.arange(B, device=device).view(B, 1, 1, 1)
        self.h = torch.arange(H, device=device).view(1, H, 1, 1)

    def masked_out(self, qs, qe, ks, ke):
        """``~mask`` on the tile as ``(Bm, Hkv or 1, G or 1, n, m)`` (True = masked out)."""
        t = self.bm.masked_out(self.b, self.h, qs, qe, ks, ke)
        while t.dim() < 4:
            t = t.unsqueeze(0)
        Bm, Hm = t.shape[0], t.shape[1]
        t = t.expand(Bm, Hm, qe - qs, ke - ks)
        if Hm == 1:
            return t.unsqueeze(1)
        return t.reshape(Bm, self.Hkv, Hm // self.Hkv, qe - qs, ke - ks)


def _tile_scores(plan, pq, pk, va, qs, qe, ks, ke, needs_mask):
    """``t = tanh(pq_i + pk_j)`` (B, Hkv, G, n, m, A) and masked scores ``s`` (B, Hkv, G, n, m)."""
    t = (pq[:, :, :, qs:qe, None, :] + pk[:, :, :, None, ks:ke, :]).tanh_()
    s = (t @ va[None, :, :, None, :, None]).squeeze(-1)
    if needs_mask:
        s = s.masked_fill(plan.masked_out(qs, qe, ks, ke), _NEG_INF)
    return t, s


def _forward(plan, pq, pk, vv, va):
    B, Hkv, G, Nq, _ = pq.shape
    Dv = vv.shape[-1]
    out = pq.new_zeros(B, Hkv, G, Nq, Dv)
    lse = pq.new_full((B, Hkv, G, Nq), _NEG_INF)
    for i, row in enumerate(plan.rows):
        qs, qe = i * plan.bq, min(Nq, (i + 1) * plan.bq)
        n = qe - qs
        m = pq.new_full((B, Hkv, G, n, 1), _NEG_INF)
        l = pq.new_zeros(B, Hkv, G, n, 1)
        o = pq.new_zeros(B, Hkv, G, n, Dv)
        for j, needs_mask in row:
            ks, ke = j * plan.bk, min(plan.Nk, (j + 1) * plan.bk)
            _, s = _tile_scores(plan, pq, pk, va, qs, qe, ks, ke, needs_mask)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(-1, keepdim=True)
            o = o * alpha + p @ vv[:, :, :, ks:ke]
            m = m_new
        empty = l == 0
        l_safe = torch.where(empty, torch.ones_like(l), l)
        out[:, :, :, qs:qe] = o / l_safe
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        lse[:, :, :, qs:qe] = torch.where(empty, torch.full_like(l, _NEG_INF), m_safe + torch.log(l_safe)).squeeze(-1)
    return out, lse


def _backward(plan, pq, pk, vv, va, out, lse, dout, dlse):
    Nq = pq.shape[3]
    delta = (dout * out).sum(-1)  # rowsum(dO ∘ O) − dLSE
    if dlse is not None:
        delta = delta - dlse
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dpq = torch.zeros_like(pq)
    dpk = torch.zeros_like(pk)
    dvv = torch.zeros_like(vv)
    dva = torch.zeros_like(va)
    va_t = va[None, :, :, None, None, :]
    for i, row in enumerate(plan.rows):
        qs, qe = i * plan.bq, min(Nq, (i + 1) * plan.bq)
        L = lse_safe[:, :, :, qs:qe, None]
        D = delta[:, :, :, qs:qe, None]
        dO = dout[:, :, :, qs:qe]
        for j, needs_mask in row:
            ks, ke = j * plan.bk, min(plan.Nk, (j + 1) * plan.bk)
            t, s = _tile_scores(plan, pq, pk, va, qs, qe, ks, ke, needs_mask)
            p = torch.exp(s - L)  # masked entries: exp(-inf) = 0
            dvv[:, :, :, ks:ke] += (p.transpose(-1, -2) @ dO).sum(2, keepdim=True)  # G -> shared kv head
            ds = p * (dO @ vv[:, :, :, ks:ke].transpose(-1, -2) - D)
            dva += _sum_to(torch.einsum("bkgij,bkgija->kga", ds, t), va.shape)
            du = (1 - t * t).mul_(va_t).mul_(ds.unsqueeze(-1))  # d e_ij / d(pq_i + pk_j)
            dpq[:, :, :, qs:qe] += du.sum(-2)
            dpk[:, :, :, ks:ke] += _sum_to(du.sum(-3), dpk[:, :, :, ks:ke].shape)
    return dpq, dpk, dvv, dva


def _sum_to(x, shape):
    """Sum ``x`` over the dims where ``shape`` has 1 (an operand that was broadcast)."""
    dims = tuple(d for d, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1)
    return x.sum(dims, keepdim=True) if dims else x


class _AdditiveFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, pq, pk, vv, va):
        out, lse = _forward(plan, pq, pk, vv, va)
        ctx.plan = plan
        ctx.save_for_backward(pq, pk, vv, va, out, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        pq, pk, vv, va, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dpq, dpk, dvv, dva = _backward(
            ctx.plan, pq, pk, vv, va, out, lse, dout.to(out.dtype), None if dlse is None else dlse.to(lse.dtype)
        )
        return None, dpq, dpk, dvv, dva


# --------------------------------------------------------------------------------------


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _project_q(q, w_q, bias, Hkv, acc):
    B, H, Nq, _ = q.shape
    qa = q.to(acc)
    if w_q.dim() == 2:
        pq = qa @ w_q.to(acc).T
    else:
        pq = torch.einsum("bhnd,had->bhna", qa, w_q.to(acc))
    if bias is not None:
        pq = pq + (bias.to(acc) if bias.dim() == 1 else bias.to(acc)[None, :, None, :])
    return pq.reshape(B, Hkv, H // Hkv, Nq, w_q.shape[-2])


def _project_k(k, w_k, Hkv, G, acc):
    ka = k.to(acc)
    if w_k.dim() == 2:
        return (ka @ w_k.to(acc).T).unsqueeze(2)
    wk = w_k.to(acc).reshape(Hkv, G, *w_k.shape[1:])
    return torch.einsum("bknd,kgad->bkgna", ka, wk)


def _vec(x, Hkv, G, acc):
    x = x.to(acc)
    return x.view(1, 1, -1) if x.dim() == 1 else x.reshape(Hkv, G, -1)


def _check(q, k, v, w_q, w_k, v_a, bias, mask, q_offset, kv_offset, return_lse):
    # q/k/v, offsets and the mask (BlockMasks: built for this problem); q and k may differ in head dim
    pr = normalize(
        q,
        k,
        v,
        mask=mask,
        q_offset=q_offset,
        kv_offset=kv_offset,
        layout=_LAYOUT,
        same_head_dim=False,
        positive_head_dim=False,
    )
    B, H, Nq, Dq = q.shape
    _, Hkv, Nk, Dk = k.shape
    q_offset, kv_offset = pr.q_offset, pr.kv_offset
    weights = {"w_q": w_q, "w_k": w_k, "v_a": v_a, "bias": bias}
    for name, w in weights.items():
        if w is None and name == "bias":
            continue
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a floating tensor, got {w.dtype}")
        if w.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {w.device}")
    if w_q.dim() not in (2, 3) or w_q.shape[-1] != Dq or (w_q.dim() == 3 and w_q.shape[0] != H):
        raise ValueError(f"w_q: expected (A, Dq={Dq}) shared or (H={H}, A, Dq={Dq}) per head, got {tuple(w_q.shape)}")
    A = w_q.shape[-2]
    if A == 0:
        raise ValueError(f"w_q: d_attn A must be >= 1, got w_q {tuple(w_q.shape)}")
    if w_k.dim() not in (2, 3) or w_k.shape[-2:] != (A, Dk) or (w_k.dim() == 3 and w_k.shape[0] != H):
        raise ValueError(
            f"w_k: expected (A={A}, Dk={Dk}) shared or (H={H}, A={A}, Dk={Dk}) per head "
            f"(A from w_q {tuple(w_q.shape)}), got {tuple(w_k.shape)}"
        )
    for name in ("v_a", "bias"):
        w = weights[name]
        if w is not None and not (tuple(w.shape) == (A,) or tuple(w.shape) == (H, A)):
            raise ValueError(
                f"{name}: expected ({A},) shared or ({H}, {A}) per head (A from w_q "
                f"{tuple(w_q.shape)}, H from q), got {tuple(w.shape)}"
            )
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    return B, H, Hkv, Nq, Nk, q_offset, kv_offset


_LAYOUT = {"q": "(B, H, Nq, Dq)", "k": "(B, Hkv, Nk, Dk)", "v": "(B, Hkv, Nk, Dv)"}
