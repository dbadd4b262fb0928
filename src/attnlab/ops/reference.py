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

from attnlab.ops.finite import all_finite, hidden_matmul, hidden_scores, traced


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


def reference_probs(q, k, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0, holder=None, need_lse=True):
    """The attention probabilities ``(B, H, Nq, Nk)`` in float32 (float64 for float64)
    and the LSE ``(B, H, Nq)``; inputs already validated.  Fully masked rows are 0.

    ``need_lse=False`` returns ``(p, None)`` from one fused ``torch.softmax`` (what
    :func:`attnlab.attention_probs` and the interp patterns read): the same probabilities
    to rounding, about half the passes over the ``(B, H, Nq, Nk)`` scores.

    With ``holder`` (a dict; the path for non-finite inputs, see :mod:`attnlab.ops.finite`)
    the scores' backward skips hidden pairs, a masked score that is not finite reaches the
    score mod as 0 (its output there is discarded anyway), and ``holder["hidden"]`` is set
    to the bool ``(B, H, Nq, Nk)`` map of final scores equal to ``-inf``."""
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    acc = acc_dtype(q.dtype)
    kr = k.repeat_interleave(G, dim=1) if G > 1 else k
    # without autograd, the scale applied in place on the GEMM's output (one pass less than an
    # out-of-place product, same bits); with it, the textbook matmul-then-scale, whose backward
    # rounding the accuracy rule's same-dtype reference stands for.  Never the GEMM's alpha: BLAS
    # may scale an operand before the products (OpenBLAS/AVX2 does), which rounds differently and
    # overflows to inf -- then NaN -- where scale·(q·k) is finite.
    no_grad = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
    if holder is None and no_grad and q.dtype == acc and q.dim() == 4 and isinstance(scale, float):
        s = torch.bmm(q.reshape(B * H, Nq, -1), kr.reshape(B * H, Nk, -1).transpose(-1, -2)).mul_(scale)
        s = s.view(B, H, Nq, Nk)
    else:
        raw = torch.matmul(q, kr.transpose(-1, -2)) if holder is None else hidden_scores(q, kr, holder)
        s = raw.to(acc) * scale
    b, h, qp, kp = index_grids(B, H, Nq, Nk, q_offset, kv_offset, q.device)
    allowed = None if mask is None else torch.as_tensor(mask(b, h, qp, kp), device=q.device)
    if score_mod is not None:
        shape = s.shape
        if holder is not None and allowed is not None:
            s = torch.where(~allowed & ~torch.isfinite(s), torch.zeros_like(s), s)
        s = score_mod(s, b, h, qp, kp)
        if not isinstance(s, torch.Tensor) or s.shape != shape:
            raise ValueError(
                f"score_mod: returned {tuple(getattr(s, 'shape', ()))} for a score matrix of shape "
                f"{tuple(shape)}; a score mod must be elementwise"
            )
    if allowed is not None:  # in place on our own fresh scores; a score mod's output may be anyone's tensor
        s = s.masked_fill_(~allowed, float("-inf")) if score_mod is None else s.masked_fill(~allowed, float("-inf"))
    if holder is not None:
        holder["hidden"] = (s == float("-inf")).detach()
    if not need_lse:  # the pattern alone (attention_probs): one fused softmax, fully masked rows to 0
        p = torch.softmax(s, dim=-1)
        # a row whose scores are all -inf comes out NaN: set it to 0 (a NaN the row can see stays NaN);
        # eager, the full check runs only when some row's first probability is NaN
        if Nk and (traced(s) or bool(p[..., 0].isnan().any())):
            p = p.masked_fill((s == float("-inf")).all(-1, keepdim=True), 0.0)
        return p, None
    m = s.amax(-1, keepdim=True) if Nk else s.new_full((*s.shape[:-1], 1), float("-inf"))
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.exp(s - m_safe)
    l = e.sum(-1, keepdim=True)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    p = e / l_safe
    lse = torch.where(empty, torch.full_like(l, float("-inf")), m_safe + torch.log(l_safe)).squeeze(-1)
    return p, lse


def reference_attention(q, k, v, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0, dropout=None):
    """Materialized attention.  Returns ``(out, lse)``; inputs already validated.

    ``mask`` is an attnlab Mask (or None); ``score_mod`` a callable (or None).
    Fully masked rows give ``out = 0`` and ``lse = -inf`` with zero, finite gradients.
    Keys a row cannot see have no effect on it even when they hold NaN/inf; NaN/inf a
    row can see propagates (:mod:`attnlab.ops.finite`).  That path runs only when q, k
    or v holds a non-finite value (one check of the inputs per call).
    """
    G = q.shape[1] // k.shape[1]
    # (under torch.compile / torch.func the check cannot run: the plain path, docs/compile.md)
    holder: dict | None = None if traced(q, k, v) or all_finite(q, k, v) else {}
    p, lse = reference_probs(
        q, k, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, kv_offset=kv_offset, holder=holder
    )
    vr = v.repeat_interleave(G, dim=1) if G > 1 else v
    if dropout is not None:
        B, H, Nq, _ = q.shape
        Nk = k.shape[2]
        qp = torch.arange(Nq, device=q.device) + q_offset
        kp = torch.arange(Nk, device=q.device) + kv_offset
        p = p * dropout.scale_tile(B, H, qp, kp, p.dtype)
    if holder is None:
        return torch.matmul(p.to(v.dtype), vr), lse
    return hidden_matmul(p.to(v.dtype), vr, holder["hidden"]), lse
