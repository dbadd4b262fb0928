"""torch.func on the Triton backend (interpreter, CPU): ``vmap``, ``grad`` and
``vmap(grad)`` equal the per-slice eager results, gradients reach learnable ALiBi slopes,
and a second derivative is refused naming ``backend='reference'``.

Under ``torch.func.grad`` the backward runs inside the transform on functorch wrappers;
the kernels read plain tensors only, so the backward goes through the
``attnlab::triton_bwd`` operator (:mod:`attnlab.ops.triton.autograd`)."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, vmap

import attnlab
from attnlab import masks, scores
from tests.helpers import FLOOR
from tests.ops.triton.conftest import F32, TRITON

pytestmark = TRITON

# the same kernel on the same slice: only the launch differs, so a few float32 ulps at most
SAME_KERNEL = dict(atol=FLOOR[F32], rtol=0)
MASKS = {"none": lambda: None, "causal": masks.causal, "window": lambda: masks.sliding_window(5)}


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 2, 9, 16, generator=g)  # a leading vmap dim of 2
    k = torch.randn(2, 1, 1, 12, 16, generator=g)
    v = torch.randn(2, 1, 1, 12, 16, generator=g)
    return q, k, v


def _loss(mask):
    def loss(q, k, v):
        return (attnlab.attention(q, k, v, mask=MASKS[mask](), backend="triton") ** 2).sum()

    return loss


def _eager_grads(loss, q, k, v):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(loss(*leaves), leaves)


@pytest.mark.parametrize("mask", list(MASKS))
def test_vmap_equals_the_loop_on_triton(qkv, mask):
    q, k, v = qkv

    def f(q, k, v):
        return attnlab.attention(q, k, v, mask=MASKS[mask](), backend="triton")

    want = torch.stack([f(q[i], k[i], v[i]) for i in range(2)])
    torch.testing.assert_close(vmap(f)(q, k, v), want, **SAME_KERNEL)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_grad_and_vmap_of_grad_equal_eager_autograd_on_triton(qkv, mask):
    q, k, v = qkv
    loss = _loss(mask)
    want = [_eager_grads(loss, q[i], k[i], v[i]) for i in range(2)]
    got = grad(loss, argnums=(0, 1, 2))(q[0], k[0], v[0])
    for a, b in zip(got, want[0], strict=True):
        torch.testing.assert_close(a, b, **SAME_KERNEL)
    vg = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for j in range(3):
        torch.testing.assert_close(vg[j], torch.stack([w[j] for w in want]), **SAME_KERNEL)


def test_torch_func_grad_reaches_learnable_alibi_slopes_on_triton(qkv):
    q, k, v = (t[0] for t in qkv)
    slopes = torch.tensor([0.5, 0.25])

    def loss(s):
        return attnlab.attention(q, k, v, mask=masks.causal(), score_mod=scores.alibi(s), backend="triton").sum()

    s = slopes.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(s), s)
    assert want.abs().sum() > 0
    torch.testing.assert_close(grad(loss)(slopes), want, **SAME_KERNEL)


def test_grad_of_grad_on_triton_is_refused_naming_the_reference_backend(qkv):
    q, k, v = (t[0] for t in qkv)

    def inner(q):
        return attnlab.attention(q, k, v, mask=masks.causal(), backend="triton").sum()

    with pytest.raises(RuntimeError, match="backend='reference'") as e:
        grad(lambda q: (grad(inner)(q) ** 2).sum())(q)
    assert type(e.value).__name__ == "DoubleBackwardError"
