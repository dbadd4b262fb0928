"""One argument normaliser for every attention entry point.

:func:`normalize` checks what :func:`attnlab.attention`, :func:`attnlab.attention_probs`,
:func:`attnlab.interp.stats.head_stats`, ring/Ulysses attention
(:mod:`attnlab.distributed`) and the linear/additive ops (:mod:`attnlab.ops.linear`,
:mod:`attnlab.ops.additive`) share — q/k/v, scale, offsets, the mask and the score mod —
once, with one wording, and returns a :class:`Problem`::

    q (B, H, Nq, D)      H % Hkv == 0 (GQA); query head h reads kv head h // (H // Hkv)
    k (B, Hkv, Nk, D)    D as q's (same_head_dim=False: additive attention projects q and k)
    v (B, Hkv, Nk, Dv)   (B, Hkv, Nk) as k's; Dv may differ

    scale     default 1/sqrt(D); a finite non-zero number
    kv_offset an int (default 0): key column j sits at position kv_offset + j
    q_offset  an int, default kv_offset + Nk - Nq (bottom-right): query row i at q_offset + i

The checks on single values come from :mod:`attnlab.validate`; the mask and the score
mod validate themselves against the problem (``mask.validate(B, H, Nq, Nk, q_offset,
kv_offset)``, ``score_mod.validate(B, H)``).  Each op keeps its own further checks
(backends, dropout, feature maps, weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab import validate
from attnlab.masks import BlockMask

__all__ = [
    "Problem",
    "normalize",
    "check_qkv",
    "scale_arg",
    "offsets",
    "check_mask",
    "check_score_mod",
    "LAYOUT",
    "BNHD_HINT",
]

LAYOUT = {"q": "(B, H, Nq, D)", "k": "(B, Hkv, Nk, D)", "v": "(B, Hkv, Nk, Dv)"}
BNHD_HINT = (
    "; attnlab reads q/k/v as (B, H, N, D) (heads before tokens): flash-attn's (B, N, H, D) tensors need layout='bnhd'"
)


@dataclass(frozen=True)
class Problem:
    """A validated attention call: the tensors, their sizes, and the normalised arguments."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    B: int
    H: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    Dv: int
    scale: float
    q_offset: int
    kv_offset: int
    mask: object = None
    score_mod: object = None


def check_qkv(
    q,
    k,
    v,
    *,
    layout: dict | None = None,
    same_head_dim: bool = True,
    shared_kv_batch: bool = False,
    positive_head_dim: bool = True,
) -> None:
    """q, k, v are 4-D float tensors of one dtype on one device whose shapes fit together:
    one batch size, k and v the same ``(B, Hkv, Nk)``, ``H % Hkv == 0`` (GQA), and (with
    ``same_head_dim``) one head dim for q and k, ``D >= 1`` (with ``positive_head_dim``).  ``layout`` names the dims in
    the messages; ``shared_kv_batch`` says in the batch message that k/v may have batch 1
    (:func:`attnlab.attention` broadcasts it)."""
    layout = layout or LAYOUT
    for name, t in (("q", q), ("k", k), ("v", v)):
        validate.tensor(t, name)
        validate.ndim(t, name, 4, layout[name])
        validate.float_dtype(t, name)
    validate.same_dtype(q=q, k=k, v=v)
    validate.same_device(q=q, k=k, v=v)

    def shapes() -> str:  # for the messages only (formatting it on every call cost ~2 us)
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"

    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"batch sizes differ: {shapes()}"
            + (" (k/v may also have batch 1, shared by the batch)" if shared_kv_batch else "")
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same (B, Hkv, Nk): {shapes()}{BNHD_HINT}")
    validate.gqa_heads(q.shape[1], k.shape[1], lambda: f"{shapes()}{BNHD_HINT}")
    if same_head_dim and q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head dims differ (D={q.shape[3]} vs {k.shape[3]}): {shapes()}")
    if positive_head_dim and q.shape[3] == 0:
        raise ValueError(f"head dim D must be >= 1: {shapes()}")


def scale_arg(scale, D: int) -> float:
    """``scale`` as a float; ``None`` gives the default ``1/sqrt(D)``."""
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0  # (D = 0 only where an op allows it: additive, linear)
    return validate.nonzero_real(scale, "scale")


def offsets(q_offset, kv_offset, Nq: int, Nk: int) -> tuple[int, int]:
    """``(q_offset, kv_offset)`` as ints; ``q_offset=None`` gives ``kv_offset + Nk - Nq``."""
    kv_offset = validate.integer(kv_offset, "kv_offset", hi=None, type_error=TypeError)
    q_offset = (
        kv_offset + Nk - Nq
        if q_offset is None
        else validate.integer(q_offset, "q_offset", hi=None, type_error=TypeError)
    )
    return q_offset, kv_offset


def check_mask(mask, B, H, Nq, Nk, q_offset, kv_offset) -> None:
    """``mask`` is None, a BlockMask built for this problem, or an attnlab mask that accepts it."""
    if mask is None:
        return
    if isinstance(mask, BlockMask):
        mask.check_shape(B, H, Nq, Nk, q_offset, kv_offset)
        return
    if not (hasattr(mask, "block_mask") and hasattr(mask, "predicate")):
        raise TypeError(
            f"mask: expected an attnlab mask (attnlab.masks.causal(), ..., or masks.custom(fn)) "
            f"or a BlockMask, got {type(mask).__name__}"
        )
    mask.validate(B, H, Nq, Nk, q_offset, kv_offset)


def check_score_mod(score_mod, B, H) -> None:
    """``score_mod`` is None or a callable ``(score, b, h, q_pos, kv_pos) -> score`` that
    accepts ``B`` batches of ``H`` heads (its ``validate(B, H)``, where it has one)."""
    if score_mod is not None:
        if not callable(score_mod):
            raise TypeError(
                f"score_mod: expected a callable (score, b, h, q_pos, kv_pos) -> score, got {type(score_mod).__name__}"
            )
        if hasattr(score_mod, "validate"):
            score_mod.validate(B, H)


def normalize(
    q,
    k,
    v=None,
    *,
    mask=None,
    score_mod=None,
    scale=None,
    q_offset=None,
    kv_offset=0,
    layout: dict | None = None,
    same_head_dim: bool = True,
    shared_kv_batch: bool = False,
    positive_head_dim: bool = True,
    check_mod: bool = True,
) -> Problem:
    """Check an attention call once and return it as a :class:`Problem`.

    ``v=None`` (a pattern or statistics: no values) checks ``k`` in its place (``Dv = D``).
    The mask is checked against the problem's absolute positions (BlockMasks: built for
    this shape and these offsets); ``check_mod=False`` leaves the score mod to the caller.
    """
    check_qkv(
        q,
        k,
        k if v is None else v,
        layout=layout,
        same_head_dim=same_head_dim,
        shared_kv_batch=shared_kv_batch,
        positive_head_dim=positive_head_dim,
    )
    v = k if v is None else v
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = scale_arg(scale, D)
    q_offset, kv_offset = offsets(q_offset, kv_offset, Nq, Nk)
    check_mask(mask, B, H, Nq, Nk, q_offset, kv_offset)
    if check_mod:
        check_score_mod(score_mod, B, H)
    return Problem(q, k, v, B, H, Hkv, Nq, Nk, D, v.shape[-1], scale, q_offset, kv_offset, mask, score_mod)
