"""Second derivatives, per backend: ``reference`` is differentiable twice (float64
``gradgradcheck`` passes, with masks, score mods and dropout); every backend that cannot
(``flash``, ``sdpa`` where torch picks a fused kernel, ``auto`` routed there, varlen on
flash; triton: tests/ops/triton/test_triton_func.py) raises
:class:`attnlab.ops.flash.DoubleBackwardError` naming ``backend='reference'`` — never a
silent wrong second derivative or a None gradient."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad

import attnlab
from attnlab import masks, scores
from attnlab.ops.flash import DoubleBackwardError

F64 = torch.float64


def _qkv(seed=0, shape=(1, 2, 5, 4)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, dtype=F64, generator=g, requires_grad=True) for _ in range(3)]


REF_CASES = {
    "causal": dict(mask=masks.causal()),
    "window_alibi": dict(mask=masks.sliding_window(3), score_mod=scores.alibi(torch.tensor([0.5, 0.25], dtype=F64))),
    "softcap": dict(score_mod=scores.softcap(2.0)),
    "dropout": dict(mask=masks.causal(), dropout_p=0.3, dropout_seed=4),
}


@pytest.mark.parametrize("case", list(REF_CASES))
def test_reference_backend_passes_gradgradcheck(case):
    q, k, v = _qkv()
    kw = REF_CASES[case]
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: attnlab.attention(q, k, v, backend="reference", **kw), (q, k, v)
    )


# (backend, kwargs): each picks a kernel whose backward is not differentiable
REFUSED = {
    "flash": dict(backend="flash", mask=masks.causal()),
    "flash-custom-mask": dict(backend="flash", mask=masks.custom(lambda b, h, q, kv: kv <= q)),
    "flash-dropout": dict(backend="flash", dropout_p=0.2, dropout_seed=1),
    "sdpa": dict(backend="sdpa"),
    "sdpa-causal": dict(backend="sdpa", mask=masks.causal()),
    "auto": dict(backend="auto", mask=masks.causal()),  # routed to torch's fused SDPA here
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_second_derivative_is_refused_naming_the_reference_backend(case):
    q, k, v = _qkv(1)
    kw = REFUSED[case]
    out = attnlab.attention(q, k, v, **kw)
    (gq,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)  # first order works
    (want,) = torch.autograd.grad((attnlab.attention(q, k, v, **{**kw, "backend": "reference"}) ** 2).sum(), q)
    torch.testing.assert_close(gq, want, atol=1e-10, rtol=0)
    with pytest.raises(DoubleBackwardError, match="backend='reference'"):
        torch.autograd.grad(gq.sum(), (q, k, v))
    with pytest.raises(DoubleBackwardError, match="backend='reference'"):
        torch.autograd.gradgradcheck(lambda q, k, v: attnlab.attention(q, k, v, **kw), (q, k, v))


def test_first_order_gradients_are_unchanged_by_the_refusal_marks():
    q, k, v = _qkv(2)
    for be in ("sdpa", "flash"):
        got = torch.autograd.grad(attnlab.attention(q, k, v, backend=be).sum(), (q, k, v))
        want = torch.autograd.grad(attnlab.attention(q, k, v, backend="reference").sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_torch_func_grad_of_grad_is_refused(backend):
    q, k, v = (t.detach() for t in _qkv(3))

    def inner(q):
        return attnlab.attention(q, k, v, backend=backend).sum()

    with pytest.raises(RuntimeError, match="backend='reference'"):
        grad(lambda q: (grad(inner)(q) ** 2).sum())(q)
    ref = grad(lambda q: (grad(lambda q: attnlab.attention(q, k, v, backend="reference").sum())(q) ** 2).sum())(q)
    assert torch.isfinite(ref).all() and ref.abs().sum() > 0


def _cu(lens):
    return torch.tensor([0, *lens]).cumsum(0)


def test_varlen_second_derivative_refused_on_flash_and_gradgradcheck_on_reference():
    lens = [3, 4]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(7, 2, 4, dtype=F64, generator=g, requires_grad=True) for _ in range(3))

    def f(backend):
        return lambda q, k, v: attnlab.varlen_attention(q, k, v, _cu(lens), _cu(lens), causal=True, backend=backend)

    (gq,) = torch.autograd.grad(f("flash")(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(DoubleBackwardError, match="backend='reference'"):
        torch.autograd.grad((gq**2).sum(), q)
    assert torch.autograd.gradgradcheck(f("reference"), (q, k, v))
