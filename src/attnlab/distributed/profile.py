"""Where a distributed attention call spends its time, per step, on this rank.

>>> with profile() as prof:
...     pass          # ring_attention(...) / ulysses_attention(...) calls record here
>>> prof.summary()["steps"]
0

Each ring step records the seconds spent computing tiles, the seconds spent *waiting*
for messages after the computation was done (it also includes waiting for a slower
peer), and ``time.perf_counter()`` stamps of its start (when its messages were
posted), of the end of its computation and of its end — one clock for all processes
of a machine, so the benchmark can tell waiting for a late peer from waiting for the
wire.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

__all__ = ["profile", "Profile", "Step"]


@dataclass
class Step:
    op: str  # "ring fwd", "ring bwd", "ulysses"
    step: int
    computed: bool
    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    t_start: float = 0.0  # time.perf_counter() when the step began (its messages were posted)
    t_compute_end: float = 0.0  # ... when its computation ended (t_start if none)
    t_end: float = 0.0  # ... when its last wait returned


@dataclass
class Profile:
    steps: list[Step] = field(default_factory=list)

    def summary(self, op: str | None = None) -> dict:
        st = [s for s in self.steps if op is None or s.op == op]
        return {
            "steps": len(st),
            "computed": sum(s.computed for s in st),
            "compute_s": sum(s.compute_s for s in st),
            "wait_s": sum(s.wait_s for s in st),
            "bytes_sent": sum(s.bytes_sent for s in st),
        }

    def as_dicts(self) -> list[dict]:
        return [asdict(s) for s in self.steps]


_ACTIVE: list[Profile] = []


@contextmanager
def profile():
    """Record the steps of every distributed attention call made inside the block."""
    p = Profile()
    _ACTIVE.append(p)
    try:
        yield p
    finally:
        _ACTIVE.remove(p)


def active() -> bool:
    return bool(_ACTIVE)


def record(step: Step) -> None:
    for p in _ACTIVE:
        p.steps.append(step)


class Timer:
    """``with t.compute(): ...`` / ``with t.wait(): ...`` accumulate into one :class:`Step`."""

    def __init__(self, op: str, step: int, computed: bool):
        self.s = Step(op, step, computed)
        self.s.t_start = self.s.t_compute_end = time.perf_counter()

    @contextmanager
    def compute(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s.t_compute_end = time.perf_counter()
            self.s.compute_s += self.s.t_compute_end - t0

    @contextmanager
    def wait(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s.wait_s += time.perf_counter() - t0

    def done(self, bytes_sent: int = 0) -> None:
        self.s.bytes_sent = bytes_sent
        self.s.t_end = time.perf_counter()
        record(self.s)
