"""Tests of the Triton kernels, run on the CPU under the Triton interpreter.

``TRITON_INTERPRET=1`` is set here, at collection, before anything imports attnlab's
kernel modules: ``triton.jit`` decides when a kernel is *defined* whether it compiles
for the GPU or interprets on the CPU, and the kernels are defined on their first use
(``attnlab.ops.triton`` itself does not import triton).  The variable stays set for the
session (triton also reads it while interpreting).  Every test module carries
``pytestmark = TRITON``: without the ``triton`` package the tests are skipped.

The interpreter runs each program in Python, so shapes stay small (lengths up to 97,
a few heads) and most tests run fewer dtypes than tests/ops.  Default tiles are 32×32;
``tiles16`` switches every kernel to 16×16 (more tiles, more partial ones).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before attnlab.ops.triton's kernels are first imported

import pytest
import torch

from attnlab.ops.triton import available
from tests.ops.conftest import compare_backend

TRITON = pytest.mark.skipif(not available(), reason="triton is not installed (pip install 'attnlab[triton]')")


@pytest.fixture
def tiles16(monkeypatch):
    from attnlab.ops.triton import config

    monkeypatch.setattr(config, "INTERPRET_TILES", (16, 16))
    return (16, 16)


def compare_triton(q, k, v, *, block=None, mask=None, q_offset=None, kv_offset=0, **kw):
    """``compare_backend`` for ``backend="triton"``; with ``block`` the mask goes in as a
    BlockMask built at those tiles, which the kernels then use as their tiling."""
    if block is not None and mask is not None:
        B, H, Nq, _ = q.shape
        Nk = k.shape[2]
        mask = mask.block_mask(B, H, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, block=block)
    return compare_backend(q, k, v, backend="triton", mask=mask, q_offset=q_offset, kv_offset=kv_offset, **kw)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
