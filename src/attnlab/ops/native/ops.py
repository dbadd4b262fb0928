"""The native kernel as PyTorch operators: ``torch.ops.attnlab.native_fwd`` / ``native_bwd``.

Registered with :func:`torch.library.custom_op` (like :mod:`attnlab.ops.library`'s
``attnlab::flash_*``), with fake implementations and the backward tied on with
``register_autograd``, so ``torch.compile(fullgraph=True)`` sees one opaque node.
The mask travels as its structure (:mod:`attnlab.ops.native.structure`), a built-in score
mod as its terms (:meth:`attnlab.scores.ScoreMod.lower`, ``scoremods.h``)::

    native_fwd(q, k, v, kv_len?, q_ids?, kv_ids?, key_keep?, slopes?, table?, scale, q_offset, kv_offset,
               band=[has_left, left, has_right, right, has_sinks_right, sinks_right], sinks, block=[bq, bk],
               mods=[term kinds], caps=[softcap values])
        -> (out (B, H, Nq, Dv) q.dtype, lse (B, H, Nq) float32)
    native_bwd(dout, dlse?, q, k, v, out, lse, <same>) -> (dq, dk, dv, dslopes, dtable)

``q_ids (B|1, Nq)`` / ``kv_ids (B|1, Nk)`` int64 and ``key_keep (B|1, Nk)`` bool are the
structure's vectors sliced to this problem's rows and columns (:func:`native_attention`);
``slopes (B|1, H)`` (ALiBi) and ``table (H, 2R+1)`` (relative bias) float32, their gradients
``dslopes``/``dtable`` (empty when absent).  Double backward is refused
(:class:`attnlab.ops.flash.DoubleBackwardError`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.ops.flash import DOUBLE_BACKWARD, DoubleBackwardError
from attnlab.ops.native import build
from attnlab.ops.native.structure import IMPLEMENTED, band_of, structure_of
from attnlab.scores import ScoreMod

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BQ = 64
# scoremods.h's ScoreMods::Kind
_SOFTCAP, _ALIBI, _ALIBI_SYMMETRIC, _RELATIVE_BIAS = 1, 2, 3, 4
_MAX_TERMS = 8


def blocks(D: int) -> list[int]:
    """``[bq, bk]``: a K tile of ``D × bk`` floats stays within 32 KiB of L1."""
    return [_BQ, max(16, min(128, 8192 // max(D, 1)) // 16 * 16)]


def _ext():
    mod = build.load()
    if mod is None:
        raise RuntimeError("attnlab native kernel is not available (attnlab.ops.native.build.status())")
    return mod


def _mask_args(band, sinks):
    return (bool(band[0]), int(band[1]), bool(band[2]), int(band[3]), int(sinks), bool(band[4]), int(band[5]))


@torch.library.custom_op("attnlab::native_fwd", mutates_args=())
def native_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_len: Tensor | None,
    q_ids: Tensor | None,
    kv_ids: Tensor | None,
    key_keep: Tensor | None,
    slopes: Tensor | None,
    table: Tensor | None,
    scale: float,
    q_offset: int,
    kv_offset: int,
    band: list[int],
    sinks: int,
    block: list[int],
    mods: list[int],
    caps: list[float],
) -> tuple[Tensor, Tensor]:
    """Forward: ``(out, lse)``."""
    out, lse = _ext().fwd(
        q,
        k,
        v,
        float(scale),
        int(q_offset),
        int(kv_offset),
        *_mask_args(band, sinks),
        kv_len,
        q_ids,
        kv_ids,
        key_keep,
        slopes,
        table,
        int(block[0]),
        int(block[1]),
        [int(x) for x in mods],
        [float(x) for x in caps],
    )
    return out, lse


@native_fwd.register_fake
def _native_fwd_fake(q, k, v, *args):
    B, H, Nq, _ = q.shape
    return q.new_empty((B, H, Nq, v.shape[-1])), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("attnlab::native_bwd", mutates_args=())
def native_bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kv_len: Tensor | None,
    q_ids: Tensor | None,
    kv_ids: Tensor | None,
    key_keep: Tensor | None,
    slopes: Tensor | None,
    table: Tensor | None,
    scale: float,
    q_offset: int,
    kv_offset: int,
    band: list[int],
    sinks: int,
    block: list[int],
    mods: list[int],
    caps: list[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv, dslopes, dtable)`` (dq/dk/dv contiguous in the inputs' dtype;
    the parameter gradients float32, empty when the parameter is absent)."""
    dq, dk, dv, dslopes, dtable = _ext().bwd(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        float(scale),
        int(q_offset),
        int(kv_offset),
        *_mask_args(band, sinks),
        kv_len,
        q_ids,
        kv_ids,
        key_keep,
        slopes,
        table,
        int(block[0]),
        int(block[1]),
        [int(x) for x in mods],
        [float(x) for x in caps],
    )
    return dq, dk, dv, dslopes, dtable


@native_bwd.register_fake
def _native_bwd_fake(dout, dlse, q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table, *args):
    f32 = dict(dtype=torch.float32)
    ds = q.new_empty(slopes.shape, **f32) if slopes is not None else q.new_empty((0,), **f32)
    dt = q.new_empty(table.shape, **f32) if table is not None else q.new_empty((0,), **f32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), ds, dt


def _setup_context(ctx, inputs, output):
    q, k, v, kv_len, q_ids, kv_ids, key_keep, slopes, table, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table)
    ctx.args = tuple(args)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table = ctx.saved_tensors
    params = (slopes, table)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dout, dlse, q, k, v, *params)):
        raise DoubleBackwardError(DOUBLE_BACKWARD.format("native backend"))
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dslopes, dtable = torch.ops.attnlab.native_bwd(
        dout, dlse, q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table, *ctx.args
    )
    dslopes = None if slopes is None else dslopes
    dtable = None if table is None else dtable
    return (dq, dk, dv, None, None, None, None, dslopes, dtable, *([None] * len(ctx.args)))


native_fwd.register_autograd(_backward, setup_context=_setup_context)


def _functorch(*ts) -> bool:
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts)


def plan(q, k, v, mask, score_mod, q_offset, kv_offset):
    """``(structure, None)`` when the native kernel runs this problem, else ``(None, why)``.
    Inputs are already validated by :func:`attnlab.attention`."""
    if build.disabled():
        return None, "disabled by ATTNLAB_NATIVE=0"
    if q.device.type != "cpu":
        return None, f"tensors on {q.device} (the native kernel is CPU only)"
    if q.dtype not in _DTYPES:
        return None, f"dtype {q.dtype} (float32, bfloat16, float16 only)"
    terms = score_terms(score_mod)
    if isinstance(terms, str):
        return None, terms
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return None, "per-batch offsets"
    compiling = torch.compiler.is_compiling()
    if not compiling and _functorch(q, k, v, *(t for t in terms[2:] if t is not None)):
        return None, "torch.func transform (the flash path's autograd.Function composes with it)"
    s = structure_of(mask)
    if s is None:
        return None, f"mask {mask!r} has no structure the kernel implements"
    if not s.fields() <= IMPLEMENTED:
        return None, f"mask fields {sorted(s.fields() - IMPLEMENTED)} are not implemented natively"
    if s.kv_len is not None and (s.kv_len.device.type != "cpu" or s.kv_len.shape != (q.shape[0],)):
        return None, "kv_len not a (B,) CPU tensor"
    B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
    for name, t, off, n in (
        ("q_ids", s.q_ids, q_offset, Nq),
        ("kv_ids", s.kv_ids, kv_offset, Nk),
        ("key_keep", s.key_keep, kv_offset, Nk),
    ):
        if t is not None and not _covers(t, B, off, n):
            return None, f"{name} of shape {tuple(t.shape)} does not cover positions [{off}, {off + n}) of B={B}"
    if (s.q_ids is None) != (s.kv_ids is None):
        return None, "q_ids without kv_ids"
    if not (build.loaded() if compiling else build.load() is not None):
        return None, "the extension could not be built"
    return s, None


def score_terms(score_mod) -> tuple[list[int], list[float], Tensor | None, Tensor | None] | str:
    """``(mods, caps, slopes, table)``: the kernel's description of a built-in score mod from its
    :meth:`~attnlab.scores.ScoreMod.lower` (at most one ALiBi and one relative-bias term, any
    softcaps), or why it stays on the flash path."""
    if score_mod is None:
        return [], [], None, None
    terms = score_mod.lower() if isinstance(score_mod, ScoreMod) else None
    if terms is None:
        return f"score mod {score_mod!r} has no structure the kernel implements (the flash path runs it)"
    if len(terms) > _MAX_TERMS:
        return f"score mod {score_mod!r}: more than {_MAX_TERMS} terms"
    mods: list[int] = []
    caps: list[float] = []
    slopes = table = None
    for t in terms:
        if t.kind == "softcap":
            mods.append(_SOFTCAP)
            caps.append(float(t.value))
        elif t.kind == "alibi" and slopes is None:
            slopes = t.tensor
            mods.append(_ALIBI_SYMMETRIC if t.symmetric else _ALIBI)
        elif t.kind == "relative_bias" and table is None:
            table = t.tensor
            mods.append(_RELATIVE_BIAS)
        else:
            return f"score term {t.kind!r} (or a second one of its kind) is not implemented natively"
    for x in (slopes, table):
        if x is not None and x.device.type != "cpu":
            return f"score mod tensor on {x.device} (the native kernel is CPU only)"
    return mods, caps, slopes, table


def _covers(t: Tensor, B: int, off: int, n: int) -> bool:
    """A ``(B|1, L)`` CPU vector by absolute position that holds positions ``[off, off + n)``."""
    return t.device.type == "cpu" and t.dim() == 2 and t.shape[0] in (1, B) and 0 <= off and off + n <= t.shape[1]


def _rows(t: Tensor | None, off: int, n: int, dtype: torch.dtype) -> Tensor | None:
    """Positions ``[off, off + n)`` of a ``(B|1, L)`` vector, contiguous, in ``dtype``."""
    return None if t is None else t[:, off : off + n].to(dtype).contiguous()


def native_attention(q, k, v, structure, *, scale, q_offset, kv_offset, score_mod=None):
    """``(out, lse)`` through ``torch.ops.attnlab.native_fwd`` for a structure from :func:`plan`
    (and the score mod :func:`plan` accepted).  ALiBi slopes and bias tables enter as float32
    views of the mod's own tensors, so their gradients reach them."""
    s = structure
    band = band_of(s)
    kv_len = None if s.kv_len is None else s.kv_len.to(torch.long).contiguous()
    Nq, Nk = q.shape[2], k.shape[2]
    q_ids = _rows(s.q_ids, q_offset, Nq, torch.long)
    kv_ids = _rows(s.kv_ids, kv_offset, Nk, torch.long)
    keep = _rows(s.key_keep, kv_offset, Nk, torch.bool)
    terms = score_terms(score_mod)
    if isinstance(terms, str):
        raise ValueError(f"native_attention: {terms}")
    mods, caps, slopes, table = terms
    if slopes is not None:
        slopes = slopes.to(torch.float32).reshape(-1, q.shape[1]).contiguous()  # (H,) -> (1, H)
    if table is not None:
        table = table.to(torch.float32).contiguous()
    return torch.ops.attnlab.native_fwd(
        q,
        k,
        v,
        kv_len,
        q_ids,
        kv_ids,
        keep,
        slopes,
        table,
        float(scale),
        int(q_offset),
        int(kv_offset),
        band,
        int(s.sinks),
        blocks(q.shape[-1]),
        mods,
        caps,
    )


__all__ = ["blocks", "native_attention", "native_bwd", "native_fwd", "plan", "score_terms"]
