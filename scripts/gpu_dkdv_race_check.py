"""On a CUDA machine: the shipped Triton configuration through the public API, forward and
backward at N = 8192, each call repeated: every gradient bit-identical from call to call and
within ERR_BOUND of max|ref| against torch SDPA in float32 (memory-efficient backend).

The dK/dV kernel with num_stages >= 2 gave wrong, run-to-run different dK on an H200 with
triton 3.6 (scripts/gpu_tile_h200_probe.md, scripts/gpu_race_check_h200.log); the shipped
dK/dV configs now use num_stages = 1 (no asynchronous dots).  This is the check of that.

    PYTHONPATH=src ATTNLAB_NATIVE=0 python3 scripts/gpu_dkdv_race_check.py [REPEATS]
"""

import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab import masks
from attnlab.ops.triton import config

ERR_BOUND = 2.0**-6  # max |x - ref| / max |ref|, bf16/fp16 against float32 (the sweep's bound)
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__, flush=True)
print(
    "dkdv configs:",
    {d: (config.GPU_TILES["16bit"][d]["dkdv"], config.AUTOTUNE["16bit"][d]["dkdv"]) for d in (64, 128, 256)},
)
bad = 0
t_start = time.time()
for D, (B, H, N) in ((128, (4, 16, 8192)), (64, (4, 32, 8192)), (256, (2, 8, 4096))):
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (True, False):
            g = torch.Generator(device=dev).manual_seed(D)
            q, k, v, do = (torch.randn(B, H, N, D, generator=g, device=dev, dtype=torch.float32) for _ in range(4))
            q32, k32, v32 = (t.clone().requires_grad_() for t in (q, k, v))
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                o32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
            o32.backward(do)
            ref = {"out": o32.detach(), "dq": q32.grad, "dk": k32.grad, "dv": v32.grad}
            first = None
            worst = 0.0
            diff = 0.0
            ms = []
            for _ in range(reps):
                qd, kd, vd = (t.to(dtype).requires_grad_() for t in (q, k, v))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                o = attnlab.attention(qd, kd, vd, mask=masks.causal() if causal else None, backend="triton")
                o.backward(do.to(dtype))
                torch.cuda.synchronize()
                ms.append(1e3 * (time.perf_counter() - t0))
                got = {"out": o.detach(), "dq": qd.grad, "dk": kd.grad, "dv": vd.grad}
                for key in ref:
                    e = float((got[key].float() - ref[key]).abs().max() / ref[key].abs().max())
                    worst = max(worst, e)
                if first is None:
                    first = got
                else:
                    diff = max(diff, max(float((got[x].float() - first[x].float()).abs().max()) for x in got))
            ok = worst <= ERR_BOUND and diff == 0.0
            bad += not ok
            print(
                f"D={D:3d} {str(dtype)[6:]:8s} {'causal' if causal else 'full  '} ({B},{H},{N},{D}): "
                f"max err/max|ref| {worst:.4f}, rerun diff {diff:.3g}, fwd+bwd ms {sorted(ms)[len(ms) // 2]:.2f}  "
                + ("ok" if ok else "FAIL"),
                flush=True,
            )
print(f"{'all ok' if not bad else f'{bad} FAIL'}; {time.time() - t_start:.0f} s")
sys.exit(1 if bad else 0)
