"""The native CPU kernel beside torch SDPA and the torch-ops flash path, in one run.

``python -m attnlab.bench.native [--quick] [--reps N] [--only SUBSTRING] [--json PATH] [--memory]``

Each case times the forward (and forward+backward) of ``attnlab.attention`` with
``backend="native"`` and ``backend="flash"``, and of torch's
``scaled_dot_product_attention`` (``is_causal`` for square causal problems, a dense boolean
``attn_mask`` for windows): median of ``reps`` after a warm-up.  Ratios are SDPA's time
over the kernel's (> 1: faster than SDPA).  The header says which kernel variant runs and
how long the first load (build) took.  ``--only SUBSTRING`` times the cases whose name
contains it (``--only fwd+bwd``), alone.

``--slow F`` measures how the kernel's schedules cope with one slow thread, load-robustly:
each case's native call alone, in interleaved rounds, as is and with thread 1 of every
parallel region paced to ``1 / (1 + F)`` of its speed (``ATTNLAB_NATIVE_SLOW=F``, sched.h;
``F = 1``: the thread's core shared with another process).  ``slow/quiet`` is the ratio of the
medians; ``ideal`` is what a perfect schedule gets, ``T / (T - 1 + 1 / (1 + F))`` on ``T``
threads (4/3 on two threads at ``F = 1``).

``--memory`` adds the peak extra memory of forward+backward, causal float32, one head,
D = 64, N = 32768, for the native kernel and torch SDPA, each in a fresh child process
(:mod:`attnlab.bench.memprobe`: tracked allocations as the OS sees them); the target is
at most 64 MiB for the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from attnlab.bench.measure import time_call


@dataclass
class Case:
    name: str
    B: int
    H: int
    N: int
    D: int
    dtype: torch.dtype
    mask: str  # "full" | "causal" | "window256"
    grad: bool = False


def cases(quick: bool) -> list[Case]:
    n = 1024 if quick else 4096
    out = [
        Case("full fp32", 1, 8, n, 64, torch.float32, "full"),
        Case("causal fp32", 1, 8, n, 64, torch.float32, "causal"),
        Case("causal bf16 D64", 1, 8, n, 64, torch.bfloat16, "causal"),
        Case("causal bf16 D128", 1, 4, n, 128, torch.bfloat16, "causal"),
        Case("window256 fp32", 1, 8, n, 64, torch.float32, "window256"),
        Case("fwd+bwd causal fp32", 1, 8, n // 2, 64, torch.float32, "causal", grad=True),
        Case("fwd+bwd window256 fp32", 1, 8, n, 64, torch.float32, "window256", grad=True),
    ]
    return out


def _mask(c: Case):
    return {"full": None, "causal": masks.causal(), "window256": masks.sliding_window(256)}[c.mask]


def _sdpa(c: Case, q, k, v):
    if c.mask == "full":
        return F.scaled_dot_product_attention(q, k, v)
    if c.mask == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    i = torch.arange(c.N)
    allowed = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < 256)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def run_case(c: Case, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(c.B, c.H, c.N, c.D, generator=g).to(c.dtype).requires_grad_(c.grad) for _ in range(3))
    m = _mask(c)
    fns = {
        "sdpa": lambda: _sdpa(c, q, k, v),
        "flash": lambda: attnlab.attention(q, k, v, mask=m, backend="flash"),
        "native": lambda: attnlab.attention(q, k, v, mask=m, backend="native"),
    }
    res: dict[str, object] = {
        "case": c.name,
        "shape": [c.B, c.H, c.N, c.D],
        "dtype": str(c.dtype).replace("torch.", ""),
    }
    for name, fn in fns.items():
        if c.grad:

            def step(fn=fn):
                out = fn()
                out.backward(torch.ones_like(out))

            res[name] = time_call(step, reps=reps)
        else:
            with torch.no_grad():
                res[name] = time_call(fn, reps=reps)
    return res


def _step(c: Case):
    """The case's native call (forward, or forward and backward) on fixed inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(c.B, c.H, c.N, c.D, generator=g).to(c.dtype).requires_grad_(c.grad) for _ in range(3))
    m = _mask(c)

    def step():
        if not c.grad:
            with torch.no_grad():
                return attnlab.attention(q, k, v, mask=m, backend="native")
        out = attnlab.attention(q, k, v, mask=m, backend="native")
        out.backward(torch.ones_like(out))
        return out

    return step


def slow_case(c: Case, reps: int, slow: float) -> dict:
    """Median seconds of the native call as is and with thread 1 paced (``ATTNLAB_NATIVE_SLOW``),
    in interleaved rounds after a warm-up of each."""
    step = _step(c)
    old = os.environ.get("ATTNLAB_NATIVE_SLOW")
    times: dict[str, list[float]] = {"quiet": [], "slow": []}
    try:
        for r in range(reps + 1):
            for name in times:
                if name == "slow":
                    os.environ["ATTNLAB_NATIVE_SLOW"] = repr(slow)
                else:
                    os.environ.pop("ATTNLAB_NATIVE_SLOW", None)
                t0 = time.perf_counter()
                step()
                if r > 0:  # round 0 warms up
                    times[name].append(time.perf_counter() - t0)
    finally:
        if old is None:
            os.environ.pop("ATTNLAB_NATIVE_SLOW", None)
        else:
            os.environ["ATTNLAB_NATIVE_SLOW"] = old
    t = torch.get_num_threads()
    quiet, paced = statistics.median(times["quiet"]), statistics.median(times["slow"])
    return {
        "case": c.name,
        "quiet": quiet,
        "slow": paced,
        "ratio": paced / quiet,
        "ideal": t / (t - 1 + 1 / (1 + slow)) if t > 1 else 1 + slow,
    }


MEMORY_LIMIT_MIB = 64.0


def memory_rows() -> list[dict]:
    """Peak extra MiB of forward+backward at (1, 1, 32768, 64), causal float32, per backend."""
    from dataclasses import asdict

    from attnlab.bench import memprobe
    from attnlab.bench.attention import Case as ProbeCase

    c = ProbeCase("memory causal float32 (1,1,32768,64)", "causal", 1, 1, 1, 32768, 64, "float32", "fwdbwd", True)
    rows = []
    for backend in ("attnlab native", "torch sdpa"):
        try:
            mib = memprobe.measure(asdict(c), backend, "fwdbwd", timeout_s=3600.0)
        except Exception as e:  # noqa: BLE001 - a failed probe is reported, not fatal
            print(f"memory {backend}: failed ({e})", flush=True)
            continue
        rows.append({"case": c.name, "backend": backend, "peak_extra_mib": mib})
        verdict = (
            ""
            if mib is None or backend != "attnlab native"
            else (f" (limit {MEMORY_LIMIT_MIB:.0f}: {'ok' if mib <= MEMORY_LIMIT_MIB else 'OVER'})")
        )
        shown = "n/a" if mib is None else f"{mib:.1f} MiB"
        print(f"memory fwd+bwd {c.name[7:]} {backend}: {shown}{verdict}", flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default=None, help="time only the cases whose name contains this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", action="store_true", help="peak extra MiB of fwd+bwd at N=32768 (child processes)")
    ap.add_argument("--slow", type=float, default=None, help="time with thread 1 paced to 1/(1+F) of its speed")
    a = ap.parse_args(argv)
    from attnlab.ops.native import build

    t0 = time.perf_counter()
    build.load()
    load_s = time.perf_counter() - t0
    header = f"{build.status()}; first load {load_s:.1f} s; torch threads {torch.get_num_threads()}"
    print(header)
    if a.slow is not None:
        return _main_slow(a, header)
    print(f"{'case':<26}{'sdpa s':>9}{'flash s':>9}{'native s':>10}{'flash x':>9}{'native x':>9}")
    rows = []
    for c in cases(a.quick):
        if a.only is not None and a.only not in c.name:
            continue
        r = run_case(c, a.reps)
        rows.append(r)
        print(
            f"{r['case']:<26}{r['sdpa']:>9.4f}{r['flash']:>9.4f}{r['native']:>10.4f}"
            f"{r['sdpa'] / r['flash']:>9.2f}{r['sdpa'] / r['native']:>9.2f}",
            flush=True,
        )
    out = {"header": header, "rows": rows}
    if a.memory:
        out["memory"] = memory_rows()

    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _main_slow(a, header: str) -> dict:
    print(f"thread 1 paced to 1/(1+{a.slow:g}) of its speed; native only, interleaved rounds")
    print(f"{'case':<26}{'quiet s':>9}{'slow s':>9}{'slow/quiet':>11}{'ideal':>7}")
    rows = []
    for c in cases(a.quick):
        if a.only is not None and a.only not in c.name:
            continue
        r = slow_case(c, a.reps, a.slow)
        rows.append(r)
        print(f"{c.name:<26}{r['quiet']:>9.4f}{r['slow']:>9.4f}{r['ratio']:>11.3f}{r['ideal']:>7.3f}", flush=True)
    out = {"header": header, "slow": a.slow, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
