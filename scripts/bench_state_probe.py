"""Does `attnlab bench attention`'s own earlier work slow window256 bf16?  In one process: the
native kernel's warm time on window256 bf16 (1,4,8192,64) (three `warm_time` readings), then
`attnlab.bench.attention.run` over every case the bench runs before it, then the warm time
again (twice), after `gc.collect()`, after `malloc_trim(0)`, and on fresh inputs.

    PYTHONPATH=src python scripts/bench_state_probe.py [all|noflex|nomem|noflexmem|flex1|sleep20]

(all: FlexAttention and the memory probes on, as the bench runs; noflex: no FlexAttention;
nomem: no memory probes; noflexmem: neither; flex1: instead of the earlier cases, only
compiled FlexAttention on window256 bf16 itself (compile, five calls, the bench's 0.5 s
settling sleep); sleep20: instead, 20 s idle.)  2026-12-05, stop 30 (docs/benchmarks.md): all,
twice: 3.35-3.41 ms before, 3.50-3.83 after; noflex, nomem and noflexmem once each: no
slowdown (3.30-3.59 ms before and after).  On this noisy VM one run each is not proof.
2026-12-05 13:21, stop 31, all once more (a copy with process diagnostics added): 3.60-3.83 ms
before, 3.63-3.71 after: no slowdown, in a slow spell of the VM (the call alone read 3.5-3.6 ms
that hour), so the stop 30 lead did not hold up.  flex1 and sleep20 once each at 14:01
(a fast spell): flex1 3.32-3.35 ms before, 3.28-3.31 after (no slowdown); sleep20 3.31-3.39
before, 3.55-3.70 in the first two readings after, 3.33-3.36 again after about a second of work.
"""

import ctypes
import gc
import sys
import time

from attnlab.bench import attention as A

VARIANTS = {
    "all": {"with_flex": True, "memory": True},
    "noflex": {"with_flex": False, "memory": True},
    "nomem": {"with_flex": True, "memory": False},
    "noflexmem": {"with_flex": False, "memory": False},
}


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "all"
    known = [*VARIANTS, "flex1", "sleep20"]
    if variant not in known:
        raise SystemExit(f"bench_state_probe.py: unknown variant {variant!r}; one of {', '.join(known)}")
    cases = A.default_cases()
    i = [c.name for c in cases].index("window256 bfloat16 (1,4,8192,64)")
    fn = A.Runner(cases[i]).backends(with_flex=False)["attnlab native"]

    def show(tag: str) -> None:
        print(tag, " ".join(f"{A.warm_time(fn) * 1e3:.3f}" for _ in range(3)), "ms", flush=True)

    show("before")
    if variant == "flex1":
        flex = A.Runner(cases[i]).backends(with_flex=True)[A.FLEX]
        for _ in range(6):
            flex()
        time.sleep(0.5)
    elif variant == "sleep20":
        time.sleep(20)
    else:
        A.run(cases[:i], reps=3, progress=False, **VARIANTS[variant])
    show("after")
    show("after")
    gc.collect()
    show("after gc.collect()")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    show("after malloc_trim(0)")
    fn = A.Runner(cases[i], seed=1).backends(with_flex=False)["attnlab native"]
    show("fresh inputs")


if __name__ == "__main__":
    main()
