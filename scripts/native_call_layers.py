"""The native kernel's per-call cost, layer by layer, on a problem too small to cost anything
else: window256 bf16 (1,4,16,64), no grad, 2 threads, best of 9 rounds of 300 calls (µs):
``attnlab.attention`` (validation, dispatch, plan, the custom op, the kernel), ``plan``,
``native_attention`` (the mask's arguments and the custom op), ``torch.ops.attnlab.native_fwd``
(torch.library's custom op around the C++ op) and the C++ op ``attnlab_native::fwd`` alone
(its checks, packs, parallel region and 16 rows of work).

    PYTHONPATH=src python scripts/native_call_layers.py

2026-12-05 14:20, stop 31 (2-core AMD EPYC VM), three runs: 66.6-70.8 / 6.0 / 36.1-39.5 /
33.4-35.8 / 14.8-18.2 µs.  So about 49-53 µs of a call is Python above the C++ op: about 25 µs
in `attnlab.attention` itself (argument checks, normalisation, the backend choice), 6 µs the
plan, 15-19 µs torch.library's custom-op layers (what makes the kernel one opaque node under
torch.compile), 3-4 µs the arguments; 1.4-1.6% of window256 bf16 at N=8192 (3.3-3.6 ms), most
of a small decode step.
"""

import torch

import attnlab
import attnlab.ops.native.ops as native_ops
from attnlab import masks
from attnlab.bench.measure import best_time
from attnlab.ops.native import build
from attnlab.ops.native.structure import band_of


def best_us(f, n: int = 300, rounds: int = 9) -> float:
    """µs per call: the fastest of ``rounds`` runs of ``n`` calls (best_time, 50 calls' warm-up)."""

    def batch() -> None:
        for _ in range(n):
            f()

    return best_time(batch, reps=rounds, warmup=max(1, 50 // n)) / n * 1e6


def main() -> None:
    torch.set_num_threads(2)
    q = torch.randn(1, 4, 16, 64).bfloat16()
    k, v = q.clone(), q.clone()
    m = masks.sliding_window(256)
    scale = 64**-0.5
    s, why = native_ops.plan(q, k, v, m, None, 0, 0)
    if s is None:
        raise SystemExit(f"the native kernel does not run here: {why}")
    band, block = band_of(s), native_ops.blocks(64)
    op_args = (q, k, v, *([None] * 11), scale, 0, 0, band, 0, block, [], [])
    ext = build.load()
    # the C++ op's own arguments (ops.native_fwd builds them so): the band as (has_left, left,
    # has_right, right, sinks, has_sinks_right, sinks_right), six absent tensors, the tiles, no
    # score terms, five empty mask extras, the BlockMask tiles (here the kernel's)
    mask_args = (bool(band[0]), int(band[1]), bool(band[2]), int(band[3]), 0, bool(band[4]), int(band[5]))
    extras = [torch.empty(0)] * 5
    ext_args = (q, k, v, scale, 0, 0, *mask_args, *([None] * 6), *block, [], [], extras, block)
    rows = {
        "attnlab.attention(backend='native')": lambda: attnlab.attention(q, k, v, mask=m, backend="native"),
        "ops.native.ops.plan": lambda: native_ops.plan(q, k, v, m, None, 0, 0),
        "ops.native.ops.native_attention": lambda: native_ops.native_attention(
            q, k, v, s, scale=scale, q_offset=0, kv_offset=0
        ),
        "torch.ops.attnlab.native_fwd": lambda: torch.ops.attnlab.native_fwd(*op_args),
        "C++ op attnlab_native::fwd": lambda: ext.fwd(*ext_args),
    }
    with torch.no_grad():
        for name, f in rows.items():
            print(f"{name:40s} {best_us(f):6.1f} us", flush=True)


if __name__ == "__main__":
    main()
