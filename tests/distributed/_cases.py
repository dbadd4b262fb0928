"""Problems for the distributed tests, built identically in the test process and in the
spawned ranks (same seeds), and the functions the ranks run.

A case is a plain dict (it crosses process boundaries).  Every rank shards the whole
problem's q, k, v and loss weights with the case's layout, runs ring or Ulysses
attention forward and backward on

    loss = (out * w).sum() + (lse_finite * c).sum()

and returns its shards of out, lse, dq, dk, dv (and its share of a score mod's
parameter gradient); the test process puts the shards back together and compares
them with the single-process reference on the whole sequence.
"""

from __future__ import annotations

import os
import time

import torch

import attnlab
import attnlab.distributed as D
from attnlab import masks, scores

DT = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16}


def case(
    name,
    method="ring",
    layout="contiguous",
    N=37,
    mask="causal",
    B=1,
    H=4,
    Hkv=2,
    Dh=16,
    Dv=None,
    dtype="f32",
    mod=None,
    seed=0,
):
    return dict(
        name=name,
        method=method,
        layout=layout,
        N=N,
        mask=mask,
        B=B,
        H=H,
        Hkv=Hkv,
        D=Dh,
        Dv=Dh if Dv is None else Dv,
        dtype=dtype,
        mod=mod,
        seed=seed,
    )


def case_id(c) -> str:
    return c["name"]


def build_mask(name, N, B):
    ids = torch.arange(N) * 3 // N  # three documents, packed
    if name == "full":
        return None
    if name == "causal":
        return masks.causal()
    if name == "window7":
        return masks.sliding_window(7)
    if name == "doc_causal":
        return masks.document(ids) & masks.causal()
    if name == "doc":
        return masks.document(ids)
    if name == "prefix":
        return masks.prefix_lm(N // 3)
    if name == "holes":  # causal without the diagonal: row 0 sees no key at all
        return masks.causal() & ~masks.sliding_window(1)
    if name == "keypad":  # left padding in batch 1: its first 5 rows see nothing
        keep = torch.ones(B, N, dtype=torch.bool)
        keep[-1, :5] = False
        return masks.key_padding(keep) & masks.causal()
    if name == "heads":  # depends on the head index, classified only by evaluation
        return masks.custom(lambda b, h, q, kv: (kv <= q) & ((q - kv) % (h + 2) != 1))
    raise ValueError(name)


def mod_param(c):
    if c["mod"] == "alibi":
        return torch.linspace(0.05, 0.4, c["H"], dtype=torch.float64)
    return None


def build_mod(c, param):
    if c["mod"] is None:
        return None
    if c["mod"] == "alibi":
        return scores.alibi(param)
    raise ValueError(c["mod"])


def inputs(c):
    """q, k, v in the case's dtype and the float64 loss weights w, c."""
    g = torch.Generator().manual_seed(1000 + c["seed"])
    dt = DT[c["dtype"]]
    B, H, Hkv, N, Dh, Dv = c["B"], c["H"], c["Hkv"], c["N"], c["D"], c["Dv"]
    q = torch.randn(B, H, N, Dh, generator=g, dtype=torch.float64).to(dt)
    k = torch.randn(B, Hkv, N, Dh, generator=g, dtype=torch.float64).to(dt)
    v = torch.randn(B, Hkv, N, Dv, generator=g, dtype=torch.float64).to(dt)
    w = torch.randn(B, H, N, Dv, generator=g, dtype=torch.float64)
    cw = torch.randn(B, H, N, generator=g, dtype=torch.float64)
    return q, k, v, w, cw


def loss_of(out, lse, w, cw):
    lf = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return (out.double() * w).sum() + (lf.double() * cw).sum()


def reference(c, dtype=None):
    """The single-process answer on the whole sequence (backend="reference"), in ``dtype``
    (default: the case's); float64 gives the oracle."""
    q, k, v, w, cw = inputs(c)
    dt = DT[c["dtype"]] if dtype is None else dtype
    pdt = torch.float64 if dt == torch.float64 else torch.float32
    q, k, v = (x.to(dt).requires_grad_() for x in (q, k, v))
    p = mod_param(c)
    p = None if p is None else p.to(pdt).requires_grad_()
    out, lse = attnlab.attention(
        q,
        k,
        v,
        mask=build_mask(c["mask"], c["N"], c["B"]),
        score_mod=build_mod(c, p),
        return_lse=True,
        backend="reference",
    )
    loss_of(out, lse, w, cw).backward()
    res = {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if p is not None:
        res["dparam"] = p.grad
    return res


def run_one(c, rank, world):
    q, k, v, w, cw = inputs(c)
    lay = c["layout"]

    def sh(x):
        return D.shard_sequence(x, dim=2, layout=lay, rank=rank, world_size=world)

    qs, ks, vs = (sh(x).requires_grad_() for x in (q, k, v))
    ws, cs = sh(w), sh(cw)
    p = mod_param(c)
    p = None if p is None else p.to(torch.float64 if c["dtype"] == "f64" else torch.float32).requires_grad_()
    fn = D.ring_attention if c["method"] == "ring" else D.ulysses_attention
    with D.profile() as prof:
        out, lse = fn(
            qs,
            ks,
            vs,
            mask=build_mask(c["mask"], c["N"], c["B"]),
            score_mod=build_mod(c, p),
            layout=lay,
            seq_len=c["N"],
            return_lse=True,
            timeout=30,
        )
        loss_of(out, lse, ws, cs).backward()
    res = {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": qs.grad,
        "dk": ks.grad,
        "dv": vs.grad,
        "fwd": prof.summary("ring fwd"),
        "bwd": prof.summary("ring bwd"),
    }
    if p is not None:
        res["dparam"] = p.grad
    return res


def run_cases(rank, world, cases):
    """What each rank of a test group runs: every case, then the extra checks."""
    results = {}
    for c in cases:
        try:
            results[c["name"]] = run_one(c, rank, world)
        except (ValueError, TypeError) as e:  # reported per case, the group keeps going
            results[c["name"]] = {"error": f"{type(e).__name__}: {e}"}
    results["__mismatch__"] = _mismatch(rank, world)
    results["__gather__"] = _gather(rank, world)
    return results


def _gather(rank, world):
    """gather_sequence of every rank's zigzag shard, and its gradient through a loss that
    every rank computes on the whole sequence."""
    N = 23
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, N, 3, generator=g, dtype=torch.float64)
    w = torch.randn(2, N, 3, generator=g, dtype=torch.float64)
    xs = D.shard_sequence(x, dim=1, layout="zigzag", rank=rank, world_size=world).requires_grad_()
    full = D.gather_sequence(xs, dim=1, seq_len=N, layout="zigzag", timeout=30)
    (full * w).sum().backward()
    return {
        "full": full.detach(),
        "x": x,
        "grad": xs.grad,
        "want_grad": world * D.shard_sequence(w, dim=1, layout="zigzag", rank=rank, world_size=world),
    }


def _mismatch(rank, world):
    """Ranks that disagree on seq_len all get the same ValueError from the handshake."""
    c = case("mm", N=24)
    q, k, v, _, _ = inputs(c)
    sh = lambda x: D.shard_sequence(x, dim=2, rank=rank, world_size=world)  # noqa: E731
    try:
        D.ring_attention(sh(q), sh(k), sh(v), mask=masks.causal(), seq_len=24 - rank % 2, timeout=30)
    except ValueError as e:
        return str(e)
    return "no error"


# --------------------------------------------------------------------------- failures
def failing_group(rank, world, T):
    """Six ranks, three pairs (subgroups), three ways to fail; the first rank of each pair
    returns, per call, the exception's type name, its message and the seconds it took.

    * ranks 0, 1 — rank 1 never calls and dies after ``2 T``; rank 0's ring call (timeout
      60 s) must report the dead peer at once: ``PeerFailureError``.
    * ranks 2, 3 — rank 3 passes the handshake and hangs inside the ring (5 T, then dies); rank
      2's ring call (timeout ``T``) must time out waiting for the K/V shard; a second call
      must fail at once (gloo closed the connection after the timeout).
    * ranks 4, 5 — rank 5 never calls Ulysses attention; rank 4's call (timeout ``T``)
      must time out in the handshake.
    """
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3]), dist.new_group([4, 5])]
    g = groups[rank // 2]
    c = case("f", N=16)
    q, k, v, _, _ = inputs(c)
    sh = lambda x: D.shard_sequence(x, dim=2, rank=rank % 2, world_size=2)  # noqa: E731

    def attempt(fn, timeout):
        t0 = time.perf_counter()
        try:
            fn(sh(q), sh(k), sh(v), group=g, timeout=timeout)
            return ("no error", "", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return (type(e).__name__, str(e), time.perf_counter() - t0)

    if rank == 1:
        time.sleep(2 * T)
        os._exit(3)  # dies without a word
    if rank == 3:
        import attnlab.distributed.ring as ring

        # Long past rank 2's timeout T, and past the T + 5 s test_failure.py allows rank 2's first
        # call (it starts before rank 3 hangs): whenever that bound holds, rank 3 is still hanging
        # when rank 2 times out.  (It raced at 2.5 T when each rank imported torch._dynamo inside
        # its first call, seconds on loaded cores; the forkserver preloads it now.)
        def hang(*args):
            time.sleep(5 * T)
            os._exit(3)

        ring.ring_forward = hang
        D.ring_attention(sh(q), sh(k), sh(v), group=g, timeout=60)
    if rank == 5:
        time.sleep(2 * T)
        return []
    if rank == 0:
        return [attempt(D.ring_attention, 60.0)]
    if rank == 2:
        return [attempt(D.ring_attention, T), attempt(D.ring_attention, 60.0)]
    return [attempt(D.ulysses_attention, T)]


# --------------------------------------------------------------------------- nn
def mha_setup(seed=0):
    from attnlab.nn import MultiHeadAttention
    from attnlab.positions import RoPE

    torch.manual_seed(seed)
    mha = MultiHeadAttention(32, n_heads=4, n_kv_heads=2, positions=RoPE(8))
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(seed + 1))
    gy = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(seed + 2))
    return mha, x, gy


def mha_group(rank, world, configs):
    """The module context-parallel: output and gradients of this rank's shard."""
    mha, x, gy = mha_setup()
    res = {}
    for method, layout in configs:
        cp = D.ContextParallel(method=method, layout=layout, seq_len=x.shape[1], timeout=30)
        D.enable_context_parallel(mha, cp)
        mha.zero_grad()
        xs = D.shard_sequence(x, dim=1, layout=layout).requires_grad_()
        y = mha(xs, mask=masks.causal())
        (y * D.shard_sequence(gy, dim=1, layout=layout)).sum().backward()
        res[f"{method}-{layout}"] = {
            "y": y.detach(),
            "dx": xs.grad,
            "dw": {n: p.grad.clone() for n, p in mha.named_parameters()},
        }
        D.enable_context_parallel(mha, None)
    return res
