"""FLOPs of the ``attnlab::flash_*`` operators under torch's FlopCounterMode.

The formulas are torch's SDPA ones scaled by the share of score elements in the tiles the
kernel visits (:func:`attnlab.ops.flops.visited_fraction`).  Checked against torch's count
for SDPA (its math backend: the fused CPU kernel is counted as 0 by torch itself), against
the eager flash kernel's own matmuls (FlopCounterMode counts its ``bmm`` calls), and against
the visited area computed here from the dense mask."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import attnlab
from attnlab import masks
from attnlab.ops.flash import flash_attention
from tests.helpers import mask_dense, tile_truth

B, H, N, D, DV = 2, 2, 40, 16, 8


def _flops(fn):
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops(), {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(4)
    return (
        torch.randn(B, H, N, D, generator=g, requires_grad=True),
        torch.randn(B, H, N, D, generator=g, requires_grad=True),
        torch.randn(B, H, N, DV, generator=g, requires_grad=True),
    )


def test_flash_forward_flops_equal_torch_sdpa_count_on_a_full_mask(qkv):
    q, k, v = qkv
    with sdpa_kernel(SDPBackend.MATH):
        want, _ = _flops(lambda: F.scaled_dot_product_attention(q, k, v))
    got, per_op = _flops(lambda: attnlab.attention(q, k, v, backend="flash"))
    assert want == 2 * B * H * N * N * (D + DV)
    assert got == want and set(per_op) == {"attnlab.flash_fwd"}


def test_flash_forward_and_backward_flops_equal_the_eager_kernels_matmuls_on_a_full_mask(qkv):
    q, k, v = qkv
    got, per_op = _flops(lambda: attnlab.attention(q, k, v, backend="flash").sum().backward())
    want, _ = _flops(lambda: flash_attention(q, k, v, scale=D**-0.5, q_offset=0)[0].sum().backward())
    assert set(per_op) == {"attnlab.flash_fwd", "attnlab.flash_bwd"}
    # the backward recomputes the scores: 5 matmuls to the forward's 2 (torch's SDPA backward formula)
    assert per_op["attnlab.flash_bwd"] == 2 * B * H * N * N * (3 * D + 2 * DV)
    assert got == want


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_masked_flash_flops_count_only_the_visited_tiles(qkv, mask):
    q, k, v = qkv
    m = masks.causal() if mask == "causal" else masks.sliding_window(7)
    bm = m.block_mask(B, H, N, N, block=(16, 8))
    any_t, _ = tile_truth(mask_dense(m, B, H, N, N, 0, 0), 16, 8)
    visited = any_t.flatten(0, 1).any(0)
    area = sum(min(16, N - 16 * i) * min(8, N - 8 * j) for i, j in visited.nonzero().tolist())
    dense = 2 * B * H * N * N * (D + DV)
    fwd, _ = _flops(lambda: attnlab.attention(q, k, v, mask=bm, backend="flash"))
    assert fwd == round(dense * area / (N * N)) < dense
    both, per_op = _flops(lambda: attnlab.attention(q, k, v, mask=bm, backend="flash").sum().backward())
    eager, _ = _flops(lambda: flash_attention(q, k, v, mask=bm, scale=D**-0.5, q_offset=0)[0].sum().backward())
    assert both == eager and per_op["attnlab.flash_fwd"] == fwd


def test_formulas_are_registered_by_the_import_hook_when_flop_counter_is_imported_after_attnlab():
    """attnlab does not import torch.utils.flop_counter (it imports triton: seconds); a one-shot
    import hook registers the formulas when it is imported.  Run here on a fresh copy of the module."""
    import importlib.util

    import torch.utils

    from attnlab.ops import flops

    spec = flops._OnFlopCounterImport().find_spec("torch.utils.flop_counter", torch.utils.__path__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    q = torch.randn(1, 2, 8, 4)
    with fresh.FlopCounterMode(display=False) as fc:
        attnlab.attention(q, q, q, backend="flash")
    assert fc.get_total_flops() == 2 * 1 * 2 * 8 * 8 * (4 + 4)
