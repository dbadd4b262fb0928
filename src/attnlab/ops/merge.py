"""Exact combination of partial attention results over disjoint key sets."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch


def merge_states(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    """Combine ``(out_i, lse_i)`` computed over disjoint key sets into ``(out, lse)``.

    ``outs[i]``: ``(..., N, Dv)``; ``lses[i]``: ``(..., N)``, natural-log LSE.  With
    ``M = max_i L_i`` (per row): ``L = M + log Σ exp(L_i − M)`` and
    ``O = Σ exp(L_i − L)·O_i``, computed in float32 (float64 for float64 inputs).
    Parts with ``L_i = -inf`` (no visible key) contribute nothing, even where their
    output holds NaN/inf; if every part is empty the row gives ``O = 0`` and ``L = -inf``.
    Parts with ``L_i = +inf`` dominate (the limit of the formula): the row gives
    ``L = +inf`` and ``O`` = the mean of those parts' outputs.  A NaN ``L_i`` gives NaN
    (out and LSE), as does NaN in the output of a part that carries weight.
    Differentiable.

    >>> import torch, attnlab
    >>> q, k, v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    >>> o1, l1 = attnlab.attention(q, k[:, :, :4], v[:, :, :4], return_lse=True, q_offset=0)
    >>> o2, l2 = attnlab.attention(q, k[:, :, 4:], v[:, :, 4:], return_lse=True, q_offset=0)
    >>> o, l = attnlab.merge_states([o1, o2], [l1, l2])
    >>> torch.allclose(o, attnlab.attention(q, k, v), atol=1e-6)
    True
    """
    if isinstance(outs, torch.Tensor) or isinstance(lses, torch.Tensor):
        raise TypeError("merge_states: pass sequences of tensors (outs=[o1, o2, ...], lses=[l1, l2, ...])")
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_states: need as many outs as lses and at least one, got {len(outs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses, strict=True)):
        if not isinstance(o, torch.Tensor) or not isinstance(l, torch.Tensor):
            raise TypeError(f"merge_states: part {i} is not a pair of tensors")
        if o.shape != outs[0].shape or l.shape != lses[0].shape:
            raise ValueError(
                f"merge_states: part {i} has shapes out {tuple(o.shape)}, lse {tuple(l.shape)}; "
                f"part 0 has out {tuple(outs[0].shape)}, lse {tuple(lses[0].shape)}"
            )
        if o.shape[:-1] != l.shape:
            raise ValueError(
                f"merge_states: out {tuple(o.shape)} and lse {tuple(l.shape)} of part {i} disagree; "
                "lse must be out.shape[:-1]"
            )
    acc = torch.float64 if outs[0].dtype == torch.float64 or lses[0].dtype == torch.float64 else torch.float32
    L = torch.stack([l.to(acc) for l in lses])  # (P, ..., N)
    M = L.amax(0)
    inf_row = M == float("inf")  # some part has LSE +inf: those parts dominate, averaged
    M_safe = torch.where((M == float("-inf")) | inf_row, torch.zeros_like(M), M)
    w = torch.where(inf_row, (L == float("inf")).to(acc), torch.exp(L - M_safe))
    s = w.sum(0)
    empty = s == 0
    s_safe = torch.where(empty, torch.ones_like(s), s)
    lse = torch.where(empty, torch.full_like(s, float("-inf")), M_safe + torch.log(s_safe))
    lse = torch.where(inf_row, torch.full_like(lse, float("inf")), lse)
    wn = w / s_safe
    # a part with no visible key (LSE -inf) or outweighed by +inf parts contributes nothing,
    # whatever its output holds: where(), not 0·out (0·NaN would be NaN, forward and backward)
    zero = torch.zeros((), dtype=acc, device=L.device)
    out = functools.reduce(
        operator.add,
        (wn[i].unsqueeze(-1) * torch.where(w[i].unsqueeze(-1) == 0, zero, outs[i].to(acc)) for i in range(len(outs))),
    )
    return out.to(outs[0].dtype), lse
