"""The native kernel on issue 16's masked cases at (1,4,8192,64), load-robust: one thread,
CPU time (time.process_time), medians of REPS runs interleaved with a one-thread square
matmul (2048) whose best run is the ceiling, all in one process; prints GFLOP/s (allowed
pairs only, bench attention's case_flops) and % of that ceiling.

OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/bench_native_masks_1t.py [REPS] [window256 doc8 prefix ...]

Old against new: run it alternately on two checkouts (PYTHONPATH, TORCH_EXTENSIONS_DIR each).
"""
import os, sys, time, statistics
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
import attnlab
from attnlab.bench.attention import Case, attnlab_mask, case_flops

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
names = sys.argv[2:] or ["window256", "doc8", "prefix"]
dts = {"float32": torch.float32, "bfloat16": torch.bfloat16}

def cpu(fn):
    t0 = time.process_time(); fn(); return time.process_time() - t0

mm = {}
for dt, tdt in dts.items():
    a, b = torch.randn(2048, 2048, dtype=tdt), torch.randn(2048, 2048, dtype=tdt)
    mm[dt] = (lambda a=a, b=b: torch.matmul(a, b))
runs = {}
for m in names:
    for dt, tdt in dts.items():
        c = Case(m, m, 1, 4, 4, 8192, 64, dt)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, 8192, 64, generator=g).to(tdt) for _ in range(3))
        mask = attnlab_mask(c)
        runs[(m, dt)] = (lambda q=q, k=k, v=v, mask=mask: attnlab.attention(q, k, v, mask=mask, backend="native"), case_flops(c))
for f in list(mm.values()) + [r[0] for r in runs.values()]:
    f()
tm = {dt: [] for dt in mm}; tr = {key: [] for key in runs}
with torch.no_grad():
    for i in range(reps):
        for dt in mm: tm[dt].append(cpu(mm[dt]))
        for key, (f, _) in runs.items(): tr[key].append(cpu(f))
ceil = {dt: 2 * 2048**3 / min(tm[dt]) / 1e9 for dt in mm}
ceil_med = {dt: 2 * 2048**3 / statistics.median(tm[dt]) / 1e9 for dt in mm}
print(f"load {os.getloadavg()[0]:.2f}; 1-thread matmul ceiling (best / median): " + ", ".join(f"{dt} {ceil[dt]:.1f} / {ceil_med[dt]:.1f}" for dt in mm))
for (m, dt), (f, fl) in runs.items():
    t = statistics.median(tr[(m, dt)])
    g = fl / t / 1e9
    print(f"{m:10s} {dt:9s} {t*1e3:8.1f} ms cpu  {g:6.1f} GFLOP/s  {100*g/ceil[dt]:5.1f}% of best ceiling  (min {fl/min(tr[(m,dt)])/1e9:6.1f})")
