"""Shared helpers for the tests under tests/ops (accuracy, parity, merge, flash internals).

The central helper is :func:`run_case`: it runs one attention problem through one
backend and returns the output, the LSE and the gradients of

    loss = (out * w).sum() + (lse_finite * c).sum()

with respect to q, k, v and the score mod's learnable parameter, so every test can
compare a fast path with the float64 oracle (``backend="reference"`` on ``.double()``
inputs) under the DESIGN.md tolerance rule (:func:`check_rule`).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.ops import flash_attention
from tests.helpers import FLOOR, PARAM_GRAD_SLACK_EPS, assert_close_rule, check_param_grad, check_rule, max_err  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every module here on one torch thread: the root conftest's fixture (two torch threads
    per xdist worker oversubscribe 2 cores and these small problems run ~3x slower)."""


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DTYPE_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype=torch.float64, g=None, scale=1.0) -> torch.Tensor:
    """Normal samples drawn in float64 and then rounded, so every dtype sees 'the same' data."""
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def make_qkv(B, H, Hkv, Nq, Nk, D, Dv=None, dtype=torch.float32, seed=0, qk_scale=1.0):
    g = gen(seed)
    Dv = D if Dv is None else Dv
    q = randn((B, H, Nq, D), dtype, g, qk_scale)
    k = randn((B, Hkv, Nk, D), dtype, g, qk_scale)
    v = randn((B, Hkv, Nk, Dv), dtype, g)
    return q, k, v


def loss_weights(B, H, Nq, Dv, seed=1):
    g = gen(seed)
    return randn((B, H, Nq, Dv), torch.float64, g), randn((B, H, Nq), torch.float64, g)


def default_q_offset(Nq, Nk, kv_offset=0):
    return kv_offset + Nk - Nq


def call(q, k, v, *, backend, mask=None, score_mod=None, scale=None, q_offset=None, kv_offset=0, lse=True, block=None):
    """Run one backend; returns ``(out, lse_or_None)``.

    ``backend``: an attnlab backend name, or ``"flash-tiles"`` (``flash_attention`` called
    directly with ``block``), or ``"flash-bm"`` (``attention(backend="flash")`` with a
    BlockMask of tiles ``block`` built from ``mask``).
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if backend == "flash-tiles":
        qo = default_q_offset(Nq, Nk, kv_offset) if q_offset is None else q_offset
        sc = 1.0 / math.sqrt(D) if scale is None else scale
        out, l = flash_attention(
            q, k, v, mask=mask, score_mod=score_mod, scale=sc, q_offset=qo, kv_offset=kv_offset, block=block
        )
        return out, (l if lse else None)
    if backend == "flash-bm":
        assert mask is not None, "flash-bm needs a mask"
        bm = mask.block_mask(B, H, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, block=block)
        res = attnlab.attention(
            q,
            k,
            v,
            mask=bm,
            score_mod=score_mod,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=lse,
            backend="flash",
        )
    else:
        res = attnlab.attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=lse,
            backend=backend,
        )
    return res if lse else (res, None)


def run_case(
    q,
    k,
    v,
    *,
    backend,
    grad=True,
    lse=True,
    mod_factory=None,
    param=None,
    param_dtype=None,
    w=None,
    c=None,
    raw_lse_loss=False,
    **kw,
):
    """Forward (and backward) of one problem; returns a dict of detached tensors.

    ``mod_factory(param) -> score_mod`` builds the score mod around a fresh copy of
    ``param`` (cast to ``param_dtype``) that requires grad, so the parameter's gradient
    is returned as ``"dparam"``.
    """
    q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    p = None
    if mod_factory is not None:
        if param is not None:
            p = param.detach().to(param_dtype or param.dtype).clone().requires_grad_(grad)
        kw["score_mod"] = mod_factory(p)
    out, l = call(q, k, v, backend=backend, lse=lse, **kw)
    res = {"out": out.detach(), "lse": None if l is None else l.detach()}
    if not grad:
        return res
    B, H, Nq, Dv = out.shape
    if w is None:
        w, c = loss_weights(B, H, Nq, Dv)
    loss = (out.double() * w).sum()
    if l is not None:
        lf = l.double() if raw_lse_loss else torch.where(torch.isinf(l), torch.zeros_like(l), l).double()
        loss = loss + (lf * c).sum()
    inputs = [q, k, v] + ([p] if p is not None else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    for name, x, g_ in zip(["dq", "dk", "dv", "dparam"], inputs, grads, strict=False):
        res[name] = torch.zeros_like(x) if g_ is None else g_
    return res


_CACHE: dict = {}


def _cached(key, fn):
    if key is None:
        return fn()
    if key not in _CACHE:
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = fn()
    return _CACHE[key]


def compare_backend(
    q, k, v, *, backend, grad=True, lse=True, mod_factory=None, param=None, what="", cache_key=None, skip=(), **kw
):
    """Run ``backend`` on (q, k, v), the same-dtype reference and the float64 oracle; apply the rule.

    ``cache_key`` (hashable, must describe the whole problem) lets several backends of one
    problem share the oracle and reference runs.  ``skip`` lists result keys the caller
    checks itself.  ``block`` in ``kw`` only matters to the flash-tiles / flash-bm pseudo backends.
    """
    dtype = q.dtype
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    param_slack_eps = kw.pop("param_slack_eps", PARAM_GRAD_SLACK_EPS)
    kw_ref = {key: val for key, val in kw.items() if key != "block"}
    if "block" in kw and backend not in ("flash-tiles", "flash-bm"):
        kw = kw_ref
    oracle = _cached(
        None if cache_key is None else (cache_key, grad, lse, "oracle"),
        lambda: run_case(
            q.double(),
            k.double(),
            v.double(),
            backend="reference",
            grad=grad,
            lse=lse,
            mod_factory=mod_factory,
            param=param,
            param_dtype=torch.float64,
            **kw_ref,
        ),
    )
    ref = _cached(
        None if cache_key is None else (cache_key, grad, lse, "ref"),
        lambda: run_case(
            q,
            k,
            v,
            backend="reference",
            grad=grad,
            lse=lse,
            mod_factory=mod_factory,
            param=param,
            param_dtype=pdt,
            **kw_ref,
        ),
    )
    fast = run_case(
        q, k, v, backend=backend, grad=grad, lse=lse, mod_factory=mod_factory, param=param, param_dtype=pdt, **kw
    )
    assert fast["out"].dtype == dtype, f"{what}: output dtype {fast['out'].dtype} != input dtype {dtype}"
    if fast["lse"] is not None:
        want = torch.float64 if dtype == torch.float64 else torch.float32
        assert fast["lse"].dtype == want, f"{what}: lse dtype {fast['lse'].dtype}, expected {want}"
    check_rule(
        {key: val for key, val in fast.items() if key not in skip},
        ref,
        oracle,
        dtype,
        what=what or backend,
        param_slack_eps=param_slack_eps,
    )
    return fast, ref, oracle


def dense_allowed(mask, B, H, Nq, Nk, q_offset, kv_offset=0):
    """The mask's predicate evaluated on the full (B, H, Nq, Nk) grid (True = may attend)."""
    if mask is None:
        return torch.ones(B, H, Nq, Nk, dtype=torch.bool)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qp = (torch.arange(Nq) + q_offset).view(1, 1, Nq, 1)
    kp = (torch.arange(Nk) + kv_offset).view(1, 1, 1, Nk)
    return torch.as_tensor(mask(b, h, qp, kp)).expand(B, H, Nq, Nk)


def naive_attention(q, k, v, allowed, scale=None, bias=None):
    """An independent float64 implementation: dense scores, torch.softmax, explicit empty rows."""
    q, k, v = q.double(), k.double(), v.double()
    _B, H, _Nq, D = q.shape
    G = H // k.shape[1]
    k = k.repeat_interleave(G, 1)
    v = v.repeat_interleave(G, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)
    p = torch.softmax(s.masked_fill(empty.unsqueeze(-1), 0.0), -1).masked_fill(~allowed, 0.0)
    out = torch.einsum("bhqk,bhkd->bhqd", p, v)
    lse = torch.logsumexp(s, -1)
    return out, lse
