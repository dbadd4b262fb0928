"""``attnlab bench interp``: per-head statistics at O(N) memory vs the materialized pattern.

Two ways to get per-head attention statistics of one causal layer at ``N`` tokens
(``q, k`` of shape ``(1, heads, N, d_head)``, float32):

* ``head_stats``       :func:`attnlab.interp.stats.head_stats`, one tiled pass;
* ``attention_probs``  :func:`attnlab.attention_probs`, the ``(1, heads, N, N)``
  pattern (what the statistics would be computed from otherwise; 4 GiB per head at
  N = 32768), without even reducing it.

Each is measured in fresh child processes (so neither sees the other's heap):
peak extra resident memory above the inputs, with glibc's
``MALLOC_MMAP_THRESHOLD_`` set as in :mod:`attnlab.bench.memprobe` so the high-water
mark follows real allocations, and wall time in a second child with malloc's
defaults.  Both children warm up on a small problem first (thread pools, BLAS
workspaces); the timed figure is the median of ``reps`` full-size runs (default
one: the dense pattern at N = 32768 takes tens of seconds).  Absolute times on a
2-core machine are noise; the ratios are the result.

    attnlab bench interp [--n 32768] [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from attnlab.bench.measure import memory_supported, peak_extra_bytes, time_call
from attnlab.bench.memprobe import ENV as MEMPROBE_ENV

MiB = 1 << 20
QUICK_N = 4096
WARMUP_N = 512
METHODS = ("head_stats", "attention_probs")


def _child(spec: dict) -> dict:
    """In the child process: build the inputs, warm up small, measure one thing."""
    import torch

    import attnlab
    from attnlab import masks
    from attnlab.interp.stats import head_stats

    def call(q, k):
        if spec["method"] == "head_stats":
            return head_stats(q, k, mask=masks.causal())
        return attnlab.attention_probs(q, k, mask=masks.causal())

    g = torch.Generator().manual_seed(0)
    shape = (1, spec["heads"], spec["n"], spec["d_head"])
    q, k = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = min(spec["n"], WARMUP_N)
    call(q[:, :, :w].contiguous(), k[:, :, :w].contiguous())
    fn = lambda: call(q, k)  # noqa: E731
    if spec["measure"] == "memory":
        return {"peak_extra_mib": peak_extra_bytes(fn, warmup=False) / MiB}
    return {"seconds": time_call(fn, reps=spec["reps"], warmup=0)}


def _in_child(spec: dict, memory: bool, timeout_s: float) -> dict:
    env = {**os.environ, **MEMPROBE_ENV} if memory else dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-m", "attnlab.bench.interp_stats", "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit status {out.returncode} (killed for memory?)"
        return {"error": why}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(
    n: int = 32768, d_head: int = 64, heads: int = 1, quick: bool = False, reps: int = 1, timeout_s: float = 1800.0
) -> dict:
    """Measure both methods at ``N = n`` (``quick``: N = 4096).  Returns a dict with one
    entry per method (``peak_extra_mib``, ``seconds`` or ``error``) and the ratios
    dense / tiled."""
    for name, x in (("n", n), ("d_head", d_head), ("heads", heads), ("reps", reps)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name}: expected a positive int, got {x!r}")
    if quick:
        n = QUICK_N
    res: dict[str, Any] = {
        "n": n,
        "d_head": d_head,
        "heads": heads,
        "dtype": "float32",
        "mask": "causal()",
        "pattern_mib": heads * n * n * 4 / MiB,
        "memory_supported": memory_supported(),
    }
    for method in METHODS:
        spec = {"method": method, "n": n, "d_head": d_head, "heads": heads, "reps": reps}
        rec = {}
        if res["memory_supported"]:
            rec.update(_in_child({**spec, "measure": "memory"}, True, timeout_s))
        if "error" not in rec:
            rec.update(_in_child({**spec, "measure": "time"}, False, timeout_s))
        res[method] = rec
    a, b = res["head_stats"], res["attention_probs"]
    for key, name in (("peak_extra_mib", "memory_ratio"), ("seconds", "time_ratio")):
        if a.get(key) and b.get(key):
            res[name] = b[key] / a[key]
    return res


def format_table(res: dict) -> str:
    def cell(rec, key, fmt):
        if "error" in rec:
            return "error"
        return fmt.format(rec[key]) if rec.get(key) is not None else "n/a"

    lines = [
        f"attnlab bench interp: causal(), q/k (1, {res['heads']}, {res['n']}, {res['d_head']}) float32; "
        f"the pattern is {res['pattern_mib']:.0f} MiB",
        f"{'method':<28} {'peak extra MiB':>15} {'seconds':>9}",
    ]
    for label, method in (
        ("head_stats (tiled, 1 pass)", "head_stats"),
        ("attention_probs (pattern)", "attention_probs"),
    ):
        rec = res[method]
        lines.append(f"{label:<28} {cell(rec, 'peak_extra_mib', '{:.1f}'):>15} {cell(rec, 'seconds', '{:.2f}'):>9}")
    mr, tr = res.get("memory_ratio"), res.get("time_ratio")
    lines.append(f"{'pattern / head_stats':<28} {(f'{mr:.0f}x' if mr else '-'):>15} {(f'{tr:.2f}x' if tr else '-'):>9}")
    for method in METHODS:
        if "error" in res[method]:
            lines.append(f"{method}: {res[method]['error']}")
    return "\n".join(lines)


def main(
    *,
    n: int = 32768,
    d_head: int = 64,
    heads: int = 1,
    quick: bool = False,
    reps: int = 1,
    json_path: str | None = None,
) -> int:
    """``attnlab bench interp``: run, print the table, write JSON to ``json_path``; bad sizes raise ValueError."""
    res = run(n=n, d_head=d_head, heads=heads, quick=quick, reps=reps)
    print(format_table(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":  # the measuring child: python -m attnlab.bench.interp_stats --child SPEC
    if sys.argv[1:2] != ["--child"] or len(sys.argv) != 3:
        sys.exit("usage: python -m attnlab.bench.interp_stats --child SPEC  (the child of `attnlab bench interp`)")
    print(json.dumps(_child(json.loads(sys.argv[2]))))
