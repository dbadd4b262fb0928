"""The native forward's time on issue 16's cases at (1, 4, 8192, D): the best of REPS runs
per case, printed as ``case=ms`` on one line (scripts/ab_native.sh compares two checkouts).

    CASES=w256,doc8 DT=bfloat16 D=64 NT=1 PYTHONPATH=src python scripts/native_case_times.py REPS

Cases: w256 / w16 (sliding window), doc8 (8 documents & causal), prefix (N/4), causal, full.
"""

import os
import sys

import torch

torch.set_num_threads(int(os.environ.get("NT", "1")))
import attnlab  # noqa: E402
from attnlab import masks  # noqa: E402
from attnlab.bench.measure import best_time  # noqa: E402

N, H, D = 8192, 4, int(os.environ.get("D", "64"))
CASES = {
    "w256": masks.sliding_window(256),
    "w16": masks.sliding_window(16),
    "doc8": masks.document(torch.arange(N) * 8 // N) & masks.causal(),
    "prefix": masks.prefix_lm(N // 4),
    "causal": masks.causal(),
    "full": None,
}


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    dt = getattr(torch, os.environ.get("DT", "bfloat16"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, D, generator=g).to(dt) for _ in range(3))
    out = []
    with torch.no_grad():
        for name in os.environ.get("CASES", "w256,doc8,w16").split(","):

            def f(m=CASES[name]):
                return attnlab.attention(q, k, v, mask=m, backend="native")

            out.append(f"{name}={best_time(f, reps=reps, warmup=2) * 1e3:.3f}")
    print(" ".join(out))


if __name__ == "__main__":
    main()
