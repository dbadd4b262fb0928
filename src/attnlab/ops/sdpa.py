"""torch's ``scaled_dot_product_attention``, used where it means exactly what we mean.

SDPA's ``is_causal`` is top-left aligned (row ``i`` sees columns ``<= i``); attnlab's
``causal()`` is aligned by absolute position, so the two agree only when
``q_offset == kv_offset`` (with the defaults: ``Nq == Nk``).  A causal chunk over a
cache (``q_offset > kv_offset``, every row sees a key) goes to SDPA with an explicit
boolean mask when ``Nq·Nk`` is small (``_DENSE_CAUSAL_MAX``).  SDPA returns no LSE and
takes no score mod.  :func:`sdpa_unsupported` says why a request does not map.
SDPA's handling of NaN/inf is not attnlab's (on the CPU a NaN query row can come back as
zeros; a NaN in a hidden value poisons every row), so :func:`attnlab.attention` checks
for non-finite inputs first and hands those requests to the flash path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.masks import BlockMask, Mask, describe
from attnlab.ops.flash import refuse_double_backward

# A causal mask whose queries sit after the first key (a prefill chunk over a cache) is
# passed to SDPA as an explicit boolean (Nq, Nk) mask up to this many elements.
_DENSE_CAUSAL_MAX = 1 << 20


def _structure(mask):
    return mask.lower() if isinstance(mask, Mask) else None


def is_causal_mask(mask) -> bool:
    """Whether ``mask`` lowers to exactly ``causal()`` (the band ``(None, 0)``, nothing else)."""
    s = _structure(mask)
    return s is not None and s.fields() == {"right"} and s.right == 0


def key_keep_slice(mask, Nk, kv_offset):
    """The ``(B, Nk)`` keep slice of a mask that lowers to exactly ``key_padding(keep)``, else None."""
    s = _structure(mask)
    if s is None or s.fields() != {"key_keep"}:
        return None
    return s.key_keep[:, kv_offset : kv_offset + Nk]


def sdpa_unsupported(q, k, mask, score_mod, q_offset, kv_offset, return_lse) -> str | None:
    """``None`` if the request maps onto SDPA exactly, else the reason it does not.

    (Empty problems, ``Nq = 0`` or ``Nk = 0``, are answered before any backend runs.)"""
    if score_mod is not None:
        return "SDPA takes no score_mod"
    if return_lse:
        return "SDPA returns no LSE"
    keep = None if mask is None else key_keep_slice(mask, k.shape[2], kv_offset)
    if keep is not None:  # key padding: a (B,1,1,Nk) bool mask
        if torch.compiler.is_compiling():
            return "under torch.compile the check for sequences with no visible key would break the graph"
        if not bool(keep.any(-1).all()):
            return "a sequence with no visible key: SDPA would give NaN where attnlab gives zeros"
        return None
    if mask is not None:
        if not is_causal_mask(mask):
            return f"SDPA maps only no mask, causal() or key_padding(), got {describe(mask)}"
        if q_offset < kv_offset:
            return (
                f"with q_offset {q_offset} < kv_offset {kv_offset} the first rows see no key; SDPA would give "
                "NaN where attnlab gives zeros"
            )
        if q_offset != kv_offset and q.shape[2] * k.shape[2] > _DENSE_CAUSAL_MAX:
            return (
                f"SDPA's is_causal is top-left aligned; attnlab's causal() matches it only when "
                f"q_offset == kv_offset (here {q_offset} vs {kv_offset}; Nq={q.shape[2]}, Nk={k.shape[2]}), "
                f"or as a dense mask of at most {_DENSE_CAUSAL_MAX} elements"
            )
    return None


def sdpa_attention(q, k, v, *, mask=None, scale, **_):
    """Run SDPA; inputs validated and :func:`sdpa_unsupported` already checked.  Where torch
    picks a fused kernel, a second derivative raises :class:`attnlab.ops.flash.DoubleBackwardError`
    naming ``backend='reference'`` (:func:`_refuse_fused_double_backward`)."""
    gqa = q.shape[1] != k.shape[1]
    keep = None if mask is None else key_keep_slice(mask, k.shape[2], _.get("kv_offset", 0))
    if keep is not None:
        keep = keep.view(q.shape[0], 1, 1, k.shape[2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
        return _refuse_fused_double_backward(out, q, k, v)
    q_offset, kv_offset = _["q_offset"], _.get("kv_offset", 0)
    if mask is not None and q_offset != kv_offset:  # bottom-right causal: explicit mask
        qp = torch.arange(q.shape[2], device=q.device).view(-1, 1) + q_offset
        kp = torch.arange(k.shape[2], device=q.device).view(1, -1) + kv_offset
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=kp <= qp, scale=scale, enable_gqa=gqa)
        return _refuse_fused_double_backward(out, q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None, scale=scale, enable_gqa=gqa)
    return _refuse_fused_double_backward(out, q, k, v)


def _refuse_fused_double_backward(out, q, k, v):
    """``out``, with torch's fused SDPA backward (not differentiable: torch says "derivative
    for ..._backward is not implemented") marked so that a second derivative raises attnlab's
    :class:`~attnlab.ops.flash.DoubleBackwardError` naming ``backend='reference'``.  A post-hook
    on the SDPA node passes its gradients through :func:`~attnlab.ops.flash.refuse_double_backward`,
    which acts only when a graph is recorded (``create_graph=True``).  The math kernel
    (differentiable twice) and compiled code are left alone."""
    node = out.grad_fn
    if node is None or torch.compiler.is_compiling() or not type(node).__name__.startswith("ScaledDotProduct"):
        return out

    def hook(grad_inputs, grad_outputs):
        if not torch.is_grad_enabled():
            return None
        live = [g for g in grad_inputs if g is not None]
        return tuple(refuse_double_backward("sdpa backend (torch's fused kernel)", live, list(grad_inputs)))

    node.register_hook(hook)
    return out


def sdpa_dense_mask(q, k, v, mask, *, scale, q_offset, kv_offset):
    """SDPA with ``mask`` evaluated on the whole (small) problem as a boolean tensor, or
    ``None`` when some row would see no key (SDPA would give NaN there)."""
    from attnlab.ops.reference import index_grids

    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    pred = mask.mask if isinstance(mask, BlockMask) else mask  # a BlockMask: its predicate
    allowed = torch.as_tensor(pred(*index_grids(B, H, Nq, Nk, q_offset, kv_offset, q.device)), device=q.device)
    if not bool(allowed.any(-1).all()):
        return None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
