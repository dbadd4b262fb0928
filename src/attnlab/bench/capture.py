"""Capture overhead: a forward pass with :func:`attnlab.interp.capture` / ``run_with_cache`` against a plain one.

Contenders, on one model and one batch, in one run (interleaved repetitions, medians):

* ``plain``: ``model(ids)`` under ``no_grad`` (the fast path);
* ``capture``: the same inside ``capture(model)`` (every layer's q, k, v, z kept);
* ``capture + 1 head``: and the pattern of one head per layer recomputed from q and k;
* ``run_with_cache``: :func:`attnlab.interp.run_with_cache` of every hook point except the
  patterns and scores (embeddings, residual stream, norms, q/k/v/z, MLP, logits; per-head
  results stay lazy);
* ``run_with_cache + 1 head``: everything, then ``cache.pattern(l, heads=[0])`` of every layer
  (patterns are recomputed from the cached q and k for that head only);
* ``output_attentions``: every layer's full pattern materialized ``(B, H, N, N)`` — what
  TransformerLens' cache, bertviz or an eager model with ``output_attentions=True`` hold.

Memory is each contender's peak extra resident memory, measured in a fresh child process
(:mod:`attnlab.bench.memprobe`'s method: glibc's mmap threshold lowered so the resident
high-water mark follows the allocations), and ``kept``: the bytes of the distinct tensors the
contender keeps (cache, patterns, captured calls), counted from their storages.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys

import torch

MODES = ("plain", "capture", "capture + 1 head", "run_with_cache", "run_with_cache + 1 head", "output_attentions")
SIZES = {"quick": (4, 256, 8, 2, 512), "full": (6, 512, 8, 4, 1024)}  # layers, d_model, heads, batch, tokens


def _setup(quick: bool, shape=None):
    from attnlab.nn import Decoder, DecoderConfig

    torch.manual_seed(0)
    L, d, H, B, N = shape or SIZES["quick" if quick else "full"]
    cfg = DecoderConfig(vocab_size=4096, d_model=d, n_layers=L, n_heads=H, max_positions=max(N, 8))
    model = Decoder(cfg).eval()
    ids = torch.randint(0, 4096, (B, N))
    return model, ids, cfg


def _no_patterns(name: str) -> bool:
    return not name.endswith(("hook_pattern", "hook_attn_scores"))


def _call(mode, model, ids):
    from attnlab.interp import capture, run_with_cache

    with torch.no_grad():
        if mode == "plain":
            return model(ids).logits
        if mode == "output_attentions":
            out = model(ids, output_attentions=True)
            return out.logits, out.attentions
        if mode == "run_with_cache":
            return run_with_cache(model, ids, names_filter=_no_patterns)
        if mode == "run_with_cache + 1 head":
            logits, cache = run_with_cache(model, ids)
            return logits, cache, [cache.pattern(l, heads=[0]) for l in range(model.cfg.n_layers)]
        with capture(model) as cap:
            logits = model(ids).logits
        if mode == "capture":
            return logits, cap
        return logits, cap, [cap.pattern(l, heads=[0]) for l in cap.layers]


def _storages(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def kept_bytes(mode: str, result) -> int:
    """Bytes of the distinct tensors ``_call(mode, ...)`` keeps beside the logits."""
    if mode == "plain":
        return 0
    if mode == "output_attentions":
        return _storages(result[1])
    if mode.startswith("run_with_cache"):
        cache = result[1]
        return cache.nbytes() + (_storages(result[2]) if len(result) > 2 else 0)
    cap = result[1]
    ts = [t for l in cap.layers for c in cap.calls(l) for t in (c.q, c.k, c.v, c.z) if t is not None]
    return _storages(ts + (list(result[2]) if len(result) > 2 else []))


def _child(mode: str, quick: bool, shape=None) -> None:
    from attnlab.bench.measure import peak_extra_bytes

    model, ids, _ = _setup(quick, shape)
    print(json.dumps({"mib": peak_extra_bytes(lambda: _call(mode, model, ids)) / 2**20}))


def run(quick: bool = False, reps: int = 5, memory: bool = True, shape=None) -> dict:
    """``shape = (layers, d_model, heads, batch, tokens)`` overrides the sizes (tests use tiny ones)."""
    from tqdm.auto import tqdm

    from attnlab.bench.measure import memory_supported, time_call

    model, ids, cfg = _setup(quick, shape)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    kernel: dict[str, list[tuple[float, int]]] = {m: [] for m in MODES}  # (system seconds, minor faults)
    for _ in tqdm(range(reps), desc="capture bench", unit="round"):
        for m in MODES:  # interleaved: every contender sees the same machine state
            if not times[m]:
                _call(m, model, ids)  # warm-up
            before = resource.getrusage(resource.RUSAGE_SELF)
            times[m].append(time_call(functools.partial(_call, m, model, ids), reps=1, warmup=0))
            after = resource.getrusage(resource.RUSAGE_SELF)
            kernel[m].append((after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt))
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    res = {
        "shape": {
            "layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "heads": cfg.n_heads,
            "batch": ids.shape[0],
            "tokens": ids.shape[1],
        },
        "thp_alloc": thp_alloc(),
        "seconds": med,
        "ratio_to_plain": {m: med[m] / med["plain"] for m in MODES},
        # what the kernel spent on the forward's memory: first-touch page faults of fresh (kept) memory
        "system_seconds": {m: sorted(x for x, _ in v)[len(v) // 2] for m, v in kernel.items()},
        "minor_faults": {m: sorted(f for _, f in v)[len(v) // 2] for m, v in kernel.items()},
        "kept_mib": {m: kept_bytes(m, _call(m, model, ids)) / 2**20 for m in MODES},
    }
    if memory and memory_supported():
        from attnlab.bench.memprobe import ENV

        mem = {}
        extra = ["--shape", ",".join(map(str, shape))] if shape else []
        for m in tqdm(MODES, desc="memory", unit="mode"):
            out = subprocess.run(
                [sys.executable, "-m", "attnlab.bench.capture", "--child", m] + (["--quick"] if quick else []) + extra,
                env={**os.environ, **ENV},
                capture_output=True,
                text=True,
                timeout=900,
            )
            if out.returncode != 0:
                raise RuntimeError(f"memory child {m!r} failed: {out.stderr.strip()[-500:]}")
            mem[m] = json.loads(out.stdout.strip().splitlines()[-1])["mib"]
        res["peak_extra_mib"] = mem
    return res


def thp_alloc() -> bool:
    """Whether torch's CPU allocator backs large tensors with huge pages in this process
    (``THP_MEM_ALLOC_ENABLE=1``; see :data:`attnlab.cli.THP_ENV`)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "0").strip() not in ("", "0")


def summary(res: dict) -> str:
    s = res["shape"]
    mem = "peak_extra_mib" in res
    thp = "on" if res.get("thp_alloc") else "off"
    rows = [
        f"capture overhead: {s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, "
        f"batch {s['batch']} x {s['tokens']} tokens; huge-page allocations {thp} (THP_MEM_ALLOC_ENABLE)",
        f"{'contender':<24} {'ms':>9} {'x plain':>8} {'sys ms':>7} {'faults':>8} {'kept MiB':>9}"
        + (f" {'peak MiB':>9}" if mem else ""),
    ]
    for m in MODES:
        row = (
            f"{m:<24} {res['seconds'][m] * 1e3:9.1f} {res['ratio_to_plain'][m]:8.2f} "
            f"{res['system_seconds'][m] * 1e3:7.0f} {res['minor_faults'][m]:8d} {res['kept_mib'][m]:9.1f}"
        )
        if mem:
            row += f" {res['peak_extra_mib'][m]:9.0f}"
        rows.append(row)
    return "\n".join(rows)


def main(*, quick: bool = False, reps: int = 5, memory: bool = True, json_path: str | None = None, shape=None) -> int:
    """``attnlab bench capture``: run, print the summary, write JSON to ``json_path``."""
    res = run(quick=quick, reps=reps, memory=memory, shape=shape)
    print(summary(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _child_main(argv: list[str]) -> int:
    """The memory child: ``python -m attnlab.bench.capture --child MODE [--quick] [--shape L,d,H,B,N]``."""
    p = argparse.ArgumentParser(prog="python -m attnlab.bench.capture")
    p.add_argument("--child", required=True, help="the contender to measure")
    p.add_argument("--quick", action="store_true", help="the quick sizes")
    p.add_argument("--shape", help="layers,d_model,heads,batch,tokens")
    a = p.parse_args(argv)
    _child(a.child, a.quick, tuple(int(v) for v in a.shape.split(",")) if a.shape else None)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
