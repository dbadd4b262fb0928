"""``attnlab bench distributed``: ring and Ulysses attention on P local gloo ranks against
one process holding the whole sequence.

For each sequence length ``N`` and group size ``P`` one group of ``P`` processes (one
torch thread each) runs every variant — ring attention in the three layouts and
Ulysses — forward and backward under a causal mask, in interleaved rounds (A, B, C,
D, A, B, ...; medians).  A round's time is the slowest rank's (a ring step ends when
its slowest member does).  The single-process anchors (``attnlab.attention`` with
``auto`` — torch SDPA here — and with the ``flash`` kernel the ring runs on each
shard, with one thread: the ideal ring time on P cores is that divided by P) run in one
process.  With 4 ranks the 2-core machine is oversubscribed two to one; read the
ratios.  (The flash kernel is many small torch operations; with 2 threads on a loaded
machine every one of them waits in an OpenMP barrier for a descheduled thread, which
made it up to 7x slower than with 1 thread here — so its anchor runs on 1 thread.)

Per variant it reports:

* time of forward and of forward+backward, and ``speed`` = single-process time /
  distributed time (against both anchors);
* peak memory per rank — the shard's inputs plus the peak extra resident memory of a
  forward+backward (:func:`attnlab.bench.measure.peak_extra_bytes`, in the timed calls;
  malloc's mmap threshold is set to 4 MiB with ``mallopt`` so that every big buffer goes
  back to the OS when freed and the high-water mark follows the allocations: within
  about 10% of :mod:`attnlab.bench.memprobe`'s 64 KiB setting, which slows the flash
  kernel too much to time in the same run) — and its ratio to the single process's
  (the target is about ``1/P``);
* communication: ``wait`` — seconds a rank spent waiting after its computation, over
  all steps (this includes waiting for a peer still busy with its own step); ``wire``
  — the part of it spent on the wire itself: at each step, from ``max(own computation
  done, every rank has posted this step's messages)`` to the end of the wait (ranks
  share one clock, ``time.perf_counter``); ``comm`` — the time of the same message
  schedule with the computation stubbed out; ``hidden = 1 − wire / comm`` (clipped to
  [0, 1]).  Ulysses' all-to-alls have nothing to overlap with: its ``wire`` is its
  all-to-all time and its hidden fraction 0 by construction;
* ``cpu%`` — CPU time / wall time of a forward+backward, averaged over the ranks: the
  share of a core each rank actually got (the machine is shared);
* causal load balance: max/min over the ranks of the allowed (query, key) pairs
  (exact, :func:`attnlab.distributed.work_per_rank`) and of the measured compute time.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from attnlab.bench.measure import memory_supported, peak_extra_bytes

MiB = 1 << 20
VARIANTS = (("ring", "contiguous"), ("ring", "zigzag"), ("ring", "striped"), ("ulysses", "contiguous"))
ANCHORS = (("auto", 2), ("flash", 1))  # (backend, torch threads)
MMAP_THRESHOLD = 4 << 20


def _malloc_setup() -> None:
    """Buffers of ``MMAP_THRESHOLD`` bytes or more come from and go back to the OS."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also stops glibc's dynamic threshold)
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD: give freed heap tops back at once
    except (OSError, AttributeError):  # not glibc: the measurement is looser
        pass


@dataclass
class Config:
    N: int
    P: int
    B: int = 1
    H: int = 4
    Hkv: int = 2
    D: int = 64
    reps: int = 2

    @property
    def name(self) -> str:
        return f"N={self.N} P={self.P}"


def _tick(path):
    if path:
        with open(path, "a") as f:
            f.write("x\n")


def _flops(N, H, D, causal=True):
    pairs = N * (N + 1) // 2 if causal else N * N
    return 4.0 * D * pairs * H


def _rank_main(rank, world, spec):
    """One rank of a group: every variant in interleaved rounds, then comm-only passes."""
    import torch.distributed as dist

    import attnlab.distributed as D
    from attnlab import masks
    from attnlab.distributed import ring as ring_mod, ulysses as uly_mod

    _malloc_setup()
    N, B, H, Hkv, Dh = spec["N"], spec["B"], spec["H"], spec["Hkv"], spec["D"]
    C = D.shard_len(N, world, "zigzag")
    g = torch.Generator().manual_seed(100 + rank)
    q = torch.randn(B, H, C, Dh, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, C, Dh, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, C, Dh, generator=g).requires_grad_()
    dout = torch.randn(B, H, C, Dh, generator=g)
    mask = masks.causal()
    inputs_mib = sum(t.numel() * t.element_size() for t in (q, k, v, dout)) / MiB

    def call(method, layout):
        fn = D.ring_attention if method == "ring" else D.ulysses_attention
        return fn(q, k, v, mask=mask, layout=layout, seq_len=N, timeout=spec["timeout"])

    def once(method, layout):
        for t in (q, k, v):
            t.grad = None
        res: dict[str, float] = {}

        def run():
            dist.barrier()
            with D.profile() as prof:
                c0, t0 = time.process_time(), time.perf_counter()
                out = call(method, layout)
                t1 = time.perf_counter()
                out.backward(dout)
                t2, c2 = time.perf_counter(), time.process_time()
            res.update(
                fwd=t1 - t0,
                fwdbwd=t2 - t0,
                cpu=c2 - c0,
                compute=prof.summary()["compute_s"],
                wait=prof.summary()["wait_s"],
                bytes=prof.summary()["bytes_sent"],
                steps=prof.as_dicts(),
            )
            return out, q.grad, k.grad, v.grad

        if spec["memory"]:
            res["peak_extra_mib"] = peak_extra_bytes(run, warmup=False) / MiB
        else:
            run()
        gc.collect()
        return res

    # warm-up on a small problem: gloo connections, allocator, code paths
    small = {"q": q, "k": k, "v": v}
    qq, kk, vv = (x.detach()[:, :, :64].clone().requires_grad_() for x in (q, k, v))
    for method, layout in spec["variants"]:
        fn = D.ring_attention if method == "ring" else D.ulysses_attention
        fn(qq, kk, vv, mask=mask, layout=layout, timeout=spec["timeout"]).sum().backward()
    del small
    recs: dict[str, list[dict]] = {f"{m} {l}": [] for m, l in spec["variants"]}
    for _ in range(spec["reps"]):
        for method, layout in spec["variants"]:
            recs[f"{method} {layout}"].append(once(method, layout))
            if rank == 0:
                _tick(spec["progress"])
    # the same message schedule with the computation stubbed out
    comm_only = {}
    saved = (ring_mod.tile_forward, ring_mod.tile_backward, uly_mod.attention)

    def fwd_stub(q, k, v, **kw):  # the names of ring_mod.tile_forward's arguments
        B_, H_, n_, _ = q.shape
        return (
            torch.zeros(B_, H_, n_, v.shape[-1], dtype=q.dtype),
            torch.full((B_, H_, n_), float("-inf"), dtype=torch.float32),
        )

    def bwd_stub(q, k, v, *a, params=(), **kw):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), []

    def att_stub(q, k, v, **kw):
        return q[..., : v.shape[-1]] * 0

    ring_mod.tile_forward, ring_mod.tile_backward, uly_mod.attention = fwd_stub, bwd_stub, att_stub
    try:
        for method, layout in spec["variants"]:
            ts = []
            for _ in range(3):
                for t in (q, k, v):
                    t.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                call(method, layout).backward(dout)
                ts.append(time.perf_counter() - t0)
            comm_only[f"{method} {layout}"] = statistics.median(ts)
    finally:
        ring_mod.tile_forward, ring_mod.tile_backward, uly_mod.attention = saved
    return {"recs": recs, "comm_only": comm_only, "inputs_mib": inputs_mib}


def _single_main(rank, world, spec):
    """The anchors: the whole sequence in one process (2 threads)."""
    import attnlab
    from attnlab import masks

    _malloc_setup()
    N, B, H, Hkv, Dh = spec["N"], spec["B"], spec["H"], spec["Hkv"], spec["D"]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, N, Dh, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, N, Dh, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, N, Dh, generator=g).requires_grad_()
    dout = torch.randn(B, H, N, Dh, generator=g)
    mask = masks.causal()
    inputs_mib = sum(t.numel() * t.element_size() for t in (q, k, v, dout)) / MiB
    for be, threads in ANCHORS:  # warm-up
        torch.set_num_threads(threads)
        x = [t.detach()[:, :, :256].clone().requires_grad_() for t in (q, k, v)]
        attnlab.attention(*x, mask=mask, backend=be).sum().backward()
    recs: dict[str, list[dict]] = {be: [] for be, _ in ANCHORS}
    for _ in range(spec["reps"]):
        for be, threads in ANCHORS:
            torch.set_num_threads(threads)
            for t in (q, k, v):
                t.grad = None
            res: dict[str, float] = {}

            def run(be=be, res=res):
                c0, t0 = time.process_time(), time.perf_counter()
                out = attnlab.attention(q, k, v, mask=mask, backend=be)
                t1 = time.perf_counter()
                out.backward(dout)
                res.update(fwd=t1 - t0, fwdbwd=time.perf_counter() - t0, cpu=time.process_time() - c0)
                return out, q.grad, k.grad, v.grad

            if spec["memory"]:
                res["peak_extra_mib"] = peak_extra_bytes(run, warmup=False) / MiB
            else:
                run()
            gc.collect()
            recs[be].append(res)
            _tick(spec["progress"])
    return {"recs": recs, "inputs_mib": inputs_mib, "threads": dict(ANCHORS)}


def _launch(fn, world, spec, threads, bar, timeout):
    """Run a group in a thread and move the progress bar as rank 0 ticks its file."""
    from attnlab.distributed import run_local

    fd, path = tempfile.mkstemp(prefix="attnlab-bench-progress-")
    os.close(fd)
    spec = {**spec, "progress": path}
    box: dict[str, Any] = {}

    def target():
        try:
            box["res"] = run_local(fn, world, spec, timeout=timeout, threads=threads, pg_timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    seen = 0
    while th.is_alive():
        th.join(0.5)
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > seen and bar is not None:
            bar.update(n - seen)
        seen = max(seen, n)
    os.remove(path)
    if "err" in box:
        raise box["err"]
    return box["res"]


def _summarize(cfg: Config, dist_res: list, single: dict) -> dict:
    from attnlab.distributed import balance, work_per_rank

    out: dict[str, Any] = {"config": asdict(cfg), "single": {}, "variants": []}
    s_in = single["inputs_mib"]
    for be, rs in single["recs"].items():
        out["single"][be] = {
            "fwd": statistics.median(r["fwd"] for r in rs),
            "fwdbwd": statistics.median(r["fwdbwd"] for r in rs),
            "peak_mib": s_in + max(r.get("peak_extra_mib", 0.0) for r in rs),
        }
    for be, rs in single["recs"].items():
        out["single"][be]["cpu_share"] = statistics.median(r["cpu"] / r["fwdbwd"] for r in rs)
    base_auto, base_flash = out["single"]["auto"], out["single"]["flash"]
    for key in dist_res[0]["recs"]:
        method, layout = key.split()
        per_rank = [d["recs"][key] for d in dist_res]
        reps = len(per_rank[0])
        fwd = statistics.median(max(pr[i]["fwd"] for pr in per_rank) for i in range(reps))
        fwdbwd = statistics.median(max(pr[i]["fwdbwd"] for pr in per_rank) for i in range(reps))
        peak = max(d["inputs_mib"] + max(r.get("peak_extra_mib", 0.0) for r in d["recs"][key]) for d in dist_res)
        wait = [statistics.median(r["wait"] for r in pr) for pr in per_rank]
        compute = [statistics.median(r["compute"] for r in pr) for pr in per_rank]
        comm = [d["comm_only"][key] for d in dist_res]
        exposed = [
            statistics.median(e)
            for e in zip(*(_exposed_comm([pr[i]["steps"] for pr in per_rank]) for i in range(reps)), strict=True)
        ]
        if method == "ulysses":  # nothing to overlap an all-to-all with
            exposed, hidden = wait, [0.0] * len(wait)
        else:
            hidden = [min(1.0, max(0.0, 1.0 - e / c)) if c > 0 else 1.0 for e, c in zip(exposed, comm, strict=False)]
        cpu_share = statistics.mean(statistics.median(r["cpu"] / r["fwdbwd"] for r in pr) for pr in per_rank)
        work = work_per_rank(cfg.N, cfg.P, layout, "causal")
        sent = [statistics.median(r["bytes"] for r in pr) for pr in per_rank]
        out["variants"].append(
            {
                "variant": key,
                "fwd": fwd,
                "fwdbwd": fwdbwd,
                "speed_vs_auto": base_auto["fwdbwd"] / fwdbwd,
                "speed_vs_flash": base_flash["fwdbwd"] / fwdbwd,
                "fwd_speed_vs_flash": base_flash["fwd"] / fwd,
                "peak_mib_per_rank": peak,
                "peak_ratio_vs_auto": peak / base_auto["peak_mib"],
                "peak_ratio_vs_flash": peak / base_flash["peak_mib"],
                "exposed_wait_s": wait,
                "exposed_comm_s": exposed,
                "comm_only_s": comm,
                "hidden": hidden,
                "cpu_share": cpu_share,
                "compute_s": compute,
                "work_pairs": work,
                "work_balance": balance(work) if method == "ring" else 1.0,
                "compute_balance": max(compute) / min(compute) if min(compute) > 0 else float("inf"),
                "bytes_sent_per_rank": sent,
                "comm_gbps": (sum(sent) / len(sent)) / statistics.median(comm) / 1e9
                if statistics.median(comm)
                else None,
            }
        )
    return out


def _exposed_comm(steps_per_rank: list[list[dict]]) -> list[float]:
    """Per rank, the seconds a ring call waited on the wire itself: at each step, the time
    from ``max(its own computation's end, the last rank's posting of that step's
    messages)`` to the end of its wait.  Waiting for a peer that is still computing its
    previous step (imbalance, or a busy machine) is not counted; a transfer that the
    computation did not cover is."""
    posted: dict = {}
    for steps in steps_per_rank:
        for st in steps:
            key = (st["op"], st["step"])
            posted[key] = max(posted.get(key, 0.0), st["t_start"])
    out = []
    for steps in steps_per_rank:
        out.append(
            sum(max(0.0, st["t_end"] - max(st["t_compute_end"], posted[(st["op"], st["step"])])) for st in steps)
        )
    return out


def run(configs: list[Config], *, memory: bool = True, progress: bool = True, timeout: float = 3600.0) -> dict:
    from tqdm import tqdm

    if memory and not memory_supported():
        memory = False
    for c in configs:
        if c.N % (2 * c.P):
            raise ValueError(f"N={c.N}: the benchmark needs N divisible by 2P={2 * c.P} (equal shards in every layout)")
    n_single = {(c.N, c.B, c.H, c.Hkv, c.D, c.reps) for c in configs}
    total = sum(k[-1] * len(ANCHORS) for k in n_single) + sum(
        c.reps * sum(1 for v in VARIANTS if v[0] == "ring" or c.H % c.P == 0) for c in configs
    )
    bar = tqdm(
        total=total, desc="bench distributed", unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True
    )
    res: dict[str, Any] = {"machine": machine_info(), "cases": []}
    singles: dict[tuple, dict] = {}
    try:
        for cfg in configs:
            spec = {
                "N": cfg.N,
                "B": cfg.B,
                "H": cfg.H,
                "Hkv": cfg.Hkv,
                "D": cfg.D,
                "reps": cfg.reps,
                "memory": memory,
                "timeout": timeout,
                "variants": list(VARIANTS),
            }
            key = (cfg.N, cfg.B, cfg.H, cfg.Hkv, cfg.D, cfg.reps)
            if key not in singles:
                bar.set_postfix_str(f"N={cfg.N} single process")
                singles[key] = _launch(_single_main, 1, spec, 2, bar, timeout)[0]
            bar.set_postfix_str(f"{cfg.name} ranks")
            variants = [v for v in VARIANTS if v[0] == "ring" or cfg.H % cfg.P == 0]
            dres = _launch(_rank_main, cfg.P, {**spec, "variants": variants}, 1, bar, timeout)
            res["cases"].append(_summarize(cfg, dres, singles[key]))
    finally:
        bar.close()
    res["machine"]["load_after"] = os.getloadavg()
    return res


def machine_info() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": os.getloadavg(),
    }


def format_table(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"torch {m['torch']}, {m['cpus']} CPUs ({m['cpu']}), {m['date']}; gloo, 1 thread per rank; "
        f"load average before/after: "
        f"{m['load_before'][0]:.1f}/{m.get('load_after', (float('nan'),))[0]:.1f}",
        "",
    ]
    for c in res["cases"]:
        cfg = c["config"]
        s = c["single"]
        lines.append(
            f"N={cfg['N']} P={cfg['P']} (B={cfg['B']}, H={cfg['H']}, Hkv={cfg['Hkv']}, D={cfg['D']}, "
            f"float32, causal; medians of {cfg['reps']})"
            + ("   [4 ranks on 2 cores: oversubscribed]" if cfg["P"] > (os.cpu_count() or 1) else "")
        )
        lines.append(
            f"  single process: auto->sdpa (2 threads) fwd {s['auto']['fwd']:.2f}s fwd+bwd "
            f"{s['auto']['fwdbwd']:.2f}s cpu {100 * s['auto']['cpu_share']:.0f}% peak "
            f"{s['auto']['peak_mib']:.0f} MiB | flash (1 thread) fwd {s['flash']['fwd']:.2f}s fwd+bwd "
            f"{s['flash']['fwdbwd']:.2f}s cpu {100 * s['flash']['cpu_share']:.0f}% peak "
            f"{s['flash']['peak_mib']:.0f} MiB"
        )
        hdr = (
            f"  {'variant':<19} {'fwd s':>7} {'f+b s':>7} {'x flash':>7} {'x sdpa':>7} {'cpu%':>5} "
            f"{'MiB/rank':>8} {'/flash':>6} {'wait s':>7} {'wire s':>7} {'comm s':>7} {'hidden':>6} "
            f"{'pairs max/min':>13} {'compute max/min':>15}"
        )
        lines += [hdr, "  " + "-" * (len(hdr) - 2)]
        for x in c["variants"]:
            lines.append(
                f"  {x['variant']:<19} {x['fwd']:>7.2f} {x['fwdbwd']:>7.2f} {x['speed_vs_flash']:>7.2f} "
                f"{x['speed_vs_auto']:>7.2f} {100 * x['cpu_share']:>5.0f} {x['peak_mib_per_rank']:>8.0f} "
                f"{x['peak_ratio_vs_flash']:>6.2f} {statistics.mean(x['exposed_wait_s']):>7.2f} "
                f"{statistics.mean(x['exposed_comm_s']):>7.2f} {statistics.mean(x['comm_only_s']):>7.2f} "
                f"{statistics.mean(x['hidden']):>6.2f} {x['work_balance']:>13.2f} {x['compute_balance']:>15.2f}"
            )
        lines.append("")
    return "\n".join(lines)


def parse_ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise ValueError(f"{name}: expected positive integers, got {text!r}")
    return out


def main(
    *,
    seqs=(16384, 32768),
    ranks=(2, 4),
    reps: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 64,
    quick: bool = False,
    memory: bool = True,
    json_path: str | None = None,
) -> dict:
    if quick:
        seqs, reps = (2048, 4096), 1
    configs = [Config(N, P, H=heads, Hkv=kv_heads, D=dim, reps=reps) for N in seqs for P in ranks]
    res = run(configs, memory=memory)
    print(format_table(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {json_path}")
    return res
