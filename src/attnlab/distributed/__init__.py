"""Attention across processes on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

* :func:`ring_attention` — K/V shards travel a ring of point-to-point messages,
  overlapped with the tile computation; partial results merge with
  :func:`attnlab.merge_states`; the backward is a second ring for dK/dV.
* :func:`ulysses_attention` — all-to-all from sequence shards to head shards, local
  attention with any backend, all-to-all back.
* Layouts and sharding (:mod:`~attnlab.distributed.layouts`): ``"contiguous"``,
  ``"zigzag"``, ``"striped"``; :func:`shard_sequence`, :func:`unshard_sequence`,
  :func:`gather_sequence`, :func:`shard_positions`, :func:`work_per_rank`.
* :class:`ContextParallel` / :func:`enable_context_parallel` — run a model's attention
  modules context-parallel.
* Failures (:mod:`~attnlab.distributed.failure`): every wait is bounded; a dead or
  absent rank raises :class:`PeerFailureError` / :class:`PeerTimeoutError`.
* :func:`run_local` — a local gloo group of spawned processes (tests, benchmarks).

Positions are global everywhere: a mask or score mod sees the same positions it
would see in a single-process call on the whole sequence.  See docs/distributed.md.

>>> import attnlab.distributed as D
>>> D.shard_positions(8, 2, 1, "zigzag").tolist()
[2, 3, 4, 5]
"""

from attnlab.distributed.context import ContextParallel, enable_context_parallel
from attnlab.distributed.failure import (
    DistributedAttentionError,
    PeerFailureError,
    PeerTimeoutError,
    get_timeout,
    set_timeout,
)
from attnlab.distributed.launch import RankError, run_local
from attnlab.distributed.layouts import (
    LAYOUTS,
    balance,
    gather_sequence,
    padded_len,
    shard_len,
    shard_positions,
    shard_sequence,
    unshard_sequence,
    work_per_rank,
)
from attnlab.distributed.profile import profile
from attnlab.distributed.ring import ring_attention
from attnlab.distributed.ulysses import ulysses_attention

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "LAYOUTS",
    "shard_positions",
    "shard_len",
    "padded_len",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "work_per_rank",
    "balance",
    "ContextParallel",
    "enable_context_parallel",
    "DistributedAttentionError",
    "PeerFailureError",
    "PeerTimeoutError",
    "set_timeout",
    "get_timeout",
    "profile",
    "run_local",
    "RankError",
]
