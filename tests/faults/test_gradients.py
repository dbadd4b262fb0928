"""Fault injection into gradients: score mods that capture what they learn, ignore or overwrite their input.

Contracts (docs/reliability/numerics.md, attnlab.ops.modparams):

* a score mod that reads a tensor requiring grad — declared with ``scores.custom(fn,
  params=...)``/``parameters()``, or captured: a closure cell, a bound method's ``self``,
  an ``nn.Module`` attribute, a ``functools.partial`` argument, a module global, a
  non-leaf computed outside the mod — gets that gradient on every backend that runs
  the mod, as the reference gives it.  One that cannot be routed is refused at call
  time with a ``ValueError`` that says to pass ``params=``.  (``sdpa`` takes no score
  mod and ``triton`` runs only the built-in ones; both refuse the others with a
  ValueError, tests/ops.)
* a mod that ignores its input score, or writes into it in place, backpropagates.

``flash`` and ``auto`` (which picks flash for score mods on the CPU) are compared with
the float32 and float64 reference under the DESIGN.md rule (tests/helpers.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

import attnlab
from attnlab import masks, scores
from tests.helpers import assert_close_rule, check_param_grad

BACKENDS = ["flash", "auto"]
F32, F64 = torch.float32, torch.float64
B, H, HKV, N, D = 1, 2, 1, 24, 8


def _dist(qp, kp, s):
    return (kp - qp).to(s.dtype)


# ---- the ways a mod can hold its learnable tensor w (a 0-d slope): factory(w) -> mod
class _Holder:
    def __init__(self, w):
        self.w = w

    def mod(self, s, b, h, qp, kp):
        return s + self.w * _dist(qp, kp, s)


class _ModuleWithTensor(torch.nn.Module):
    """An nn.Module whose learnable tensor is a plain attribute (not a Parameter)."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, s, b, h, qp, kp):
        return s + self.w * _dist(qp, kp, s)


def _partial_fn(s, b, h, qp, kp, *, slope):
    return s + slope * _dist(qp, kp, s)


_GLOBAL_W = None


def _global_mod(s, b, h, qp, kp):
    return s + _GLOBAL_W * _dist(qp, kp, s)


def _set_global(w):
    global _GLOBAL_W
    _GLOBAL_W = w
    return _global_mod


def _nonleaf(w):
    w2 = w * 2.0  # computed outside the mod: the closure holds a non-leaf
    return lambda s, b, h, qp, kp: s + w2 * _dist(qp, kp, s)


KINDS = {
    "closure": lambda w: lambda s, b, h, qp, kp: s + w * _dist(qp, kp, s),
    "custom-without-params": lambda w: scores.custom(lambda s, b, h, qp, kp: s + w * _dist(qp, kp, s)),
    "bound-method": lambda w: _Holder(w).mod,
    "module-attribute": lambda w: _ModuleWithTensor(w),
    "partial": lambda w: functools.partial(_partial_fn, slope=w),
    "global": _set_global,
    "non-leaf-closure": _nonleaf,
    "ignores-input": lambda w: lambda s, b, h, qp, kp: torch.zeros_like(s) + w * _dist(qp, kp, s),
    "in-place": lambda w: lambda s, b, h, qp, kp: s.add_(w * _dist(qp, kp, s)),
}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=F64)
    k = torch.randn(B, HKV, N, D, generator=g, dtype=F64)
    v = torch.randn(B, HKV, N, D, generator=g, dtype=F64)
    w_out = torch.randn(B, H, N, D, generator=g, dtype=F64)
    return q, k, v, w_out


def _grads(backend, factory, dtype, seed=0, with_param=True):
    """dq, dk, dv (and dw) of ``(out·W).sum()`` by torch.autograd.grad."""
    q, k, v, w_out = _inputs(seed)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    w = torch.tensor(0.3, dtype=dtype, requires_grad=True)
    out = attnlab.attention(q, k, v, mask=masks.causal(), score_mod=factory(w), backend=backend)
    ins = [q, k, v] + ([w] if with_param else [])
    gs = torch.autograd.grad((out.double() * w_out).sum(), ins, allow_unused=True)
    names = ["dq", "dk", "dv", "dw"]
    return {n: (torch.zeros_like(x) if g is None else g) for n, x, g in zip(names, ins, gs, strict=False)}


def _check(backend, factory, with_param=True, what=""):
    fast = _grads(backend, factory, F32, with_param=with_param)
    ref = _grads("reference", factory, F32, with_param=with_param)
    oracle = _grads("reference", factory, F64, with_param=with_param)
    for key in ("dq", "dk", "dv"):
        assert_close_rule(fast[key], ref[key], oracle[key], F32, factor=3.0, what=f"{what} {key}")
    if with_param:
        assert fast["dw"].abs().item() > 0, f"{what}: the captured tensor got no gradient"
        check_param_grad(fast["dw"], ref["dw"], oracle["dw"], F32, what=f"{what} dw")
    return fast


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_the_score_mod_captures_gets_its_gradient(backend, kind):
    _check(backend, KINDS[kind], what=f"{backend}/{kind}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_that_cannot_be_routed_is_refused_at_call_time(backend):
    """A non-leaf hidden deeper than the discovery walks: refused before any result, with
    the fix in the message; passing it as params= then works and matches the reference."""

    class Box:
        pass

    def factory(w, declare=False):
        box = Box()
        box.deep = [[{"x": [w * 2.0]}]]
        fn = lambda s, b, h, qp, kp: s + box.deep[0][0]["x"][0] * _dist(qp, kp, s)  # noqa: E731
        return scores.custom(fn, params=[box.deep[0][0]["x"][0]]) if declare else fn

    q, k, v, _ = _inputs()
    q = q.float().requires_grad_(True)
    w = torch.tensor(0.3, requires_grad=True)
    with pytest.raises(ValueError, match=r"params="):
        attnlab.attention(q, k.float(), v.float(), mask=masks.causal(), score_mod=factory(w), backend=backend)
    _check(backend, functools.partial(factory, declare=True), what=f"{backend}/declared")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mod_that_ignores_its_input_score_backpropagates(backend):
    """The issue's mod: ``zeros_like(s) - |q_pos - kv_pos|``; the output does not depend on
    q or k (their gradients are 0), dv is the reference's."""
    factory = lambda w: lambda s, b, h, qp, kp: torch.zeros_like(s) - (qp - kp).abs().to(s.dtype)  # noqa: E731
    fast = _check(backend, factory, with_param=False, what=f"{backend}/ignores-input")
    assert (fast["dq"] == 0).all() and (fast["dk"] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mod_that_writes_into_its_input_backpropagates(backend):
    """``s.mul_(0.5)`` then ``add_``: the flash backward hands such a mod a copy of its input."""
    factory = lambda w: lambda s, b, h, qp, kp: s.mul_(0.5).add_(w * _dist(qp, kp, s))  # noqa: E731
    _check(backend, factory, what=f"{backend}/in-place")
