"""``attnlab.attention``: validate once, pick a backend."""

from __future__ import annotations

import torch

from attnlab.masks import BlockMask, dense_mask
from attnlab.ops import conventions
from attnlab.ops.args import normalize
from attnlab.ops.dropout import check_dropout, make_dropout
from attnlab.ops.finite import maybe_nonfinite, traced
from attnlab.ops.flash import flash_attention
from attnlab.ops.library import flash_op, op_args
from attnlab.ops.reference import reference_attention, reference_probs
from attnlab.ops.sdpa import is_causal_mask, sdpa_attention, sdpa_dense_mask, sdpa_unsupported

BACKENDS = ("auto", "reference", "flash", "sdpa", "triton", "native")


def attention(
    q,
    k,
    v,
    *,
    mask=None,
    score_mod=None,
    scale=None,
    q_offset=None,
    kv_offset=0,
    return_lse=False,
    backend="auto",
    dropout_p=0.0,
    dropout_seed=None,
    layout="bhnd",
):
    """Scaled dot-product attention: ``softmax(scale·q kᵀ + score_mod, masked) v``.

    Shapes::

        q   (B, H,   Nq, D)        H % Hkv == 0; query head h reads kv head h // (H // Hkv)
        k   (B, Hkv, Nk, D)        (GQA; MQA is Hkv = 1).  K/V are never repeated per head
        v   (B, Hkv, Nk, Dv)       on the flash path.  Dv may differ from D.
        out (B, H,   Nq, Dv)       dtype of q
        lse (B, H,   Nq)           natural log, float32 (float64 for float64 inputs)

    Positions (what masks and score mods see) are absolute::

        query row i   -> q_pos  = q_offset + i,  q_offset defaults to kv_offset + Nk - Nq
        key column j  -> kv_pos = kv_offset + j

    so by default the queries are the *newest* tokens (bottom-right), which is what
    decoding over a KV cache needs.  causal() with Nq=2 over Nk=4::

               kv_pos: 0 1 2 3
        row 0 (q_pos 2) x x x .        x = may attend (mask polarity: True = attend)
        row 1 (q_pos 3) x x x x

    (torch SDPA's ``is_causal`` is top-left: row 0 would see only column 0.)  Pass
    ``q_offset=0`` for top-left.

    Args:
        mask: an :mod:`attnlab.masks` mask (``causal()``, ``sliding_window(w)``, ...,
            combined with ``& | ~``) or a ``BlockMask`` built for this shape.
        score_mod: ``(score, b, h, q_pos, kv_pos) -> score`` applied to the scaled score
            before masking (:mod:`attnlab.scores`).
        scale: default ``1/sqrt(D)``.
        return_lse: also return the log-sum-exp of each row's scaled, modded, masked
            scores.  A row with no visible key gives ``out = 0``, ``lse = -inf`` and zero
            gradients, never NaN.
        dropout_p: drop attention probabilities with this probability after the softmax
            and scale the kept ones by ``1/(1 − p)`` (inverted dropout; the op has no
            train/eval state: pass 0 in eval, which is exactly the no-dropout path).
            The keep-mask is a hash of ``(seed, b, h, q_pos, kv_pos)``
            (:mod:`attnlab.ops.dropout`): every backend and tiling gives the same mask
            and the backward regenerates it; :func:`attnlab.ops.dropout.dropout_mask`
            returns it.  The LSE stays that of the *undropped* scores; fully masked
            rows stay 0.  Runs on ``"reference"``, ``"flash"`` and ``"triton"``;
            ``"auto"`` routes it there; ``"sdpa"`` refuses it (torch's SDPA dropout
            draws a different mask, which no backward here could regenerate).
        dropout_seed: an int (same seed, same mask), a ``torch.Generator`` to draw the
            seed from, or ``None``: one int64 drawn from torch's default CPU generator,
            so ``torch.manual_seed`` makes runs reproducible and each call gets a fresh
            mask.
        layout: ``"bhnd"`` (default, the shapes above) or ``"bnhd"``: q/k/v are
            flash-attn's ``(B, N, H, D)``, read through transposed views (no copy); out is
            ``(B, Nq, H, Dv)``, lse stays ``(B, H, Nq)``.  attnlab cannot tell the layouts
            apart from the shapes: a (B, N, H, D) tensor passed without ``layout="bnhd"``
            is read as (B, H, N, D).

    Peer conventions (:mod:`attnlab.ops.conventions`, docs/conventions.md): ``mask`` may
    be a tensor broadcastable to ``(B, H, Nq, Nk)``, bool (True = attend) or additive
    float (a float mask that requires grad is learned), indexed by row and column like
    SDPA's ``attn_mask``; ``scale`` may be a 0-d tensor (learnable); ``q_offset`` a
    ``(B,)`` int tensor (per-batch query positions, ragged decoding); k/v may have
    batch 1 (shared by every batch element, broadcast as views).

    Non-finite inputs (:mod:`attnlab.ops.finite`, docs/reliability/numerics.md): a key
    a row cannot see has no effect on it even when it holds NaN/inf; NaN/inf a row can
    see propagates (IEEE), the same on every backend (``"sdpa"`` hands such inputs to
    the flash path).
        backend: ``"reference"`` (materialized oracle), ``"flash"`` (tiled online
            softmax, skips empty tiles), ``"sdpa"`` (torch SDPA, only where it means
            the same), ``"triton"`` (GPU kernels, :mod:`attnlab.ops.triton`; CUDA tensors,
            or CPU under ``TRITON_INTERPRET=1``), ``"native"`` (the C++ CPU kernel,
            :mod:`attnlab.ops.native`, where it implements the mask; else flash), or ``"auto"`` (the fastest correct one,
            per docs/benchmarks.md; never ``"triton"`` on the CPU).

    >>> import torch, attnlab
    >>> from attnlab import masks
    >>> q = torch.randn(2, 8, 16, 64); k = v = torch.randn(2, 2, 16, 64)   # GQA 8:2
    >>> out, lse = attnlab.attention(q, k, v, mask=masks.causal(), return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 8, 16, 64]), torch.Size([2, 8, 16]))
    """
    if conventions.wants_conventions(q, k, mask, scale, q_offset, layout):
        return conventions.apply(
            attention,
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
            layout=layout,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
        )
    pr = normalize(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        q_offset=q_offset,
        kv_offset=kv_offset,
        shared_kv_batch=True,
    )
    B, H, Nq, Nk = pr.B, pr.H, pr.Nq, pr.Nk
    scale, q_offset, kv_offset = pr.scale, pr.q_offset, pr.kv_offset
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    dropout_p, dropout_seed = check_dropout(dropout_p, dropout_seed)
    if dropout_p:
        return _dropout_attention(
            q,
            k,
            v,
            mask,
            score_mod,
            scale,
            q_offset,
            kv_offset,
            return_lse,
            backend,
            make_dropout(dropout_p, dropout_seed),
        )
    if mask is not None and Nk and is_causal_mask(mask) and q_offset >= kv_offset + Nk - 1:
        mask = None  # every key sits at or before the first query: causal() hides nothing (decoding)

    if backend == "sdpa":
        why = sdpa_unsupported(q, k, mask, score_mod, q_offset, kv_offset, return_lse)
        if why is not None:
            raise ValueError(
                f"backend='sdpa': this request does not map onto torch SDPA ({why}); use backend='flash' or 'auto'"
            )
    elif backend == "triton":
        from attnlab.ops.triton import unsupported as triton_unsupported

        why = triton_unsupported(q, k, v, mask, score_mod, q_offset, kv_offset)
        if why is not None:
            raise ValueError(f"backend='triton': {why}; use backend='flash' or 'auto'")
    elif backend == "auto":
        backend = choose_backend(q, k, mask, score_mod, q_offset, kv_offset, return_lse, v=v, scale=scale)
        if (
            backend == "flash"
            and mask is not None
            and score_mod is None
            and not return_lse
            and not traced(q, k, v)
            and B * H * Nq * Nk <= _DENSE_MASK_MAX
            and not _wants_grad(q, k, v)
            and not maybe_nonfinite(q, k, v)
        ):
            out = sdpa_dense_mask(q, k, v, mask, scale=scale, q_offset=q_offset, kv_offset=kv_offset)
            if out is not None:
                return out
    if Nq == 0 or Nk == 0:
        backend = "flash"  # every backend's answer for empty problems: out 0, lse -inf
    elif backend == "sdpa" and not traced(q, k, v) and maybe_nonfinite(q, k, v):
        # torch SDPA's NaN/inf handling is not attnlab's (a NaN query gives 0 on the CPU, a
        # hidden NaN value poisons every row): the flash path keeps the contract
        backend = "flash"
    kw = dict(mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, kv_offset=kv_offset)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, **kw)
    if backend == "reference":
        if isinstance(mask, BlockMask):  # a BlockMask: the reference reads its predicate
            kw["mask"] = mask.mask
        out, lse = reference_attention(q, k, v, **kw)
    elif backend == "triton":
        from attnlab.ops.triton import triton_attention

        out, lse = triton_attention(q, k, v, **kw)
    elif backend == "native":
        out, lse = _native(q, k, v, kw)
    else:
        out, lse = _flash(q, k, v, kw)
    return (out, lse) if return_lse else out


def _native(q, k, v, kw):
    """The native C++ CPU kernel (:mod:`attnlab.ops.native`) where it implements the
    problem (its mask's structure, a built-in score mod's terms); the flash path otherwise.
    A decode step (a query row per head, no gradient) runs on the decode kernel
    (:mod:`attnlab.ops.native.dense_decode`) where its answer is finite."""
    from attnlab.ops.native import dense_decode
    from attnlab.ops.native.ops import native_attention, plan

    args = (kw["mask"], kw["score_mod"], kw["scale"], kw["q_offset"], kw["kv_offset"])
    d, _ = dense_decode.plan(q, k, v, *args)
    if d is not None:
        r = dense_decode.attend(q, k, v, d, scale=kw["scale"], q_offset=kw["q_offset"], kv_offset=kw["kv_offset"])
        if r is not None:
            return r
    s, _ = plan(q, k, v, kw["mask"], kw["score_mod"], kw["q_offset"], kw["kv_offset"])
    if s is None:
        return _flash(q, k, v, kw)
    return native_attention(
        q, k, v, s, scale=kw["scale"], q_offset=kw["q_offset"], kv_offset=kw["kv_offset"], score_mod=kw["score_mod"]
    )


def _flash(q, k, v, kw):
    """The flash backend: ``torch.ops.attnlab.flash_fwd`` for built-in masks and score mods
    (by structural key, :mod:`attnlab.ops.library`); a ``custom`` one runs the autograd
    Function eagerly.  Under ``torch.compile`` or a ``torch.func`` transform a custom mask is
    evaluated densely (bool ``(B, H, Nq, Nk)``, traced) and handed to the op, and a custom
    score mod runs the reference math inline (no graph break; O(Nq·Nk) memory: docs/compile.md)."""
    mask, mod, drop = kw["mask"], kw["score_mod"], kw.get("dropout")
    args = op_args(q, k, mask, mod, kw["q_offset"], kw["kv_offset"])
    if args is None and traced(q, k, v):
        if mod is not None and op_args(q, k, None, mod, 0, 0) is None:
            ref_kw = dict(kw, mask=mask.mask if isinstance(mask, BlockMask) else mask)
            if drop is None:
                ref_kw.pop("dropout", None)
            return reference_attention(q, k, v, **ref_kw)
        B, H, Nq, _ = q.shape
        dm = dense_mask(
            mask.mask if isinstance(mask, BlockMask) else mask,
            B,
            H,
            Nq,
            k.shape[2],
            kw["q_offset"],
            kw["kv_offset"],
            q.device,
        )
        args = op_args(q, k, dm, mod, kw["q_offset"], kw["kv_offset"])
    if args is None:
        return flash_attention(q, k, v, **kw)
    return flash_op(q, k, v, args, kw["scale"], dropout=drop)


def _dropout_attention(q, k, v, mask, score_mod, scale, q_offset, kv_offset, return_lse, backend, dropout):
    """``attention`` with dropout (inputs validated): reference, flash or triton."""
    if backend == "sdpa":
        raise ValueError(
            f"backend='sdpa' with dropout_p={dropout.p}: torch SDPA's dropout draws its own mask, "
            "which attnlab cannot regenerate or reproduce; use backend='flash' or 'auto' (the "
            "counter-based dropout of attnlab.ops.dropout)"
        )
    if backend in ("auto", "triton") and q.shape[2] and k.shape[2]:
        from attnlab.ops.triton import unsupported as triton_unsupported

        if backend == "triton" or q.device.type == "cuda":
            why = triton_unsupported(q, k, v, mask, score_mod, q_offset, kv_offset, dropout=dropout)
            if why is not None and backend == "triton":
                raise ValueError(f"backend='triton': {why}; use backend='flash' or 'auto'")
            backend = "triton" if why is None else "flash"
    kw = dict(mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, kv_offset=kv_offset, dropout=dropout)
    if backend == "reference" and q.shape[2] and k.shape[2]:
        if isinstance(mask, BlockMask):
            kw["mask"] = mask.mask
        out, lse = reference_attention(q, k, v, **kw)
    elif backend == "triton":
        from attnlab.ops.triton import triton_attention

        out, lse = triton_attention(q, k, v, **kw)
    else:
        out, lse = _flash(q, k, v, kw)
    return (out, lse) if return_lse else out


def attention_probs(q, k, *, mask=None, score_mod=None, scale=None, q_offset=None, kv_offset=0):
    """The attention pattern ``softmax(scale·q kᵀ + score_mod, masked)``, materialized.

    Same conventions as :func:`attention` (shapes, GQA, absolute positions, masks):
    returns ``(B, H, Nq, Nk)`` in float32 (float64 for float64 inputs); each row sums
    to 1, or is all zeros where every key is masked.  For looking at, not for speed.

    >>> import torch, attnlab
    >>> from attnlab import masks
    >>> p = attnlab.attention_probs(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), mask=masks.causal())
    >>> p.shape, p[0, 0, 0].tolist()[1:]
    (torch.Size([1, 2, 3, 3]), [0.0, 0.0])
    """
    pr = normalize(
        q, k, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, kv_offset=kv_offset, shared_kv_batch=True
    )
    if isinstance(mask, BlockMask):
        mask = mask.mask
    return reference_probs(
        q,
        k,
        mask=mask,
        score_mod=score_mod,
        scale=pr.scale,
        q_offset=pr.q_offset,
        kv_offset=pr.kv_offset,
        need_lse=False,
    )[0]


# Measured choice (docs/benchmarks.md, `attnlab bench attention`, 2 threads): torch SDPA
# wins for float32/float64/float16 wherever it applies.  For bfloat16 the flash path's
# bf16 matmuls beat SDPA's kernel on CPU: forward 1.06x at D=64 and 1.44x at D=128;
# forward+backward 0.96x at D=64 (so SDPA keeps it) and 1.10x at D=128.
_BF16_FLASH_MIN_D = {False: 64, True: 128}  # keyed by "needs a backward"


# Inference on small problems (a decode step, a speculative tree): evaluating the mask
# densely and handing it to SDPA costs microseconds, where the flash path's tile
# planning costs a millisecond of Python.  Only without gradients (torch's CPU SDPA
# backward misses the gradient accuracy rule on peaky softmaxes; see test_accuracy).
_DENSE_MASK_MAX = 1 << 16


def _wants_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


# Where SDPA maps the problem too, the native CPU kernel from these sizes (measured side by side,
# docs/benchmarks.md): float32 from 128 query rows (forward 1.2x SDPA at (1,8,4096,64),
# forward+backward 1.5x at (1,8,2048,64); below that, and for decode steps, SDPA's smaller
# per-call cost wins: one query row over 16k keys ran 3x faster there); bfloat16 from 1024
# query-key pairs (torch's bf16 SDPA on the CPU: 1.4-6x slower from there, forward+backward
# included; one query row over 1k-16k keys 6-13x).  float16 and float64 keep SDPA.
_NATIVE_OVER_SDPA_MIN_ROWS = {torch.float32: 128}
_NATIVE_OVER_SDPA_MIN_PAIRS = {torch.bfloat16: 1024}


#: a decode step (dense_decode.plan's rows) runs on the native decode kernel under ``auto`` from
#: these key counts: torch's bf16 SDPA is slow at any length; float32 SDPA plus the NaN/inf check
#: of its route costs about as much as the decode route at 256 keys, 1.4x it at 1024
#: (``python scripts/decode_route.py``, docs/native.md); float16 unmeasured (SDPA)
_DECODE_MIN_KEYS = {torch.float32: 512, torch.bfloat16: 1}


def _native_beats_sdpa(q, k) -> bool:
    Nq, Nk = q.shape[2], k.shape[2]
    if q.dtype in _NATIVE_OVER_SDPA_MIN_ROWS:
        return Nq >= _NATIVE_OVER_SDPA_MIN_ROWS[q.dtype]
    if q.dtype in _NATIVE_OVER_SDPA_MIN_PAIRS:
        return Nq * Nk >= _NATIVE_OVER_SDPA_MIN_PAIRS[q.dtype]
    return False


def choose_backend(q, k, mask, score_mod, q_offset, kv_offset, return_lse, v=None, scale=None) -> str:
    """The backend ``backend="auto"`` runs for a validated request (before the dense-mask shortcut):
    :func:`torch_backend`'s choice, where the native CPU kernel implements the problem replaced
    by it wherever that would be the torch-ops flash path, and where it would be SDPA for the
    sizes the native kernel was measured faster at (``_native_beats_sdpa``)."""
    choice = torch_backend(q, k, mask, score_mod, q_offset, kv_offset, return_lse, v)
    upgrade = choice == "flash" or (choice == "sdpa" and _native_beats_sdpa(q, k))
    if (
        choice == "sdpa"
        and not upgrade
        and q.device.type == "cpu"
        and k.shape[2] >= _DECODE_MIN_KEYS.get(q.dtype, 1 << 62)
    ):
        # a decode step: the native decode kernel reads each key once, where SDPA's route
        # first checks every input for NaN/inf (docs/native.md, "Decode steps on dense keys")
        from attnlab.ops.native import dense_decode

        sc = 1.0 if scale is None else scale
        if dense_decode.plan(q, k, k if v is None else v, mask, score_mod, sc, q_offset, kv_offset)[0] is not None:
            return "native"
    if upgrade and q.device.type == "cpu" and q.shape[2] and k.shape[2]:
        from attnlab.ops.native.ops import plan

        if plan(q, k, k if v is None else v, mask, score_mod, q_offset, kv_offset)[0] is not None:
            return "native"
    return choice


def torch_backend(q, k, mask, score_mod, q_offset, kv_offset, return_lse, v=None) -> str:
    """:func:`choose_backend` among the torch-ops backends (no native kernel)."""
    if sdpa_unsupported(q, k, mask, score_mod, q_offset, kv_offset, return_lse) is None:
        wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] >= _BF16_FLASH_MIN_D[wants_grad]:
            return "flash"
        return "sdpa"
    if q.device.type == "cuda":  # unmeasured policy (docs/triton.md): SDPA where it maps, else the Triton kernels
        from attnlab.ops.triton import unsupported as triton_unsupported

        if triton_unsupported(q, k, k if v is None else v, mask, score_mod, q_offset, kv_offset) is None:
            return "triton"
    return "flash"


__all__ = ["attention", "attention_probs", "BACKENDS", "is_causal_mask"]
