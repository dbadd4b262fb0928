"""The bf16 matmul ceiling read right beside the native kernel, round by round: does the
kernel's speed follow the ceiling's swings on this VM?  Per round: the ceiling
(`attnlab.bench.attention.matmul_rate`: 1024 and 2048, fastest of 7 each), then the native
kernel's warm time (`warm_time`) on window256, doc8 and prefix bf16 (1,4,8192,64), then the
ceiling again.  Prints each round's share of the round's own ceiling, the shares against the
run's best ceiling (what `attnlab bench attention` divides by), and the correlation of the
kernel's rate with the ceiling across rounds.

    PYTHONPATH=src python scripts/ceiling_beside_kernel.py [ROUNDS]

2026-12-05 11:31, 20 rounds (docs/benchmarks.md, stop 30): the ceiling jumped between about
945 and 1030 GFLOP/s within rounds; window256's share of its round's ceiling, median 61.7%
(55.0-65.1); against the run's best ceiling (1046), median 57.9%, best 60.7%; correlation of
window256's rate with the ceiling 0.34 (doc8 0.11, prefix -0.11).
"""

import statistics
import sys

import numpy as np
import torch

from attnlab.bench.attention import Case, Runner, case_flops, matmul_rate, warm_time


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    cases = [Case(f"{m} bf16", m, 1, 4, 4, 8192, 64, "bfloat16") for m in ("window256", "doc8", "prefix")]
    fns = {c.name: (c, Runner(c).backends(with_flex=False)["attnlab native"]) for c in cases}
    rows = []
    for i in range(rounds):
        rec = {"ceil": matmul_rate(torch.bfloat16)}
        for name, (c, f) in fns.items():
            rec[name] = case_flops(c) / warm_time(f) / 1e9
        rec["ceil"] = max(rec["ceil"], matmul_rate(torch.bfloat16))
        rows.append(rec)
        print(
            f"{i:2d} ceiling {rec['ceil']:6.0f} "
            + " ".join(f"{n.split()[0]} {100 * rec[n] / rec['ceil']:5.1f}%" for n in fns),
            flush=True,
        )
    best = max(r["ceil"] for r in rows)
    for n in fns:
        own = [100 * r[n] / r["ceil"] for r in rows]
        vs_best = [100 * r[n] / best for r in rows]
        corr = float(np.corrcoef([r["ceil"] for r in rows], [r[n] for r in rows])[0, 1])
        print(
            f"{n}: of its round's ceiling median {statistics.median(own):.1f}% ({min(own):.1f}-{max(own):.1f}); "
            f"of the run's best ceiling {best:.0f}: median {statistics.median(vs_best):.1f}%, best {max(vs_best):.1f}%; "
            f"correlation with the ceiling {corr:.2f}"
        )


if __name__ == "__main__":
    main()
