"""``attnlab bench compile``: a Decoder training step compiled vs eager, same run.

A :class:`attnlab.nn.Decoder` with a sliding-window mask (the flash backend's
``attnlab::flash_*`` custom ops), one training step = forward + cross-entropy + backward
+ AdamW step.  The compiled contender is ``torch.compile(loss_fn, fullgraph=True)`` (the
optimizer step stays eager in both); compilation happens in the warm-up and is reported
separately.  Eager and compiled steps are interleaved (A, B, A, B, ...) and the medians
reported with their ratio (compiled throughput over eager).

    attnlab bench compile [--quick] [--reps N] [--backend inductor|aot_eager] [--json PATH]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from attnlab import masks
from attnlab.nn import Decoder
from attnlab.nn.config import DecoderConfig

SHAPES = {  # (layers, d_model, heads, vocab, batch, seq, window)
    "full": (4, 256, 4, 4096, 4, 1024, 256),
    "quick": (1, 32, 2, 64, 1, 32, 8),
}


def run(quick: bool = False, reps: int = 5, backend: str = "inductor", progress: bool = True) -> dict:
    L, d, H, V, B, N, w = SHAPES["quick" if quick else "full"]
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=V, d_model=d, n_layers=L, n_heads=H, max_positions=N, backend="flash"))
    ids = torch.randint(0, V, (B, N))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_fn(ids):
        logits = model(ids, mask=masks.sliding_window(w)).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))

    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)

    def step(fn):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        fn(ids).backward()
        opt.step()
        return time.perf_counter() - t

    t0 = time.perf_counter()
    step(compiled)  # compiles
    compile_s = time.perf_counter() - t0
    step(loss_fn)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(reps):
        times["eager"].append(step(loss_fn))
        times["compiled"].append(step(compiled))
        if progress:
            print(
                f"  rep {r + 1}/{reps}: eager {times['eager'][-1]:.3f}s compiled {times['compiled'][-1]:.3f}s",
                file=sys.stderr,
            )
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = B * N
    return {
        "shape": dict(layers=L, d_model=d, heads=H, vocab=V, batch=B, seq=N, window=w),
        "backend": backend,
        "compile_s": compile_s,
        "eager_step_s": med["eager"],
        "compiled_step_s": med["compiled"],
        "eager_tok_s": tokens / med["eager"],
        "compiled_tok_s": tokens / med["compiled"],
        "ratio_compiled_over_eager": med["eager"] / med["compiled"],
        "reps": reps,
    }


def main(*, quick: bool = False, reps: int = 5, backend: str = "inductor", json_path: str | None = None) -> int:
    """``attnlab bench compile``: run, print the figures, write JSON to ``json_path``."""
    res = run(quick=quick, reps=reps, backend=backend)
    s = res["shape"]
    print(
        f"Decoder L={s['layers']} d={s['d_model']} H={s['heads']} B={s['batch']} N={s['seq']} "
        f"sliding_window({s['window']}), torch.compile backend={res['backend']}"
    )
    print(f"  compile (first step): {res['compile_s']:.1f}s")
    print(f"  eager    step {res['eager_step_s']:.4f}s  {res['eager_tok_s']:.0f} tok/s")
    print(f"  compiled step {res['compiled_step_s']:.4f}s  {res['compiled_tok_s']:.0f} tok/s")
    print(f"  ratio compiled/eager throughput: {res['ratio_compiled_over_eager']:.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    return 0
