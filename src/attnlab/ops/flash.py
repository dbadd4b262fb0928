"""Tiled online-softmax attention (FlashAttention-2) in PyTorch tensor ops, with its own backward.

Forward, for each q-block ``i`` and each kv-block ``j`` the BlockMask does not
empty (natural log throughout)::

    S    = scale · Q_i K_jᵀ  (+ score_mod; masked entries -> -inf, on partial tiles only)
    m'   = max(m, rowmax S)             running max, -inf until a key is visible
    P    = exp(S − m')                  with m' := 0 where m' = -inf, so P = 0 there
    l    = l·exp(m − m') + rowsum P
    acc  = acc·exp(m − m') + P V_j
    O_i  = acc / l,   LSE_i = m + log l      (l = 0: O_i = 0, LSE_i = -inf)

Backward recomputes ``P = exp(S − LSE)`` tile by tile from the saved LSE and uses
``dS = P ∘ (dP − Δ)`` with ``dP = dO Vᵀ`` and ``Δ = rowsum(dO ∘ O) − dLSE``.  The
``Nq × Nk`` matrix is never held: the working set is one tile.  GQA folds the
``G = H / Hkv`` query heads that share a kv head into the rows of one matmul, so
K/V are never repeated.  A score mod is differentiated tile by tile with autograd,
so gradients reach its parameters.
"""

from __future__ import annotations

import torch

from attnlab.ops.reference import acc_dtype
from attnlab.ops.tiles import choose_tiles

_NEG_INF = float("-inf")


def _mm_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    # CPU float16 matmul has no fast kernel (about 1 GFLOP/s here); compute it in float32.
    if dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return dtype


class _Problem:
    """Everything the kernel needs besides the tensors (kept out of autograd's inputs)."""

    def __init__(self, block_mask, score_mod, params, scale, q_offset, kv_offset, B, H, Nq, Nk, bq, bk):
        self.block_mask, self.score_mod, self.n_params = block_mask, score_mod, len(params)
        self.scale, self.q_offset, self.kv_offset = scale, q_offset, kv_offset
        self.bq, self.bk = bq, bk
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        if block_mask is None:
            self.plan = [[(j, False) for j in range(nkb)] for _ in range(nqb)]
        else:
            self.plan = block_mask.plan()
        self.mask = None if block_mask is None else block_mask.mask

    def grids(self, B, H, device):
        return torch.arange(B, device=device).view(B, 1, 1, 1), torch.arange(H, device=device).view(1, H, 1, 1)


def _fold(x, qs, qe, Hkv, G, dtype):
    """Rows ``qs:qe`` of a ``(B, H, N, D)`` tensor as ``(B, Hkv, G*n, D)`` in ``dtype``."""
    B, _, _, D = x.shape
    n = qe - qs
    return x[:, :, qs:qe].reshape(B, Hkv, G * n, D).to(dtype)


def _scores(pb: _Problem, Qi, Kj, b, h, qs, qe, ks, ke, needs_mask, acc, with_grad=False):
    """Scaled, modded, masked score tile ``(B, H, n, m)`` in ``acc``; also the pre-mask leaf."""
    B, Hkv, Gn, _ = Qi.shape
    n, m = qe - qs, ke - ks
    H = Gn // n * Hkv
    S = torch.matmul(Qi, Kj.transpose(-1, -2)).view(B, H, n, m)
    S = S.to(acc) if S.dtype != acc else S
    S.mul_(pb.scale)
    qp = kp = None
    leaf = mod_out = None
    if pb.score_mod is not None or needs_mask:
        dev = S.device
        qp = (torch.arange(qs, qe, device=dev) + pb.q_offset).view(1, 1, n, 1)
        kp = (torch.arange(ks, ke, device=dev) + pb.kv_offset).view(1, 1, 1, m)
    if pb.score_mod is not None:
        if with_grad:
            leaf = S.requires_grad_(True)
            with torch.enable_grad():
                mod_out = pb.score_mod(leaf, b, h, qp, kp)
            S = mod_out.detach().clone()  # later in-place ops must not touch the graph's tensors
        else:
            S = pb.score_mod(S, b, h, qp, kp)
        if S.shape != (B, H, n, m):
            raise ValueError(f"score_mod: returned shape {tuple(S.shape)} for a score tile of shape "
                             f"{(B, H, n, m)}; a score mod must be elementwise")
    if needs_mask:
        S.masked_fill_(~pb.mask(b, h, qp, kp), _NEG_INF)
    return S, leaf, mod_out


def _forward(pb: _Problem, q, k, v):
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc = acc_dtype(q.dtype)
    mmd = _mm_dtype(q.dtype, q.device)
    out = torch.empty(B, H, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=acc, device=q.device)
    b, h = pb.grids(B, H, q.device)
    for i, row in enumerate(pb.plan):
        qs, qe = i * pb.bq, min(Nq, (i + 1) * pb.bq)
        n = qe - qs
        if not row:
            out[:, :, qs:qe] = 0
            lse[:, :, qs:qe] = _NEG_INF
            continue
        Qi = _fold(q, qs, qe, Hkv, G, mmd)
        m = torch.full((B, H, n), _NEG_INF, dtype=acc, device=q.device)
        l = torch.zeros((B, H, n), dtype=acc, device=q.device)
        o = torch.zeros((B, H, n, Dv), dtype=acc, device=q.device)
        for j, needs_mask in row:
            ks, ke = j * pb.bk, min(Nk, (j + 1) * pb.bk)
            Kj, Vj = k[:, :, ks:ke].to(mmd), v[:, :, ks:ke].to(mmd)
            S, _, _ = _scores(pb, Qi, Kj, b, h, qs, qe, ks, ke, needs_mask, acc)
            m_new = torch.maximum(m, S.amax(-1))
            m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)
            P = S.sub_(m_safe.unsqueeze(-1)).exp_()
            alpha = torch.exp(m - m_safe)
            l.mul_(alpha).add_(P.sum(-1))
            PV = torch.matmul(P.to(mmd).view(B, Hkv, G * n, ke - ks), Vj).view(B, H, n, Dv)
            o.mul_(alpha.unsqueeze(-1)).add_(PV)
            m = m_new
        empty = l == 0
        l_safe = l.masked_fill(empty, 1.0)
        out[:, :, qs:qe] = (o / l_safe.unsqueeze(-1)).to(q.dtype)
        lse[:, :, qs:qe] = torch.where(empty, torch.full_like(l, _NEG_INF), m + torch.log(l_safe))
    return out, lse


def _backward(pb: _Problem, q, k, v, out, lse, dout, dlse, params):
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc = acc_dtype(q.dtype)
    mmd = _mm_dtype(q.dtype, q.device)
    dq = torch.zeros(B, H, Nq, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, Hkv, Nk, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, Nk, Dv, dtype=acc, device=q.device)
    dparams = [torch.zeros_like(p) for p in params]
    b, h = pb.grids(B, H, q.device)
    for i, row in enumerate(pb.plan):
        if not row:
            continue
        qs, qe = i * pb.bq, min(Nq, (i + 1) * pb.bq)
        n = qe - qs
        Qi = _fold(q, qs, qe, Hkv, G, mmd)
        dOi = _fold(dout, qs, qe, Hkv, G, mmd)
        L = lse[:, :, qs:qe]
        L_safe = L.masked_fill(L == _NEG_INF, 0.0).unsqueeze(-1)
        delta = (dout[:, :, qs:qe].to(acc) * out[:, :, qs:qe].to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse[:, :, qs:qe].to(acc)
        delta = delta.unsqueeze(-1)
        dQi = torch.zeros(B, Hkv, G * n, D, dtype=acc, device=q.device)
        for j, needs_mask in row:
            ks, ke = j * pb.bk, min(Nk, (j + 1) * pb.bk)
            mk = ke - ks
            Kj, Vj = k[:, :, ks:ke].to(mmd), v[:, :, ks:ke].to(mmd)
            S, leaf, mod_out = _scores(pb, Qi, Kj, b, h, qs, qe, ks, ke, needs_mask, acc, with_grad=pb.score_mod is not None)
            P = S.sub_(L_safe).exp_()
            Pm = P.to(mmd).view(B, Hkv, G * n, mk)
            dv[:, :, ks:ke] += torch.matmul(Pm.transpose(-1, -2), dOi)
            dP = torch.matmul(dOi, Vj.transpose(-1, -2)).view(B, H, n, mk)
            dS = P.mul_(dP.to(acc).sub_(delta))  # P is dead after this: reuse its storage
            if leaf is not None:
                grads = torch.autograd.grad(mod_out, [leaf, *params], dS, allow_unused=True)
                dS = grads[0]
                for t, g in zip(dparams, grads[1:]):
                    if g is not None:
                        t += g
            dSm = dS.mul_(pb.scale).to(mmd).view(B, Hkv, G * n, mk)
            dQi += torch.matmul(dSm, Kj)
            dk[:, :, ks:ke] += torch.matmul(dSm.transpose(-1, -2), Qi)
        dq[:, :, qs:qe] = dQi.view(B, H, n, D)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams


class _FlashFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pb, q, k, v, *params):
        out, lse = _forward(pb, q, k, v)
        ctx.pb = pb
        ctx.save_for_backward(q, k, v, out, lse, *params)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *params = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dparams = _backward(ctx.pb, q, k, v, out, lse, dout, dlse, params)
        return (None, dq, dk, dv, *dparams)


def flash_attention(q, k, v, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0, block=None):
    """Tiled attention, forward and backward.  Returns ``(out, lse)``; inputs already validated.

    ``mask`` is an attnlab Mask, a BlockMask built for this shape, or None.  ``block``
    overrides the measured tile sizes ``(block_q, block_k)`` (a BlockMask's own
    sizes win).
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if block is None:
        block = choose_tiles(q.dtype, D, B * H, q.device)
    if mask is not None and hasattr(mask, "plan"):
        block_mask = mask
        block = (mask.block_q, mask.block_k)
    elif mask is not None and Nq > 0 and Nk > 0:
        block_mask = mask.block_mask(B, H, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, block=block)
    else:
        block_mask = None
    params = list(score_mod.parameters()) if score_mod is not None and hasattr(score_mod, "parameters") else []
    pb = _Problem(block_mask, score_mod, params, scale, q_offset, kv_offset, B, H, Nq, Nk, *block)
    return _FlashFn.apply(pb, q, k, v, *params)
