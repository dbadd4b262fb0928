"""``MultiHeadAttention(context_parallel=...)``: a module run on sequence shards over 2 gloo
ranks equals the same module on the whole sequence (output, input gradient and, summed
over the ranks, the weight gradients), with RoPE at the shards' global positions and GQA."""

from __future__ import annotations

import copy

import pytest
import torch

import attnlab.distributed as D
from attnlab import masks
from tests.distributed._cases import mha_group, mha_setup
from tests.helpers import assert_close_rule

CONFIGS = [("ring", "zigzag"), ("ring", "striped"), ("ulysses", "contiguous"), ("ulysses", "zigzag")]


@pytest.fixture(scope="module")
def group():
    return D.run_local(mha_group, 2, CONFIGS, timeout=120)


def _single(dtype):
    mha, x, gy = mha_setup()
    mha = copy.deepcopy(mha).to(dtype)
    x = x.to(dtype).requires_grad_()
    y = mha(x, mask=masks.causal())
    (y * gy.to(dtype)).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": {n: p.grad for n, p in mha.named_parameters()}}


@pytest.mark.parametrize("method,layout", CONFIGS)
def test_module_context_parallel_equals_single_process(group, method, layout):
    key = f"{method}-{layout}"
    N = 37
    got = {
        "y": D.unshard_sequence([g[key]["y"] for g in group], dim=1, seq_len=N, layout=layout),
        "dx": D.unshard_sequence([g[key]["dx"] for g in group], dim=1, seq_len=N, layout=layout),
        "dw": {n: sum(g[key]["dw"][n] for g in group) for n in group[0][key]["dw"]},
    }
    ref, oracle = _single(torch.float32), _single(torch.float64)
    assert_close_rule(got["y"], ref["y"], oracle["y"], torch.float32, 2.0, f"{key} y")
    assert_close_rule(got["dx"], ref["dx"], oracle["dx"], torch.float32, 3.0, f"{key} dx")
    for n in oracle["dw"]:
        assert_close_rule(got["dw"][n], ref["dw"][n], oracle["dw"][n], torch.float32, 3.0, f"{key} d{n}")


def test_off_by_default_and_refuses_what_it_cannot_do():
    from attnlab.nn import MultiHeadAttention

    mha = MultiHeadAttention(16, 2)
    assert mha.context_parallel is None
    mha.context_parallel = D.ContextParallel(method="ring", layout="zigzag")
    with pytest.raises(ValueError, match="context_parallel"):
        mha(torch.randn(1, 4, 16), need_weights=True)
    with pytest.raises(ValueError, match="method"):
        D.ContextParallel(method="tree")
    with pytest.raises(ValueError, match="layout"):
        D.ContextParallel(layout="spiral")
    with pytest.raises(ValueError, match="no module"):
        D.enable_context_parallel(torch.nn.Linear(2, 2), None)
