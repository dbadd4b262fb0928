"""Measure one benchmark case's peak memory in a fresh child process.

The parent runs ``python -m attnlab.bench.attention_probe '<json>'`` (the child, which
imports :mod:`attnlab.bench.attention`; this module does not) with glibc's
``MALLOC_MMAP_THRESHOLD_=65536``: every buffer of 64 KiB or more then comes from
and goes back to the OS, so the child's resident-set high-water mark follows the
bytes actually allocated (tracked allocations, as the OS sees them) instead of what
malloc happens to keep.  The timing process keeps malloc's defaults, so the
setting cannot slow the timed runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from attnlab.bench.measure import memory_supported

ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def measure(case_fields: dict, backend: str, mode: str, timeout_s: float = 600.0) -> float | None:
    """Peak extra MiB of ``backend`` on the case (``mode`` "fwd" or "fwdbwd"), or None."""
    if not memory_supported():
        return None
    spec = json.dumps({"case": {**case_fields, "mode": mode}, "backend": backend})
    env = {**os.environ, **ENV}
    out = subprocess.run(
        [sys.executable, "-m", "attnlab.bench.attention_probe", spec],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"memprobe failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_mib"]
