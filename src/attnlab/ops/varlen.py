"""Variable-length (packed) attention in flash-attn's form: ``flash_attn_varlen_func``.

Shapes (flash-attn's)::

    q    (total_q, H,   D)      the sequences packed one after another, no padding
    k    (total_k, Hkv, D)      H % Hkv == 0 (GQA)
    v    (total_k, Hkv, Dv)
    cu_seqlens_q, cu_seqlens_k  (num_seqs + 1,) int: sequence s is rows cu[s]:cu[s+1]
    out  (total_q, H, Dv)
    lse  (H, total_q)           float32, natural log (flash-attn's softmax_lse layout)

It runs as one ``B = 1`` problem over the packed tokens with the block-skipping mask
:func:`attnlab.masks.varlen` (tiles across two sequences are never computed; nothing
is padded), forward and backward, on the ``flash`` (default), ``native`` (the C++ CPU
kernel, which reads the mask's per-sequence positions and ids itself: :mod:`attnlab.ops.native`)
or ``reference`` backend.
On ``flash`` the tiles are classified exactly and sized for the packed problem, and the
map is cached by ``cu_seqlens`` (:mod:`attnlab.ops.varlen_tiles`), so the layers of a
model reuse it.
Positions are per sequence and bottom-right aligned, as in flash-attn: with
``causal=True`` the last query of a sequence sees every key of it.
"""

from __future__ import annotations

import torch

from attnlab import masks, scores
from attnlab.masks import varlen as varlen_mask
from attnlab.ops.dispatch import attention
from attnlab.ops.dropout import check_dropout
from attnlab.ops.varlen_tiles import varlen_block_mask
from attnlab.validate import integer


class _LocalPositions(scores.ScoreMod):
    """Runs ``inner`` on per-sequence positions (and the sequence index as ``b``)."""

    def __init__(self, inner, vmask):
        self.inner, self.vmask = inner, vmask

    def apply(self, score, b, h, q, kv):
        seq, ql, kl = self.vmask.local_positions(q, kv)
        return self.inner(score, seq, h, ql, kl)

    def parameters(self):
        return self.inner.parameters()

    def __repr__(self):
        return f"{self.inner!r} on per-sequence positions"


def _max_seqlen(x, name, cu):
    lens = cu[1:] - cu[:-1]
    actual = int(lens.max()) if lens.numel() else 0
    if x is None:
        return actual
    x = integer(x, name, hi=None, type_error=TypeError)
    if int(x) < actual:
        raise ValueError(
            f"{name}={int(x)} is shorter than the longest sequence ({actual}); flash-attn would "
            "read past it, attnlab refuses"
        )
    return int(x)


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    return_lse=False,
    backend="flash",
    dropout_seed=None,
):
    """flash-attn's ``flash_attn_varlen_func`` on attnlab's kernels (shapes: module doc).

    Args (flash-attn's names and meanings):
        causal: bottom-right causal within each sequence (= ``window_size=(left, 0)``).
        window_size: ``(left, right)``; ``-1`` is unbounded.  A query at local position
            ``i`` sees keys ``i - left .. i + right`` of its own sequence.  attnlab's
            ``sliding_window(w)`` is ``(w - 1, 0)``.
        softcap: ``> 0`` caps the scaled scores, ``c·tanh(s/c)``, before ALiBi (as flash-attn).
        alibi_slopes: ``(H,)`` or ``(num_seqs, H)``: adds ``-slope·|i + Lk - Lq - j|``
            (flash-attn's sign; = ``scores.alibi(slopes, symmetric=True)`` on local positions).
        softmax_scale: default ``1/sqrt(D)``.
        dropout_p: attention dropout (inverted, after the softmax; 0 in eval) with the
            counter-based RNG of :mod:`attnlab.ops.dropout` on the *packed* problem: the
            keep bit of a pair is ``hash(seed, 0, h, t_q, t_k)`` at packed token indices
            ``t_q``/``t_k``, regenerated per tile in the backward.  The keep-mask is
            ``dropout_mask(1, H, total_q, total_k, p=p, seed=seed, q_offset=0)``.
        dropout_seed: (attnlab's) an int, a ``torch.Generator``, or None: one int64 drawn
            from torch's default generator (``torch.manual_seed`` reproduces it), as in
            :func:`attnlab.attention`.
        return_attn_probs: as flash-attn, returns ``(out, lse, None)`` (attnlab does not
            materialise the probabilities); ``return_lse=True`` returns ``(out, lse)``.
        backend: ``"flash"``, ``"native"`` (the C++ CPU kernel where it runs the problem -- a
            softcap or ALiBi on per-sequence positions keeps the flash path) or ``"reference"``.
    """
    for name, t, what in (("q", q, "(total_q, H, D)"), ("k", k, "(total_k, Hkv, D)"), ("v", v, "(total_k, Hkv, Dv)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: varlen expects 3 dims {what} (packed tokens), got shape {tuple(t.shape)}")
    dropout_p, dropout_seed = check_dropout(dropout_p, dropout_seed)
    if backend not in ("flash", "native", "reference"):
        raise ValueError(f"backend: varlen_attention runs on 'flash', 'native' or 'reference', got {backend!r}")
    if causal not in (True, False):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size: expected (left, right), got {window_size!r}")
    left, right = window_size
    if causal:
        right = 0
    mask = varlen_mask(cu_seqlens_q, cu_seqlens_k, window=(left, right))
    total_q, total_k = int(mask.cu_q[-1]), int(mask.cu_k[-1])
    if q.shape[0] != total_q or k.shape[0] != total_k or v.shape[0] != total_k:
        raise ValueError(
            f"cu_seqlens_q[-1]={total_q} / cu_seqlens_k[-1]={total_k} must equal the packed lengths: "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    _max_seqlen(max_seqlen_q, "max_seqlen_q", mask.cu_q)
    _max_seqlen(max_seqlen_k, "max_seqlen_k", mask.cu_k)
    mods: list[scores.ScoreMod] = []
    alibi_mod = None
    if softcap:
        mods.append(scores.softcap(softcap))
    if alibi_slopes is not None:
        s = alibi_slopes
        if isinstance(s, torch.Tensor) and s.dim() == 2 and s.shape[0] != mask.cu_q.numel() - 1:
            raise ValueError(
                f"alibi_slopes: (num_seqs, H) slopes of shape {tuple(s.shape)} for {mask.cu_q.numel() - 1} sequences"
            )
        alibi_mod = scores.alibi(s, symmetric=True)
        mods.append(alibi_mod)
    mod = None
    if mods:
        inner = mods[0] if len(mods) == 1 else scores.compose(*mods)
        mod = _LocalPositions(inner, mask)
        if alibi_mod is not None:  # validate the slopes against H (the sequence index is b)
            sl = alibi_mod.slopes
            if sl.shape[-1] != q.shape[1]:
                raise ValueError(f"alibi_slopes: {sl.shape[-1]} slopes for H={q.shape[1]} query heads")
    kernel_mask: masks.Mask | masks.BlockMask = mask
    if backend in ("flash", "native") and total_q and total_k:  # exact tiles, sized for the packed problem
        # (native reads the mask's structure from it; its flash fallback reads the tiles)
        kernel_mask = varlen_block_mask(mask, q.shape[1], q.shape[2], q.dtype, q.device)
    res = attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        mask=kernel_mask,
        score_mod=mod,
        scale=softmax_scale,
        q_offset=0,
        kv_offset=0,
        return_lse=True,
        backend=backend,
        layout="bnhd",
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    out, lse = res[0][0], res[1][0]
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


flash_attn_varlen_func = varlen_attention  # the peer's name, for drop-in code

__all__ = ["varlen_attention", "flash_attn_varlen_func"]
