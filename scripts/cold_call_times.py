"""A call's time hot (the third of back-to-back calls) and cold (right after a pass over 256 MiB
that evicts every cache level), median over ROUNDS, for the native forward on issue 16's
cases at (1, 4, 8192, 64) and for a tiny (1, 4, 64, 64) call of native and of torch SDPA
(``tinysplit``: the same native call entered at its torch custom op and at the extension's op):

    CASES=w256,doc8,tiny,tinysplit NT=2 PYTHONPATH=src python scripts/cold_call_times.py [ROUNDS]

Prints ``case-hot=ms case-cold=ms`` on one line.  What a call costs after other work (the
bench's interleaved column) beyond its warm time: the inputs and outputs read from memory,
and the call path's own code and data.  With WARM_QKV=1 the cold call's Q, K and V are read
once after the eviction (so its extra time is what is not the inputs).
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(os.environ.get("NT", "2")))
import attnlab  # noqa: E402
from attnlab import masks  # noqa: E402

N, H, D = 8192, 4, 64
MASKS = {
    "w256": masks.sliding_window(256),
    "doc8": masks.document(torch.arange(N) * 8 // N) & masks.causal(),
    "causal": masks.causal(),
}


def split_calls(g):
    from attnlab.ops.native import ops

    q, k, v = (torch.randn(1, H, 64, D, generator=g).to(torch.bfloat16) for _ in range(3))
    none, band, blk = [None] * 11, [0, 0, 0, 0, 0, 0], [64, 256]
    yield "tiny-op", (q, k, v), lambda: ops.native_fwd(q, k, v, *none, D**-0.5, 0, 0, band, 0, blk, [], [])
    ext = ops._ext()
    args = (D**-0.5, 0, 0, False, 0, False, 0, 0, False, 0, *[None] * 6, *blk, [], [], [], blk)
    yield "tiny-ext", (q, k, v), lambda: ext.fwd(q, k, v, *args)


def calls():
    g = torch.Generator().manual_seed(0)
    for name in os.environ.get("CASES", "w256,tiny").split(","):
        if name == "tiny":
            q, k, v = (torch.randn(1, H, 64, D, generator=g).to(torch.bfloat16) for _ in range(3))
            yield "tiny-native", (q, k, v), lambda q=q, k=k, v=v: attnlab.attention(q, k, v, backend="native")
            yield "tiny-sdpa", (q, k, v), lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v)
            continue
        if name == "tinysplit":  # the native call's layers: the torch custom op, the extension's op
            yield from split_calls(g)
            continue
        q, k, v = (torch.randn(1, H, N, D, generator=g).to(torch.bfloat16) for _ in range(3))
        m = MASKS[name]
        yield name, (q, k, v), lambda q=q, k=k, v=v, m=m: attnlab.attention(q, k, v, mask=m, backend="native")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    junk = torch.ones(64 << 20)  # 256 MiB
    warm_inputs = os.environ.get("WARM_QKV") == "1"
    out = []
    with torch.no_grad():
        for name, inputs, fn in calls():
            for _ in range(3):
                fn()
            hot, cold = [], []
            for _ in range(rounds):
                junk.add_(1.0)
                if warm_inputs:
                    for t in inputs:
                        t.float().sum()
                t0 = time.perf_counter()
                fn()
                cold.append(time.perf_counter() - t0)
                fn()
                fn()
                t0 = time.perf_counter()
                fn()
                hot.append(time.perf_counter() - t0)
            out.append(f"{name}-hot={statistics.median(hot) * 1e3:.3f} {name}-cold={statistics.median(cold) * 1e3:.3f}")
    print(" ".join(out))


if __name__ == "__main__":
    main()
