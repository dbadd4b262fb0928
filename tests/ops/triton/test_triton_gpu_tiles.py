"""The kernels at the tiles they ship for the GPU, run under the interpreter.

Under ``TRITON_INTERPRET=1`` every kernel normally uses ``config.INTERPRET_TILES``
(32×32); the GPU tiles (``config.GPU_TILES``, per dtype group and head-dim bucket:
float32 has small tiles of its own, 64×16 or 16×16 where 16-bit runs 128×64) are what
the compile in test_resources.py measures.  Here the interpreter runs those very tiles
(``kernel_tiles`` asked for the GPU's), so the block lists, partial tiles and tails at
those shapes are checked against the float64 reference under the DESIGN.md rule.
"""

from __future__ import annotations

import pytest

from attnlab import masks
from attnlab.ops.triton import config
from tests.ops.conftest import DTYPE_IDS, make_qkv
from tests.ops.triton.conftest import BF16, F32, TRITON, compare_triton

pytestmark = TRITON

# (B, H, Hkv, Nq, Nk, D): lengths that are not multiples of any tile, GQA, Nq != Nk
SHAPES = {
    "d64-97x70-gqa": (1, 4, 2, 97, 70, 64),
    "d128-70x97": (1, 2, 2, 70, 97, 128),
    "d256-40x33": (1, 2, 1, 40, 33, 256),
}
CASES = [(s, m, d) for s in SHAPES for m in ("none", "causal") for d in (F32, BF16)]


@pytest.fixture
def gpu_tiles(monkeypatch):
    """Make the launchers take the GPU tiles while the kernels interpret."""
    real = config.kernel_tiles
    seen: list = []

    def tiles(D, Dv, Nq, Nk, interpret, block=None, *, dtype):
        got = real(D, Dv, Nq, Nk, False, block, dtype=dtype)
        seen.append((dtype, got))
        return got

    monkeypatch.setattr(config, "kernel_tiles", tiles)
    return seen


@pytest.mark.parametrize("shape, maskname, dtype", CASES, ids=lambda x: DTYPE_IDS.get(x, str(x)))
def test_shipped_gpu_tiles_against_reference(gpu_tiles, shape, maskname, dtype):
    B, H, Hkv, Nq, Nk, D = SHAPES[shape]
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, D, dtype=dtype, seed=Nq * 7 + D)
    mask = None if maskname == "none" else masks.causal()
    compare_triton(q, k, v, mask=mask, what=f"{shape}/{maskname}/gpu-tiles")
    want = config.gpu_tiles(config.head_block(D), dtype)
    capped = {n: (min(bm, config.pow2(Nq)), min(bn, config.pow2(Nk))) for n, (bm, bn) in want.items()}
    assert gpu_tiles and all(got == capped for dt, got in gpu_tiles if dt == dtype), gpu_tiles


def test_dkdv_candidates_run_one_stage_only():
    """dK/dV with 2 or 3 pipeline stages gave wrong, run-to-run different dK on an H200
    (docs/triton.md, "The dK/dV race"): no shipped dK/dV candidate may pipeline."""
    dkdv = [(g, d, c) for g in config.AUTOTUNE for d in config.AUTOTUNE[g] for c in config.AUTOTUNE[g][d]["dkdv"]]
    assert dkdv and all(stages == config.DKDV_STAGES == 1 for _, _, (_, stages) in dkdv), dkdv
