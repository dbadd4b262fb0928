"""Argument checks shared by ring and Ulysses attention, and the cross-rank handshake.

The handshake all-gathers the fingerprint of the call (:mod:`attnlab.distributed.fingerprint`:
shapes, dtypes, sequence length, layout, the mask and the score mod with all their
parameters, scale, ...) before any data moves: ranks that disagree all get the same
``ValueError``, naming what differs and each rank's value, instead of different
problems computed silently or mismatched messages later; a rank that never calls
makes the others raise :class:`PeerTimeoutError` here.
"""

from __future__ import annotations

import torch

from attnlab.distributed.fingerprint import FIELDS, call_fields, decode, diff_message, digests, encode
from attnlab.distributed.layouts import check_layout, shard_len
from attnlab.masks import BlockMask
from attnlab.ops.args import check_qkv, check_score_mod, scale_arg
from attnlab.validate import integer


def check_call(op, q, k, v, *, mask, score_mod, scale, layout, seq_len, return_lse, world):
    """Validate a sharded self-attention call; returns ``(scale, seq_len)``."""
    check_qkv(q, k, v, shared_kv_batch=True)
    B, H, C, D = q.shape
    if k.shape[2] != C:
        raise ValueError(
            f"{op}: q and k must be shards of the same sequence (self-attention), got q {tuple(q.shape)} "
            f"and k {tuple(k.shape)}: shard lengths {C} and {k.shape[2]}"
        )
    check_layout(layout)
    if seq_len is None:
        seq_len = C * world
        if layout == "zigzag" and C % 2:
            raise ValueError(
                f"{op}: layout='zigzag' needs an even shard length (two chunks per rank), got {C}; "
                "shard with attnlab.distributed.shard_sequence, which pads"
            )
    else:
        seq_len = integer(seq_len, "seq_len", lo=0, what="(the whole sequence's length)")
        if shard_len(seq_len, world, layout) != C:
            raise ValueError(
                f"{op}: seq_len={seq_len} over {world} ranks ({layout}) gives shards of "
                f"{shard_len(seq_len, world, layout)} tokens, but q has {C} (q {tuple(q.shape)})"
            )
    if mask is not None:
        if isinstance(mask, BlockMask):
            raise TypeError(
                f"mask: {op} takes a Mask (masks.causal(), ...), not a BlockMask: a BlockMask is built "
                "for one shape and every step here has another"
            )
        if not (hasattr(mask, "predicate") and hasattr(mask, "classify") and hasattr(mask, "validate")):
            raise TypeError(f"mask: expected an attnlab mask (attnlab.masks.causal(), ...), got {type(mask).__name__}")
        if seq_len:
            mask.validate(B, H, seq_len, seq_len, 0, 0)
    check_score_mod(score_mod, B, H)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    return scale_arg(scale, D), seq_len


def handshake(
    comm,
    op,
    q,
    k,
    v,
    *,
    seq_len,
    layout,
    mask,
    score_mod,
    scale,
    return_lse,
    backend="-",
    params=(),
    error: BaseException | None = None,
):
    """All ranks agree on the call, or all raise the same ``ValueError``.

    One all-gather of a fixed-size int64 tensor (one digest per field of
    :data:`attnlab.distributed.fingerprint.FIELDS`); only when the digests differ, two
    more all-gathers exchange the texts of the fields that differ, so that every rank
    builds the same message from the same data.  ``error`` is this rank's own argument
    error (from :func:`check_call`), if any: when every rank has the same one it is
    raised as it is; when the ranks disagree, every rank raises the mismatch (a rank
    that refused its arguments does not leave the others waiting)."""
    if comm.world == 1:
        if error is not None:
            raise error
        return
    fields = call_fields(
        op,
        q,
        k,
        v,
        seq_len=seq_len,
        layout=layout,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        return_lse=return_lse,
        backend=backend,
        params=params,
        error=error,
    )
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    mine = torch.tensor(digests(fields), dtype=torch.int64, device=device)
    allsig = comm.all_gather(mine, f"the handshake of {op} (every rank's call fingerprint)").cpu()
    same = (allsig == allsig[0]).all(0).tolist()
    if all(same):
        if error is not None:
            raise error
        return
    names = list(FIELDS) if not same[0] else [n for n, s in zip(FIELDS, same[1:], strict=False) if not s]
    payload = encode(fields, names)
    lens = (
        comm.all_gather(
            torch.tensor([len(payload)], dtype=torch.int64, device=device),
            f"the handshake of {op} (the lengths of the fields that differ)",
        )
        .cpu()
        .view(-1)
    )
    buf = torch.zeros(max(1, int(lens.max())), dtype=torch.uint8)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
    allbuf = comm.all_gather(buf.to(device), f"the handshake of {op} (the fields that differ)").cpu()
    per_rank = [decode(allbuf[r, : int(lens[r])].numpy().tobytes(), names) for r in range(comm.world)]
    raise ValueError(diff_message(op, per_rank, names)) from error
