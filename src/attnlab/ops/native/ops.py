"""The native kernel as PyTorch operators: ``torch.ops.attnlab.native_fwd`` / ``native_bwd``.

Registered with :func:`torch.library.custom_op` (like :mod:`attnlab.ops.library`'s
``attnlab::flash_*``), with fake implementations and the backward tied on with
``register_autograd``, so ``torch.compile(fullgraph=True)`` sees one opaque node.
The mask travels as its structure (:mod:`attnlab.ops.native.structure`)::

    native_fwd(q, k, v, kv_len?, scale, q_offset, kv_offset,
               band=[has_left, left, has_right, right, has_sinks_right, sinks_right], sinks, block=[bq, bk])
        -> (out (B, H, Nq, Dv) q.dtype, lse (B, H, Nq) float32)
    native_bwd(dout, dlse?, q, k, v, out, lse, <same>) -> (dq, dk, dv)

Double backward is refused (:class:`attnlab.ops.flash.DoubleBackwardError`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.ops.flash import DOUBLE_BACKWARD, DoubleBackwardError
from attnlab.ops.native import build
from attnlab.ops.native.structure import IMPLEMENTED, structure_of

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BQ = 64


def blocks(D: int) -> list[int]:
    """``[bq, bk]``: a K tile of ``D × bk`` floats stays within 32 KiB of L1."""
    return [_BQ, max(16, min(128, 8192 // max(D, 1)) // 16 * 16)]


def _ext():
    mod = build.load()
    if mod is None:
        raise RuntimeError("attnlab native kernel is not available (attnlab.ops.native.build.status())")
    return mod


@torch.library.custom_op("attnlab::native_fwd", mutates_args=())
def native_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_len: Tensor | None,
    scale: float,
    q_offset: int,
    kv_offset: int,
    band: list[int],
    sinks: int,
    block: list[int],
) -> tuple[Tensor, Tensor]:
    """Forward: ``(out, lse)``."""
    out, lse = _ext().fwd(
        q,
        k,
        v,
        float(scale),
        int(q_offset),
        int(kv_offset),
        bool(band[0]),
        int(band[1]),
        bool(band[2]),
        int(band[3]),
        int(sinks),
        bool(band[4]),
        int(band[5]),
        kv_len,
        int(block[0]),
        int(block[1]),
    )
    return out, lse


@native_fwd.register_fake
def _native_fwd_fake(q, k, v, kv_len, scale, q_offset, kv_offset, band, sinks, block):
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
    scale: float,
    q_offset: int,
    kv_offset: int,
    band: list[int],
    sinks: int,
    block: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv)`` (contiguous, the inputs' dtype)."""
    dq, dk, dv = _ext().bwd(
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
        bool(band[0]),
        int(band[1]),
        bool(band[2]),
        int(band[3]),
        int(sinks),
        bool(band[4]),
        int(band[5]),
        kv_len,
        int(block[0]),
        int(block[1]),
    )
    return dq, dk, dv


@native_bwd.register_fake
def _native_bwd_fake(dout, dlse, q, k, v, out, lse, kv_len, scale, q_offset, kv_offset, band, sinks, block):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_len, scale, q_offset, kv_offset, band, sinks, block = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_len)
    ctx.args = (scale, q_offset, kv_offset, band, sinks, block)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_len = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dout, dlse, q, k, v)):
        raise DoubleBackwardError(DOUBLE_BACKWARD.format("native backend"))
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.attnlab.native_bwd(dout, dlse, q, k, v, out, lse, kv_len, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


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
    if score_mod is not None:
        return None, "score mods run on the flash path"
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return None, "per-batch offsets"
    compiling = torch.compiler.is_compiling()
    if not compiling and _functorch(q, k, v):
        return None, "torch.func transform (the flash path's autograd.Function composes with it)"
    s = structure_of(mask)
    if s is None:
        return None, f"mask {mask!r} has no structure the kernel implements"
    if not s.fields() <= IMPLEMENTED:
        return None, f"mask fields {sorted(s.fields() - IMPLEMENTED)} are not implemented natively"
    if s.kv_len is not None and (s.kv_len.device.type != "cpu" or s.kv_len.shape != (q.shape[0],)):
        return None, "kv_len not a (B,) CPU tensor"
    if not (build.loaded() if compiling else build.load() is not None):
        return None, "the extension could not be built"
    return s, None


def native_attention(q, k, v, structure, *, scale, q_offset, kv_offset):
    """``(out, lse)`` through ``torch.ops.attnlab.native_fwd`` for a structure from :func:`plan`."""
    s = structure
    sr = getattr(s, "sinks_right", None)
    band = [
        int(s.left is not None),
        0 if s.left is None else int(s.left),
        int(s.right is not None),
        0 if s.right is None else int(s.right),
        int(sr is not None),
        0 if sr is None else int(sr),
    ]
    kv_len = None if s.kv_len is None else s.kv_len.to(torch.long).contiguous()
    return torch.ops.attnlab.native_fwd(
        q, k, v, kv_len, float(scale), int(q_offset), int(kv_offset), band, int(s.sinks), blocks(q.shape[-1])
    )


__all__ = ["blocks", "native_attention", "native_bwd", "native_fwd", "plan"]
