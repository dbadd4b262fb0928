"""The native forward's tile shortcuts at lengths where they matter: S and P·V run only on
the columns that some row of a 16-row group may see (the band's envelope and the rows'
document runs, from a 16-column boundary), in wide tiles across kv blocks where every row's
columns are intervals, bf16 pairs use a longer kv block (256 columns at D = 64 and 128), and
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
    "document&sinks": lambda: masks.document(torch.arange(700).view(1, -1) * 3 // 700) & masks.sink_window(8, 60),
    "causal": lambda: masks.causal(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize(("Nq", "Nk"), [(700, 700), (333, 700)], ids=["square", "offset"])
@pytest.mark.parametrize("wide", [None, "0", "48"], ids=["wide", "kvblocks", "wide48"])
def test_forward_envelope_matches_oracle(native_ext, monkeypatch, name, dtype, Nq, Nk, wide):
    """``wide``: ATTNLAB_NATIVE_WIDE (forward.h): the default wide tiles, tiles per kv block
    only, or wide tiles of 48 columns (a row's columns in many tiles, across kv blocks)."""
    if wide is not None:
        monkeypatch.setenv("ATTNLAB_NATIVE_WIDE", wide)
    q, k, v = make_qkv(2, 2, 1, Nq, Nk, 64, dtype=dtype, seed=Nq + len(name))
    compare_backend(q, k, v, backend="native", mask=MASKS[name](), grad=False, what=f"{name} {dtype} {Nq}x{Nk}")


@pytest.mark.parametrize("name", ["window100", "causal&padding", "document&window"])
def test_forward_envelope_bf16_d128(native_ext, name):
    """D = 128 in bf16: kv blocks of 256 columns (four times ops.blocks' 64), edges inside them."""
    q, k, v = make_qkv(2, 2, 1, 700, 700, 128, dtype=torch.bfloat16, seed=128 + len(name))
    compare_backend(q, k, v, backend="native", mask=MASKS[name](), grad=False, what=f"{name} bf16 D128")
