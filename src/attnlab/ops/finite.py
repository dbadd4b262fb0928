"""Non-finite values: hidden keys have no effect, visible ones propagate (one policy, every backend).

The contract (docs/reliability/numerics.md):

* **Hidden entries contribute nothing.**  A key whose final score is ``-inf`` for a row
  (masked out, or a score mod returned ``-inf``) changes nothing in that row, whatever
  its key or value holds (NaN/inf in an unused cache slot included), forward and
  backward; its gradients from that row are exactly 0.  A row that sees no key gives
  0, LSE ``-inf`` and zero gradients.
* **Visible entries are IEEE.**  NaN/inf in an input a row *can* see propagates as the
  math says: NaN in q, or in a visible key or value, gives NaN in that row (flash-attn
  and the materialized math behave so; torch's CPU SDPA gives 0 for a NaN query, which
  is why backend ``"sdpa"`` hands non-finite inputs to the flash path).

The plain kernels compute ``P·V`` (and ``dS·K``, ``dSᵀ·Q``, ``Pᵀ·dO``) as dense
matmuls, where a structural zero of ``P`` meets a NaN in ``V`` as ``0·NaN = NaN``.
:func:`zmm` is the matmul that skips them exactly; kernels use it only on the rare
tiles/calls that need it (detected from a non-finite result or input), so the
all-finite path pays nothing but a check of its own output.
"""

from __future__ import annotations

import torch

_INF = float("inf")


def traced(*ts: torch.Tensor) -> bool:
    """True under ``torch.compile`` or a ``torch.func`` transform (vmap, grad), where a
    value-dependent Python branch cannot run (or would graph-break): callers take their
    plain path without the finiteness check (docs/compile.md)."""
    if torch.compiler.is_compiling():
        return True
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts)


def all_finite(*ts: torch.Tensor) -> bool:
    """True when every tensor holds only finite values (one pass each, one host sync)."""
    with torch.no_grad():
        flags = [torch.isfinite(t).all() for t in ts if t.numel()]
        if not flags:
            return True
        # a score mod's parameter may live on another device than q/k/v (its gradient does too)
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def maybe_nonfinite(*ts: torch.Tensor) -> bool:
    """False when every tensor is certainly finite: one pass each and one host sync.  float32
    and float64 are summed (float32 / float64 accumulator); 16-bit floats give their min and
    max (``torch.aminmax``: NaN and ±inf reach them), whose float32 difference is summed in:
    summing a bf16 tensor into float32 took 2.7x as long (8 MiB: 495 µs against 180; float16
    292 against 188; float32's sum stays the fastest, 116 against 314).  A finite tensor whose
    sum overflows answers True (a false alarm only costs the caller its careful path)."""
    tot = None
    with torch.no_grad():
        for t in ts:
            if t.dtype in (torch.float16, torch.bfloat16):
                if not t.numel():
                    continue
                lo, hi = torch.aminmax(t)
                s = hi.float() - lo.float()
            else:
                s = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
            tot = s if tot is None else tot + s.to(tot.dtype)
        return tot is not None and not bool(torch.isfinite(tot))


def zmm(A: torch.Tensor, B: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``A @ B`` (batched ``(..., n, m) @ (..., m, d)``) where the entries of ``A`` flagged in
    ``zero`` (bool, broadcastable to ``A``) contribute exactly nothing, whatever ``A`` or the
    matching rows of ``B`` hold.  Every other product is IEEE: a NaN of ``B`` met by a live
    entry gives NaN, an inf gives ±inf (NaN against a live 0, or against both signs).

    Costs one matmul when ``B`` is finite; otherwise four more on 0/1 indicators.
    """
    Az = A.masked_fill(zero, 0)
    fin = torch.isfinite(B)
    if bool(fin.all()):
        return torch.matmul(Az, B)
    out = torch.matmul(Az, torch.where(fin, B, torch.zeros((), dtype=B.dtype, device=B.device)))
    f = torch.float64 if out.dtype == torch.float64 else torch.float32
    live = ~torch.broadcast_to(zero, A.shape)
    a_any, a_zero = live.to(f), (live & (A == 0)).to(f)
    a_pos, a_neg = (live & (A > 0)).to(f), (live & (A < 0)).to(f)
    b_nan, b_pos, b_neg = torch.isnan(B).to(f), (B == _INF).to(f), (B == -_INF).to(f)
    n_nan = torch.matmul(a_any, b_nan) + torch.matmul(a_zero, b_pos + b_neg)
    n_pos = torch.matmul(a_pos, b_pos) + torch.matmul(a_neg, b_neg)
    n_neg = torch.matmul(a_pos, b_neg) + torch.matmul(a_neg, b_pos)
    out = torch.where(n_pos > 0, torch.full_like(out, _INF), out)
    out = torch.where(n_neg > 0, torch.full_like(out, -_INF), out)
    return torch.where((n_nan > 0) | ((n_pos > 0) & (n_neg > 0)), torch.full_like(out, float("nan")), out)


class _ZeroAwareMatmul(torch.autograd.Function):
    """``zmm`` under autograd: ``dA = dOut·Bᵀ`` (0 where ``zero``), ``dB = zmm(Aᵀ, dOut, zeroᵀ)``."""

    @staticmethod
    def forward(ctx, A, B, zero):
        ctx.save_for_backward(A, B, zero)
        return zmm(A, B, zero)

    @staticmethod
    def backward(ctx, dout):
        A, B, zero = ctx.saved_tensors
        dA = dB = None
        if ctx.needs_input_grad[0]:
            dA = torch.matmul(dout, B.transpose(-1, -2)).masked_fill(zero, 0)
        if ctx.needs_input_grad[1]:
            zt = torch.broadcast_to(zero, A.shape).transpose(-1, -2)
            dB = zmm(A.transpose(-1, -2), dout, zt)
            dB = _sum_to(dB, B.shape)
        return dA, dB, None


class _HiddenScores(torch.autograd.Function):
    """``q @ kᵀ`` whose backward ignores the hidden (row, key) pairs: ``dq = zmm(dS, k)``,
    ``dk = zmm(dSᵀ, q)``.  ``holder["hidden"]`` (bool, broadcastable to the scores) is
    filled in by the caller after the forward, once the final scores are known."""

    @staticmethod
    def forward(ctx, q, k, holder):
        ctx.save_for_backward(q, k)
        ctx.holder = holder
        return torch.matmul(q, k.transpose(-1, -2))

    @staticmethod
    def backward(ctx, ds):
        q, k = ctx.saved_tensors
        hid = torch.broadcast_to(ctx.holder["hidden"], ds.shape)
        dq = zmm(ds, k, hid) if ctx.needs_input_grad[0] else None
        dk = zmm(ds.transpose(-1, -2), q, hid.transpose(-1, -2)) if ctx.needs_input_grad[1] else None
        return dq, dk, None


def hidden_matmul(A, B, zero):
    """Differentiable :func:`zmm`."""
    return _ZeroAwareMatmul.apply(A, B, zero)


def hidden_scores(q, k, holder):
    """Differentiable ``q @ kᵀ`` whose gradients skip ``holder["hidden"]`` pairs."""
    return _HiddenScores.apply(q, k, holder)


def _sum_to(x, shape):
    while x.dim() > len(shape):
        x = x.sum(0)
    for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)):
        if a != b:
            x = x.sum(i, keepdim=True)
    return x
