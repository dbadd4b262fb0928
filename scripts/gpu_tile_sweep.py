"""Tile sweep of the Triton kernels on a GPU: which (BM, BN, num_warps, num_stages) per kernel
(fwd, dq, dkdv) is fastest, bf16, D = 64 and 128, among the candidates that compile
spill-free for sm_80 and sm_90 (scripts/gpu_tile_candidates.json, written by
scripts/gpu_tile_prefilter.py on a CPU machine).

    OUT=out/sweep PYTHONPATH=src ATTNLAB_NATIVE=0 python3 scripts/gpu_tile_sweep.py --budget-s 240
    PYTHONPATH=src python scripts/gpu_tile_sweep.py --interpret-smoke     # CPU: the plumbing, tiny shapes

Nothing in the source tree is edited.  Per candidate, the kernel's launch arguments come from
the real launchers (``autograd._forward`` / ``_backward`` with ``autograd._launch`` patched to
record instead of launch), with that kernel's tiles set on the problem (``_Problem.tiles``:
the block lists are built at those tiles); the kernel is then launched directly with the
candidate's ``num_warps`` / ``num_stages`` (no autotuner), checked against torch SDPA and timed
(``triton.testing.do_bench``, median).  At the end, for each head dim, the winners go
through the public path (``attnlab.attention(backend="triton")``) with ``config.GPU_TILES`` and
``config.AUTOTUNE`` patched in-process (one candidate each; ``autograd._TUNED``, the cache of
autotuners, cleared), side by side with the shipped configuration and SDPA's backends.

Work order (most informative first, in case the budget runs out): dK/dV at D = 128, dQ at
128, dK/dV at 64, dQ at 64, forward 128, forward 64; then the end-to-end comparison (time
for it is reserved: ``--reserve-s``).  Compiles run ahead in ``--jobs`` worker processes
(``JITFunction.warmup`` at the bench shape: the same specialisation as the launch, so the
main process finds the cubins in triton's cache).  Results go to ``$OUT/tile_sweep.json``
(rewritten after every measurement) and a table is printed per kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
CANDIDATES = os.path.join(HERE, "gpu_tile_candidates.json")
GROUP_ORDER = [("dkdv", 128), ("dq", 128), ("dkdv", 64), ("dq", 64), ("fwd", 128), ("fwd", 64)]
MASKS = ("causal", "full")
#: a candidate passes when max|x - ref| <= BOUND_REL * max|ref| for each output it writes
#: (bf16 kernels against bf16 SDPA: healthy kernels measured 0.0009-0.0045 of max|ref| on
#: the H200 at these shapes; racy dK/dV configurations 0.01-0.3)
BOUND_REL = 2**-6
#: and when ``RERUNS`` more launches on the same inputs give bit-identical outputs: on the
#: H200 (triton 3.6) some dK/dV configurations, the shipped D = 128 32x64 (8, 2) among them,
#: gave different (and wrong) dK from run to run at N = 8192
RERUNS = 5
#: notional matmul FLOPs per kernel, in units of the forward's 4·B·H·N²·D (dQ: Q·Kᵀ, dO·Vᵀ,
#: dS·K; dK/dV: Q·Kᵀ, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q); fwd+bwd end to end counts 3.5 as the benchmark does
KERNEL_FLOPS = {"fwd": 1.0, "dq": 1.5, "dkdv": 2.0}
FB_FLOPS = 3.5


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- problem + launches
class _Captured(Exception):
    pass


def shape_for(D: int, a) -> tuple[int, int, int, int]:
    """(B, H, N, D): the benchmark's B·N = tokens, H·D = width."""
    return max(1, a.tokens // a.N), max(1, a.width // D), a.N, D


def make_inputs(D: int, a, device):
    import torch

    B, H, N, _ = shape_for(D, a)
    g = torch.Generator(device=device).manual_seed(1234 + D)
    return tuple(torch.randn(B, H, N, D, generator=g, device=device, dtype=torch.bfloat16) for _ in range(4))


def the_mask(name: str):
    from attnlab import masks

    return None if name == "full" else _CAUSAL.setdefault("m", masks.causal())


_CAUSAL: dict = {}  # one causal Mask object: its block masks (per tiling) are cached on it


def problem(q, k, v, mask_name: str, tiles: dict):
    """An ``autograd._Problem`` for the unmasked / causal problem, with ``tiles`` (kernel ->
    (BM, BN)) replacing the shipped ones for the kernels it names."""
    from attnlab.ops.triton import autograd as ag, config
    from attnlab.ops.triton.scoremods import lower_score_mod

    pb = ag._Problem(q, k, v, the_mask(mask_name), lower_score_mod(None), q.shape[-1] ** -0.5, 0, 0, None)
    cap_m, cap_n = max(16, config.pow2(q.shape[2])), max(16, config.pow2(k.shape[2]))
    for name, (bm, bn) in tiles.items():
        pb.tiles[name] = (min(int(bm), cap_m), min(int(bn), cap_n))
    return pb


def capture(direction: str, pb, q, k, v, out=None, lse=None, do=None) -> dict:
    """``{kernel: (grid, kwargs)}`` of the launches the real launcher makes, none of them run:
    ``direction`` "fwd" (the forward) or "bwd" (delta, dq, dkdv)."""
    from attnlab.ops.triton import autograd as ag

    got: dict = {}
    last = "fwd" if direction == "fwd" else "dkdv"

    def record(name, grid, **kw):
        got[name] = (grid, kw)
        if name == last:
            raise _Captured

    saved = ag._launch
    ag._launch = record
    try:
        if direction == "fwd":
            ag._forward(pb, q, k, v)
        else:
            ag._backward(pb, q, k, v, out, lse, do, None, [])
    except _Captured:
        pass
    finally:
        ag._launch = saved
    if last not in got:
        raise RuntimeError(f"the launcher did not launch {last!r} (got {sorted(got)})")
    return got


def launch(name: str, grid, kw: dict, warps: int, stages: int):
    """Launch one kernel directly (no autotuner); returns triton's compiled kernel (None
    under the interpreter)."""
    from attnlab.ops.triton import autograd as ag

    return ag._KERNELS[name][grid](**kw, num_warps=warps, num_stages=stages)


def delta_config(D: int) -> tuple[int, int]:
    from attnlab.ops.triton import config

    return tuple(config.candidates("delta", D, "bfloat16")[0])


def kernel_facts(k) -> dict:
    """Registers, spills and shared memory as this machine's triton reports them."""
    if k is None:
        return {}
    out = {}
    with contextlib.suppress(Exception):
        k._init_handles()
    for name in ("n_regs", "n_spills"):
        v = getattr(k, name, None)
        if v is not None:
            out[name] = int(v)
    with contextlib.suppress(Exception):
        out["shared"] = int(k.metadata.shared)
    return out


# ----------------------------------------------------------------------------- compile workers
_W: dict = {}


def warm_task(task: tuple) -> dict:
    """In a worker process: compile one (kernel, D, tile, warps, stages, mask) at the bench
    shape with ``JITFunction.warmup`` (nothing runs on the GPU), so the main process finds
    the cubin in triton's cache.  Returns the device's own register / spill counts."""
    kernel, D, tile, warps, stages, mask_name, a_dict = task
    t0 = time.perf_counter()
    try:
        import torch

        from attnlab.ops.triton import autograd as ag

        a = argparse.Namespace(**a_dict)
        if ("inp", D) not in _W:  # values do not matter for the compile: zeros, both D kept
            _W[("inp", D)] = tuple(torch.zeros(shape_for(D, a), device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q, k, v, do = _W[("inp", D)]
        pb = problem(q, k, v, mask_name, {kernel: tuple(tile)})
        if kernel == "fwd":
            got = capture("fwd", pb, q, k, v)
        else:
            out = torch.zeros_like(q)
            lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
            got = capture("bwd", pb, q, k, v, out, lse, do)
            grid, kw = got["delta"]
            if ("delta", D) not in _W:
                w, s = delta_config(D)
                ag._KERNELS["delta"].warmup(grid=grid, **kw, num_warps=w, num_stages=s)
                _W[("delta", D)] = True
        grid, kw = got[kernel]
        ck = ag._KERNELS[kernel].warmup(grid=grid, **kw, num_warps=warps, num_stages=stages)
        res = {"ok": True, **kernel_facts(ck)}
        del got, kw, pb
    except Exception as e:  # noqa: BLE001 - reported with the row, never fatal
        res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    res["compile_s"] = round(time.perf_counter() - t0, 2)
    return res


class Precompiler:
    """Compile tasks ahead of the timing loop in worker processes; every failure here only
    means the main process compiles that kernel itself."""

    def __init__(self, jobs: int, a):
        self.futures: dict = {}
        self.pool = None
        self.a_dict = {k: getattr(a, k) for k in ("N", "tokens", "width")}
        if jobs <= 0:
            return
        try:
            import concurrent.futures
            import multiprocessing

            self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        except Exception as e:  # noqa: BLE001
            log(f"precompile pool unavailable ({type(e).__name__}: {e}); compiling in-process")
            self.pool = None

    def submit(self, key: tuple) -> None:
        if self.pool is None or key in self.futures:
            return
        try:
            self.futures[key] = self.pool.submit(warm_task, (*key, self.a_dict))
        except Exception as e:  # noqa: BLE001 - a broken pool: compile in-process from now on
            log(f"precompile submit failed ({type(e).__name__}: {e}); compiling in-process")
            self.pool = None

    def wait(self, key: tuple, timeout: float) -> dict | None:
        f = self.futures.get(key)
        if f is None:
            return None
        try:
            return f.result(timeout=max(0.0, timeout))
        except Exception as e:  # noqa: BLE001 - timeout or a dead worker
            return {"ok": False, "error": f"precompile: {type(e).__name__}: {str(e)[:200]}"}

    def close(self) -> None:
        if self.pool is None:
            return
        procs = list(getattr(self.pool, "_processes", {}).values())
        with contextlib.suppress(Exception):
            self.pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:  # workers still compiling: stop them (ours), so the run ends now
            with contextlib.suppress(Exception):
                p.terminate()
        self.pool = None


# ----------------------------------------------------------------------------- timing, errors
def bench_ms(fn, device, a, grad_to_none=None) -> float:
    """Median milliseconds of ``fn`` (CUDA: ``triton.testing.do_bench`` after a warm-up; CPU
    under the interpreter: one call with a wall clock, for the plumbing only)."""
    if str(device) == "cpu":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(
        triton.testing.do_bench(fn, warmup=a.warmup_ms, rep=a.rep_ms, grad_to_none=grad_to_none, return_mode="median")
    )


def max_err(x, ref) -> tuple[float, float]:
    """(max |x - ref|, max |ref|) in float32 (NaN in x -> inf)."""
    import torch

    x, ref = x.detach(), ref.detach()
    d = (x.float() - ref.float()).abs()
    e = float(torch.nan_to_num(d, nan=float("inf")).max())
    return e, float(ref.float().abs().max())


def check(outputs: dict, refs: dict) -> dict:
    """Per output: error, bound and pass (``BOUND_REL`` of max|ref|)."""
    res, ok = {}, True
    for key, x in outputs.items():
        e, m = max_err(x, refs[key])
        bound = BOUND_REL * m
        res[key] = {"err": e, "max_ref": m, "err_over_bound": e / bound if bound else float("inf")}
        ok &= e <= bound
    res["ok"] = bool(ok)
    return res


def density(mask: str, N: int) -> float:
    return 1.0 if mask == "full" else (N + 1) / (2 * N)


def fwd_flops(D: int, mask: str, a) -> float:
    B, H, N, _ = shape_for(D, a)
    return 4.0 * B * H * N * N * D * density(mask, N)


# ----------------------------------------------------------------------------- per head dim state
class Setup:
    """Inputs, SDPA references and baselines, and the shipped forward's out/LSE for one D."""

    def __init__(self, D: int, a, device):
        import torch
        import torch.nn.functional as F

        self.D, self.a, self.device = D, a, device
        self.q, self.k, self.v, self.do = make_inputs(D, a, device)
        self.ref: dict = {}
        self.sdpa: dict = {}
        self.base: dict = {}  # mask -> {"out", "lse", "delta_ms", "fwd_ms"}
        for mask in MASKS:
            q, k, v = (t.detach().clone().requires_grad_(True) for t in (self.q, self.k, self.v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal")
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), self.do)
            self.ref[mask] = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}
            del q, k, v, out

    def sdpa_baselines(self, rec: dict) -> None:
        """SDPA's backends, forward and forward+backward, per mask (into ``rec``)."""
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        if str(self.device) == "cpu":
            backends = {"math": SDPBackend.MATH}
        for mask in MASKS:
            causal = mask == "causal"
            row = {}
            for name, be in backends.items():
                q, k, v = (t.detach().clone().requires_grad_(True) for t in (self.q, self.k, self.v))
                try:
                    with sdpa_kernel(be):

                        def fwd(q=q, k=k, v=v, causal=causal):
                            with torch.no_grad():
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def fb(q=q, k=k, v=v, causal=causal):
                            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(self.do)

                        t_f = bench_ms(fwd, self.device, self.a)
                        t_fb = bench_ms(fb, self.device, self.a, grad_to_none=[q, k, v])
                    fl = fwd_flops(self.D, mask, self.a)
                    row[name] = {
                        "fwd_ms": t_f,
                        "fb_ms": t_fb,
                        "fwd_tflops": fl / t_f / 1e9,
                        "fb_tflops": FB_FLOPS * fl / t_fb / 1e9,
                    }
                except Exception as e:  # noqa: BLE001 - a backend that refuses is reported
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                del q, k, v
            good = [r for r in row.values() if "fwd_ms" in r]
            if good:
                row["best"] = {"fwd_ms": min(r["fwd_ms"] for r in good), "fb_ms": min(r["fb_ms"] for r in good)}
            self.sdpa[mask] = row
            log(
                f"  SDPA D={self.D} {mask:6s} "
                + "  ".join(
                    f"{n} fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TF) fwd+bwd {r['fb_ms']:.3f} ms ({r['fb_tflops']:.0f} TF)"
                    if "fwd_ms" in r
                    else f"{n}: {r.get('error', '')[:80]}"
                    for n, r in row.items()
                    if n != "best"
                )
            )
        rec["sdpa"][str(self.D)] = self.sdpa
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def forward_base(self, mask: str, fwd_default) -> dict:
        """Run the shipped forward once (out / LSE for the backward candidates) and time Δ."""
        if mask in self.base:
            return self.base[mask]
        (bm, bn), (w, s) = fwd_default
        pb = problem(self.q, self.k, self.v, mask, {"fwd": (bm, bn)})
        got = capture("fwd", pb, self.q, self.k, self.v)
        grid, kw = got["fwd"]
        launch("fwd", grid, kw, w, s)
        out, lse = kw["O"], kw["LSE"]
        fwd_ms = bench_ms(lambda: launch("fwd", grid, kw, w, s), self.device, self.a)
        chk = check({"out": out}, self.ref[mask])
        pbb = problem(self.q, self.k, self.v, mask, {})
        bw = capture("bwd", pbb, self.q, self.k, self.v, out, lse, self.do)
        dg, dkw = bw["delta"]
        dw, ds = delta_config(self.D)
        delta_ms = bench_ms(lambda: launch("delta", dg, dkw, dw, ds), self.device, self.a)
        self.base[mask] = {"out": out, "lse": lse, "fwd_ms": fwd_ms, "delta_ms": delta_ms, "check": chk}
        log(
            f"  shipped forward D={self.D} {mask}: {fwd_ms:.3f} ms, check {'ok' if chk['ok'] else 'FAILS'}; "
            f"delta {delta_ms:.3f} ms"
        )
        return self.base[mask]


# ----------------------------------------------------------------------------- one candidate
def measure(kernel: str, st: Setup, mask: str, cand: dict, fwd_default) -> dict:
    """Launch, check and time one candidate of ``kernel`` for one mask."""
    a, D = st.a, st.D
    tile, w, s = tuple(cand["tile"]), cand["warps"], cand["stages"]
    pb = problem(st.q, st.k, st.v, mask, {kernel: tile})
    if kernel == "fwd":
        got = capture("fwd", pb, st.q, st.k, st.v)
    else:
        base = st.forward_base(mask, fwd_default)
        got = capture("bwd", pb, st.q, st.k, st.v, base["out"], base["lse"], st.do)
        dg, dkw = got["delta"]
        dw, ds = delta_config(D)
        launch("delta", dg, dkw, dw, ds)
    grid, kw = got[kernel]
    t0 = time.perf_counter()
    ck = launch(kernel, grid, kw, w, s)  # compiles here unless a worker did
    first_s = time.perf_counter() - t0
    if kernel == "fwd":
        outs = {"out": kw["O"]}
    elif kernel == "dq":
        outs = {"dq": kw["DQ"]}
    else:
        outs = {"dk": kw["DK"], "dv": kw["DV"]}
    chk = check(outs, st.ref[mask])
    first = {key: t.clone() for key, t in outs.items()}
    ms = bench_ms(lambda: launch(kernel, grid, kw, w, s), st.device, a)
    rerun = rerun_diff(outs, first, lambda: launch(kernel, grid, kw, w, s))
    chk["deterministic"] = rerun == 0.0
    chk["rerun_max_diff"] = rerun
    chk["ok"] = bool(chk["ok"] and chk["deterministic"])
    fl = fwd_flops(D, mask, a)
    return {
        "ms": ms,
        "tflops": KERNEL_FLOPS[kernel] * fl / ms / 1e9,
        "first_launch_s": round(first_s, 2),
        "check": chk,
        **kernel_facts(ck),
    }


def rerun_diff(outs: dict, first: dict, run, reruns: int | None = None) -> float:
    """Max |difference| between the first launch's outputs and those of the launch the timing
    left plus ``RERUNS`` more (outputs filled with NaN before each: an element a launch
    leaves unwritten shows as NaN -> inf)."""
    import torch

    worst = 0.0
    for i in range(RERUNS if reruns is None else reruns):
        if i:
            for t in outs.values():
                t.fill_(float("nan"))
            run()
        for key, t in outs.items():
            d = (t.float() - first[key].float()).abs()
            worst = max(worst, float(torch.nan_to_num(d, nan=float("inf")).max()))
    return worst


def cand_key(c: dict) -> str:
    return f"{c['tile'][0]}x{c['tile'][1]} w{c['warps']} s{c['stages']}"


def score(rows: list, default_ms: dict) -> float | None:
    """Geometric mean over the masks of ms ÷ the shipped config's best ms (lower is better)."""
    rs = []
    for mask in MASKS:
        r = rows.get(mask) if isinstance(rows, dict) else None
        if not r or "ms" not in r or not r["check"]["ok"] or mask not in default_ms:
            return None
        rs.append(r["ms"] / default_ms[mask])
    return math.exp(sum(math.log(x) for x in rs) / len(rs))


def est_fb(kernel: str, st: Setup, mask: str, ms: float, defaults_ms: dict) -> float | None:
    """Estimated fwd+bwd kernel time with this kernel at ``ms`` and the others at the shipped
    configs' times measured here (fwd, Δ, dQ, dK/dV)."""
    if mask not in st.base:
        return None
    parts = dict(defaults_ms)
    if parts.get("fwd") is None:  # the shipped forward's first candidate, timed with the out / LSE
        parts["fwd"] = st.base[mask]["fwd_ms"]
    parts[kernel] = ms
    if any(parts.get(k) is None for k in ("fwd", "dq", "dkdv")):
        return None
    return parts["fwd"] + parts["dq"] + parts["dkdv"] + st.base[mask]["delta_ms"]


# ----------------------------------------------------------------------------- end to end
@contextlib.contextmanager
def patched_config(D: int, picks: dict | None):
    """``config.GPU_TILES`` / ``config.AUTOTUNE`` for bf16 at ``D`` set to ``picks`` (kernel ->
    (tile, [(w, s), ...])); None = as shipped.  The autotuners (``autograd._TUNED``) are
    dropped before and after, so nothing built under one config serves another."""
    from attnlab.ops.triton import autograd as ag, config

    g, b = config.group("bfloat16"), config.bucket(D)
    saved_t, saved_a = copy.deepcopy(config.GPU_TILES), copy.deepcopy(config.AUTOTUNE)
    try:
        if picks:
            for kernel, (tile, cands) in picks.items():
                config.GPU_TILES[g][b][kernel] = tuple(tile)
                config.AUTOTUNE[g][b][kernel] = [tuple(c) for c in cands]
        ag._TUNED.clear()
        yield
    finally:
        config.GPU_TILES.clear()
        config.GPU_TILES.update(saved_t)
        config.AUTOTUNE.clear()
        config.AUTOTUNE.update(saved_a)
        ag._TUNED.clear()


def end_to_end(st: Setup, name: str, picks: dict | None) -> dict:
    """``attnlab.attention(backend="triton")`` forward and forward+backward per mask under one
    configuration, checked against SDPA."""
    import torch

    import attnlab

    res = {}
    with patched_config(st.D, picks):
        for mask in MASKS:
            m = the_mask(mask)
            q, k, v = (t.detach().clone().requires_grad_(True) for t in (st.q, st.k, st.v))
            try:
                out = attnlab.attention(q, k, v, mask=m, backend="triton")
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), st.do)
                chk = check({"out": out, "dq": dq, "dk": dk, "dv": dv}, st.ref[mask])
                first = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}
                diff = 0.0
                for _ in range(2):  # the same call again: bit-identical results expected
                    o2 = attnlab.attention(q, k, v, mask=m, backend="triton")
                    again = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(o2, (q, k, v), st.do), strict=True))
                    again["out"] = o2.detach()
                    for key2, t in again.items():
                        d = (t.float() - first[key2].float()).abs()
                        diff = max(diff, float(torch.nan_to_num(d, nan=float("inf")).max()))
                chk["rerun_max_diff"] = diff
                chk["deterministic"] = diff == 0.0
                chk["ok"] = bool(chk["ok"] and chk["deterministic"])
                del out, dq, dk, dv, first, again, o2

                def fwd(q=q, k=k, v=v, m=m):
                    with torch.no_grad():
                        return attnlab.attention(q, k, v, mask=m, backend="triton")

                def fb(q=q, k=k, v=v, m=m):
                    attnlab.attention(q, k, v, mask=m, backend="triton").backward(st.do)

                t_f = bench_ms(fwd, st.device, st.a)
                t_fb = bench_ms(fb, st.device, st.a, grad_to_none=[q, k, v])
                fl = fwd_flops(st.D, mask, st.a)
                best = st.sdpa.get(mask, {}).get("best")
                res[mask] = {
                    "fwd_ms": t_f,
                    "fb_ms": t_fb,
                    "fwd_tflops": fl / t_f / 1e9,
                    "fb_tflops": FB_FLOPS * fl / t_fb / 1e9,
                    "fwd_vs_sdpa_best": best["fwd_ms"] / t_f if best else None,
                    "fb_vs_sdpa_best": best["fb_ms"] / t_fb if best else None,
                    "check": chk,
                }
                from attnlab.ops.triton import config

                res[mask]["chosen"] = {str(k): v for k, v in config.CHOSEN.items()}
            except Exception as e:  # noqa: BLE001
                res[mask] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                traceback.print_exc()
            del q, k, v
            r = res[mask]
            log(
                f"  end-to-end D={st.D} {mask:6s} {name:8s} "
                + (
                    f"fwd {r['fwd_ms']:.3f} ms {r['fwd_tflops']:.0f} TF ({_x(r['fwd_vs_sdpa_best'])} SDPA best)  "
                    f"fwd+bwd {r['fb_ms']:.3f} ms {r['fb_tflops']:.0f} TF ({_x(r['fb_vs_sdpa_best'])} SDPA best)  "
                    f"check {'ok' if r['check']['ok'] else 'FAIL'} (rerun diff {r['check']['rerun_max_diff']:.3g})"
                    if "fwd_ms" in r
                    else r["error"][:200]
                )
            )
    return res


def _x(v) -> str:
    return "?" if v is None else f"{v:.2f}x"


# ----------------------------------------------------------------------------- the run
def load_candidates(path: str, kernels, head_dims, per_group: int | None, smoke: bool = False) -> dict:
    with open(path) as f:
        doc = json.load(f)
    groups: dict = {}
    for c in doc["candidates"]:
        if c["kernel"] in kernels and c["D"] in head_dims:
            groups.setdefault((c["kernel"], c["D"]), []).append(c)
    for key, cs in groups.items():
        cs.sort(key=lambda c: not c.get("default"))  # the shipped configs first: the baseline
        if smoke:  # one shipped config and one other: the patch of config.py is exercised
            groups[key] = [c for c in cs if c.get("default")][:1] + [c for c in cs if not c.get("default")][:1]
        elif per_group:
            groups[key] = cs[:per_group]
    return {"meta": {k: doc.get(k) for k in ("generated", "triton", "dtype", "mask")}, "groups": groups}


def shipped(kernel: str, D: int) -> tuple[tuple, list]:
    from attnlab.ops.triton import config

    return tuple(config.gpu_tiles(D, "bfloat16")[kernel]), [tuple(c) for c in config.candidates(kernel, D, "bfloat16")]


def write(rec: dict, path: str) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    os.replace(tmp, path)


def table(kernel: str, D: int, rows: dict, default_ms: dict, st: Setup) -> list:
    """Print one kernel's rows (best first); returns [(score, key)]."""
    scored = []
    for key, r in rows.items():
        sc = score(r["by_mask"], default_ms)
        r["score_vs_default"] = sc
        scored.append((sc if sc is not None else float("inf"), key))
    scored.sort()
    log(f"\n== {kernel} D={D}: ms (TFLOP/s) per mask, ÷ shipped best; est. fwd+bwd ÷ SDPA best; regs/spills (this GPU)")
    log(
        f"  {'config':16s} {'causal ms':>10s} {'TF':>5s} {'÷ship':>6s} {'fb÷SDPA':>8s}  "
        f"{'full ms':>9s} {'TF':>5s} {'÷ship':>6s} {'fb÷SDPA':>8s}  {'geo':>5s} regs/spill check"
    )
    for sc, key in scored:
        r = rows[key]
        cells = []
        for mask in MASKS:
            m = r["by_mask"].get(mask, {})
            if "ms" in m:
                cells.append(
                    f"{m['ms']:10.3f} {m['tflops']:5.0f} {_x(m['ms'] / default_ms[mask]) if mask in default_ms else '?':>6s}"
                    f" {_x(m.get('est_fb_vs_sdpa')):>8s}"
                )
            else:
                cells.append(f"{(m.get('error') or 'not run')[:36]:>33s}")
        facts = next((m for m in r["by_mask"].values() if "n_regs" in m), {})
        ok = all(m.get("check", {}).get("ok") for m in r["by_mask"].values() if "check" in m)
        racy = any(not m["check"].get("deterministic", True) for m in r["by_mask"].values() if "check" in m)
        log(
            f"  {key:16s} {cells[0]}  {cells[1]}  {sc if sc != float('inf') else float('nan'):5.2f} "
            f"{facts.get('n_regs', '?')}/{facts.get('n_spills', '?')} {'ok' if ok else 'FAIL' + ('(racy)' if racy else '')}{' *shipped' if r['default'] else ''}"
        )
    return scored


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--candidates", default=CANDIDATES)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop cleanly after this many seconds")
    p.add_argument("--reserve-s", type=float, default=40.0, help="kept for the end-to-end comparison")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else ./tmp)")
    p.add_argument("--kernel", nargs="+", default=["dkdv", "dq", "fwd"], choices=["fwd", "dq", "dkdv"])
    p.add_argument("--head-dim", type=int, nargs="+", default=[128, 64], choices=[64, 128])
    p.add_argument("--per-group", type=int, default=None, help="at most this many candidates per (kernel, D)")
    p.add_argument("--N", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=32768, help="B·N (the benchmark's 32k)")
    p.add_argument("--width", type=int, default=2048, help="H·D (the benchmark's 2048)")
    p.add_argument("--jobs", type=int, default=None, help="compile workers (default: CPUs - 2; 0 = in-process)")
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=50.0)
    p.add_argument("--no-end-to-end", action="store_true")
    p.add_argument(
        "--interpret-smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, 1-2 candidates"
    )
    a = p.parse_args(argv)
    if a.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
        a.N, a.tokens, a.width, a.jobs = 128, 128, 128, 0
    t_start = time.perf_counter()
    deadline = t_start + a.budget_s
    out_dir = a.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "tmp")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tile_sweep.json")

    import torch
    import triton

    from attnlab.ops.triton import autograd as ag

    device = torch.device("cpu" if a.interpret_smoke else "cuda")
    if not a.interpret_smoke:
        if not torch.cuda.is_available():
            log("no CUDA GPU (use --interpret-smoke on a CPU machine)")
            return 2
        if ag.interpreting():
            log("TRITON_INTERPRET is set: unset it to time the compiled kernels")
            return 2
    elif not ag.interpreting():
        log("--interpret-smoke: the kernels were not defined for the interpreter")
        return 2
    jobs = a.jobs if a.jobs is not None else max(1, (os.cpu_count() or 4) - 2)
    cands = load_candidates(a.candidates, a.kernel, a.head_dim, a.per_group, a.interpret_smoke)
    rec: dict = {
        "meta": {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "args": vars(a),
            "shapes": {str(D): shape_for(D, a) for D in a.head_dim},
            "bound_rel": BOUND_REL,
            "candidates_file": cands["meta"],
            "jobs": jobs,
        },
        "sdpa": {},
        "rows": [],
        "winners": {},
        "end_to_end": {},
        "done": False,
    }
    log(
        f"{rec['meta']['device']}; torch {torch.__version__}, triton {triton.__version__}; budget {a.budget_s:.0f} s; "
        f"shapes {rec['meta']['shapes']}; {sum(len(v) for v in cands['groups'].values())} candidates; {jobs} compile workers"
    )
    write(rec, path)

    order = [g for g in GROUP_ORDER if g in cands["groups"]]
    pre = Precompiler(jobs, a)
    for D in a.head_dim:  # the shipped forward first: the backward candidates need its out / LSE
        (ft, fws) = shipped("fwd", D)
        for mask in MASKS:
            pre.submit(("fwd", D, ft, fws[0][0], fws[0][1], mask))
    for kernel, D in order:
        for c in cands["groups"][(kernel, D)]:
            for mask in MASKS:
                pre.submit((kernel, D, tuple(c["tile"]), c["warps"], c["stages"], mask))

    setups: dict = {}
    stopped = None
    reserve = 0.0 if a.no_end_to_end else a.reserve_s
    results: dict = {}  # (kernel, D) -> key -> {"by_mask": ..., ...}
    default_ms: dict = {}  # (kernel, D) -> mask -> best ms of the shipped candidates
    try:
        for kernel, D in order:
            if time.perf_counter() > deadline - reserve:
                stopped = f"budget: stopped before {kernel} D={D}"
                break
            if D not in setups:
                log(f"\n-- D={D}: inputs {shape_for(D, a)}, SDPA references and baselines")
                setups[D] = Setup(D, a, device)
                setups[D].sdpa_baselines(rec)
                write(rec, path)
            st = setups[D]
            fwd_default = (shipped("fwd", D)[0], shipped("fwd", D)[1][0])
            dtile, dcands = shipped(kernel, D)
            rows = results.setdefault((kernel, D), {})
            dms = default_ms.setdefault((kernel, D), {})
            log(f"\n-- {kernel} D={D}: {len(cands['groups'][(kernel, D)])} candidates (shipped {dtile} {dcands})")
            for c in cands["groups"][(kernel, D)]:
                if time.perf_counter() > deadline - reserve:
                    stopped = f"budget: stopped in {kernel} D={D}"
                    break
                key = cand_key(c)
                r = rows.setdefault(key, {"kernel": kernel, "D": D, **c, "by_mask": {}})
                r["default"] = tuple(c["tile"]) == dtile and (c["warps"], c["stages"]) in dcands
                for mask in MASKS:
                    left = deadline - reserve - time.perf_counter()
                    pc = pre.wait((kernel, D, tuple(c["tile"]), c["warps"], c["stages"], mask), left)
                    try:
                        m = measure(kernel, st, mask, c, fwd_default)
                    except Exception as e:  # noqa: BLE001 - one candidate never ends the run
                        m = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                        log(f"  {key} {mask}: {m['error'][:200]}")
                    if pc is not None:
                        m["worker"] = pc
                    r["by_mask"][mask] = m
                    if "ms" in m and r["default"]:  # the time users get, racy or not
                        dms[mask] = min(dms.get(mask, float("inf")), m["ms"])
                    if "ms" in m:
                        log(
                            f"  {key:16s} {mask:6s} {m['ms']:8.3f} ms {m['tflops']:5.0f} TF  "
                            f"regs {m.get('n_regs', '?')} spills {m.get('n_spills', '?')}  "
                            f"check {'ok' if m['check']['ok'] else 'FAIL'} "
                            f"(worst err/bound {max(v['err_over_bound'] for v in m['check'].values() if isinstance(v, dict)):.2f}, "
                            f"rerun diff {m['check']['rerun_max_diff']:.3g})"
                        )
                    rec["rows"] = [x for g in results.values() for x in g.values()]
                    write(rec, path)
                if stopped:
                    break
            # estimated fwd+bwd ratios to SDPA with the others at the shipped configs
            fill_estimates(results, default_ms, setups, rec)
            scored = table(kernel, D, rows, dms, st)
            best = [k for s_, k in scored if s_ != float("inf")]
            if best:
                w = rows[best[0]]
                rec["winners"].setdefault(str(D), {})[kernel] = {
                    "tile": w["tile"],
                    "warps": w["warps"],
                    "stages": w["stages"],
                    "score_vs_default": w["score_vs_default"],
                    "runner_up": [{"config": k, "score_vs_default": rows[k]["score_vs_default"]} for k in best[1:4]],
                    # (warps, stages) at the winning tile within 3% of it: the autotune list
                    "autotune": [
                        [rows[k]["warps"], rows[k]["stages"]]
                        for k in best
                        if rows[k]["tile"] == w["tile"] and rows[k]["score_vs_default"] <= 1.03 * w["score_vs_default"]
                    ],
                    "ms": {mk: w["by_mask"][mk]["ms"] for mk in MASKS},
                    "shipped_ms": dict(dms),
                }
            write(rec, path)
            if stopped:
                break
    finally:
        pre.close()

    # ---- the winners end to end, against the shipped configuration and SDPA
    if not a.no_end_to_end:
        for D in a.head_dim:
            if D not in setups:
                continue
            if time.perf_counter() > deadline + 0.5 * reserve:  # the reserve is for this; a little over is fine
                stopped = (stopped or "") + f"; budget: no end-to-end at D={D}"
                break
            picks = {}
            for kernel, w in rec["winners"].get(str(D), {}).items():
                picks[kernel] = (tuple(w["tile"]), [tuple(c) for c in w.get("autotune") or [(w["warps"], w["stages"])]])
            st = setups[D]
            e2e = {"picks": {k: [list(t), c] for k, (t, c) in picks.items()}}
            log(f"\n-- end to end D={D}: shipped vs picks {e2e['picks']}")
            try:
                e2e["shipped"] = end_to_end(st, "shipped", None)
                if picks:
                    e2e["picks_run"] = end_to_end(st, "picks", picks)
            except Exception as e:  # noqa: BLE001
                e2e["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
            rec["end_to_end"][str(D)] = e2e
            write(rec, path)

    rec["config_patch"] = config_patch(rec)
    rec["done"] = stopped is None
    rec["stopped"] = stopped
    rec["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write(rec, path)
    log("\n== suggested config.py entries (bf16; apply only with the rows above):\n" + rec["config_patch"])
    log(f"\n{'stopped: ' + stopped if stopped else 'done'}; {rec['elapsed_s']} s; {path}")
    return 0


def fill_estimates(results: dict, default_ms: dict, setups: dict, rec: dict) -> None:
    for (kernel, D), rows in results.items():
        st = setups.get(D)
        if st is None:
            continue
        for r in rows.values():
            for mask, m in r["by_mask"].items():
                if "ms" not in m:
                    continue
                others = {k: default_ms.get((k, D), {}).get(mask) for k in ("fwd", "dq", "dkdv")}
                fb = est_fb(kernel, st, mask, m["ms"], others)
                best = st.sdpa.get(mask, {}).get("best")
                m["est_fb_ms"] = fb
                m["est_fb_vs_sdpa"] = best["fb_ms"] / fb if fb and best else None
    rec["rows"] = [x for g in results.values() for x in g.values()]


def config_patch(rec: dict) -> str:
    """The GPU_TILES / AUTOTUNE entries the winners suggest, as text to paste into config.py."""
    lines = []
    for D, ws in sorted(rec["winners"].items(), key=lambda kv: -int(kv[0])):
        tiles = ", ".join(f'"{k}": ({w["tile"][0]}, {w["tile"][1]})' for k, w in sorted(ws.items()))
        cands = ", ".join(
            f'"{k}": [' + ", ".join(f"({a}, {b})" for a, b in w.get("autotune") or [(w["warps"], w["stages"])]) + "]"
            for k, w in sorted(ws.items())
        )
        lines.append(f'GPU_TILES["16bit"][{D}] <- {{{tiles}}}   (kernels not listed: unchanged)')
        lines.append(f'AUTOTUNE["16bit"][{D}] <- {{{cands}, "delta": [(4, 1)]}}')
        for k, w in sorted(ws.items()):
            lines.append(
                f"    {k} D={D}: {w['tile'][0]}x{w['tile'][1]} w{w['warps']} s{w['stages']}: "
                f"geo-mean {w['score_vs_default']:.3f}x the shipped time; runners-up "
                + ", ".join(f"{r['config']} ({r['score_vs_default']:.3f}x)" for r in w["runner_up"])
            )
    return "\n".join(lines) if lines else "(no winners measured)"


if __name__ == "__main__":
    sys.exit(main())
