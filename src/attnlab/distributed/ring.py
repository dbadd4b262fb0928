"""Ring attention: each rank keeps its queries; K/V shards travel around the ring.

Forward, on rank ``r`` of ``P`` (step ``t`` holds the K/V shard of rank ``s = r − t``)::

    post  send(K/V_s → r+1), recv(K/V_{s−1} ← r−1)      # the next shard is in flight ...
    O_t, L_t = attention(Q_r, K/V_s)                      # ... while this one is used
    (O, L)   = merge_states([O, O_t], [L, L_t])           # exact, float32, -inf-safe
    wait

Backward (a second ring): K/V travel as in the forward and, one step behind them,
a float32 accumulator of ``dK/dV`` for the shard's owner.  At each step the rank
adds this shard's share — the flash backward run with the *global* ``O``, ``LSE``
(``P = exp(S − LSE)``, ``Δ = rowsum(dO∘O) − dLSE``, see
:mod:`attnlab.distributed.local`) — to its own ``dQ`` and to the travelling
accumulator, and passes the accumulator on; after its last stop it goes home.
The accumulator a rank receives at step ``t`` was finished by its neighbour at step
``t − 1``, so it is in flight during this step's computation too.

Masks see global positions (:mod:`attnlab.distributed.views`), so causal,
sliding-window, document and custom masks work for every layout.  Before anything
moves, every rank computes the same ``need[r][s]`` matrix from the mask's block
classifier (:func:`attnlab.distributed.views.need_matrix`): a rank computes nothing
for an empty pair, and a shard is forwarded only while a later rank on its way still
needs it (causal + contiguous: rank ``P−1``'s shard is never sent; a sliding window
sends each shard only as far as the window reaches).

Every message is posted with ``batch_isend_irecv`` (NCCL groups them; gloo runs them
on its I/O thread), and every wait is bounded (:mod:`attnlab.distributed.failure`).
"""

from __future__ import annotations

from typing import cast

import torch

from attnlab.distributed.args import check_call, handshake
from attnlab.distributed.comm import Comm
from attnlab.distributed.layouts import padded_len, shard_positions
from attnlab.distributed.local import mod_params, tile_backward, tile_forward
from attnlab.distributed.profile import Timer
from attnlab.distributed.views import ShardMask, ShardScoreMod, need_matrix
from attnlab.ops.merge import merge_states
from attnlab.ops.reference import acc_dtype

__all__ = ["ring_attention", "RingPlan"]

TAG_KV, TAG_DKV, TAG_FINAL, TAG_V = 11, 12, 13, 14  # TAG_KV carries K, TAG_V its V


class RingPlan:
    """Who holds, computes, sends and receives what at each step; the same on every rank
    up to ``rank`` (it depends only on the call's arguments)."""

    def __init__(self, world: int, rank: int, seq_len: int, layout: str, mask, B: int, H: int, device=None):
        self.world, self.rank, self.seq_len, self.layout, self.mask = world, rank, seq_len, layout, mask
        self.positions = [shard_positions(seq_len, world, s, layout, device=device) for s in range(world)]
        self.padded = padded_len(seq_len, world, layout) != seq_len
        self.need = need_matrix(mask, self.positions, seq_len, B, H)
        P = world
        # reach[s]: ring distance of the last rank that needs shard s (0: only its owner, or nobody)
        self.reach = [max([d for d in range(P) if self.need[(s + d) % P][s]], default=0) for s in range(P)]

    def origin(self, t: int) -> int:
        return (self.rank - t) % self.world

    def holds(self, t: int) -> bool:
        return t < self.world and t <= self.reach[self.origin(t)]

    def sends_kv(self, t: int) -> bool:
        return self.holds(t) and t + 1 <= self.reach[self.origin(t)]

    def recvs_kv(self, t: int) -> bool:
        return t + 1 < self.world and t + 1 <= self.reach[(self.rank - t - 1) % self.world]

    def computes(self, t: int) -> bool:
        return self.holds(t) and self.need[self.rank][self.origin(t)]

    def views(self, s: int, score_mod):
        """The mask and score mod for this rank's queries against shard ``s``'s keys."""
        qp, kp = self.positions[self.rank], self.positions[s]
        m = None
        if self.mask is not None or self.padded:
            m = ShardMask(self.mask, qp, kp, self.seq_len)
        mod = None if score_mod is None else ShardScoreMod(score_mod, qp, kp, self.seq_len)
        return m, mod

    def acc_to(self, t: int):
        """Where the dK/dV accumulator finished at backward step ``t`` goes (sent at boundary
        ``t + 1``): ``None`` (nothing held), ``"own"`` (this rank's own, complete),
        ``(rank + 1, TAG_DKV)`` (on along the ring) or ``(owner, TAG_FINAL)`` (home)."""
        if not self.holds(t):
            return None
        s = self.origin(t)
        if self.sends_kv(t):
            return ((self.rank + 1) % self.world, TAG_DKV)
        return "own" if s == self.rank else (s, TAG_FINAL)

    def final_from(self, t: int):
        """The rank this rank's finished dK/dV comes from at boundary ``t``, or ``None``."""
        m = self.reach[self.rank]
        return (self.rank + m) % self.world if m >= 1 and t == m + 1 else None

    def sends_skipped(self) -> int:
        """K/V messages the mask saved, over the whole ring (``P·(P−1)`` without a mask)."""
        return sum(self.world - 1 - r for r in self.reach)


def _unpack(x, sa, sb):
    """Views of a flat buffer as a ``sa``-shaped and a ``sb``-shaped tensor."""
    n = 1
    for d in sa:
        n *= d
    return x[:n].view(sa), x[n:].view(sb)


def _kv_messages(plan, t, k_cur, v_cur, k_shape, v_shape, dtype, device, step_name):
    """The K/V sends and receives of step ``t``: ``(sends, recvs, k_next, v_next)``.
    K and V travel as two messages (no packing copy).  Each message's text names the
    step it is posted at (and travels during), which every error about it repeats."""
    P, r = plan.world, plan.rank
    sends, recvs, k_next, v_next = [], [], None, None
    if plan.sends_kv(t):
        what = (f"the K/V shard of rank {plan.origin(t)}", f"{step_name} {t}")
        sends += [("k", k_cur, (r + 1) % P, TAG_KV, what), ("v", v_cur, (r + 1) % P, TAG_V, what)]
    if plan.recvs_kv(t):
        k_next = torch.empty(k_shape, dtype=dtype, device=device)
        v_next = torch.empty(v_shape, dtype=dtype, device=device)
        what = (f"the K/V shard of rank {(r - t - 1) % P}", f"{step_name} {t}, for step {t + 1}")
        recvs += [("k_in", k_next, (r - 1) % P, TAG_KV, what), ("v_in", v_next, (r - 1) % P, TAG_V, what)]
    return sends, recvs, k_next, v_next


def ring_forward(plan: RingPlan, comm: Comm, q, k, v, score_mod, scale):
    acc = acc_dtype(q.dtype)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    o_acc = l_acc = None
    for t in range(plan.world):
        if not (plan.holds(t) or plan.recvs_kv(t)):
            continue
        timer = Timer("ring fwd", t, plan.computes(t))
        b0 = comm.bytes_sent
        sends, recvs, k_next, v_next = _kv_messages(
            plan, t, k_cur, v_cur, k.shape, v.shape, k.dtype, q.device, "forward step"
        )
        pend = comm.start(sends, recvs)  # the next shard is in flight ...
        if plan.computes(t):  # ... while this one is used
            with timer.compute():
                m, mod = plan.views(plan.origin(t), score_mod)
                o, l = tile_forward(q, k_cur, v_cur, mask=m, score_mod=mod, scale=scale)
                o = o.to(acc)
                if o_acc is None or l_acc is None:
                    o_acc, l_acc = o, l
                else:
                    o_acc, l_acc = merge_states([o_acc, o], [l_acc, l])
                del o, l
        with timer.wait():
            pend.wait_all()
        timer.done(comm.bytes_sent - b0)
        k_cur, v_cur = k_next, v_next
    if o_acc is None:  # nothing visible to any of these queries (or all of them are padding)
        B, H, C, _ = q.shape
        return (
            torch.zeros(B, H, C, v.shape[-1], dtype=q.dtype, device=q.device),
            torch.full((B, H, C), float("-inf"), dtype=acc, device=q.device),
        )
    return o_acc.to(q.dtype), l_acc


def ring_backward(plan: RingPlan, comm: Comm, q, k, v, out, lse, dout, dlse, score_mod, scale, params):
    P, r = plan.world, plan.rank
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dparams = [torch.zeros_like(p) for p in params]
    k_cur, v_cur = k.contiguous(), v.contiguous()
    n = k.numel() + v.numel()  # the dK/dV accumulator: one flat buffer in the accumulation dtype
    own = None
    pending = None  # the accumulator finished at the previous step, sent at this boundary
    for t in range(P + 1):
        holds, src = plan.holds(t), plan.final_from(t)
        recv_acc = t >= 1 and holds  # the accumulator the previous rank finished at step t-1
        if not (holds or plan.recvs_kv(t) or src is not None or pending is not None):
            continue
        timer = Timer("ring bwd", t, plan.computes(t))
        b0 = comm.bytes_sent
        sends, recvs, k_next, v_next = _kv_messages(
            plan, t, k_cur, v_cur, k.shape, v.shape, k.dtype, q.device, "backward step"
        )
        if pending is not None:
            sends.append(pending)
        pending = None
        acc_in = fin = None
        if recv_acc:
            acc_in = torch.empty(n, dtype=acc, device=q.device)
            recvs.append(
                (
                    "dkv_in",
                    acc_in,
                    (r - 1) % P,
                    TAG_DKV,
                    (f"the dK/dV accumulator of rank {plan.origin(t)}'s shard", f"backward step {t}"),
                )
            )
        if src is not None:
            fin = torch.empty(n, dtype=acc, device=q.device)
            recvs.append(("final", fin, src, TAG_FINAL, (f"rank {r}'s finished dK/dV", f"backward step {t}")))
        pend = comm.start(sends, recvs)
        if holds:
            dk_s = dv_s = None
            if plan.computes(t):
                with timer.compute():
                    m, mod = plan.views(plan.origin(t), score_mod)
                    dq_s, dk_s, dv_s, dp = tile_backward(
                        q, k_cur, v_cur, out, lse, dout, dlse, mask=m, score_mod=mod, scale=scale, params=params
                    )
                    dq += dq_s
                    del dq_s
                    for a_, g in zip(dparams, dp, strict=True):
                        a_ += g
            if recv_acc:
                with timer.wait():
                    pend.wait("dkv_in")
                a = acc_in
            else:
                a = torch.zeros(n, dtype=acc, device=q.device)
            if dk_s is not None:
                ak, av = _unpack(a, k.shape, v.shape)
                ak.add_(dk_s)
                av.add_(dv_s)
                del dk_s, dv_s
            dest = plan.acc_to(t)
            if dest == "own":
                own = a
            else:
                peer, tag = dest
                what = (
                    f"the dK/dV accumulator of rank {plan.origin(t)}'s shard"
                    if tag == TAG_DKV
                    else f"rank {peer}'s finished dK/dV",
                    f"backward step {t + 1}",
                )
                pending = ("dkv" if tag == TAG_DKV else "final", a, peer, tag, what)
        with timer.wait():
            pend.wait_all()
        timer.done(comm.bytes_sent - b0)
        if fin is not None:
            own = fin
        k_cur, v_cur = k_next, v_next
    if own is None:
        own = torch.zeros(n, dtype=acc, device=q.device)
    dk, dv = _unpack(own, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, comm, score_mod, scale, q, k, v, *params):
        out, lse = ring_forward(plan, comm, q, k, v, score_mod, scale)
        ctx.plan, ctx.comm, ctx.score_mod, ctx.scale = plan, comm, score_mod, scale
        ctx.save_for_backward(q, k, v, out, lse, *params)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *params = ctx.saved_tensors
        dq, dk, dv, dparams = ring_backward(
            ctx.plan, ctx.comm, q, k, v, out, lse, dout, dlse, ctx.score_mod, ctx.scale, params
        )
        return (None, None, None, None, dq, dk, dv, *dparams)


def ring_attention(
    q,
    k,
    v,
    *,
    group=None,
    mask=None,
    score_mod=None,
    scale=None,
    layout: str = "contiguous",
    seq_len: int | None = None,
    return_lse: bool = False,
    timeout=None,
):
    """Attention of a sequence sharded over the ranks of ``group``; forward and backward.

    Each rank passes its shard (:func:`attnlab.distributed.shard_sequence` with the
    same ``layout``) and gets the output rows of its own queries::

        q (B, H, C, D), k (B, Hkv, C, D), v (B, Hkv, C, Dv)   ->   out (B, H, C, Dv)
                                                                 [lse (B, H, C)]

    equal to rows ``shard_positions(seq_len, P, rank, layout)`` of
    ``attnlab.attention(Q, K, V, mask=mask, score_mod=score_mod)`` on the whole
    sequence (self-attention, query ``i`` and key ``i`` at global position ``i``).
    Padded rows (positions ``>= seq_len``) give 0 and LSE ``-inf``.

    Args:
        group: a ``torch.distributed`` process group (default: the world).
        mask, score_mod: as for :func:`attnlab.attention`, in global positions.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"`` (balance the causal
            triangle with the last two).
        seq_len: the whole sequence's length (default ``P·C``: no padding).
        timeout: seconds any wait may take (default :func:`attnlab.distributed.get_timeout`);
            a rank that died or never calls makes the others raise
            :class:`attnlab.distributed.PeerFailureError` / :class:`PeerTimeoutError`.

    Every rank of the group must call it with shards of the same problem and, when
    training, run its backward: the backward is a ring too.  A handshake compares the
    whole call's fingerprint (:mod:`attnlab.distributed.fingerprint`: shapes, dtypes,
    layout, ``seq_len``, the mask and score mod with their parameters, scale, ...) and
    every rank raises the same ``ValueError`` naming what differs; an argument error on
    some ranks only is reported to all of them the same way.
    Gradients of a score mod's parameters are this rank's share; sum them over the
    ranks as for every other replicated weight (DDP/FSDP over the group does).
    """
    comm = Comm(group, timeout, "ring_attention")
    error, params = None, []
    try:
        scale, seq_len = check_call(
            "ring_attention",
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            layout=layout,
            seq_len=seq_len,
            return_lse=return_lse,
            world=comm.world,
        )
        params = mod_params(score_mod, dtype=acc_dtype(q.dtype), device=q.device)  # declared or captured
    except (ValueError, TypeError) as e:  # every rank learns of it in the handshake, not by a timeout
        error = e
    handshake(
        comm,
        "ring_attention",
        q,
        k,
        v,
        seq_len=seq_len,
        layout=layout,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        return_lse=return_lse,
        params=params,
        error=error,
    )
    # the handshake raised on every rank unless check_call resolved seq_len
    plan = RingPlan(comm.world, comm.rank, cast(int, seq_len), layout, mask, q.shape[0], q.shape[1], device=q.device)
    out, lse = _RingFn.apply(plan, comm, score_mod, scale, q, k, v, *params)
    return (out, lse) if return_lse else out
