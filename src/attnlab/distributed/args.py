"""Argument checks shared by ring and Ulysses attention, and the cross-rank handshake.

The handshake all-gathers a few integers that describe the call (shapes, dtype,
sequence length, layout, mask kind) before any data moves: ranks that disagree get a
``ValueError`` that shows every rank's view, instead of mismatched messages later; a
rank that never calls makes the others raise :class:`PeerTimeoutError` here.
"""

from __future__ import annotations

import zlib

import torch

from attnlab.distributed.layouts import LAYOUTS, check_layout, shard_len
from attnlab.ops.dispatch import _check_score_mod, _check_tensors, _scale_arg

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def check_call(op, q, k, v, *, mask, score_mod, scale, layout, seq_len, return_lse, world):
    """Validate a sharded self-attention call; returns ``(scale, seq_len)``."""
    _check_tensors(q, k, v)
    B, H, C, D = q.shape
    if k.shape[2] != C:
        raise ValueError(f"{op}: q and k must be shards of the same sequence (self-attention), got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}: shard lengths {C} and {k.shape[2]}")
    check_layout(layout)
    if seq_len is None:
        seq_len = C * world
        if layout == "zigzag" and C % 2:
            raise ValueError(f"{op}: layout='zigzag' needs an even shard length (two chunks per rank), got {C}; "
                             "shard with attnlab.distributed.shard_sequence, which pads")
    else:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise ValueError(f"seq_len: expected an int >= 0 (the whole sequence's length), got {seq_len!r}")
        if shard_len(seq_len, world, layout) != C:
            raise ValueError(f"{op}: seq_len={seq_len} over {world} ranks ({layout}) gives shards of "
                             f"{shard_len(seq_len, world, layout)} tokens, but q has {C} (q {tuple(q.shape)})")
    if mask is not None:
        if hasattr(mask, "plan"):
            raise TypeError(f"mask: {op} takes a Mask (masks.causal(), ...), not a BlockMask: a BlockMask is built "
                            "for one shape and every step here has another")
        if not (hasattr(mask, "predicate") and hasattr(mask, "classify") and hasattr(mask, "validate")):
            raise TypeError(f"mask: expected an attnlab mask (attnlab.masks.causal(), ...), got {type(mask).__name__}")
        if seq_len:
            mask.validate(B, H, seq_len, seq_len, 0, 0)
    _check_score_mod(score_mod, B, H)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    return _scale_arg(scale, D), seq_len


def _mask_code(mask) -> int:
    return 0 if mask is None else zlib.crc32(type(mask).__name__.encode()) & 0x7FFFFFFF


def handshake(comm, op, q, k, v, *, seq_len, layout, mask, score_mod, extra=()):
    """All ranks agree on the call, or all raise ``ValueError`` (one small all-gather)."""
    if comm.world == 1:
        return
    sig = [*q.shape, *k.shape, v.shape[-1], _DTYPES.index(q.dtype), seq_len, LAYOUTS.index(layout),
           _mask_code(mask), int(score_mod is not None), *extra]
    mine = torch.tensor(sig, dtype=torch.int64, device=q.device)
    allsig = comm.all_gather(mine, f"the handshake of {op} (every rank's shapes)").cpu()
    if not bool((allsig == allsig[0]).all()):
        names = ["B", "H", "C", "D", "B_k", "Hkv", "C_k", "D_k", "Dv", "dtype", "seq_len", "layout", "mask",
                 "score_mod"]
        rows = []
        for r, row in enumerate(allsig.tolist()):
            d = dict(zip(names, row))
            d["dtype"] = str(_DTYPES[d["dtype"]]).replace("torch.", "")
            d["layout"] = LAYOUTS[d["layout"]]
            rows.append(f"rank {r}: " + ", ".join(f"{n}={d[n]}" for n in names if n in d))
        raise ValueError(f"{op}: the ranks called with different arguments; every rank must pass shards of one "
                         "problem (same shapes, dtype, seq_len, layout and mask kind):\n  " + "\n  ".join(rows))
