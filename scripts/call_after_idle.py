"""What one attention call costs after the machine sat idle: window256 bf16 (1,4,8192,64)
through `attnlab.attention` (auto -> native), back to back and after sleeps of 0.5 s and
0.05 s, medians of 7 (the bench's interleaved column put `attnlab auto` right after
FlexAttention's 0.5 s settling sleep in every round until b2bb11e: docs/benchmarks.md).

    PYTHONPATH=src python scripts/call_after_idle.py

2026-12-05, two runs (2-core AMD EPYC VM): back to back 3.38-3.45 ms; after 0.5 s 4.45-5.23 ms;
after 0.05 s 7.3-9.9 ms (the idle vCPU wakes late: a dynamically scheduled region then runs
mostly on one core).
"""

import statistics
import time

import torch

torch.set_num_threads(2)
import attnlab  # noqa: E402
from attnlab import masks  # noqa: E402

N, H, D = 8192, 4, 64
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, H, N, D, generator=g).to(torch.bfloat16) for _ in range(3))
mask = masks.sliding_window(256)


def call():
    return attnlab.attention(q, k, v, mask=mask)


with torch.no_grad():
    for _ in range(5):
        call()
    for label, pause in (("back to back", 0.0), ("after a 0.5 s sleep", 0.5), ("after a 0.05 s sleep", 0.05)):
        ts = []
        for _ in range(7):
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        print(f"{label:24s} median {statistics.median(ts) * 1e3:.2f} ms  min {min(ts) * 1e3:.2f} ms")
