"""Tile sizes and autotuning configs of the Triton kernels, and the record of the choice.

Tile sizes are fixed per dtype group and head-dim bucket, not autotuned: the block lists and the
partial-tile tables of a mask are built for one tiling (a BlockMask per tiling), so
tuning them would re-classify the mask per candidate.  ``triton.autotune`` chooses
only among a few ``(num_warps, num_stages)`` pairs per kernel, keyed by the head-dim
blocks and the dtype; what it picked is recorded in :data:`CHOSEN` (the GPU benchmark
prints it).  The starting points follow the Triton fused-attention tutorial's choices
for Hopper (forward 128×64; backward 32×128 for dK/dV and 128×32 for dQ), cut down
where the compile for sm_80 / sm_90 showed spills (:mod:`.resources`: dK/dV 32×64, dQ
64×64 at D = 128, more warps).  float32 has tiles of its own: its dots use
``input_precision="ieee"`` (no tensor cores), which Triton lowers to FMA loops over
per-thread slices of the operands, and those slices grow with the tile until they
spill (the 16-bit tiles spilled kilobytes in float32); a 16-key tile (BN = 16) keeps
the K-tile and P·V operands small enough.  Their speed is **not measured here** (no GPU
on the CI machine): ``attnlab bench triton`` measures them on a GPU.

Under the interpreter (CPU, tests) every kernel uses 32×32 tiles: enough tiles on the
small test shapes to exercise the block lists, few enough programs to keep it quick.
"""

from __future__ import annotations

INTERPRET_TILES = (32, 32)

#: the dtype groups with configurations of their own: "16bit" (bfloat16, float16: their
#: dots run on the tensor cores, MMA layouts) and "float32" (``input_precision="ieee"``:
#: no tensor cores, the dots are lowered to FMA loops whose per-thread operand slices
#: grow with the tile, so float32 needs smaller tiles or more warps)
GROUPS = ("16bit", "float32")

# dtype group -> head-dim bucket (largest head-dim block) -> kernel -> (BM, BN)
GPU_TILES = {
    "16bit": {
        64: {"fwd": (128, 64), "dq": (128, 32), "dkdv": (64, 64)},
        128: {"fwd": (128, 64), "dq": (64, 64), "dkdv": (32, 64)},
        256: {"fwd": (64, 32), "dq": (64, 32), "dkdv": (32, 64)},
    },
    "float32": {
        64: {"fwd": (64, 32), "dq": (64, 32), "dkdv": (32, 16)},
        128: {"fwd": (64, 16), "dq": (64, 16), "dkdv": (16, 16)},
        256: {"fwd": (32, 16), "dq": (32, 16), "dkdv": (16, 16)},
    },
}

# dtype group -> head-dim bucket -> kernel -> candidate (num_warps, num_stages).
# 16-bit: at D = 64, 128 and 256 every candidate compiles spill-free for sm_80 and sm_90
# (``python -m attnlab.ops.triton.resources``, tests/ops/triton/test_resources.py; the
# figures are in docs/triton.md).  A 4-warp forward at D = 128 holds a 128-row float32
# accumulator at 128 registers per thread on top of its operands and spilled, so the D = 128
# forward offers 8 warps only; 4-warp dQ spilled at D = 64 on sm_80, 4-warp dK/dV at D = 256 by
# kilobytes, dQ's (4, 1) at D = 256 by 8 bytes on sm_90.
# **dK/dV runs with num_stages = 1 only** (:data:`DKDV_STAGES`): on an H200 (triton 3.6) every
# dK/dV configuration tried with 2 or 3 stages was at some point wrong and run-to-run different
# in dK at N = 8192 (up to 20% of max|dK|; each program writes its own block, so this is the
# compiler's asynchronous dots racing on shared memory, not the kernel's logic), while all six
# one-stage configurations were exact and bit-identical (docs/triton.md, "The dK/dV race").  The
# choices below were timed there: dK/dV 64x64 (4, 1) at D = 64 and 32x64 (4, 1) at D = 128
# (0.69x and 0.74x the old shipped time), dQ (4, 2) at D = 128 (0.48x).  float32 (no tensor-core
# dots, not timed on the GPU) keeps the same rule.  float32 (its own tiles above):
# one candidate each, spill-free on both archs; 16 keys per tile at D >= 128, and dK/dV at
# D = 256 only with one stage (16x16 at 4, 8 and 16 warps with 2 stages spilled); the
# configurations that spilled are listed in docs/triton.md.
AUTOTUNE = {
    "16bit": {
        64: {"fwd": [(4, 3), (8, 3), (8, 2)], "dq": [(8, 2), (8, 3)], "dkdv": [(4, 1)], "delta": [(4, 1)]},
        128: {"fwd": [(8, 2), (8, 3)], "dq": [(4, 2)], "dkdv": [(4, 1)], "delta": [(4, 1)]},
        256: {"fwd": [(4, 3), (8, 2), (4, 1)], "dq": [(8, 2)], "dkdv": [(8, 1)], "delta": [(4, 1)]},
    },
    "float32": {
        64: {"fwd": [(8, 2)], "dq": [(8, 2)], "dkdv": [(4, 1)], "delta": [(4, 1)]},
        128: {"fwd": [(8, 2)], "dq": [(8, 2)], "dkdv": [(8, 1)], "delta": [(4, 1)]},
        256: {"fwd": [(4, 2)], "dq": [(8, 2)], "dkdv": [(8, 1)], "delta": [(4, 1)]},
    },
}

#: the only num_stages the dK/dV kernel is given (see the note above :data:`AUTOTUNE`)
DKDV_STAGES = 1

#: (kernel, autotune key) -> the config triton.autotune picked, filled as kernels run on a GPU
CHOSEN: dict = {}

MAX_HEAD_DIM = 256


def pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def bucket(bd: int) -> int:
    """The head-dim bucket (a key of :data:`GPU_TILES` / :data:`AUTOTUNE`) of a head-dim block."""
    return 64 if bd <= 64 else 128 if bd <= 128 else 256


def group(dtype) -> str:
    """The dtype group (a key of :data:`GPU_TILES` / :data:`AUTOTUNE`) of a torch dtype or its name."""
    name = str(dtype).removeprefix("torch.")
    if name == "float32":
        return "float32"
    if name in ("bfloat16", "float16"):
        return "16bit"
    raise ValueError(f"dtype: the Triton kernels take float16, bfloat16 or float32, got {name}")


def candidates(kernel: str, bd: int, dtype) -> list:
    """The autotune candidates ``[(num_warps, num_stages), ...]`` of ``kernel`` at head-dim
    block ``bd`` for inputs of ``dtype``."""
    return AUTOTUNE[group(dtype)][bucket(bd)][kernel]


def gpu_tiles(bd: int, dtype) -> dict:
    """``{"fwd"|"dq"|"dkdv": (BM, BN)}``: the shipped tiles at head-dim block ``bd`` for ``dtype``."""
    return dict(GPU_TILES[group(dtype)][bucket(bd)])


def head_block(d: int) -> int:
    """The padded head-dim block: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, pow2(d))


def valid_tiles(block) -> bool:
    """Powers of two in 16..256 (what a BlockMask must have for the kernels to use its tiling)."""
    return all(16 <= int(x) <= 256 and not int(x) & (int(x) - 1) for x in block)


def _check_block(block):
    if len(tuple(block)) != 2 or not valid_tiles(block):
        raise ValueError(f"block: Triton tiles must be two powers of two in 16..256, got {tuple(block)}")
    return int(block[0]), int(block[1])


def kernel_tiles(D: int, Dv: int, Nq: int, Nk: int, interpret: bool, block=None, *, dtype) -> dict:
    """``{"fwd"|"dq"|"dkdv": (BM, BN)}`` for one problem of ``dtype``.  ``block`` sets all three.

    Otherwise tiles never exceed the problem by more than one power of two (a decode step
    with one query gets 16-row tiles, not 128)."""
    if block is not None:  # as given (not capped): a BlockMask built at these tiles must match
        t = _check_block(block)
        return {"fwd": t, "dq": t, "dkdv": t}
    if interpret:
        tiles = {"fwd": INTERPRET_TILES, "dq": INTERPRET_TILES, "dkdv": INTERPRET_TILES}
    else:
        tiles = gpu_tiles(max(head_block(D), head_block(Dv)), dtype)
    cap_m, cap_n = max(16, pow2(Nq)), max(16, pow2(Nk))
    return {name: (min(bm, cap_m), min(bn, cap_n)) for name, (bm, bn) in tiles.items()}
