#!/usr/bin/env bash
# One prepared run of the Triton kernels on a CUDA machine (the device tool's H200):
# versions, a smoke test, the correctness grid against the float64 reference, then the
# timing table side by side with SDPA (flash, cuDNN) and compiled FlexAttention.
# Each stage is its own process with its own time limit, so one failing stage still
# leaves the others' output.  Output goes to $OUT (or out/gpu) as logs, JSON and markdown.
#   OUT=out/gpu scripts/gpu_triton_check.sh [quick|full]
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} ATTNLAB_NATIVE=0 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PY:-python3}
MODE=${1:-quick}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/env.txt"
$PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$OUT/env.txt"

echo "== smoke"
timeout ${SMOKE_TIMEOUT:-150} $PY - <<'PY' 2>&1 | tee "$OUT/smoke.log"
import time, torch, attnlab
from attnlab import masks
t0 = time.time()
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for D in (64, 128):
        q, k, v = (torch.randn(2, 4, 300, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        out, lse = attnlab.attention(q, k, v, mask=masks.causal(), backend="triton", return_lse=True)
        out.float().square().sum().backward()
        g = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        ref = attnlab.attention(q, k, v, mask=masks.causal(), backend="reference")
        ref.float().square().sum().backward()
        e = [(a - b.grad).abs().max().item() for a, b in zip(g, (q, k, v))]
        print(f"smoke {dtype} D={D}: out err {(out - ref).abs().max().item():.3g}  grad errs {[f'{x:.3g}' for x in e]}", flush=True)
print(f"smoke done in {time.time() - t0:.1f}s")
PY

echo "== correctness + timing (attnlab bench triton)"
ARGS="--json $OUT/triton.json --markdown $OUT/triton.md"
[ "$MODE" = quick ] && ARGS="--quick $ARGS"
timeout ${BENCH_TIMEOUT:-420} $PY -m attnlab.cli bench triton $ARGS 2>&1 | tee "$OUT/bench.log"
echo "bench exit ${PIPESTATUS[0]}"
