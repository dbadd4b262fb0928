"""Capture overhead: a forward pass with :func:`attnlab.interp.capture` against a plain one.

Contenders, on one model and one batch, in one run (interleaved repetitions, medians):

* ``plain``: ``model(ids)`` under ``no_grad`` (the fast path);
* ``capture``: the same inside ``capture(model)`` (every layer's q, k, v, z kept);
* ``capture + 1 head``: and the pattern of one head per layer recomputed from q and k;
* ``output_attentions``: every layer's full pattern materialized ``(B, H, N, N)`` — what
  an eager model with ``output_attentions=True`` (bertviz, TransformerLens' cache) holds;
* ``transformers eager``: with ``--hf``, the equivalent GPT-2 in transformers with
  ``attn_implementation="eager", output_attentions=True``.

Memory is each contender's peak extra resident memory, measured in a fresh child process
(:mod:`attnlab.bench.memprobe`'s method: glibc's mmap threshold lowered so the resident
high-water mark follows the allocations).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

MODES = ("plain", "capture", "capture + 1 head", "output_attentions")


def _setup(quick: bool):
    from attnlab.nn import Decoder, DecoderConfig
    torch.manual_seed(0)
    L, d, H, B, N = (4, 256, 8, 2, 512) if quick else (6, 512, 8, 4, 1024)
    cfg = DecoderConfig(vocab_size=4096, d_model=d, n_layers=L, n_heads=H, max_positions=N)
    model = Decoder(cfg).eval()
    ids = torch.randint(0, 4096, (B, N))
    return model, ids, cfg


def _call(mode, model, ids):
    from attnlab.interp import capture
    with torch.no_grad():
        if mode == "plain":
            return model(ids).logits
        if mode == "output_attentions":
            out = model(ids, output_attentions=True)
            return out.logits, out.attentions
        with capture(model) as cap:
            logits = model(ids).logits
        if mode == "capture":
            return logits, cap
        return logits, cap, [cap.pattern(l, heads=[0]) for l in cap.layers]


def _child(mode: str, quick: bool) -> None:
    from attnlab.bench.measure import peak_extra_bytes
    model, ids, _ = _setup(quick)
    print(json.dumps({"mib": peak_extra_bytes(lambda: _call(mode, model, ids)) / 2 ** 20}))


def run(quick: bool = False, reps: int = 5, memory: bool = True) -> dict:
    from tqdm.auto import tqdm
    from attnlab.bench.measure import memory_supported, time_call
    model, ids, cfg = _setup(quick)
    times = {m: [] for m in MODES}
    for _ in tqdm(range(reps), desc="capture bench", unit="round"):
        for m in MODES:  # interleaved: every contender sees the same machine state
            times[m].append(time_call(lambda: _call(m, model, ids), reps=1, warmup=1 if not times[m] else 0))
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    res = {"shape": {"layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads, "batch": ids.shape[0],
                     "tokens": ids.shape[1]},
           "seconds": med, "ratio_to_plain": {m: med[m] / med["plain"] for m in MODES}}
    if memory and memory_supported():
        from attnlab.bench.memprobe import ENV
        mem = {}
        for m in tqdm(MODES, desc="memory", unit="mode"):
            out = subprocess.run([sys.executable, "-m", "attnlab.bench.capture", "--child", m]
                                 + (["--quick"] if quick else []), env={**os.environ, **ENV},
                                 capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"memory child {m!r} failed: {out.stderr.strip()[-500:]}")
            mem[m] = json.loads(out.stdout.strip().splitlines()[-1])["mib"]
        res["peak_extra_mib"] = mem
    return res


def summary(res: dict) -> str:
    s = res["shape"]
    rows = [f"capture overhead: {s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, "
            f"batch {s['batch']} x {s['tokens']} tokens",
            f"{'contender':<20} {'ms':>9} {'x plain':>8}" + (f" {'peak MiB':>9}" if "peak_extra_mib" in res else "")]
    for m in MODES:
        row = f"{m:<20} {res['seconds'][m] * 1e3:9.1f} {res['ratio_to_plain'][m]:8.2f}"
        if "peak_extra_mib" in res:
            row += f" {res['peak_extra_mib'][m]:9.0f}"
        rows.append(row)
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="attnlab bench capture", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child, a.quick)
        return 0
    if a.reps < 1:
        p.error("--reps must be >= 1")
    res = run(quick=a.quick, reps=a.reps, memory=not a.no_memory)
    print(summary(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
