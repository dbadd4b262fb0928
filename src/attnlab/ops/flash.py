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
so gradients reach its parameters, declared or captured (:mod:`attnlab.ops.modparams`).

Non-finite inputs (:mod:`attnlab.ops.finite`): a q-block whose result is not finite is
recomputed *careful* — hidden entries (final score ``-inf``) are exact zeros in every
product (``zmm``), so a NaN in a key or value the row cannot see has no effect — and so
is a backward whose gradients are not finite.  The all-finite path pays one check of
its output per q-block and of its gradients per call.  The fused fast path runs only
while ``|scale·q·k| <= FUSED_MAX`` (huge scales take the exact path).

The pieces shared with the other tiled passes (the tile plan, the score/mask/mod tile,
the LSE merge step) are :mod:`attnlab.ops.tiling`; this module is the forward and
backward loops and their ``autograd.Function``.
"""

from __future__ import annotations

import torch

from attnlab.masks import BlockMask
from attnlab.ops.finite import all_finite, zmm
from attnlab.ops.modparams import score_mod_params
from attnlab.ops.reference import acc_dtype
from attnlab.ops.tiles import choose_tiles
from attnlab.ops.tiling import (
    FUSED_MAX,
    LOG2E,
    NEG_INF,
    TileProblem,
    drop_tile,
    exp_shifted_fast,
    fast_tile,
    finish,
    fused_ok,
    mm_dtype,
    pick_block_mask,
    prepare,
    rescale,
    rows,
    score_dtype,
    score_tile,
)

__all__ = [
    "flash_attention",
    "flash_forward",
    "flash_backward",
    "make_problem",
    "tiled_function",
    "refuse_double_backward",
    "DoubleBackwardError",
    "DOUBLE_BACKWARD",
    "FUSED_MAX",
    "LOG2E",
]


def _forward_row(pb, i, qf, kT, vf, outf, lsef, b, h, Nq, Nk, acc, mmd, B, H, careful=False):
    """One q-block row of the forward: online softmax over its visited kv-blocks.

    A non-finite result (``0·NaN`` from a hidden key's value, or a visible NaN) makes the
    row run again ``careful``: ``P·V`` skips the hidden entries exactly (:func:`zmm`)."""
    BH, G = qf.shape[0] * qf.shape[1], qf.shape[2]
    Dv = vf.shape[-1]
    row = pb.plan[i]
    qs, qe = pb.q_block(i, Nq)
    n = qe - qs
    if not row:
        outf[:, :, qs:qe] = 0
        lsef[:, :, qs:qe] = NEG_INF
        return
    dev = qf.device
    Qi = rows(qf, qs, qe, score_dtype(mmd))  # S = QKᵀ in float32 for bf16/fp16 (kT is upcast)
    m = torch.full((BH, G * n, 1), NEG_INF, dtype=acc, device=dev)
    l = torch.zeros((BH, G * n, 1), dtype=acc, device=dev)
    o = torch.zeros((BH, G * n, Dv), dtype=acc, device=dev)
    for j, needs_mask in row:
        ks, ke = pb.kv_block(j, Nk)
        S = torch.bmm(Qi, kT[:, :, ks:ke])
        X = S.to(acc) if S.dtype != acc else S
        hidden = None
        if fast_tile(pb, needs_mask):
            m_new, m_safe, alpha = rescale(m, X.amax(-1, keepdim=True).mul_(pb.scale))
            P = exp_shifted_fast(pb, X, m_safe)
        else:
            X, _, _ = score_tile(pb, X, b, h, qs, qe, ks, ke, needs_mask, acc, B, H, careful=careful)
            if careful:
                hidden = X == NEG_INF
            m_new, m_safe, alpha = rescale(m, X.amax(-1, keepdim=True))
            P = X.sub_(m_safe).mul_(LOG2E).exp2_()
        l.mul_(alpha).add_(P.sum(-1, keepdim=True))  # the LSE is of the undropped probabilities
        if pb.dropout is not None:
            P.mul_(drop_tile(pb, B, H, qs, qe, ks, ke, acc, P.shape, dev))
        Vj = vf[:, ks:ke]
        o.mul_(alpha).add_(torch.bmm(P.to(mmd), Vj) if hidden is None else zmm(P.to(mmd), Vj, hidden).to(acc))
        m = m_new
    if not careful and not bool(torch.isfinite(o).all()):
        return _forward_row(pb, i, qf, kT, vf, outf, lsef, b, h, Nq, Nk, acc, mmd, B, H, careful=True)
    _, l_safe, lse_i = finish(m, l)
    outf[:, :, qs:qe] = (o / l_safe).view(BH, G, n, Dv).to(outf.dtype)
    lsef[:, :, qs:qe] = lse_i.view(BH, G, n)


def _forward(pb: TileProblem, q, k, v):
    B, H, Nq, _D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    BH = B * Hkv
    acc = acc_dtype(q.dtype)
    mmd = mm_dtype(q.dtype, q.device)
    qf, _, kT, vf = prepare(q, k, v, mmd)
    kT = kT.to(score_dtype(mmd))
    out = torch.empty(B, H, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=acc, device=q.device)
    outf, lsef = out.view(BH, G, Nq, Dv), lse.view(BH, G, Nq)
    b, h = pb.grids(B, H, q.device)
    for i in range(len(pb.plan)):
        _forward_row(pb, i, qf, kT, vf, outf, lsef, b, h, Nq, Nk, acc, mmd, B, H)
    return out, lse


def _backward(pb: TileProblem, q, k, v, out, lse, dout, dlse, params, careful=False):
    """The tiled backward; a non-finite gradient makes it run again ``careful``: hidden
    entries of P and dS are exact zeros in every product (:func:`zmm`)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    BH = B * Hkv
    acc = acc_dtype(q.dtype)
    mmd = mm_dtype(q.dtype, q.device)
    qf, kf, kT, vf = prepare(q, k, v, mmd)
    sdt = score_dtype(mmd)  # S and dP in float32 for bf16/fp16: their operands upcast once
    kTs = kT.to(sdt)
    vT = vf.transpose(1, 2).to(sdt).contiguous()
    dof = dout.unflatten(1, (Hkv, G))
    # Δ = rowsum(dO ∘ O) − dLSE, per query row
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    deltaf, lsef = delta.reshape(BH, G, Nq), lse.reshape(BH, G, Nq)
    dq = torch.zeros(BH, G, Nq, D, dtype=acc, device=q.device)
    dk = torch.zeros(BH, Nk, D, dtype=acc, device=q.device)
    dv = torch.zeros(BH, Nk, Dv, dtype=acc, device=q.device)
    dparams = [torch.zeros_like(p) for p in params]
    b, h = pb.grids(B, H, q.device)
    for i, row in enumerate(pb.plan):
        if not row:
            continue
        qs, qe = pb.q_block(i, Nq)
        n = qe - qs
        Qi, dOi = rows(qf, qs, qe, mmd), rows(dof, qs, qe, mmd)
        Qs, dOs = Qi.to(sdt), dOi.to(sdt)
        L = lsef[:, :, qs:qe].reshape(BH, G * n, 1)
        L_safe = L.masked_fill(L == NEG_INF, 0.0)
        Di = deltaf[:, :, qs:qe].reshape(BH, G * n, 1)
        dQi = torch.zeros(BH, G * n, D, dtype=acc, device=q.device)
        for j, needs_mask in row:
            ks, ke = pb.kv_block(j, Nk)
            S = torch.bmm(Qs, kTs[:, :, ks:ke])
            X = S.to(acc) if S.dtype != acc else S
            leaf = hidden = None
            if fast_tile(pb, needs_mask):
                P = exp_shifted_fast(pb, X, L_safe)
            else:
                X, leaf, mod_out = score_tile(
                    pb,
                    X,
                    b,
                    h,
                    qs,
                    qe,
                    ks,
                    ke,
                    needs_mask,
                    acc,
                    B,
                    H,
                    with_grad=pb.score_mod is not None,
                    careful=careful,
                )
                if careful:
                    hidden = X == NEG_INF
                P = X.sub_(L_safe).mul_(LOG2E).exp2_()
            Zs = Pv = None
            if pb.dropout is not None:  # out = (P∘Zs)V: dV = (P∘Zs)ᵀdO, dP = Zs∘(dO Vᵀ), Δ unchanged
                Zs = drop_tile(pb, B, H, qs, qe, ks, ke, acc, P.shape, q.device)
                Pv = P * Zs
            Pv = P if Pv is None else Pv
            if hidden is None:
                dv[:, ks:ke] += torch.bmm(Pv.to(mmd).transpose(1, 2), dOi)
            else:
                dv[:, ks:ke] += zmm(Pv.to(mmd).transpose(1, 2), dOi, hidden.transpose(1, 2))
            dP = torch.bmm(dOs, vT[:, :, ks:ke]).to(acc)
            if Zs is not None:
                dP = dP.mul_(Zs)
            dS = P.mul_(dP.sub_(Di))  # P is dead after this: reuse its storage
            if hidden is not None:
                dS.masked_fill_(hidden, 0.0)
            if leaf is not None:
                dS = _mod_backward(mod_out, leaf, params, dparams, dS)
                if hidden is not None:
                    dS.masked_fill_(hidden, 0.0)
            dSm = dS.mul_(pb.scale).to(mmd)
            if hidden is None:
                dQi += torch.bmm(dSm, kf[:, ks:ke])
                dk[:, ks:ke] += torch.bmm(dSm.transpose(1, 2), Qi)
            else:
                dQi += zmm(dSm, kf[:, ks:ke], hidden)
                dk[:, ks:ke] += zmm(dSm.transpose(1, 2), Qi, hidden.transpose(1, 2))
        dq[:, :, qs:qe] = dQi.view(BH, G, n, D)
    if not careful and not all_finite(dq, dk, dv, *dparams):
        return _backward(pb, q, k, v, out, lse, dout, dlse, params, careful=True)
    return (
        dq.view(B, H, Nq, D).to(q.dtype),
        dk.view(B, Hkv, Nk, D).to(k.dtype),
        dv.view(B, Hkv, Nk, Dv).to(v.dtype),
        dparams,
    )


def _mod_backward(mod_out, leaf, params, dparams, dS):
    """dL/d(scaled score) from dL/d(modded score) ``dS`` through the tile's mod graph;
    the params' gradients are added to ``dparams``.  A mod whose output does not depend
    on its input (or on anything requiring grad) passes no gradient: zeros."""
    if not mod_out.requires_grad:
        return torch.zeros_like(dS)
    grads = torch.autograd.grad(mod_out, [leaf, *params], dS.view(mod_out.shape), allow_unused=True)
    for t, g in zip(dparams, grads[1:], strict=True):
        if g is not None:
            t += g
    return torch.zeros_like(dS) if grads[0] is None else grads[0].reshape(dS.shape)


class DoubleBackwardError(RuntimeError):
    """A second derivative through a tiled kernel (flash, triton) was asked for."""


DOUBLE_BACKWARD = (
    "attnlab {}: double backward (create_graph=True, gradgradcheck, grad of grad) is not "
    "implemented by the tiled kernel; use backend='reference' (materialized, differentiable any "
    "number of times) for second derivatives"
)


class _NoDoubleBackward(torch.autograd.Function):
    """Passes a backward's gradients through and refuses to be differentiated: a second
    derivative would otherwise be silently wrong (the tiled backward is not differentiable).
    ``anchors`` (tensors requiring grad) give the node a place in the graph."""

    generate_vmap_rule = True

    @staticmethod
    def forward(name, n_anchors, *ts):
        return tuple(t.view_as(t) for t in ts[n_anchors:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.name = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise DoubleBackwardError(DOUBLE_BACKWARD.format(ctx.name))


def refuse_double_backward(name, anchors, grads):
    """``grads`` unchanged, but marked so that differentiating them raises
    :class:`DoubleBackwardError` naming ``backend='reference'`` (only when a graph is being
    recorded: ``create_graph=True`` or a torch.func transform)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():  # (compiled backwards are never
        return grads  # differentiated again: torch refuses)
    anchors = [t for t in anchors if t is not None and t.requires_grad]
    live = [i for i, g in enumerate(grads) if g is not None]
    if not anchors or not live:
        return grads
    out = list(grads)
    for i, g in zip(
        live, _NoDoubleBackward.apply(name, len(anchors), *anchors, *(grads[i] for i in live)), strict=False
    ):
        out[i] = g
    return out


def tiled_function(fwd, bwd, name: str) -> type[torch.autograd.Function]:
    """The autograd.Function of a tiled kernel pair: ``fwd(pb, q, k, v, *params) -> (out, lse)`` and
    ``bwd(pb, q, k, v, out, lse, dout, dlse, params) -> (dq, dk, dv, dparams)``, where
    ``pb`` is the kernel's plan and ``params`` the score mod's learnable tensors.  The
    gradient reaches the LSE too; only ``out, lse`` are saved (no score matrix)."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(pb, q, k, v, *params):
            return fwd(pb, q, k, v, *params)  # params: what a kernel reads must come from its inputs (torch.func)

        @staticmethod
        def setup_context(ctx, inputs, output):  # separate from forward: torch.func transforms need it
            pb, q, k, v, *params = inputs
            ctx.pb = pb
            ctx.save_for_backward(q, k, v, *output, *params)

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, *params = ctx.saved_tensors
            if dout is None:
                dout = torch.zeros_like(out)
            with torch.no_grad():
                dq, dk, dv, dparams = bwd(ctx.pb, q, k, v, out, lse, dout, dlse, params)
            grads = refuse_double_backward(name, (q, k, v, dout, dlse, *params), [dq, dk, dv, *dparams])
            return (None, *grads)

        @staticmethod
        def vmap(info, in_dims, pb, q, k, v, *params):
            """A loop over the mapped dimension (masks read the batch index b)."""
            outs = []
            for i in range(info.batch_size):
                sl = [t if d is None else t.select(d, i) for t, d in zip((q, k, v, *params), in_dims[1:], strict=True)]
                outs.append(Fn.apply(pb, *sl))
            return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)

    Fn.__name__ = Fn.__qualname__ = name
    return Fn


_FlashFn = tiled_function(lambda pb, q, k, v, *params: _forward(pb, q, k, v), _backward, "_FlashFn")
flash_forward, flash_backward = _forward, _backward  # the kernel pair, for backends that fall back on it


def flash_attention(q, k, v, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0, block=None, dropout=None):
    """Tiled attention, forward and backward.  Returns ``(out, lse)``; inputs already validated.

    ``mask`` is an attnlab Mask, a BlockMask built for this shape, or None.  ``block``
    overrides the measured tile sizes ``(block_q, block_k)`` (a BlockMask's own
    sizes win).  ``dropout`` (an :class:`attnlab.ops.dropout.Dropout` or None): each
    visited tile's keep-mask is regenerated from its counters, forward and backward.
    """
    pb, params = make_problem(
        q,
        k,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        q_offset=q_offset,
        kv_offset=kv_offset,
        block=block,
        dropout=dropout,
    )
    return _FlashFn.apply(pb, q, k, v, *params)


def make_problem(q, k, *, mask, score_mod, scale, q_offset, kv_offset, block=None, params=None, dropout=None):
    """The flash kernel's plan and the score mod's tensors requiring grad (``params``
    given: used as they are).  Other kernels fall back on it (the Triton backend, for
    non-finite inputs)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if isinstance(mask, BlockMask):
        block_mask = mask
        block = (mask.block_q, mask.block_k)
    elif mask is not None and Nq > 0 and Nk > 0:
        block_mask = pick_block_mask(mask, q.dtype, B, H, Nq, Nk, D, q_offset, kv_offset, block, q.device)
        block = (block_mask.block_q, block_mask.block_k)
    else:
        block_mask = None
        block = block or choose_tiles(q.dtype, D, B * H, q.device)
    if params is not None:
        pass
    elif score_mod is not None and torch.is_grad_enabled():
        # declared (mod.parameters()) or captured (closure, bound self, module, partial):
        # every tensor requiring grad that the mod reads must be an input of the Function
        params = score_mod_params(
            score_mod, dtype=acc_dtype(q.dtype), device=q.device, q_offset=q_offset, kv_offset=kv_offset
        )
    else:
        params = []
    pb = TileProblem(block_mask, score_mod, scale, q_offset, kv_offset, Nq, Nk, *block)
    pb.fused_ok = fused_ok(q, k, scale)
    pb.dropout = dropout
    if score_mod is not None and torch.is_grad_enabled():
        pb.check_graph = params
    return pb, params
