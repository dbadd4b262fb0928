"""The oracle: softmax(scale·QKᵀ + score_mod, masked)·V, materialized.

Same signature and contract as every other backend (see :func:`attnlab.attention`).
It repeats K/V per query head and builds the whole ``(B, H, Nq, Nk)`` score matrix,
so use it for checking, teaching and small problems.  Matmuls run in the input
dtype (as a textbook implementation in that dtype would); the softmax and its
statistics in float32 (float64 for float64 inputs).  Run it on ``.double()`` inputs
for the float64 oracle the tests compare every fast path against.
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def index_grids(B, H, Nq, Nk, q_offset, kv_offset, device):
    """Broadcastable ``(b, h, q_pos, kv_pos)`` int64 grids with absolute positions."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    qp = (torch.arange(Nq, device=device) + q_offset).view(1, 1, Nq, 1)
    kp = (torch.arange(Nk, device=device) + kv_offset).view(1, 1, 1, Nk)
    return b, h, qp, kp


def reference_probs(q, k, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0):
    """The attention probabilities ``(B, H, Nq, Nk)`` in float32 (float64 for float64)
    and the LSE ``(B, H, Nq)``; inputs already validated.  Fully masked rows are 0."""
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    acc = acc_dtype(q.dtype)
    kr = k.repeat_interleave(G, dim=1) if G > 1 else k
    s = torch.matmul(q, kr.transpose(-1, -2)).to(acc) * scale
    b, h, qp, kp = index_grids(B, H, Nq, Nk, q_offset, kv_offset, q.device)
    if score_mod is not None:
        shape = s.shape
        s = score_mod(s, b, h, qp, kp)
        if not isinstance(s, torch.Tensor) or s.shape != shape:
            raise ValueError(f"score_mod: returned {tuple(getattr(s, 'shape', ()))} for a score matrix of shape "
                             f"{tuple(shape)}; a score mod must be elementwise")
    if mask is not None:
        allowed = torch.as_tensor(mask(b, h, qp, kp), device=q.device)
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True) if Nk else s.new_full((*s.shape[:-1], 1), float("-inf"))
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m_safe)
    l = e.sum(-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    p = e / l_safe
    lse = torch.where(empty, torch.full_like(l, float("-inf")), m_safe + torch.log(l_safe)).squeeze(-1)
    return p, lse


def reference_attention(q, k, v, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0):
    """Materialized attention.  Returns ``(out, lse)``; inputs already validated.

    ``mask`` is an attnlab Mask (or None); ``score_mod`` a callable (or None).
    Fully masked rows give ``out = 0`` and ``lse = -inf`` with zero, finite gradients.
    """
    G = q.shape[1] // k.shape[1]
    p, lse = reference_probs(q, k, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset,
                             kv_offset=kv_offset)
    vr = v.repeat_interleave(G, dim=1) if G > 1 else v
    return torch.matmul(p.to(v.dtype), vr), lse
