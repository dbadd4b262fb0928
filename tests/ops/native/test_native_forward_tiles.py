"""The native forward's tile shortcuts at lengths where they matter: S and P·V run only on
the columns of a kv block that some row of the q block may see (the band's envelope, from a
16-column boundary), bf16 pairs use a longer kv block (256 columns at D = 64 and 128), and
work items run largest first.  Windows, sinks, prefixes, offsets, padding and documents
whose edges fall inside kv blocks, float32 and bf16, against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from tests.ops.conftest import compare_backend, make_qkv

MASKS = {
    "window100": lambda: masks.sliding_window(100),
    "sink_window": lambda: masks.sink_window(4, 100),
    "sinks40_window": lambda: masks.sink_window(40, 37),
    "prefix150": lambda: masks.prefix_lm(150),
    "band": lambda: masks.band(70, 20),
    "causal&padding": lambda: masks.causal() & masks.padding(torch.tensor([530, 700])),
    "document&window": lambda: masks.document(torch.arange(700).view(1, -1) * 5 // 700) & masks.sliding_window(200),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize(("Nq", "Nk"), [(700, 700), (333, 700)], ids=["square", "offset"])
def test_forward_envelope_matches_oracle(native_ext, name, dtype, Nq, Nk):
    q, k, v = make_qkv(2, 2, 1, Nq, Nk, 64, dtype=dtype, seed=Nq + len(name))
    compare_backend(q, k, v, backend="native", mask=MASKS[name](), grad=False, what=f"{name} {dtype} {Nq}x{Nk}")


@pytest.mark.parametrize("name", ["window100", "causal&padding", "document&window"])
def test_forward_envelope_bf16_d128(native_ext, name):
    """D = 128 in bf16: kv blocks of 256 columns (four times ops.blocks' 64), edges inside them."""
    q, k, v = make_qkv(2, 2, 1, 700, 700, 128, dtype=torch.bfloat16, seed=128 + len(name))
    compare_backend(q, k, v, backend="native", mask=MASKS[name](), grad=False, what=f"{name} bf16 D128")
