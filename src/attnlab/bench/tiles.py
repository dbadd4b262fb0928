"""``attnlab bench tiles``: measure the flash backend's tile sizes per dtype and head dim.

For each (dtype, head dim) it times the forward of a dense ``(1, 8, 4096, D)``
problem at every candidate ``(block_k, target elements per tile)`` and prints the
fastest, in the form of :data:`attnlab.ops.tiles.TABLE`.  Same run, same machine:
the ratios between candidates are what count.
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from attnlab.bench.measure import time_call
from attnlab.ops.flash import flash_attention
from attnlab.ops.tiles import TABLE

BLOCK_K = (256, 512, 1024)
TARGETS = (1 << 19, 1 << 20, 1 << 21)


def run(N: int = 4096, H: int = 8, reps: int = 3, progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    jobs = [
        (dt, D, bk, t) for dt in (torch.float32, torch.bfloat16) for D in (64, 128) for bk in BLOCK_K for t in TARGETS
    ]
    rows = []
    inputs = {}
    for dt, D, bk, target in tqdm(jobs, desc="bench tiles", unit="cfg", disable=not progress, file=sys.stderr):
        if (dt, D) not in inputs:
            g = torch.Generator().manual_seed(0)
            inputs[(dt, D)] = [torch.randn(1, H, N, D, generator=g).to(dt) for _ in range(3)]
        q, k, v = inputs[(dt, D)]
        bq = max(32, min(1024, target // (H * bk)))
        bq = 1 << (bq.bit_length() - 1)
        with torch.no_grad():
            t = time_call(
                functools.partial(flash_attention, q, k, v, scale=D**-0.5, q_offset=0, block=(bq, bk)), reps=reps
            )
        rows.append(
            {
                "dtype": str(dt).replace("torch.", ""),
                "D": D,
                "block_k": bk,
                "target": target,
                "block_q": bq,
                "seconds": t,
            }
        )
    return rows


def main(json_path: str | None = None) -> list[dict]:
    rows = run()
    print(f"{'dtype':<9} {'D':>4} {'block_k':>7} {'target':>8} {'block_q':>7} {'ms':>8}  vs current")
    for r in rows:
        cur = TABLE.get((getattr(torch, r["dtype"]), r["D"]))
        same = [
            x
            for x in rows
            if x["dtype"] == r["dtype"]
            and x["D"] == r["D"]
            and cur
            and x["block_k"] == cur[0]
            and x["target"] == cur[1]
        ]
        ratio = f"{same[0]['seconds'] / r['seconds']:.2f}x" if same else "-"
        print(
            f"{r['dtype']:<9} {r['D']:>4} {r['block_k']:>7} {r['target']:>8} {r['block_q']:>7} "
            f"{r['seconds'] * 1e3:>8.1f}  {ratio}"
        )
    print("\nfastest per (dtype, D) -> TABLE entry (block_k, target):")
    for dt in sorted({r["dtype"] for r in rows}):
        for D in sorted({r["D"] for r in rows}):
            best = min((r for r in rows if r["dtype"] == dt and r["D"] == D), key=lambda r: r["seconds"])
            print(f"  (torch.{dt}, {D}): ({best['block_k']}, 1 << {best['target'].bit_length() - 1}),")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
