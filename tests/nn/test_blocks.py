"""Norms, MLPs and Block (pre-norm, post-norm, attention-only) against hand-written formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab import masks
from attnlab.nn import MLP, Block, DecoderConfig, RMSNorm, SwiGLU
from attnlab.nn.norms import make_norm
from tests.helpers import F32_FORMULA, F32_REORDER, F64_FORMULA, F64_REORDER


def randx(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64 stays float64 (design.md)
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rmsnorm_equals_the_formula(dtype, eps):
    norm = RMSNorm(12, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-2, 3, 12))
    x = randx(3, 5, 12, dtype=dtype) * 4
    xd = x.double()
    want = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + eps) * norm.weight.double()
    got = norm(x)
    assert got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_rmsnorm_bfloat16_computes_in_float32():
    norm = RMSNorm(64)
    x = (randx(2, 64) * 100).to(torch.bfloat16)  # mean(x²) ~ 1e4: fine in float32
    got = norm.to(torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    xd = x.double()
    want = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + 1e-6)
    assert (got.double() - want).abs().max() <= 2 * 2**-8 * want.abs().max()


def test_rmsnorm_is_scale_invariant_and_unit_rms():
    norm = RMSNorm(16, eps=1e-12)
    x = randx(4, 16)
    y = norm(x)
    torch.testing.assert_close(norm(7.5 * x), y)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4))


def test_rmsnorm_keeps_dtype_and_grads_flow_to_weight():
    norm = RMSNorm(6)
    x = randx(2, 6).requires_grad_(True)
    norm(x).sum().backward()
    assert norm.weight.grad is not None and x.grad is not None
    # d/dw of sum(w * n(x)) is sum over rows of n(x)
    xd = x.detach().double()
    torch.testing.assert_close(
        norm.weight.grad.double(), (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0), **F32_REORDER
    )


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True])
def test_rmsnorm_bad_eps(bad):
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(8, eps=bad)


def test_rmsnorm_bad_width():
    with pytest.raises(ValueError, match="d_model"):
        RMSNorm(0)


# ----------------------------------------------------------------------------- make_norm
def test_make_norm_options():
    ln = make_norm("layernorm", 10, 1e-5, True)
    assert isinstance(ln, nn.LayerNorm) and ln.bias is not None and ln.eps == 1e-5
    ln_nb = make_norm("layernorm", 10, 1e-3, False)
    assert isinstance(ln_nb, nn.LayerNorm) and ln_nb.bias is None and ln_nb.eps == 1e-3
    rms = make_norm("rmsnorm", 10, 1e-4)
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-4 and rms.weight.shape == (10,)
    # layernorm computes the LayerNorm formula
    x = randx(3, 10, dtype=torch.float64)
    ln = ln.double()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(ln(x), (x - mu) / torch.sqrt(var + 1e-5) * ln.weight + ln.bias)


def test_make_norm_rejects_unknown_kind():
    with pytest.raises(ValueError, match=r"norm: expected one of \('layernorm', 'rmsnorm'\), got 'batchnorm'"):
        make_norm("batchnorm", 8, 1e-5)


# ----------------------------------------------------------------------------- MLPs
def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


HAND_ACTS = {
    "gelu": gelu_erf,
    "gelu_tanh": gelu_tanh,
    "relu": lambda x: x.clamp(min=0),
    "silu": lambda x: x / (1 + torch.exp(-x)),
}


@pytest.mark.parametrize("act", sorted(HAND_ACTS))
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_equals_hand_computation(act, bias):
    torch.manual_seed(0)
    mlp = MLP(8, 24, act=act, bias=bias).double()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    x = randx(2, 3, 8, dtype=torch.float64)
    W_in, W_out = mlp.fc_in.weight.T, mlp.fc_out.weight.T  # (8, 24), (24, 8)
    h = x @ W_in + (mlp.fc_in.bias if bias else 0)
    want = HAND_ACTS[act](h) @ W_out + (mlp.fc_out.bias if bias else 0)
    torch.testing.assert_close(mlp(x), want, **F64_FORMULA)
    assert (mlp.fc_in.bias is None) == (not bias)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_equals_hand_computation(bias):
    torch.manual_seed(0)
    d, dm = 8, 12
    sw = SwiGLU(d, dm, bias=bias).double()
    W_g = torch.randn(d, dm, dtype=torch.float64)
    W_u = torch.randn(d, dm, dtype=torch.float64)
    W_d = torch.randn(dm, d, dtype=torch.float64)
    with torch.no_grad():
        sw.gate_up.weight.copy_(torch.cat([W_g.T, W_u.T], 0))  # gate rows first, then up
        sw.down.weight.copy_(W_d.T)
        if bias:
            sw.gate_up.bias.zero_()
            sw.down.bias.zero_()
    x = randx(2, 5, d, dtype=torch.float64)
    g = x @ W_g
    want = (g / (1 + torch.exp(-g)) * (x @ W_u)) @ W_d
    torch.testing.assert_close(sw(x), want, **F64_FORMULA)
    # gate and up are not interchangeable: swapping them changes the result
    with torch.no_grad():
        sw.gate_up.weight.copy_(torch.cat([W_u.T, W_g.T], 0))
    assert (sw(x) - want).abs().max() > 1e-3
    assert sum(p.numel() for p in sw.parameters()) == 3 * d * dm + (2 * dm + d if bias else 0)


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: MLP(8, 16, act="tanh"), "act"),
        (lambda: MLP(0, 16), "d_model"),
        (lambda: MLP(8, 0), "d_mlp"),
        (lambda: SwiGLU(8, 0), "d_mlp"),
        (lambda: SwiGLU(8, 16, act="swish"), "act"),
    ],
)
def test_mlp_errors(build, words):
    with pytest.raises(ValueError) as e:
        build()
    assert words in str(e.value)


# ----------------------------------------------------------------------------- Block
def cfg(**kw):
    base = dict(vocab_size=11, d_model=16, n_layers=1, n_heads=4, d_mlp=32)
    base.update(kw)
    return DecoderConfig(**base)


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(
                torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.3
                + (1.0 if p.dim() == 1 and p.shape[0] == 16 else 0.0)
            )
    return module


def _hand_mlp(block, x):
    m = block.mlp
    if isinstance(m, SwiGLU):
        g, u = F.linear(x, m.gate_up.weight, m.gate_up.bias).split(m.d_mlp, -1)
        return F.linear(F.silu(g) * u, m.down.weight, m.down.bias)
    return F.linear(gelu_erf(F.linear(x, m.fc_in.weight, m.fc_in.bias)), m.fc_out.weight, m.fc_out.bias)


def _hand_norm(norm, x):
    if isinstance(norm, RMSNorm):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    out = (x - mu) / torch.sqrt(var + norm.eps) * norm.weight
    return out + norm.bias if norm.bias is not None else out


# float64 for LayerNorm; RMSNorm computes in float32 (see RMS_F64_BUG), so the llama case is float32
@pytest.mark.parametrize(
    "kw, dtype, tol",
    [
        (dict(), torch.float64, F64_REORDER),
        (dict(norm="rmsnorm", mlp="swiglu", act="silu", bias=False), torch.float32, F32_FORMULA),
    ],
    ids=["gpt2", "llama"],
)
def test_pre_norm_block_formula(kw, dtype, tol):
    block = _randomize(Block(cfg(**kw))).to(dtype).eval()
    assert not block.post
    x = randx(2, 5, 16, dtype=dtype)
    mask = masks.causal()
    h = x + block.attn(_hand_norm(block.norm1, x), mask=mask)
    want = h + _hand_mlp(block, _hand_norm(block.norm2, h))
    got, w = block(x, mask=mask)
    assert w is None
    torch.testing.assert_close(got, want, **tol)


def test_post_norm_block_formula():
    block = _randomize(Block(cfg(norm_position="post"))).double().eval()
    assert block.post
    x = randx(2, 5, 16, dtype=torch.float64)
    h = _hand_norm(block.norm1, x + block.attn(x))
    want = _hand_norm(block.norm2, h + _hand_mlp(block, h))
    torch.testing.assert_close(block(x)[0], want, **F64_REORDER)
    # and it is not the pre-norm formula
    pre = x + block.attn(_hand_norm(block.norm1, x))
    pre = pre + _hand_mlp(block, _hand_norm(block.norm2, pre))
    assert (block(x)[0] - pre).abs().max() > 1e-3


def test_attn_only_block_has_no_norms_or_mlp():
    block = _randomize(Block(cfg(), attn_only=True)).double().eval()
    assert block.norm1 is None and block.norm2 is None and block.mlp is None
    names = {n for n, _ in block.named_parameters()}
    assert all(n.startswith("attn.") for n in names), names
    x = randx(2, 5, 16, dtype=torch.float64)
    got, w = block(x, mask=masks.causal(), need_weights=True)
    a, wa = block.attn(x, mask=masks.causal(), need_weights=True)
    torch.testing.assert_close(got, x + a, **F64_FORMULA)
    torch.testing.assert_close(w, wa)
    assert w.shape == (2, 4, 5, 5)


def test_block_need_weights_matches_attention_pattern_of_normed_input():
    block = _randomize(Block(cfg())).double().eval()
    x = randx(1, 4, 16, dtype=torch.float64)
    _, w = block(x, mask=masks.causal(), need_weights=True)
    _, want = block.attn(_hand_norm(block.norm1, x), mask=masks.causal(), need_weights=True)
    torch.testing.assert_close(w, want)


def test_block_residual_dropout_only_in_training():
    block = Block(cfg(dropout=0.5)).eval()
    x = randx(1, 6, 16)
    a, b = block(x)[0], block(x)[0]
    assert torch.equal(a, b)
    block.train()
    torch.manual_seed(0)
    c = block(x)[0]
    assert (c - a).abs().max() > 1e-3


def test_block_wires_config_into_attention():
    block = Block(cfg(n_heads=4, n_kv_heads=2, d_head=8, bias=False, attn_dropout=0.25, backend="flash"))
    a = block.attn
    assert (a.n_heads, a.n_kv_heads, a.d_head, a.dropout, a.backend) == (4, 2, 8, 0.25, "flash")
    assert a.qkv_bias is None and a.out_bias is None
    assert block.mlp.fc_in.bias is None and block.norm1.bias is None
