"""Decode attention: a few new queries over keys/values that live in pieces.

Paged and quantized caches do not hold one dense ``(B, Hkv, Nk, D)`` tensor.  Their
``attend`` walks the pieces (a run of blocks, a dequantized group, the
full-precision window) and calls :func:`split_kv_attention`, which attends each piece
with :func:`attnlab.attention` (``return_lse=True``) and combines the partial results
exactly with :func:`attnlab.merge_states` — the split-KV ("flash-decoding") scheme.
No piece is copied into a dense cache-sized tensor.

Same contract as the op: GQA, masks and score mods at absolute positions (each piece
says where its first key sits), natural-log LSE, rows with no visible key give 0 and
``-inf``.

>>> import torch, attnlab
>>> from attnlab.ops.decode import split_kv_attention
>>> q = torch.randn(1, 4, 1, 8); k = torch.randn(1, 2, 10, 8); v = torch.randn(1, 2, 10, 8)
>>> pieces = [(k[:, :, :6], v[:, :, :6], 0), (k[:, :, 6:], v[:, :, 6:], 6)]
>>> out = split_kv_attention(q, pieces, q_offset=9)
>>> bool((out - attnlab.attention(q, k, v)).abs().max() < 1e-5)
True
"""

from __future__ import annotations

from collections.abc import Iterable

from attnlab.ops.dispatch import attention
from attnlab.ops.merge import merge_states


def split_kv_attention(
    q,
    pieces: Iterable,
    *,
    mask=None,
    score_mod=None,
    scale=None,
    q_offset: int,
    backend: str = "auto",
    return_lse: bool = False,
):
    """Attention of ``q (B, H, Nq, D)`` over ``pieces``: ``(k_i, v_i, kv_offset_i)`` with
    ``k_i (B, Hkv, n_i, D)``, ``v_i (B, Hkv, n_i, Dv)``, disjoint key positions.

    ``q_offset`` (required: the pieces do not say where the queries sit) is the absolute
    position of the first query.  Returns ``out (B, H, Nq, Dv)`` (and the LSE).
    """
    outs, lses = [], []
    for k, v, kv_offset in pieces:
        if k.shape[2] == 0:
            continue
        o, l = attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=True,
            backend=backend,
        )
        outs.append(o)
        lses.append(l)
    if not outs:
        raise ValueError("split_kv_attention: no keys to attend (every piece is empty)")
    if len(outs) == 1:
        out, lse = outs[0], lses[0]
    else:
        out, lse = merge_states(outs, lses)
        out = out.to(q.dtype)
    return (out, lse) if return_lse else out
