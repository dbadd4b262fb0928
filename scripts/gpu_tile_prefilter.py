"""Pre-filter for the GPU tile sweep (no GPU needed): which tile / warp / stage candidates
of the Triton kernels compile spill-free for BOTH sm_80 and sm_90.

For each kernel (fwd, dq, dkdv) and head dim D in {64, 128}, bfloat16, causal (the mask
variant test_resources.py compiles: the masked partial-tile loop and the full-tile loop
in one kernel), every candidate of :data:`GRID` is compiled through
:mod:`attnlab.ops.triton.resources` (the same launch specialisation and the same
register / spill reading as tests/ops/triton/test_resources.py), sm_80 first; sm_90 is
compiled only for the candidates that were clean on sm_80.  The rows, with their compile
times, go to scripts/gpu_tile_candidates.json, which scripts/gpu_tile_sweep.py reads on
the GPU machine.

    PYTHONPATH=src python scripts/gpu_tile_prefilter.py --jobs 2        # ~150 compiles
    PYTHONPATH=src python scripts/gpu_tile_prefilter.py --kernel dkdv --head-dim 128 --limit 2  # a quick look

A compile takes ~3-5 s of CPU on an idle core (docs/triton.md); triton's cache keeps the
cubins, so a rerun is fast.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

OUT_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_tile_candidates.json")
DTYPE = "bfloat16"
MASK = "causal"

# D -> kernel -> [((BM, BN), [(warps, stages), ...]), ...]; BM = query rows and BN = keys
# per tile (dK/dV: BN keys per program, BM query rows per step; dQ and fwd: BM queries per
# program, BN keys per step).  The shipped defaults (config.py) are added if missing.
GRID: dict[int, dict[str, list]] = {
    128: {
        "fwd": [
            ((128, 64), [(8, 2), (8, 3), (8, 4)]),
            ((128, 128), [(8, 2), (8, 3)]),
            ((128, 32), [(8, 3)]),
            ((64, 64), [(4, 2), (4, 3), (4, 4), (8, 3)]),
            ((64, 128), [(4, 2), (4, 3)]),
        ],
        "dq": [
            ((64, 64), [(8, 2), (8, 3), (4, 2), (4, 3)]),
            ((128, 64), [(8, 2), (8, 3)]),
            ((128, 32), [(8, 2), (8, 3), (8, 4)]),
            ((64, 32), [(4, 2), (4, 3)]),
            ((64, 128), [(8, 2)]),
            ((32, 64), [(4, 2), (4, 3), (8, 2)]),
            ((64, 32), [(8, 2)]),
            ((64, 64), [(8, 4)]),
            ((64, 16), [(4, 2)]),
        ],
        "dkdv": [
            ((32, 64), [(8, 2), (8, 3), (4, 2), (4, 3)]),
            ((16, 64), [(4, 2), (4, 3)]),
            ((64, 64), [(8, 1), (8, 2)]),
            ((32, 128), [(8, 1), (8, 2)]),
            ((16, 128), [(8, 2), (8, 3), (4, 2)]),
            ((64, 32), [(4, 2), (8, 2)]),
            ((32, 32), [(4, 2), (4, 3), (8, 2)]),
            ((64, 64), [(8, 3)]),
            ((16, 64), [(8, 2)]),
            ((32, 64), [(8, 1)]),
        ],
    },
    64: {
        "fwd": [
            ((128, 64), [(4, 3), (8, 3), (8, 2), (4, 4)]),
            ((128, 128), [(8, 2), (8, 3)]),
            ((64, 64), [(4, 2), (4, 3), (4, 4)]),
            ((64, 128), [(4, 2), (4, 3)]),
            ((128, 32), [(4, 3)]),
        ],
        "dq": [
            ((128, 32), [(8, 2), (8, 3), (4, 3)]),
            ((128, 64), [(8, 2), (8, 3), (4, 2)]),
            ((64, 64), [(4, 2), (4, 3), (8, 2)]),
            ((64, 32), [(4, 2), (4, 3), (8, 2)]),
            ((64, 128), [(4, 2)]),
            ((128, 32), [(8, 4)]),
            ((128, 16), [(8, 2), (4, 2)]),
            ((32, 64), [(4, 2)]),
        ],
        "dkdv": [
            ((32, 64), [(4, 2), (8, 2), (4, 3)]),
            ((32, 128), [(8, 2), (8, 3)]),
            ((64, 64), [(4, 2), (4, 3), (8, 2), (8, 3)]),
            ((64, 128), [(8, 2)]),
            ((16, 64), [(4, 2), (4, 3)]),
            ((16, 128), [(4, 2), (8, 2)]),
            ((64, 32), [(4, 2), (4, 3), (8, 2)]),
            ((32, 32), [(4, 3), (4, 2)]),
            ((32, 64), [(8, 3)]),
            ((16, 64), [(8, 2)]),
        ],
    },
}


def shipped(D: int, kernel: str) -> tuple[tuple, list]:
    """The shipped (tile, [(warps, stages), ...]) of ``kernel`` at ``D`` for bfloat16."""
    from attnlab.ops.triton import config

    return tuple(config.gpu_tiles(D, DTYPE)[kernel]), [tuple(c) for c in config.candidates(kernel, D, DTYPE)]


def candidates(kernels, head_dims) -> list[dict]:
    """Every candidate of :data:`GRID` (plus the shipped defaults), flagged ``default``."""
    out = []
    for D in head_dims:
        for kernel in kernels:
            dtile, dcands = shipped(D, kernel)
            seen = set()
            grid = list(GRID[D][kernel])
            grid.insert(0, (dtile, dcands))
            for tile, ws in grid:
                for w, s in ws:
                    key = (tuple(tile), w, s)
                    if key in seen:
                        continue
                    seen.add(key)
                    default = tuple(tile) == dtile and (w, s) in dcands
                    out.append(
                        {"kernel": kernel, "D": D, "tile": list(tile), "warps": w, "stages": s, "default": default}
                    )
    return out


def compile_row(args) -> dict:
    """One compile (in a worker process): resources' row plus the wall time it took."""
    kernel, arch, D, tile, warps, stages = args
    from attnlab.ops.triton import resources

    v = resources.Variant(kernel, arch, DTYPE, D, MASK, tuple(tile), warps, stages)
    t0 = time.perf_counter()
    row = resources._row(v)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    return row


def _run(jobs_args, jobs: int) -> list[dict]:
    if jobs <= 1 or len(jobs_args) <= 1:
        return [compile_row(a) for a in jobs_args]
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(jobs_args)), mp_context=ctx) as pool:
        return list(pool.map(compile_row, jobs_args))


def _facts(row: dict) -> dict:
    keys = ("registers", "spill_stores", "spill_loads", "stack", "shared", "spill_free", "fits", "compile_s", "error")
    keys += ("reused",)
    return {k: row[k] for k in keys if k in row}


def clean(row: dict | None) -> bool:
    return row is not None and "error" not in row and bool(row.get("spill_free")) and bool(row.get("fits"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", nargs="+", default=["dkdv", "dq", "fwd"], choices=["fwd", "dq", "dkdv"])
    p.add_argument("--head-dim", type=int, nargs="+", default=[128, 64], choices=[64, 128])
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--limit", type=int, default=None, help="only the first N candidates (a quick look)")
    p.add_argument("--out", default=OUT_DEFAULT)
    p.add_argument("--reuse", action="store_true", help="keep the rows already in --out; compile only the new ones")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernels must be defined for the GPU to compile them", file=sys.stderr)
        return 2
    import triton

    from attnlab.ops.triton import resources

    if resources.tool("cuobjdump") is None:
        print("cuobjdump not found in the triton package", file=sys.stderr)
        return 2
    cands = candidates(a.kernel, a.head_dim)[: a.limit]
    old: dict = {}
    if a.reuse and os.path.exists(a.out):
        with open(a.out) as f:
            prev = json.load(f)
        for c in prev["candidates"] + prev["rejected"]:
            old[(c["kernel"], c["D"], tuple(c["tile"]), c["warps"], c["stages"])] = c
    t0 = time.perf_counter()
    by_arch: dict[int, list] = {}
    todo = cands
    for arch in (80, 90):  # sm_90 only for what was clean on sm_80
        rows = [None] * len(todo)
        fresh = []
        for i, c in enumerate(todo):
            was = old.get((c["kernel"], c["D"], tuple(c["tile"]), c["warps"], c["stages"]), {}).get(f"sm_{arch}")
            if was is not None:
                rows[i] = dict(was, registers=was.get("registers"), reused=True)
            else:
                fresh.append(i)
        got = _run(
            [
                (todo[i]["kernel"], arch, todo[i]["D"], todo[i]["tile"], todo[i]["warps"], todo[i]["stages"])
                for i in fresh
            ],
            a.jobs,
        )
        for i, r in zip(fresh, got, strict=True):
            rows[i] = r
        for c, r in zip(todo, rows, strict=True):
            c[f"sm_{arch}"] = _facts(r)
            ok = clean(r)
            print(
                f"  sm_{arch} {c['kernel']:4s} D={c['D']:3d} {c['tile'][0]:3d}x{c['tile'][1]:<3d} "
                f"w{c['warps']} s{c['stages']}: "
                + (
                    r.get("error", "")[:100]
                    if "error" in r
                    else f"{r['registers']} regs, spill {r['spill_stores']}/{r['spill_loads']} B, "
                    f"stack {r['stack']}, smem {r['shared']} {'ok' if ok else 'REJECT'} ({r['compile_s']} s)"
                ),
                flush=True,
            )
        by_arch[arch] = rows
        todo = [c for c, r in zip(todo, rows, strict=True) if clean(r)]
    keep = todo
    for c in cands:
        c["spill_free_both"] = any(c is k for k in keep)
    doc = {
        "what": "bf16 causal compile of Triton kernel candidates for sm_80 and sm_90 (attnlab.ops.triton.resources)",
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "triton": triton.__version__,
        "dtype": DTYPE,
        "mask": MASK,
        "wall_s": round(time.perf_counter() - t0, 1),
        "n_compiles": sum(1 for r in by_arch.values() for x in r if not x.get("reused")),
        "candidates": [c for c in cands if c["spill_free_both"]],
        "rejected": [c for c in cands if not c["spill_free_both"]],
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(
        f"{len(doc['candidates'])} of {len(cands)} candidates spill-free on sm_80 and sm_90 "
        f"({doc['n_compiles']} compiles, {doc['wall_s']} s) -> {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
