"""The child process of :func:`attnlab.bench.memprobe.measure`: run one benchmark case's
backend once under glibc's ``MALLOC_MMAP_THRESHOLD_`` and print its peak extra memory.

    python -m attnlab.bench.attention_probe '{"case": {...fields of Case, "mode": "fwd"|"fwdbwd"}, "backend": NAME}'

Prints one JSON line ``{"peak_extra_mib": float}``.  Kept apart from ``memprobe`` so that
``attention`` -> ``memprobe`` is the only direction of import between them.
"""

from __future__ import annotations

import json
import sys

from attnlab.bench.attention import Case, MiB, Runner
from attnlab.bench.measure import peak_extra_bytes


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    runner = Runner(Case(**spec["case"]))
    fn = runner.backends(with_flex=False)[spec["backend"]]
    fn()  # warm-up: one-time allocations (thread pools, workspaces) are not the kernel's
    for t in (runner.q, runner.k, runner.v):
        t.grad = None  # so the measured call's gradients count as the extra memory they are
    print(json.dumps({"peak_extra_mib": peak_extra_bytes(fn, warmup=False) / MiB}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
