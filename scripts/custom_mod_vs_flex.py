"""A custom score mod (a user lambda: a per-head distance bias) with a causal mask at (1, 4, N, 64):
``attnlab.attention`` (backend auto) against compiled FlexAttention with the same score mod and
block mask, forward only, best and median of 5 after 2.  A custom score mod is not one the native
kernel reads (issue 16: "custom score mods keep the tensor-ops path"), so auto runs the torch-ops
flash path here, where FlexAttention compiles the lambda into its kernel.

    PYTHONPATH=src python scripts/custom_mod_vs_flex.py [N] [float32|bfloat16]
"""

import statistics
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.set_num_threads(2)
import attnlab  # noqa: E402
from attnlab import masks, scores  # noqa: E402


def main() -> None:
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    dt = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, N, 64, generator=g).to(dt) for _ in range(3))
    slope = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def bias(s, b, h, qi, kv):
        return s - slope[h] * (qi - kv).abs() / 64

    mod = scores.custom(bias)
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, N, N, device="cpu")
    calls = {
        "attnlab auto": lambda: attnlab.attention(q, k, v, mask=masks.causal(), score_mod=mod, q_offset=0),
        "flex compiled": lambda: flex(q, k, v, score_mod=bias, block_mask=bm),
    }
    with torch.no_grad():
        diff = (calls["attnlab auto"]().float() - calls["flex compiled"]().float()).abs().max().item()
        print(f"N={N} {dt}: max |attnlab - flex| {diff:.3g}")
        for name, f in calls.items():
            for _ in range(2):
                f()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            print(f"{name:14s} best {min(ts) * 1e3:8.1f} ms  median {statistics.median(ts) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
