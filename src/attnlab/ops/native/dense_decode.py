"""Decode steps on dense keys and values through the native decode kernel.

A decode step -- one query row per head (float32: up to :data:`MAX_ROWS_F32`) over dense
``(B|1, Hkv, Nk, D)`` keys and values -- runs on ``decode.cpp``'s kernel, the one the paged and
quantized caches use (:mod:`attnlab.ops.native.decode_ops`), with the keys and values read in
place as a pool of one block of ``Nk`` tokens per batch row (``k.transpose(0, 1)``: a view, no
copy).  The tile kernel packs every key and value before its first tile (O(Nk·D) copies for
one row of work) and the SDPA route checks every input for NaN/inf first (one more pass over
K and V); the decode kernel reads each key once.

Measured (2 threads, causal decode at the end of the keys, median µs, against the tile kernel
and ``auto`` before this route, ``python scripts/decode_route.py``): see docs/native.md,
"Decode steps on dense keys".

Contract: the decode kernel visits the keys its rows' visible spans cover and sets a hidden
score to ``-inf`` before its max (a NaN/inf in a hidden key cannot reach the row), but its
``P·V`` adds ``0 · v`` for a key hidden from one row inside another row's span (several float32
rows under causal), so a NaN/inf *value* that row cannot see would reach it (``0 · NaN``); a
NaN/inf a row can see gives a non-finite row as well.  The output is checked (``(B, H, Nq, Dv)``: a few rows): where any entry
is not finite, :func:`attend` returns ``None`` and the caller runs the tile kernel, whose
careful path keeps attnlab's contract (hidden entries contribute nothing, visible ones
propagate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.ops.finite import traced
from attnlab.ops.native import decode_ops
from attnlab.ops.native.structure import band_of

__all__ = ["MAX_ROWS", "MAX_ROWS_F32", "attend", "plan"]

#: query rows per head the route takes (bfloat16 / float16): from two rows on the tile
#: kernel's bf16 dot products beat the decode kernel's float32 ones from 1024 keys
MAX_ROWS = 1
#: float32 (the decode kernel's products are the tile kernel's, without its packing)
MAX_ROWS_F32 = 4


def plan(q, k, v, mask, score_mod, scale, q_offset, kv_offset):
    """``(structure, None)`` where the decode route runs this (validated) request, else
    ``(None, why)``: the dense-specific conditions here, the rest (dtype, score mod, gradient,
    scale, tracing, the mask's fields, the build) :func:`decode_ops.plan`'s, as for a cache."""
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[2] == 0 or k.shape[2] == 0:
        return None, "empty"
    Nq = q.shape[2]
    if Nq > (MAX_ROWS_F32 if q.dtype == torch.float32 else MAX_ROWS):
        return None, f"{Nq} query rows (a decode step has few: the tile kernel runs more)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return None, f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (one dtype)"
    if k.device.type != "cpu" or v.device.type != "cpu":
        return None, "keys or values not on the CPU"
    if not isinstance(kv_offset, int) or not isinstance(q_offset, int):
        return None, "offsets"  # (per-batch query positions arrive as a mask's q_shift)
    if k.stride(3) != 1 or v.stride(3) != 1:
        return None, "keys or values without unit channel stride"
    if traced(q, k, v):
        return None, "traced"
    return decode_ops.plan(q, k.dtype, mask, score_mod, "native", q.shape[0], (k, v), scale)


def attend(q, k, v, s, *, scale: float, q_offset: int, kv_offset: int) -> tuple[Tensor, Tensor] | None:
    """``(out, lse)`` of the request :func:`plan` accepted (structure ``s``), or ``None`` where the
    output holds a NaN/inf (the caller runs the tile kernel: see the module's contract)."""
    B, Nk = q.shape[0], k.shape[2]
    kb = k.shape[0]  # 1: one block shared by every batch row (keys broadcast over the batch)
    # lens, kv_start and q_pos in one tensor (a decode loop's Nk and offsets change every step)
    rows = torch.tensor([[Nk] * B, [kv_offset] * B, [q_offset] * B], dtype=torch.long)
    tables = (torch.arange(B, dtype=torch.int32) if kb == B else torch.zeros(B, dtype=torch.int32)).view(B, 1)
    kv_len = None if s.kv_len is None else s.kv_len.to(torch.long).reshape(B)
    # the decode op itself, not its torch.library wrapper: plan() ruled out gradients and
    # tracing, the wrapper's two reasons to be (its autograd and fake kernels)
    out, lse = decode_ops.paged_op()(
        q,
        k.transpose(0, 1),
        v.transpose(0, 1),
        tables,
        rows[0],
        rows[1],
        rows[2],
        kv_len,
        float(scale),
        band_of(s),
        int(s.sinks),
        int(decode_ops.SPLIT),
    )
    if not bool(torch.isfinite(out).all()):
        return None
    return out, lse
