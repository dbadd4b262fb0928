"""Tile sizes for the flash backend, chosen by measurement.

``attnlab bench tiles`` re-measures this table on the machine at hand; the numbers
below come from that command on the 2-core AVX-512 (bf16) CPU of the CI machine, see
docs/benchmarks.md.  ``TARGET`` is the number of score elements (all batch and head
rows together) one tile should hold: enough to amortise Python's per-tile overhead,
small enough to stay in cache.
"""

from __future__ import annotations

import torch

# (dtype, head-dim bucket) -> (block_k, target elements per tile), from
# `attnlab bench tiles` on 2026-11-29 (docs/benchmarks.md): the best candidate was
# within 3-8% of its neighbours, so the table is flat by design.
TABLE = {
    (torch.bfloat16, 64): (512, 1 << 20),
    (torch.bfloat16, 128): (512, 1 << 20),
    (torch.float32, 64): (512, 1 << 20),
    (torch.float32, 128): (512, 1 << 21),
}
_DEFAULT = (512, 1 << 20)


def _bucket(D: int) -> int:
    return 64 if D <= 64 else 128


def choose_tiles(dtype: torch.dtype, D: int, BH: int, device=None) -> tuple[int, int]:
    """``(block_q, block_k)`` for a problem with ``BH`` = batch × heads rows per tile."""
    key = (torch.float32 if dtype in (torch.float16, torch.float64) else dtype, _bucket(D))
    bk, target = TABLE.get(key, _DEFAULT)
    bq = target // max(1, BH * bk)
    bq = 1 << max(5, min(10, bq.bit_length() - 1)) if bq > 0 else 32
    return bq, bk


def tile_candidates(dtype: torch.dtype, D: int, BH: int, device=None) -> list[tuple[int, int]]:
    """Tile sizes worth trying for a masked problem: the measured default and finer
    kv-blocks, which skip more of a sparse mask (the BlockMask cost model picks)."""
    bq, bk = choose_tiles(dtype, D, BH, device)
    out = [(bq, bk)]
    for cq in sorted({bq, min(bq, 256), min(bq, 128)}, reverse=True):
        for ck in (bk, 256, 128):
            if ck <= bk and (cq, ck) not in out:
                out.append((cq, ck))
    return out
