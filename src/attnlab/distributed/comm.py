"""The few torch.distributed operations distributed attention uses, with guarded waits.

* point-to-point messages posted together with ``dist.batch_isend_irecv`` (on NCCL
  that groups them, so a ring of sends and receives cannot deadlock; on gloo each
  runs asynchronously in gloo's I/O thread while this thread computes);
* ``all_to_all_single``, ``all_gather_into_tensor`` and ``all_reduce`` for Ulysses,
  gathering sequences and the argument handshake.

Every call that posts an operation goes through
:func:`attnlab.distributed.failure.guarded_post` and every wait through
:func:`~attnlab.distributed.failure.guarded_wait`: whatever the backend raises (a peer
that died, a timeout) becomes a :class:`~attnlab.distributed.PeerFailureError` /
:class:`~attnlab.distributed.PeerTimeoutError` naming this rank, the peer and the
message or collective (with its ring step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnlab.distributed.failure import guarded_post, guarded_wait, resolve_timeout

__all__ = ["Comm", "Pending"]


class Comm:
    """A process group seen from this rank: group ranks, timeouts, guarded operations."""

    def __init__(self, group, timeout, op: str):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{op}: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group('gloo' or 'nccl', ...) on every rank first "
                "(attnlab.distributed.run_local does it for a local test group)"
            )
        self.group = group
        self.op = op
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError(f"{op}: group: this process is not a member of the group it was given")
        self.timeout_s = resolve_timeout(timeout)
        # NCCL coalesces a batch of point-to-point operations (and needs to, or a ring of
        # blocking sends could deadlock); gloo runs each on its I/O thread.  Anything but
        # a plain gloo group ("nccl", "cpu:gloo,cuda:nccl", ...) keeps batch_isend_irecv.
        self.coalesce = str(dist.get_backend(group)) != "gloo"
        self.bytes_sent = 0
        self.bytes_received = 0

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def start(self, sends, recvs) -> Pending:
        """Post ``sends`` and ``recvs`` — lists of ``(name, tensor, group_peer, tag, what)``,
        ``what`` naming the message, or ``(message, step)`` (``("the K/V shard of rank 0",
        "forward step 0")``) — as one batch; returns a :class:`Pending` to wait on by name.

        On gloo (where ``batch_isend_irecv`` is a loop over ``isend``/``irecv`` anyway)
        each message is posted on its own, so an error names the exact message and peer;
        on any other backend (NCCL) the batch is one ``batch_isend_irecv`` (coalesced: a
        ring of sends and receives cannot deadlock) and an error names all its messages.
        Posting is guarded like waiting."""
        ops: list[dist.P2POp] = []
        meta: list[tuple[str, int, str, torch.Tensor, str]] = []
        for kind, items in ((dist.isend, sends), (dist.irecv, recvs)):
            for name, t, peer, tag, what in items:
                ops.append(dist.P2POp(kind, t, self.global_rank(peer), self.group, tag))
                key = ("send " if kind is dist.isend else "recv ") + name
                if any(m[0] == key for m in meta):
                    raise AssertionError(f"two messages named {key!r} in one batch")  # internal invariant
                what, step = what if isinstance(what, tuple) else (what, None)
                step = f" ({step})" if step else ""
                waits = f"rank {peer} to take {what}{step}" if kind is dist.isend else f"{what} from rank {peer}{step}"
                posting = (
                    f"the send of {what} to rank {peer}{step}"
                    if kind is dist.isend
                    else f"the receive of {what} from rank {peer}{step}"
                )
                meta.append((key, peer, waits, t, posting))
                if kind is dist.isend:
                    self.bytes_sent += t.numel() * t.element_size()
                else:
                    self.bytes_received += t.numel() * t.element_size()
        if not ops:
            return Pending(self, [], [])
        postings = [m[4] for m in meta]
        if self.coalesce:
            peers = sorted({m[1] for m in meta})
            works = self.post(
                lambda: dist.batch_isend_irecv(ops),
                peer=peers[0] if len(peers) == 1 else None,
                what="; ".join(postings),
            )
            return Pending(self, works, meta)
        works = []
        for p2p, m, what in zip(ops, meta, postings, strict=True):
            # (if one fails, the works already posted are dropped with the exception: gloo
            # cancels them, and the group is unusable anyway)
            works.append(
                self.post(lambda p2p=p2p: p2p.op(p2p.tensor, p2p.peer, p2p.group, p2p.tag), peer=m[1], what=what)
            )
        return Pending(self, works, meta)

    def _peer(self, peer):
        # a collective of two ranks has one peer: name it
        return 1 - self.rank if peer is None and self.world == 2 else peer

    def post(self, fn, *, peer, what):
        """``fn()`` (it starts a communication), its backend errors translated."""
        return guarded_post(fn, timeout_s=self.timeout_s, op=self.op, rank=self.rank, peer=self._peer(peer), what=what)

    def wait(self, work, *, peer, what):
        guarded_wait(work, timeout_s=self.timeout_s, op=self.op, rank=self.rank, peer=self._peer(peer), what=what)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> torch.Tensor:
        """Equal-split ``all_to_all_single`` along dim 0 (``out`` is filled and returned)."""
        work = self.post(
            lambda: dist.all_to_all_single(out, inp, group=self.group, async_op=True), peer=None, what=what
        )
        self.bytes_sent += inp.numel() * inp.element_size() * (self.world - 1) // max(1, self.world)
        self.wait(work, peer=None, what=what)
        return out

    def all_gather(self, inp: torch.Tensor, what: str) -> torch.Tensor:
        """``(world, *inp.shape)``: every rank's ``inp``."""
        flat = inp.contiguous().view(-1)
        out = torch.empty(self.world * flat.numel(), dtype=inp.dtype, device=inp.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = self.post(lambda: gather(out, flat, group=self.group, async_op=True), peer=None, what=what)
        self.wait(work, peer=None, what=what)
        return out.view(self.world, *inp.shape)

    def all_reduce(self, t: torch.Tensor, what: str) -> torch.Tensor:
        work = self.post(lambda: dist.all_reduce(t, group=self.group, async_op=True), peer=None, what=what)
        self.wait(work, peer=None, what=what)
        return t


class Pending:
    """Messages in flight.  ``wait(name)`` waits for the receive ``name`` (or, with a
    ``"send "`` prefix, the send), ``wait_all()`` for the rest.

    Every work object is kept until it has been waited on: gloo cancels an operation
    whose work object is destroyed.  (NCCL may coalesce a batch into a single work
    object; then any wait waits for all.)"""

    def __init__(self, comm: Comm, works, meta):
        self.comm = comm
        self.meta = meta
        self._keep = list(works)
        if len(works) == len(meta):
            self.works = {m[0]: (w, m) for w, m in zip(works, meta, strict=True)}
            self.coalesced = None
        else:
            self.works = {}
            self.coalesced = (list(works), meta)

    def wait(self, name: str) -> None:
        if self.coalesced is not None:
            self.wait_all()
            return
        if not name.startswith(("send ", "recv ")):
            name = "recv " + name
        item = self.works.pop(name, None)
        if item is not None:
            w, (_, peer, what, _t, _n) = item
            self.comm.wait(w, peer=peer, what=what)

    def wait_all(self) -> None:
        if self.coalesced is not None:
            works, meta = self.coalesced
            self.coalesced = ([], meta)
            what = ", ".join(m[2] for m in meta)
            peers = sorted({m[1] for m in meta})
            for w in works:
                self.comm.wait(w, peer=peers[0] if len(peers) == 1 else None, what=what)
            return
        for name in list(self.works):
            self.wait(name)
        self._keep = []
