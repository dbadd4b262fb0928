"""``attnlab bench attention``: attnlab's backends side by side with torch SDPA and
FlexAttention (compiled) in one run.

For every case it reports the median time of each backend, GFLOP/s counting only
the unmasked work (forward ``4·D`` flops per allowed (q, k) pair with ``D = Dv``;
forward+backward 3.5× that, FlashAttention's convention), the ratio to torch SDPA
(with a dense boolean mask where the case has a mask), and the same-dtype
``torch.matmul`` rate measured in the same run as the machine's ceiling (the best of square
matmuls of 1024 and 2048, each the fastest of 7 runs after warm-ups, before and after the
cases: :func:`matmul_rate`).  Memory
cases report the peak extra resident memory of forward and of forward+backward
(see :mod:`attnlab.bench.measure`).  Absolute times on a shared 2-core machine are
noise; read the ratios.

Two times per backend.  The median of the interleaved rounds (A, B, C, flex, then B, C, A,
flex, ...: the backends before FlexAttention rotate, round by round) is the one the ratios to
SDPA use: drift and order hit every backend alike, and every call starts
where a user's would, after other work (here: the other backends, whose dense masks and
compiled graphs leave the caches cold and the allocator's pages handed back).  The *warm*
time is the fastest of back-to-back calls of the same backend after two untimed calls
(:func:`warm_time`), measured as the ceiling is: at two moments, after the case's rounds and
again after every case, next to the ceiling's second reading (:func:`_warm_again`), the faster
of the two.  The share of the ceiling (``warm %mm``) compares the two like for like.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from attnlab.bench import memprobe
from attnlab.bench.measure import best_time

MiB = 1 << 20
#: compiled FlexAttention's backend name (last in every round; no second warm moment)
FLEX = "flex compiled"
_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Case:
    name: str
    mask: str  # full | causal | window256 | doc8 | prefix
    B: int
    H: int
    Hkv: int
    N: int
    D: int
    dtype: str
    mode: str = "fwd"  # fwd | fwdbwd
    memory_only: bool = False
    quick: bool = True

    @property
    def shape(self):
        return (self.B, self.H, self.N, self.D)


def default_cases() -> list[Case]:
    cs = []
    for dt in ("float32", "bfloat16"):
        for B, H, N, D in ((1, 8, 4096, 64), (1, 4, 8192, 128)):
            for m in ("full", "causal"):
                cs.append(Case(f"{m} {dt} ({B},{H},{N},{D})", m, B, H, H, N, D, dt, quick=(N == 4096)))
    for m in ("window256", "doc8", "prefix"):
        for dt in ("float32", "bfloat16"):
            cs.append(Case(f"{m} {dt} (1,4,8192,64)", m, 1, 4, 4, 8192, 64, dt, quick=dt == "float32"))
    for dt in ("float32", "bfloat16"):
        cs.append(Case(f"GQA 8:2 causal {dt} (1,8,4096,64)", "causal", 1, 8, 2, 4096, 64, dt))
    for m in ("causal", "window256"):
        for dt in ("float32", "bfloat16"):
            cs.append(
                Case(f"fwd+bwd {m} {dt} (1,8,2048,64)", m, 1, 8, 8, 2048, 64, dt, mode="fwdbwd", quick=dt == "float32")
            )
    cs.append(
        Case(
            "memory causal float32 (1,1,32768,64)",
            "causal",
            1,
            1,
            1,
            32768,
            64,
            "float32",
            mode="fwdbwd",
            memory_only=True,
        )
    )
    return cs


def attnlab_mask(case: Case):
    N = case.N
    if case.mask == "full":
        return None
    if case.mask == "causal":
        return masks.causal()
    if case.mask == "window256":
        return masks.sliding_window(256)
    if case.mask == "doc8":
        return masks.document(torch.arange(N) * 8 // N) & masks.causal()
    if case.mask == "prefix":
        return masks.prefix_lm(N // 4)
    raise ValueError(case.mask)


def flex_mask_mod(case: Case):
    N = case.N
    if case.mask == "causal":
        return lambda b, h, q, kv: kv <= q
    if case.mask == "window256":
        return lambda b, h, q, kv: (kv <= q) & (q - kv < 256)
    if case.mask == "doc8":
        ids = torch.arange(N) * 8 // N
        return lambda b, h, q, kv: (ids[q] == ids[kv]) & (kv <= q)
    if case.mask == "prefix":
        return lambda b, h, q, kv: (kv < N // 4) | (kv <= q)
    return None


def dense_bool_mask(case: Case):
    m = attnlab_mask(case)
    if m is None:
        return None
    idx = torch.arange(case.N)
    return m(torch.tensor(0), torch.tensor(0), idx.view(-1, 1), idx.view(1, -1)).reshape(case.N, case.N)


def allowed_pairs(case: Case) -> int:
    dm = dense_bool_mask(case)
    per_head = case.N * case.N if dm is None else int(dm.sum())
    return per_head * case.B * case.H


def case_flops(case: Case) -> float:
    f = 4.0 * case.D * allowed_pairs(case)
    return f * 3.5 if case.mode == "fwdbwd" else f


#: square matmul sizes of the ceiling: 1024 (operands in L2/L3, as the kernels' tiles) and 2048
MATMUL_SIZES = (1024, 2048)


def matmul_rates(dtype: torch.dtype, sizes=MATMUL_SIZES, reps: int = 7, warmup: int = 2) -> dict[int, float]:
    """GFLOP/s of a square ``torch.matmul`` per size: the fastest of ``reps`` runs after
    ``warmup`` (into a preallocated output, so no allocation is timed; see
    :func:`attnlab.bench.measure.best_time`)."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        c = torch.empty(n, n, dtype=dtype)

        def mm(a: torch.Tensor = a, b: torch.Tensor = b, c: torch.Tensor = c) -> torch.Tensor:
            return torch.matmul(a, b, out=c)

        out[n] = 2.0 * n**3 / best_time(mm, reps=reps, warmup=warmup, budget_s=5.0) / 1e9
    return out


WARM_BUDGET_S = 3.0
#: the warm time's calls, as many as the ceiling's per size (:func:`matmul_rates`): two untimed,
#: then the fastest of seven.  It was one untimed call and the fastest of ``--reps`` (3) until
#: 2026-12-05, when window256 bf16's warm time (5.1 ms) came out slower than the same backend's
#: interleaved median (4.4 ms) in one run: three calls on this machine can all land in a slow spell.
WARM_REPS, WARM_WARMUP = 7, 2


def warm_time(
    fn: Callable[[], object], reps: int = WARM_REPS, warmup: int = WARM_WARMUP, budget_s: float = WARM_BUDGET_S
) -> float:
    """Seconds of ``fn()`` called back to back, as the ceiling is measured: ``warmup`` untimed
    calls, then the fastest of ``reps`` (fewer where ``budget_s`` of timed calls runs out; at
    least one)."""
    return best_time(fn, reps=reps, warmup=warmup, budget_s=budget_s)


def matmul_rate(dtype: torch.dtype, sizes=MATMUL_SIZES, reps: int = 7) -> float:
    """The machine's same-dtype matmul ceiling (GFLOP/s): the best rate over ``sizes``, each
    the fastest of ``reps`` runs after a warm-up.  A median of one size (what this was before)
    read 129 GFLOP/s float32 in a run where SDPA itself reached 147: a ceiling is what the
    machine can do, and load only ever slows a run, so the best run is the estimate."""
    return max(matmul_rates(dtype, sizes, reps).values())


class Runner:
    """Builds the inputs of one case and a zero-argument callable per backend."""

    def __init__(self, case: Case, seed: int = 0):
        self.case = case
        g = torch.Generator().manual_seed(seed)
        dt = _DT[case.dtype]
        B, H, Hkv, N, D = case.B, case.H, case.Hkv, case.N, case.D
        grad = case.mode == "fwdbwd"
        self.q = torch.randn(B, H, N, D, generator=g).to(dt).requires_grad_(grad)
        self.k = torch.randn(B, Hkv, N, D, generator=g).to(dt).requires_grad_(grad)
        self.v = torch.randn(B, Hkv, N, D, generator=g).to(dt).requires_grad_(grad)
        self.dout = torch.randn(B, H, N, D, generator=g).to(dt) if grad else None
        self.mask = attnlab_mask(case)
        self.flex_compile_s: float | None = None
        self._flex: Callable[[], torch.Tensor] | None = None

    def _run(self, f):
        def go():
            for t in (self.q, self.k, self.v):
                t.grad = None
            out = f()
            if self.dout is not None:
                out.backward(self.dout)
                return out, self.q.grad, self.k.grad, self.v.grad
            return out

        if self.dout is None:

            def nograd():
                with torch.no_grad():
                    return go()

            return nograd
        return go

    def backends(self, with_flex: bool = True) -> dict:
        c = self.case
        q, k, v, mask = self.q, self.k, self.v, self.mask
        gqa = c.H != c.Hkv
        out = {
            "attnlab auto": self._run(lambda: attnlab.attention(q, k, v, mask=mask)),
            "attnlab flash": self._run(lambda: attnlab.attention(q, k, v, mask=mask, backend="flash")),
        }
        from attnlab.ops.native import build as native_build

        if native_build.load() is not None:  # the C++ CPU kernel, where it builds
            out["attnlab native"] = self._run(lambda: attnlab.attention(q, k, v, mask=mask, backend="native"))
        if c.mask in ("full", "causal"):
            out["torch sdpa"] = self._run(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c.mask == "causal", enable_gqa=gqa)
            )
        else:
            dm = dense_bool_mask(c)
            out["torch sdpa (dense mask)"] = self._run(
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dm, enable_gqa=gqa)
            )
        if with_flex and flex_available():
            out[FLEX] = self._run(self._flex_call)
        return out

    def _flex_call(self):
        """Compiled FlexAttention on this case (compiled on the first call, timed as
        ``flex_compile_s``).  Every case compiles ``flex_attention``'s one code object again, and
        dynamo stops compiling a code object after ``recompile_limit`` (8) versions: from the
        ninth case on it ran flex_attention *eagerly* (5 s a call at N=8192) under the name
        "flex compiled", with one warning (the runs up to 2026-12-05 07:15, docs/benchmarks.md).
        So each case starts from an empty dynamo cache (the earlier cases are done with theirs),
        and a call that would still fall back raises instead (``fail_on_recompile_limit_hit``:
        the table records the error, not an eager time)."""
        if self._flex is None:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            c = self.case
            mm = flex_mask_mod(c)
            bm = None if mm is None else create_block_mask(mm, None, None, c.N, c.N, device="cpu")
            torch.compiler.reset()
            fn = torch.compile(flex_attention, dynamic=False)
            gqa = c.H != c.Hkv

            def flex():
                with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                    return fn(self.q, self.k, self.v, block_mask=bm, enable_gqa=gqa)

            self._flex = flex
            t0 = time.perf_counter()
            r = flex()
            if self.dout is not None:
                r.backward(self.dout)
            self.flex_compile_s = time.perf_counter() - t0
        return self._flex()


_FLEX_OK = None


def flex_available() -> bool:
    """Compiled FlexAttention needs torch.compile's C++ backend (a working compiler)."""
    global _FLEX_OK
    if _FLEX_OK is None:
        try:
            import shutil

            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

            _FLEX_OK = shutil.which("g++") is not None or shutil.which("c++") is not None
        except Exception:  # noqa: BLE001  # pragma: no cover - torch without flex
            _FLEX_OK = False
    return _FLEX_OK


def run(
    cases: list[Case],
    reps: int = 3,
    with_flex: bool = True,
    progress: bool = True,
    memory: bool = True,
    warm: bool = True,
) -> dict:
    """Time every backend of every case (the interleaved rounds' median; with ``warm``, also
    the fastest of back-to-back calls, :func:`warm_time`, at two moments: after the case's rounds
    and after every case, :func:`_warm_again`); with ``memory``, also measure each
    one's peak extra memory in a child process (:mod:`attnlab.bench.memprobe`)."""
    from tqdm import tqdm

    results: dict[str, Any] = {"machine": machine_info(), "cases": [], "matmul_gflops": {}}
    dtypes = sorted({c.dtype for c in cases})
    for dt in dtypes:
        results["matmul_gflops"][dt] = matmul_rate(_DT[dt])
    plan = []
    for c in cases:
        r = Runner(c)
        names = ["attnlab auto", "attnlab flash", "torch sdpa"] if c.memory_only else list(r.backends(with_flex))
        plan.append((c, r, names))
    n_reps = {c.name: 1 if c.memory_only else reps for c, _, _ in plan}
    per_backend = {c.name: n_reps[c.name] + 1 + (1 if warm and not c.memory_only else 0) for c, _, _ in plan}
    total = sum(len(names) * per_backend[c.name] for c, _, names in plan)
    if warm:  # the warm times' second moment (_warm_again)
        total += sum(len(names) - names.count(FLEX) for c, _, names in plan if not c.memory_only)
    bar = tqdm(
        total=total, desc="bench attention", unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True
    )
    by_case = {}
    for c, r, names in plan:
        recs = _run_case(c, r, names, n_reps[c.name], with_flex, memory, bar, warm and not c.memory_only)
        by_case[c.name] = (c, recs)
    if warm:
        for c, r, _names in plan:
            if not c.memory_only:
                _warm_again(c, r, by_case[c.name][1], bar)
    bar.close()
    for dt in dtypes:  # again after the cases: a ceiling read while the machine was busy is low
        results["matmul_gflops"][dt] = max(results["matmul_gflops"][dt], matmul_rate(_DT[dt]))
    for _name, (c, recs) in by_case.items():
        flops = case_flops(c)
        anchor = next((x["seconds"] for x in recs if x["backend"].startswith("torch sdpa") and "seconds" in x), None)
        ceil = results["matmul_gflops"][c.dtype]
        for x in recs:
            if "seconds" in x:
                x["gflops"] = flops / x["seconds"] / 1e9
                x["pct_of_matmul"] = 100.0 * x["gflops"] / ceil
                x["vs_torch_sdpa"] = anchor / x["seconds"] if anchor else None
            if "warm_seconds" in x:
                x["warm_gflops"] = flops / x["warm_seconds"] / 1e9
                x["warm_pct_of_matmul"] = 100.0 * x["warm_gflops"] / ceil
        results["cases"].append(
            {**asdict(c), "flops": flops, "density": allowed_pairs(c) / (c.B * c.H * c.N * c.N), "results": recs}
        )
    return results


def _run_case(
    c: Case, r: Runner, names: list[str], reps: int, with_flex: bool, memory: bool, bar, warm: bool = False
) -> list[dict]:
    """Warm every backend up, then time them in interleaved rounds (backend A, B, C,
    A, B, C, ...) so that drift and order effects hit all of them alike; medians.  With
    ``warm``, then each backend's fastest back-to-back call (:func:`warm_time`)."""
    import statistics

    fns = r.backends(with_flex)
    fns = {n: fns.get(n) or fns["torch sdpa (dense mask)"] for n in names}
    recs: dict[str, dict[str, Any]] = {n: {"backend": n} for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}

    def attempt(n, what):
        bar.set_postfix_str(f"{c.name[:34]} | {n} | {what}")
        if "error" in recs[n]:
            bar.update(1)
            return None
        try:
            t0 = time.perf_counter()
            fns[n]()
            return time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this case is reported, not fatal
            recs[n]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return None
        finally:
            bar.update(1)
            if n == FLEX:
                # inductor's OpenMP workers spin for a while after a kernel returns; let
                # them settle so that they do not steal the next backend's cores
                time.sleep(0.5)

    if not c.memory_only:
        for n in names:
            attempt(n, "warm-up")
    else:
        bar.update(len(names))
    # Round i starts at the i-th backend (FlexAttention stays last).  In a fixed order the first
    # backend always came right after FlexAttention's settling sleep, when this VM's idle second
    # core wakes late and the caches have gone cold: `attnlab auto`, first, read 8.7 ms
    # interleaved at window256 bf16 where `attnlab native`, the same kernel third, read 4.3
    # (2026-12-05 10:21).  Rotated, that call falls to a different backend each round, and the
    # median of three drops it.
    rest = [n for n in names if n != FLEX]
    last = [n for n in names if n == FLEX]
    for i in range(reps):
        k = i % len(rest) if rest else 0
        for n in rest[k:] + rest[:k] + last:
            t = attempt(n, f"rep {i + 1}/{reps}")
            if t is not None:
                times[n].append(t)
    for n in names:
        if warm and times[n]:
            bar.set_postfix_str(f"{c.name[:34]} | {n} | warm")
            rec_t = warm_time(fns[n])
            if n == FLEX:
                time.sleep(0.5)  # as in attempt(): inductor's workers settle
            recs[n]["warm_seconds"] = rec_t
            bar.update(1)
        elif warm:
            bar.update(1)
    for n in names:
        rec = recs[n]
        if times[n]:
            rec["seconds"] = statistics.median(times[n])
        if n == FLEX and r.flex_compile_s is not None and times[n]:
            rec["compile_seconds"] = r.flex_compile_s - rec["seconds"]
        elif memory and "error" not in rec:  # in a child process, see attnlab.bench.memprobe
            bar.set_postfix_str(f"{c.name[:34]} | {n} | memory")
            try:
                fields = asdict(c)
                if c.mode == "fwdbwd":
                    rec["peak_extra_mib"] = memprobe.measure(fields, n, "fwdbwd")
                if c.mode == "fwd" or c.memory_only:
                    rec["peak_extra_fwd_mib"] = memprobe.measure(fields, n, "fwd")
            except Exception as e:  # noqa: BLE001 - a failed memory probe is reported in the record
                rec["memory_error"] = f"{type(e).__name__}: {e}"
        if n == "attnlab auto" and "error" not in rec:
            rec["auto_choice"] = _auto_choice(r)
    return [recs[n] for n in names]


def _warm_again(c: Case, r: Runner, recs: list[dict], bar) -> None:
    """Each backend's warm time a second time, after every case has run and next to the
    ceiling's second reading; its warm time is then the faster of the two moments
    (``warm_seconds``; both in ``warm_seconds_runs``).  The ceiling is the best of its readings
    before and after the cases (:func:`run`), so a warm time read at one moment only was the
    weaker estimate of the two sides of ``w%mm``: in a slow spell of this VM (minutes long)
    every one of its seven calls is slow, and the ceiling's other moment is not.  Not
    FlexAttention's: its compiled graph went with the case's dynamo cache (it keeps its one
    moment).  A backend that fails now keeps its first moment and the error
    (``warm_again_error``): the whole run's results are not lost to it."""
    fns = r.backends(with_flex=False)
    for rec in recs:
        n = rec["backend"]
        if n == FLEX:
            continue
        if n in fns and "warm_seconds" in rec and "error" not in rec:
            bar.set_postfix_str(f"{c.name[:34]} | {n} | warm again")
            try:
                t = warm_time(fns[n])
            except Exception as e:  # noqa: BLE001 - reported; the run's other results are kept
                rec["warm_again_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            else:
                rec["warm_seconds_runs"] = [rec["warm_seconds"], t]
                rec["warm_seconds"] = min(rec["warm_seconds"], t)
        bar.update(1)


def _auto_choice(r: Runner) -> str:
    from attnlab.ops.dispatch import choose_backend

    c = r.case
    with torch.set_grad_enabled(c.mode == "fwdbwd"):
        return choose_backend(r.q, r.k, r.mask, None, c.N - c.N, 0, False)


def machine_info() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def format_table(res: dict) -> str:
    lines = [
        f"torch {res['machine']['torch']}, {res['machine']['threads']} threads, {res['machine']['cpu']}, "
        f"{res['machine']['date']}",
        "matmul ceiling (GFLOP/s): " + ", ".join(f"{k} {v:.0f}" for k, v in res["matmul_gflops"].items()),
        "",
    ]
    hdr = f"{'case':<40} {'backend':<24} {'ms':>9} {'GFLOP/s':>8} {'%mm':>5} {'x sdpa':>7} {'warm ms':>9} {'w%mm':>5}  notes"
    lines += [hdr, "-" * len(hdr)]
    for c in res["cases"]:
        for x in c["results"]:
            notes = []
            if x.get("auto_choice"):
                notes.append(f"-> {x['auto_choice']}")
            if x.get("compile_seconds") is not None:
                notes.append(f"compile {x['compile_seconds']:.1f}s")
            if x.get("peak_extra_fwd_mib") is not None:
                notes.append(f"peak extra fwd {x['peak_extra_fwd_mib']:.1f} MiB")
            if x.get("warm_again_error"):
                notes.append(f"second warm moment failed: {x['warm_again_error']}")
            if x.get("peak_extra_mib") is not None:
                notes.append(f"peak extra fwd+bwd {x['peak_extra_mib']:.1f} MiB")
            if "error" in x:
                lines.append(
                    f"{c['name']:<40} {x['backend']:<24} {'-':>9} {'':>8} {'':>5} {'':>7} {'':>9} {'':>5}  {x['error']}"
                )
                continue
            ratio = f"{x['vs_torch_sdpa']:.2f}" if x.get("vs_torch_sdpa") else "-"
            warm = (
                f"{x['warm_seconds'] * 1e3:>9.1f} {x['warm_pct_of_matmul']:>5.0f}"
                if "warm_seconds" in x
                else f"{'-':>9} {'-':>5}"
            )
            lines.append(
                f"{c['name']:<40} {x['backend']:<24} {x['seconds'] * 1e3:>9.1f} {x['gflops']:>8.1f} "
                f"{x['pct_of_matmul']:>5.0f} {ratio:>7} {warm}  {'; '.join(notes)}"
            )
        lines.append("")
    return "\n".join(lines)


def main(
    argv=None,
    quick: bool = False,
    json_path: str | None = None,
    reps: int = 3,
    flex: bool = True,
    only: str | None = None,
    memory: bool = True,
    warm: bool = True,
) -> dict:
    cases = default_cases()
    if quick:
        cases = [c for c in cases if c.quick]
    if only:
        cases = [c for c in cases if only in c.name]
    res = run(cases, reps=reps, with_flex=flex, memory=memory, warm=warm)
    print(format_table(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
        print(f"wrote {json_path}")
    return res
