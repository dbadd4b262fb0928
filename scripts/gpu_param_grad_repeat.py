"""On a CUDA machine: the Triton kernels' score-mod cases repeated, each key's error against the
float64 oracle beside the same-dtype reference's, to tell run-to-run variation (float32 atomics
into the relative-bias table's gradient) from a wrong gradient.

    PYTHONPATH=src python3 scripts/gpu_param_grad_repeat.py [REPEATS]
"""

import sys

import torch

from attnlab import masks, scores
from attnlab.bench.triton import _err, _run

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
cases = [
    (
        "softcap+relbias f32",
        torch.float32,
        None,
        lambda p: scores.compose(scores.relative_bias(p), scores.softcap(20.0)),
        (4, 33),
    ),
    ("relbias f32", torch.float32, None, lambda p: scores.relative_bias(p), (4, 33)),
    ("relbias f32 causal", torch.float32, masks.causal(), lambda p: scores.relative_bias(p), (4, 33)),
    (
        "softcap+relbias bf16",
        torch.bfloat16,
        None,
        lambda p: scores.compose(scores.relative_bias(p), scores.softcap(20.0)),
        (4, 33),
    ),
]
B, H, N, D = 1, 4, 512, 64
for name, dtype, mask, factory, pshape in cases:
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(4))
    c = torch.randn(B, H, N, generator=g, dtype=torch.float64)
    param = torch.randn(*pshape, generator=g) * 0.5
    oracle = _run(q, k, v, "reference", mask, factory, param.double(), w, c, "cpu")
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    ref = _run(qd, kd, vd, "reference", mask, factory, param.float(), w, c, "cpu")
    r = {key: _err(ref[key], oracle[key]) for key in oracle}
    M = float(oracle["dparam"].abs().max())
    print(f"{name}: reference errors " + " ".join(f"{k}={v:.2e}" for k, v in r.items()) + f"  max|dparam|={M:.3g}")
    for i in range(reps):
        fast = _run(qd, kd, vd, "triton", mask, factory, param.float(), w, c, "cuda")
        e = {key: _err(fast[key], oracle[key]) for key in fast}
        excess = (e["dparam"] - 3 * r["dparam"]) / (torch.finfo(dtype).eps * M)
        print(
            f"  run {i}: "
            + " ".join(f"{k}={v:.2e}" for k, v in e.items())
            + f"  dparam excess over 3x: {excess:.2f} eps*M"
        )
