"""Decode steps on dense keys: torch SDPA, ``attnlab.attention`` (auto) and ``backend="native"``,
interleaved call by call, median microseconds (docs/native.md, "Decode steps on dense keys").

    PYTHONPATH=src python scripts/decode_route.py [REPS]

Causal decode at the end of the keys (``q_offset = Nk - Nq``), D = 128, inference (no grad).
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks

SHAPES = [  # (B, H, Hkv, Nq)
    (1, 8, 8, 1),
    (2, 8, 2, 1),
    (1, 8, 8, 4),
]
KEYS = (256, 1024, 4096, 16384)


def calls(q, k, v, dense, m, off):
    gqa = q.shape[1] != k.shape[1]
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa),
        "auto": lambda: attnlab.attention(q, k, v, mask=m, q_offset=off),
        "native": lambda: attnlab.attention(q, k, v, mask=m, q_offset=off, backend="native"),
    }


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 41
    torch.set_num_threads(2)
    print(f"{'dtype':9} {'B,H:Hkv,Nq':>11} {'Nk':>6} {'sdpa':>8} {'auto':>8} {'native':>8}  auto/sdpa")
    for dt in (torch.float32, torch.bfloat16):
        for B, H, Hkv, Nq in SHAPES:
            for Nk in KEYS:
                g = torch.Generator().manual_seed(0)
                q = torch.randn(B, H, Nq, 128, generator=g).to(dt)
                k, v = (torch.randn(B, Hkv, Nk, 128, generator=g).to(dt) for _ in range(2))
                m, off = masks.causal(), Nk - Nq
                qp = torch.arange(Nq).view(-1, 1) + off
                # SDPA's bottom-right causal (one row at the end sees every key: no mask)
                dense = None if Nq == 1 else torch.arange(Nk).view(1, -1) <= qp
                fs = calls(q, k, v, dense, m, off)
                ts: dict[str, list[float]] = {n: [] for n in fs}
                with torch.no_grad():
                    for f in fs.values():
                        f()
                    for _ in range(reps if Nk <= 4096 else max(5, reps // 4)):
                        for n, f in fs.items():
                            t0 = time.perf_counter()
                            f()
                            ts[n].append(time.perf_counter() - t0)
                md = {n: statistics.median(t) * 1e6 for n, t in ts.items()}
                name = f"{B},{H}:{Hkv},{Nq}"
                print(
                    f"{str(dt)[6:]:9} {name:>11} {Nk:>6} {md['sdpa']:>8.0f} {md['auto']:>8.0f} {md['native']:>8.0f}"
                    f"  {md['auto'] / md['sdpa']:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
