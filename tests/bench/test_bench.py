"""The benchmark machinery: measurement helpers and one tiny case end to end."""

import inspect
import json
import subprocess
import sys
import time

import pytest
import torch

from attnlab.bench import attention as bench
from attnlab.bench.measure import best_time, memory_supported, peak_extra_bytes, time_call
from attnlab.cli import main
from tests.helpers import F32_FEW_ULPS

MiB = 1 << 20


@pytest.mark.skipif(not memory_supported(), reason="needs /proc/self/clear_refs (Linux)")
def test_peak_extra_sees_a_transient_allocation_and_not_an_old_one():
    keep = torch.ones(32 * MiB // 4)  # allocated before: must not count
    extra = peak_extra_bytes(lambda: torch.ones(64 * MiB // 4).sum())  # 64 MiB, freed inside
    assert 60 * MiB <= extra <= 100 * MiB
    small = peak_extra_bytes(lambda: torch.ones(1024).sum())
    assert small < 8 * MiB
    del keep


def test_time_call_is_a_median_of_positive_times():
    calls = []
    t = time_call(lambda: calls.append(1), reps=5, warmup=2)
    assert t >= 0 and len(calls) == 7
    # timed calls sleeping 0, 0, 50, 50, 50 ms after two 200 ms warm-ups (not timed): the median is
    # at least 50 ms (sleep never returns early), where the mean (30 ms) and the minimum (0) are not,
    # and a timed warm-up would not leave it under 200 ms
    naps = iter([0.2, 0.2, 0.0, 0.0, 0.05, 0.05, 0.05])
    t = time_call(lambda: time.sleep(next(naps)), reps=5, warmup=2)
    assert 0.05 <= t < 0.2


def test_best_time_is_the_fastest_timed_run():
    # two 200 ms warm-ups (not timed), then runs of 80, 30 and 80 ms: the best is the 30 ms one
    # (where the median would be 80 ms and a timed warm-up 200)
    naps = iter([0.2, 0.2, 0.08, 0.03, 0.08])
    t = best_time(lambda: time.sleep(next(naps)), reps=3, warmup=2)
    assert 0.03 <= t < 0.08


def test_warm_time_is_the_fastest_call_after_the_untimed_ones():
    # two untimed calls (a 10 ms one among them would be the fastest), then 80, 30 and 80 ms: 30 ms
    naps = iter([0.2, 0.01, 0.08, 0.03, 0.08])
    assert 0.03 <= bench.warm_time(lambda: time.sleep(next(naps)), reps=3) < 0.08
    # the budget stops the timed calls, never before one
    calls = []
    t = bench.warm_time(lambda: calls.append(time.sleep(0.02)), reps=50, budget_s=0.0)
    assert len(calls) == bench.WARM_WARMUP + 1 and t >= 0.02
    # by default as many calls as the ceiling's per size (matmul_rates' reps and warm-up)
    calls.clear()
    bench.warm_time(lambda: calls.append(None))
    sig = inspect.signature(bench.matmul_rates).parameters
    assert len(calls) == sig["warmup"].default + sig["reps"].default == bench.WARM_WARMUP + bench.WARM_REPS


def test_warm_times_are_back_to_back_calls_after_the_interleaved_rounds(monkeypatch):
    log: list[str] = []

    class Fake:
        def __init__(self, case):
            self.case = case

        def backends(self, with_flex=True):
            return {n: (lambda n=n: log.append(n)) for n in ("a", "b", "c")}

    case = bench.Case("fake", "causal", 1, 1, 1, 64, 16, "float32")

    class Bar:
        n = 0

        def set_postfix_str(self, s):
            pass

        def update(self, k):
            Bar.n += k

    recs = bench._run_case(case, Fake(case), ["a", "b", "c"], 2, False, False, Bar(), warm=True)
    # warm-ups, two interleaved rounds (the second starts at the second backend), then each
    # backend's warm calls in a row (warm_time's untimed and timed calls, whatever the
    # interleaved rounds' count)
    w = bench.WARM_WARMUP + bench.WARM_REPS
    assert log == ["a", "b", "c"] * 2 + ["b", "c", "a"] + ["a"] * w + ["b"] * w + ["c"] * w
    assert all(r["warm_seconds"] > 0 and r["seconds"] > 0 for r in recs)
    assert Bar.n == 3 * (2 + 1 + 1)  # the progress bar counts warm-up, reps and the warm time
    log.clear()
    recs = bench._run_case(case, Fake(case), ["a", "b", "c"], 2, False, False, Bar(), warm=False)
    assert log == ["a", "b", "c"] * 2 + ["b", "c", "a"] and not any("warm_seconds" in r for r in recs)


def test_the_backend_after_flexattention_changes_round_by_round(monkeypatch):
    """FlexAttention, last in every round, is followed by a settling sleep; the call after it
    starts on a cold machine (8.7 ms against 4.3 for the same kernel at window256 bf16).  The
    other backends rotate, so each interleaved round hands that call to another backend."""
    log: list[str] = []
    names = ["a", "b", "c", "flex compiled"]

    class Fake:
        flex_compile_s = None

        def backends(self, with_flex=True):
            return {n: (lambda n=n: log.append(n)) for n in names}

    class Bar:
        def set_postfix_str(self, s):
            pass

        def update(self, k):
            pass

    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    case = bench.Case("fake", "causal", 1, 1, 1, 64, 16, "float32")
    bench._run_case(case, Fake(), names, 3, True, False, Bar(), warm=False)
    rounds = ["a", "b", "c", "flex compiled", "b", "c", "a", "flex compiled", "c", "a", "b", "flex compiled"]
    assert log == [*names, *rounds]
    after_flex = [log[i + 1] for i, n in enumerate(log[:-1]) if n == "flex compiled"]
    assert after_flex == ["a", "b", "c"]


def test_matmul_ceiling_is_the_best_size_and_run(monkeypatch):
    seen = []

    def fake_best_time(fn, reps, warmup, budget_s):
        fn()  # a real (tiny) matmul into the preallocated output
        seen.append((reps, warmup))
        return {1: 2.0, 2: 4.0}[len(seen)]  # size 64: 2 s; size 128: 4 s

    monkeypatch.setattr(bench, "best_time", fake_best_time)
    rates = bench.matmul_rates(torch.float32, sizes=(64, 128))
    assert rates == {64: pytest.approx(2 * 64**3 / 2.0 / 1e9), 128: pytest.approx(2 * 128**3 / 4.0 / 1e9)}
    assert all(r >= 3 and w >= 1 for r, w in seen)  # several timed runs, warmed up
    seen.clear()
    assert bench.matmul_rate(torch.float32, sizes=(64, 128)) == pytest.approx(2 * 128**3 / 4.0 / 1e9)
    monkeypatch.undo()  # a real one: positive and finite
    assert 0 < bench.matmul_rate(torch.float32, sizes=(32,), reps=2) < 1e6


def test_run_takes_the_better_ceiling_of_before_and_after(monkeypatch):
    ceilings = iter([10.0, 25.0])  # measured before the cases, then after them
    monkeypatch.setattr(bench, "matmul_rate", lambda dtype: next(ceilings))
    case = bench.Case("tiny causal", "causal", 1, 1, 1, 64, 16, "float32")
    res = bench.run([case], reps=1, with_flex=False, progress=False, memory=False)
    assert res["matmul_gflops"] == {"float32": 25.0}
    for r in res["cases"][0]["results"]:
        assert r["pct_of_matmul"] == pytest.approx(100 * r["gflops"] / 25.0)
        assert r["warm_pct_of_matmul"] == pytest.approx(100 * r["warm_gflops"] / 25.0)


def test_tiny_case_end_to_end_reports_ratios_and_auto_choice(monkeypatch):
    # the ceiling is measured for real, on one 512 x 512 matmul: the default sizes (1024 and 2048,
    # for machines with many cores) cost 1.7 s a call here, twice a run, for the same rate within
    # 1 % on one core; matmul_rates' choice of size and run is test_matmul_ceiling_is_the_best_size_and_run's
    real_rate = bench.matmul_rate
    monkeypatch.setattr(bench, "matmul_rate", lambda dtype: real_rate(dtype, sizes=(512,)))
    cases = [
        bench.Case("tiny window", "window256", 1, 2, 1, 512, 32, "float32"),
        bench.Case("tiny causal fwd+bwd", "causal", 1, 2, 2, 256, 16, "float32", mode="fwdbwd"),
    ]
    res = bench.run(cases, reps=1, with_flex=False, progress=False, memory=False)
    assert set(res["matmul_gflops"]) == {"float32"}
    assert res["matmul_gflops"]["float32"] > 0
    win, cz = res["cases"]
    names = [r["backend"] for r in win["results"]]
    from attnlab.ops.native import build

    native = ["attnlab native"] if build.load() is not None else []  # the C++ kernel, where it builds
    assert names == ["attnlab auto", "attnlab flash", *native, "torch sdpa (dense mask)"]
    # window 256 over 512 keys: exactly sum_{i<512} min(i+1, 256) allowed pairs per head
    expect = sum(min(i + 1, 256) for i in range(512)) / 512**2
    assert win["density"] == pytest.approx(expect)
    assert set(res) == {"machine", "cases", "matmul_gflops"}
    # a CPU's float32 matmul rate: above 0.1 GFLOP/s, below 100 TFLOP/s
    assert 0.1 < res["matmul_gflops"]["float32"] < 1e5
    for case, c in zip(cases, res["cases"], strict=True):
        assert {k: c[k] for k in case.__dataclass_fields__} == {k: getattr(case, k) for k in case.__dataclass_fields__}
        # the work counted: 4·D flops per allowed pair forward, 3.5x that forward and backward
        work = 4 * case.D * c["density"] * case.B * case.H * case.N**2 * (3.5 if case.mode == "fwdbwd" else 1)
        assert c["flops"] == pytest.approx(work) == bench.case_flops(case)
        anchor = next(r for r in c["results"] if r["backend"].startswith("torch sdpa"))
        assert anchor["vs_torch_sdpa"] == pytest.approx(1.0)
        for r in c["results"]:
            assert "error" not in r, r
            assert r["seconds"] > 0
            assert r["gflops"] == pytest.approx(c["flops"] / r["seconds"] / 1e9)
            assert r["pct_of_matmul"] == pytest.approx(100 * r["gflops"] / res["matmul_gflops"]["float32"])
            assert r["vs_torch_sdpa"] == pytest.approx(anchor["seconds"] / r["seconds"])
            # the warm time: the same work over the fastest back-to-back call, against the same ceiling
            assert r["warm_seconds"] > 0
            assert r["warm_gflops"] == pytest.approx(c["flops"] / r["warm_seconds"] / 1e9)
            assert r["warm_pct_of_matmul"] == pytest.approx(100 * r["warm_gflops"] / res["matmul_gflops"]["float32"])
            # physical bounds: no attention call runs 10x above the machine's own matmul rate, none
            # is 10^4 times slower than SDPA on a 512-token problem
            assert r["pct_of_matmul"] < 1000 and 1e-4 < r["vs_torch_sdpa"] < 1e4
    auto = next(r for r in cz["results"] if r["backend"] == "attnlab auto")
    # float32 causal, 512 query rows: SDPA maps it, and the native kernel (where it builds) was
    # measured faster from 128 rows (dispatch._native_beats_sdpa)
    assert auto["auto_choice"] == ("native" if native else "sdpa")
    text = bench.format_table(res)
    assert "tiny window" in text and "x sdpa" in text and "w%mm" in text
    assert json.loads(json.dumps(res, default=str))["cases"][0]["results"][0]["backend"] == "attnlab auto"


def test_dense_mask_matches_the_attnlab_predicate():
    c = bench.Case("doc", "doc8", 1, 1, 1, 64, 8, "float32")
    dm = bench.dense_bool_mask(c)
    ids = torch.arange(64) * 8 // 64
    i = torch.arange(64)
    assert torch.equal(dm, (ids[:, None] == ids[None, :]) & (i[None, :] <= i[:, None]))


def test_cli_rejects_bad_reps_and_unknown_commands(capsys):
    assert main(["bench", "attention", "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err
    assert main(["bench", "nonsense"]) == 2  # argparse's usage error, as the exit status


def test_console_script_is_installed_and_prints_help():
    out = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "bench", "attention", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--json" in out and "--quick" in out


@pytest.mark.skipif(not memory_supported(), reason="needs /proc/self/clear_refs (Linux)")
def test_memprobe_child_reports_the_working_set():
    from attnlab.bench import memprobe

    # (1, 1, 1024, 32) float32: the reference materializes 1024x1024 scores (4 MiB and
    # copies of it); flash holds one tile, so it must need clearly less
    c = bench.Case("probe", "causal", 1, 1, 1, 1024, 32, "float32")
    fields = {k: getattr(c, k) for k in c.__dataclass_fields__}
    flash = memprobe.measure(fields, "attnlab flash", "fwd")
    sdpa = memprobe.measure(fields, "torch sdpa", "fwdbwd")
    assert flash is not None and 0 < flash < 16
    assert sdpa is not None and sdpa > 0


@pytest.mark.skipif(not bench.flex_available(), reason="compiled FlexAttention needs a C++ compiler")
def test_compiled_flex_contender_runs_again_after_its_compile():
    # every timed rep after the first (compile) call reuses the compiled callable; it once
    # returned an unbound local there, and the whole flex column of the table read
    # "UnboundLocalError" (found in the 2026-12-04 run)
    r = bench.Runner(bench.Case("tiny causal", "causal", 1, 2, 2, 64, 16, "float32"))
    first, again = r._flex_call(), r._flex_call()
    assert r.flex_compile_s is not None and r.flex_compile_s > 0
    ref = torch.nn.functional.scaled_dot_product_attention(r.q, r.k, r.v, is_causal=True)
    torch.testing.assert_close(again, ref, **F32_FEW_ULPS)
    assert torch.equal(first, again)


@pytest.mark.skipif(not bench.flex_available(), reason="compiled FlexAttention needs a C++ compiler")
def test_compiled_flex_contender_compiles_every_case_past_dynamos_recompile_limit():
    # dynamo compiles one code object (flex_attention's) at most recompile_limit times, then
    # runs it eagerly with one warning: from the 9th case on, the bench's "flex compiled" column
    # timed eager flex (2026-12-05).  With the limit at 1, the second case must still compile
    # a graph of its own and give FlexAttention's values.
    from torch._dynamo.utils import counters

    with torch._dynamo.config.patch(recompile_limit=1):
        for N, mask in ((64, "causal"), (80, "window256")):
            r = bench.Runner(bench.Case(f"tiny {mask}", mask, 1, 2, 2, N, 16, "float32"))
            # inductor's CPU flex template is instantiated once per compile (eager flex, the
            # fallback, compiles its mask functions but no template)
            kernels = counters["inductor"]["cpp_templated_kernel_counter"]
            out = r._flex_call()
            assert counters["inductor"]["cpp_templated_kernel_counter"] > kernels, f"N={N} {mask}: flex ran eagerly"
            dm = bench.dense_bool_mask(r.case) if mask != "causal" else torch.ones(N, N, dtype=torch.bool).tril()
            ref = torch.nn.functional.scaled_dot_product_attention(r.q, r.k, r.v, attn_mask=dm)
            torch.testing.assert_close(out, ref, **F32_FEW_ULPS)


def test_warm_times_are_read_again_after_every_case_and_the_faster_moment_counts(monkeypatch):
    """The ceiling is the best of readings before and after the cases; each backend's warm time
    is read at two moments too (after its case's rounds, and after every case), and the faster
    one is its warm time.  FlexAttention keeps its one moment (its compiled graph is gone)."""
    log: list[tuple[str, str]] = []
    # per (case, backend): the seconds each of its warm passes reports, in order
    warm_reads = {
        ("one", "a"): [0.5, 0.2],
        ("one", "b"): [0.1, 0.3],
        ("two", "a"): [0.4, 0.4],
        ("two", "b"): [0.2, 0.1],
    }
    passes: dict[tuple[str, str], int] = {}

    class Fake:
        def __init__(self, case, seed=0):
            self.case = case
            self.flex_compile_s = None

        def backends(self, with_flex=True):
            names = ["a", "b"] + (["flex compiled"] if with_flex else [])
            return {n: (lambda n=n: log.append((self.case.name, n))) for n in names}

    def fake_warm_time(fn):
        fn()
        key = log[-1]
        i = passes.get(key, 0)
        passes[key] = i + 1
        return warm_reads.get(key, [0.05])[i]

    monkeypatch.setattr(bench, "Runner", Fake)
    monkeypatch.setattr(bench, "warm_time", fake_warm_time)
    monkeypatch.setattr(bench, "matmul_rate", lambda dt: 100.0)
    monkeypatch.setattr(bench, "flex_available", lambda: True)
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    cases = [bench.Case(n, "causal", 1, 1, 1, 64, 16, "float32") for n in ("one", "two")]
    res = bench.run(cases, reps=1, progress=False, memory=False)
    got = {(c["name"], x["backend"]): x for c in res["cases"] for x in c["results"]}
    for key, reads in warm_reads.items():
        assert got[key]["warm_seconds_runs"] == reads and got[key]["warm_seconds"] == min(reads), key
    assert got[("one", "flex compiled")]["warm_seconds"] == 0.05
    assert "warm_seconds_runs" not in got[("one", "flex compiled")]
    # the second moment comes after every case's first (and FlexAttention is not called again)
    end = max(i for i, x in enumerate(log) if x == ("two", "flex compiled"))
    assert log[end + 1 :] == [("one", "a"), ("one", "b"), ("two", "a"), ("two", "b")]
    assert passes[("one", "flex compiled")] == 1


def test_a_backend_failing_at_its_second_warm_moment_loses_nothing(monkeypatch):
    """The second moment runs after every case (minutes of work): a backend that raises there
    (out of memory, say) keeps its first warm time and the error; the run still returns every
    case's results."""
    state = {"second": False}

    class Fake:
        def __init__(self, case, seed=0):
            self.case = case
            self.flex_compile_s = None

        def backends(self, with_flex=True):
            def bad():
                if state["second"]:
                    raise MemoryError("injected at the second moment")

            return {"good": lambda: None, "bad": bad}

    real_warm_again = bench._warm_again

    def warm_again(*args):
        state["second"] = True
        real_warm_again(*args)

    monkeypatch.setattr(bench, "Runner", Fake)
    monkeypatch.setattr(bench, "_warm_again", warm_again)
    monkeypatch.setattr(bench, "matmul_rate", lambda dt: 100.0)
    cases = [bench.Case(n, "causal", 1, 1, 1, 64, 16, "float32") for n in ("one", "two")]
    res = bench.run(cases, reps=1, progress=False, memory=False, with_flex=False)
    got = {(c["name"], x["backend"]): x for c in res["cases"] for x in c["results"]}
    assert len(got) == 4 and all(x["warm_seconds"] > 0 for x in got.values())
    for case in ("one", "two"):
        assert "warm_seconds_runs" in got[(case, "good")] and "warm_again_error" not in got[(case, "good")]
        assert got[(case, "bad")]["warm_again_error"] == "MemoryError: injected at the second moment"
        assert "warm_seconds_runs" not in got[(case, "bad")]
    assert bench.format_table(res).count("second warm moment failed: MemoryError: injected") == 2
