"""Context parallelism for modules: :class:`ContextParallel` plugs ring or Ulysses
attention into :class:`attnlab.nn.MultiHeadAttention`.

A model runs context-parallel when every rank feeds it its shard of the sequence
(``shard_sequence(x, dim=1, layout=...)``), passes the shard's global positions
wherever positions are used (``pos=cp.positions(...)`` for a ``Decoder``'s learned
positions; RoPE inside an attention module picks them up by itself) and every
attention module carries the same ``ContextParallel``::

    cp = ContextParallel(method="ring", layout="zigzag", seq_len=N)
    enable_context_parallel(model, cp)     # or MultiHeadAttention(..., context_parallel=cp)
    out = model(shard_sequence(ids, dim=1, layout="zigzag"), pos=cp.positions(C))

Everything outside attention (projections, MLPs, norms) is per token, so it needs
nothing else.  The gradients of the weights on each rank are that rank's share: sum
them over the group (DDP over the group does) before the optimizer step.
"""

from __future__ import annotations

import torch

from attnlab.distributed.layouts import check_layout, shard_positions

__all__ = ["ContextParallel", "enable_context_parallel"]

METHODS = ("ring", "ulysses")


class ContextParallel:
    """How one attention module attends across the group: ``method`` ``"ring"`` or
    ``"ulysses"``, the sequence ``layout`` of the shards, the whole ``seq_len`` (default:
    shard length × group size) and the ``timeout``/``backend`` of the calls."""

    def __init__(
        self,
        *,
        group=None,
        method: str = "ring",
        layout: str = "zigzag",
        seq_len: int | None = None,
        timeout=None,
        backend: str = "auto",
    ):
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        self.group, self.method, self.layout = group, method, check_layout(layout)
        self.seq_len, self.timeout, self.backend = seq_len, timeout, backend

    def _world_rank(self):
        import torch.distributed as dist

        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def _seq_len(self, n_local: int) -> int:
        P, _ = self._world_rank()
        return n_local * P if self.seq_len is None else self.seq_len

    def positions(self, n_local: int, device=None) -> torch.Tensor:
        """Global positions ``(n_local,)`` of this rank's shard (padding: ``>= seq_len``)."""
        P, r = self._world_rank()
        pos = shard_positions(self._seq_len(n_local), P, r, self.layout, device=device)
        if pos.numel() != n_local:
            raise ValueError(
                f"context_parallel: a shard of {n_local} tokens does not match seq_len="
                f"{self._seq_len(n_local)} over {P} ranks ({self.layout}: {pos.numel()} per rank)"
            )
        return pos

    def attend(self, q, k, v, *, mask=None, score_mod=None, scale=None):
        from attnlab.distributed.ring import ring_attention
        from attnlab.distributed.ulysses import ulysses_attention

        kw = dict(
            group=self.group,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            layout=self.layout,
            seq_len=self._seq_len(q.shape[2]),
            timeout=self.timeout,
        )
        if self.method == "ring":
            return ring_attention(q, k, v, **kw)
        return ulysses_attention(q, k, v, backend=self.backend, **kw)

    def __repr__(self):
        return f"ContextParallel(method={self.method!r}, layout={self.layout!r}, seq_len={self.seq_len})"


def enable_context_parallel(model: torch.nn.Module, cp: ContextParallel | None) -> torch.nn.Module:
    """Set ``context_parallel = cp`` on every attention module of ``model`` (``None`` turns it off)."""
    n = 0
    for mod in model.modules():
        if hasattr(mod, "context_parallel"):
            mod.context_parallel = cp  # type: ignore[assignment]  # torch's stubs type Module attributes as Tensor | Module
            n += 1
    if n == 0:
        raise ValueError(
            "enable_context_parallel: the model has no module with a context_parallel option "
            "(attnlab.nn.MultiHeadAttention)"
        )
    return model
