"""The calling conventions of flash-attn, FlexAttention and torch SDPA, mapped onto
attnlab's one contract before a backend runs (see docs/conventions.md).

:func:`attention` hands a call here when it uses one of them:

* ``layout="bnhd"``: q/k/v are ``(B, N, H, D)`` (flash-attn's); they are transposed
  as views (no copy) and the output comes back ``(B, Nq, H, Dv)`` (a view of the
  kernel's result); the LSE stays ``(B, H, Nq)`` as flash-attn returns it.
* ``mask=tensor``: bool (True = attend) becomes :func:`attnlab.masks.dense`; float is
  an additive mask, :func:`attnlab.scores.bias` (plus a dense mask of its ``-inf``
  entries so that empty tiles are skipped).  Both broadcast to ``(B, H, Nq, Nk)`` and are
  indexed by query row and key column (SDPA's ``attn_mask``).
* K/V with batch 1 under a query batch ``B``: expanded as stride-0 views.
* ``scale`` a tensor (0-d; learnable when it requires grad): applied as the first score
  mod, so the gradient reaches it.
* ``q_offset`` a ``(B,)`` int tensor: per-batch query positions (ragged decoding);
  masks and score mods see ``q_offset[b] + i``.
"""

from __future__ import annotations

import torch

LAYOUTS = ("bhnd", "bnhd")


def is_tensor_arg(x) -> bool:
    return isinstance(x, torch.Tensor)


def wants_conventions(q, k, mask, scale, q_offset, layout) -> bool:
    """True when the call uses a convention that :func:`apply` maps first."""
    if layout != "bhnd" or is_tensor_arg(mask) or is_tensor_arg(scale) or is_tensor_arg(q_offset):
        return True
    return (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and q.dim() == 4
        and k.dim() == 4
        and k.shape[0] == 1
        and q.shape[0] > 1
    )


def _layout_arg(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhnd' (B, H, N, D) or 'bnhd' (B, N, H, D, flash-attn's), got {layout!r}")
    return layout


def apply(
    attention,
    q,
    k,
    v,
    *,
    mask,
    score_mod,
    scale,
    q_offset,
    kv_offset,
    return_lse,
    backend,
    layout,
    dropout_p=0.0,
    dropout_seed=None,
):
    """Map the conventions onto a plain call of ``attention`` and map its result back."""
    from attnlab import scores  # here, not at import: attnlab.masks imports attnlab.ops
    from attnlab.masks import Mask, check_dense, dense, per_batch_q_offset

    layout = _layout_arg(layout)
    if layout == "bnhd":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(
                    f"{name}: layout='bnhd' expects 4 dims (B, N, H, D), got "
                    f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views: no copy
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        # let attention() word the error
        return attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=return_lse,
            backend=backend,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
        )
    B, H, Nq, _ = q.shape
    if k.shape[0] == 1 and v.shape[0] == 1 and B > 1:
        k, v = k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])  # K/V shared by the batch: views
    Nk = k.shape[2]
    mods = []
    if is_tensor_arg(scale):
        s = scale
        if s.numel() != 1 or not s.dtype.is_floating_point:
            raise ValueError(f"scale: a tensor scale must be one float value (0-d), got {s.dtype} {tuple(s.shape)}")
        s = s.reshape(())
        mods.append(scores.custom(lambda x, b, h, qp, kp, s=s: x * s.to(x.dtype), params=[s]))
        scale = 1.0
    base_mask, ko = mask, kv_offset
    if is_tensor_arg(q_offset):
        qo = _q_offsets(q_offset, B)
        kernel_qo = 0
        if isinstance(base_mask, Mask):
            base_mask = per_batch_q_offset(base_mask, qo)
        if score_mod is not None:
            score_mod = _shifted_mod(score_mod, qo)
    else:
        kernel_qo = q_offset
    if score_mod is not None:
        mods.append(score_mod if isinstance(score_mod, scores.ScoreMod) else scores.custom(score_mod))
    if is_tensor_arg(mask):
        qo_int = (ko if isinstance(ko, int) else 0) + Nk - Nq if kernel_qo is None else kernel_qo
        t = check_dense(mask, B, H, Nq, Nk)
        if t.dtype == torch.bool:
            base_mask = dense(t, q_offset=qo_int, kv_offset=ko)
        elif t.dtype.is_floating_point:
            mods.append(scores.bias(t, q_offset=qo_int, kv_offset=ko))
            ninf = torch.isneginf(t.detach())
            # traced (torch.compile): no data-dependent branch and no masks.dense (its lookup does not
            # trace); the -inf entries are scores of -inf in the kernel, which hides them exactly
            # (fully hidden rows: out 0, LSE -inf), only without skipping their tiles
            if torch.compiler.is_compiling() or not bool(ninf.any()):
                base_mask = None
            else:
                base_mask = dense(~ninf, q_offset=qo_int, kv_offset=ko)
        else:
            raise TypeError(f"mask: a tensor mask must be bool (True = attend) or float (additive), got {t.dtype}")
    mod = None if not mods else mods[0] if len(mods) == 1 else scores.compose(*mods)
    res = attention(
        q,
        k,
        v,
        mask=base_mask,
        score_mod=mod,
        scale=scale,
        q_offset=kernel_qo,
        kv_offset=kv_offset,
        return_lse=return_lse,
        backend=backend,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    if layout == "bnhd":
        if return_lse:
            return res[0].transpose(1, 2), res[1]
        return res.transpose(1, 2)
    return res


def _q_offsets(q_offset, B):
    t = q_offset
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != 1 or t.shape[0] != B:
        raise ValueError(
            f"q_offset: a tensor q_offset must be (B,)={B} integers (per-batch query positions), "
            f"got {t.dtype} {tuple(t.shape)}"
        )
    return t.to(torch.long)


def _shifted_mod(mod, qo):
    from attnlab import scores

    def shifted(score, b, h, q, kv):
        return mod(score, b, h, q + qo.to(q.device).view(-1, 1, 1, 1), kv)

    params = mod.parameters() if isinstance(mod, scores.ScoreMod) else []
    out = scores.custom(shifted, params=params)
    if hasattr(mod, "validate"):
        out.validate = mod.validate  # type: ignore[method-assign]  # the shifted mod checks shapes as the wrapped one does
    return out
