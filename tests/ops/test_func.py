"""torch.func on every backend (vmap, grad, vmap of grad) and double backward.

``flash`` runs through the ``attnlab::flash_*`` custom ops (vmap rules, an autograd.Function
with ``setup_context``); its backward is not differentiable, so a second derivative is refused
with an error naming ``backend='reference'``, which is differentiable any number of times.
"""

import pytest
import torch
from torch.func import grad, vmap

import attnlab
from attnlab import masks, scores

F64 = torch.float64
TOL = dict(atol=1e-12, rtol=0)  # float64, the same kernel per slice: summation order only

BACKENDS = ["reference", "flash", "sdpa"]
MASKS = {
    "none": lambda: None,
    "causal": masks.causal,
    "window": lambda: masks.sliding_window(3),
    "custom": lambda: masks.custom(lambda b, h, q, kv: (q - kv) % 2 == 0),
}
SDPA_MASKS = ("none", "causal")


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 1, 2, 5, 4, dtype=F64, generator=g)  # a leading vmap dim of 3
    k = torch.randn(3, 1, 1, 6, 4, dtype=F64, generator=g)
    v = torch.randn(3, 1, 1, 6, 3, dtype=F64, generator=g)
    return q, k, v


def _cases():
    for be in BACKENDS:
        for name in MASKS:
            if be == "sdpa" and name not in SDPA_MASKS:
                continue
            yield be, name


@pytest.mark.parametrize("backend,mask", list(_cases()))
def test_vmap_grad_and_vmap_of_grad_match_the_loop(qkv, backend, mask):
    q, k, v = qkv
    m = MASKS[mask]()

    def f(q, k, v):
        return attnlab.attention(q, k, v, mask=m, backend=backend)

    def loss(q, k, v):
        return (f(q, k, v) ** 2).sum()

    torch.testing.assert_close(vmap(f)(q, k, v), torch.stack([f(q[i], k[i], v[i]) for i in range(3)]), **TOL)
    want = []
    for i in range(3):
        leaves = [t[i].clone().requires_grad_() for t in (q, k, v)]
        want.append(torch.autograd.grad(loss(*leaves), leaves))
    got = grad(loss, argnums=(0, 1, 2))(q[0], k[0], v[0])
    for a, b in zip(got, want[0], strict=True):
        torch.testing.assert_close(a, b, **TOL)
    vg = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for j in range(3):
        torch.testing.assert_close(vg[j], torch.stack([w[j] for w in want]), **TOL)


def test_grad_reaches_learnable_score_mod_tensors_under_torch_func(qkv):
    q, k, v = qkv
    slopes = torch.tensor([0.5, 0.25], dtype=F64)

    def loss(s, backend):
        return attnlab.attention(
            q[0], k[0], v[0], mask=masks.causal(), score_mod=scores.alibi(s), backend=backend
        ).sum()

    torch.testing.assert_close(grad(loss)(slopes, "flash"), grad(loss)(slopes, "reference"), **TOL)


def test_gradgradcheck_passes_on_reference():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=F64, generator=g, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: attnlab.attention(q, k, v, mask=masks.causal(), backend="reference"), (q, k, v)
    )


@pytest.mark.parametrize("mask", ["causal", "custom"])
def test_double_backward_on_flash_is_refused_naming_the_reference_backend(mask):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=F64, generator=g, requires_grad=True) for _ in range(3))
    out = attnlab.attention(q, k, v, mask=MASKS[mask](), backend="flash")
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)  # first order is fine
    with pytest.raises(RuntimeError, match="backend='reference'") as e:
        torch.autograd.grad(gq.sum(), (q, k, v))
    assert type(e.value).__name__ == "DoubleBackwardError"  # attnlab.ops.flash.DoubleBackwardError
    with pytest.raises(RuntimeError, match="backend='reference'"):
        torch.autograd.gradgradcheck(
            lambda q, k, v: attnlab.attention(q, k, v, mask=MASKS[mask](), backend="flash"), (q, k, v)
        )

    def inner(q):
        return attnlab.attention(q, k.detach(), v.detach(), mask=MASKS[mask](), backend="flash").sum()

    with pytest.raises(RuntimeError, match="backend='reference'"):
        grad(lambda q: grad(inner)(q).sum())(q.detach())  # torch.func grad of grad
