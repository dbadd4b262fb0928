"""bf16 torch-ops flash: S/dP in float32 (this checkout) vs the bf16 bmm (the git ref given, default main), side by side.

PYTHONPATH=src python scripts/bench_flash_bf16_scores.py <ref>
"""

import subprocess
import sys
import time
import types

import torch

from attnlab import masks, scores

src = subprocess.run(
    ["git", "show", f"{sys.argv[1] if len(sys.argv) > 1 else 'main'}:src/attnlab/ops/flash.py"],
    capture_output=True,
    text=True,
    check=True,
).stdout
old = types.ModuleType("attnlab.ops._flash_old")
old.__file__ = "old_flash.py"
exec(compile(src, "old_flash.py", "exec"), old.__dict__)
from attnlab.ops import flash as new  # noqa: E402

torch.manual_seed(0)


def case(B, H, N, D, mask, mod):
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    kw = dict(mask=mask, score_mod=mod, scale=D**-0.5, q_offset=0)
    res = {}
    for name in ("old", "new"):
        res[name] = [1e9, 1e9]
    for _rep in range(3):
        for name, m in (("old", old), ("new", new)):
            t0 = time.perf_counter()
            with torch.no_grad():
                m.flash_attention(q, k, v, **kw)
            t1 = time.perf_counter()
            o, _ = m.flash_attention(q, k, v, **kw)
            o.sum().backward()
            t2 = time.perf_counter()
            res[name][0] = min(res[name][0], t1 - t0)
            res[name][1] = min(res[name][1], t2 - t1)
    print(
        f"B{B} H{H} N{N} D{D} {mask!r} {mod!r}: fwd old {res['old'][0] * 1e3:.1f} ms new {res['new'][0] * 1e3:.1f} ms "
        f"ratio {res['new'][0] / res['old'][0]:.2f}x | fwd+bwd old {res['old'][1] * 1e3:.1f} new {res['new'][1] * 1e3:.1f} "
        f"ratio {res['new'][1] / res['old'][1]:.2f}x",
        flush=True,
    )


case(1, 4, 1024, 64, masks.causal(), None)
case(1, 4, 2048, 128, masks.causal(), None)
case(1, 4, 2048, 64, None, scores.softcap(20.0))
