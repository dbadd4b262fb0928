"""Score mods: values against direct formulas, attention against a hand-written
materialized softmax (float64), parameter gradients, and validation errors."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.ops import flash_attention
from tests.helpers import F64_ELEMENTWISE, F64_ELEMENTWISE_WIDE, F64_REORDER_ABS

F64 = torch.float64


def grids(B, H, Nq, Nk, qo, ko):
    return (
        torch.arange(B).view(B, 1, 1, 1),
        torch.arange(H).view(1, H, 1, 1),
        (torch.arange(Nq) + qo).view(1, 1, Nq, 1),
        (torch.arange(Nk) + ko).view(1, 1, 1, Nk),
    )


# ----------------------------------------------------------------------------- values
B, H, NQ, NK, QO, KO = 2, 3, 4, 9, 6, 1  # q positions 6..9, kv positions 1..9


def _apply(mod, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, NQ, NK, dtype=F64, generator=g) * 3
    out = mod(s.clone(), *grids(B, H, NQ, NK, QO, KO))
    return s, torch.broadcast_to(out, s.shape)


def _loop(s, f):
    want = torch.empty_like(s)
    for b in range(B):
        for h in range(H):
            for i in range(NQ):
                for j in range(NK):
                    want[b, h, i, j] = f(float(s[b, h, i, j]), b, h, QO + i, KO + j)
    return want


def test_alibi_values():
    slopes = [0.5, 0.25, 0.125]
    s, got = _apply(scores.alibi(torch.tensor(slopes, dtype=F64)))
    torch.testing.assert_close(got, _loop(s, lambda x, b, h, q, k: x - slopes[h] * (q - k)), **F64_ELEMENTWISE)


def test_alibi_symmetric_values():
    slopes = [0.5, -0.25, 2.0]
    s, got = _apply(scores.alibi(torch.tensor(slopes, dtype=F64), symmetric=True))
    torch.testing.assert_close(got, _loop(s, lambda x, b, h, q, k: x - slopes[h] * abs(q - k)), **F64_ELEMENTWISE)


@pytest.mark.parametrize("c", [0.5, 3, 30.0])
def test_softcap_values(c):
    s, got = _apply(scores.softcap(c))
    torch.testing.assert_close(got, _loop(s, lambda x, b, h, q, k: c * math.tanh(x / c)), **F64_ELEMENTWISE_WIDE)


@pytest.mark.parametrize("R", [0, 2, 20])
def test_relative_bias_values(R):
    g = torch.Generator().manual_seed(5)
    table = torch.randn(H, 2 * R + 1, dtype=F64, generator=g)
    s, got = _apply(scores.relative_bias(table))
    want = _loop(s, lambda x, b, h, q, k: x + float(table[h, min(max(k - q, -R), R) + R]))
    torch.testing.assert_close(got, want, **F64_ELEMENTWISE)


def test_custom_values_and_params():
    w = torch.tensor([1.5, -0.5, 2.0], dtype=F64, requires_grad=True)
    frozen = torch.tensor([0.1, 0.2, 0.3], dtype=F64)
    mod = scores.custom(lambda s, b, h, q, kv: s * w[h] + frozen[h] * (kv - q) + b, params=[w, frozen])
    s, got = _apply(mod)
    want = _loop(s, lambda x, b, h, q, k: x * float(w.detach()[h]) + float(frozen[h]) * (k - q) + b)
    torch.testing.assert_close(got.detach(), want, **F64_ELEMENTWISE_WIDE)
    assert mod.parameters() == [w]  # only tensors that require grad are learnable


def test_compose_applies_in_order():
    slopes = [0.5, 0.25, 0.125]
    a = scores.alibi(torch.tensor(slopes, dtype=F64))
    s, got = _apply(scores.compose(a, scores.softcap(2.0)))
    torch.testing.assert_close(
        got, _loop(s, lambda x, b, h, q, k: 2.0 * math.tanh((x - slopes[h] * (q - k)) / 2.0)), **F64_ELEMENTWISE_WIDE
    )
    s, got = _apply(scores.compose(scores.softcap(2.0), a))
    torch.testing.assert_close(
        got, _loop(s, lambda x, b, h, q, k: 2.0 * math.tanh(x / 2.0) - slopes[h] * (q - k)), **F64_ELEMENTWISE_WIDE
    )
    t = torch.zeros(3, 3, dtype=F64, requires_grad=True)
    sl = torch.ones(3, dtype=F64, requires_grad=True)
    comp = scores.compose(scores.alibi(sl), scores.softcap(1.0), scores.relative_bias(t))
    assert [id(p) for p in comp.parameters()] == [id(sl), id(t)]


def test_module_doctests():
    res = doctest.testmod(scores)
    assert res.attempted > 0 and res.failed == 0


# ----------------------------------------------------------------------------- attention vs hand-written
def naive(q, k, v, bias, allowed, scale):
    """softmax(scale q k^T + bias, masked) v in float64, one (b, h) at a time.

    ``bias(s, b, h, qpos, kpos)`` is the score mod written with torch ops on the
    (Nq, Nk) tile (so that autograd reaches its parameters); ``allowed`` is a bool
    (B, H, Nq, Nk) tensor or None.
    """
    Bq, Hq, _Nq, _ = q.shape
    G = Hq // k.shape[1]
    outs, lses = [], []
    for b in range(Bq):
        ob, lb = [], []
        for h in range(Hq):
            s = q[b, h] @ k[b, h // G].T * scale
            if bias is not None:
                s = bias(s, b, h)
            a = torch.ones_like(s, dtype=torch.bool) if allowed is None else allowed[b, h]
            s = torch.where(a, s, torch.full_like(s, -math.inf))
            m = s.amax(-1, keepdim=True).detach()
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(s - m)
            l = e.sum(-1, keepdim=True)
            nonempty = l > 0
            l1 = torch.where(nonempty, l, torch.ones_like(l))
            ob.append((e / l1) @ v[b, h // G])
            lb.append(torch.where(nonempty, m + torch.log(l1), torch.full_like(l, -math.inf)).squeeze(-1))
        outs.append(torch.stack(ob))
        lses.append(torch.stack(lb))
    return torch.stack(outs), torch.stack(lses)


def dense_allowed(mask, Bq, Hq, Nq, Nk, qo, ko):
    if mask is None:
        return None
    return torch.broadcast_to(mask(*grids(Bq, Hq, Nq, Nk, qo, ko)), (Bq, Hq, Nq, Nk))


def make_case(name, Hq, Nq, Nk, qo, ko, dtype=F64):
    """(score_mod, bias(s, b, h) written by hand, params) sharing the same parameter tensors."""
    g = torch.Generator().manual_seed(11)
    qpos = (torch.arange(Nq) + qo).view(-1, 1)
    kpos = (torch.arange(Nk) + ko).view(1, -1)
    d = (kpos - qpos).to(dtype)
    if name in ("alibi", "alibi_sym"):
        sl = (torch.rand(Hq, dtype=dtype, generator=g) * 0.5).requires_grad_()
        sym = name == "alibi_sym"
        bias = (lambda s, b, h: s - sl[h] * d.abs()) if sym else (lambda s, b, h: s + sl[h] * d)
        return scores.alibi(sl, symmetric=sym), bias, [sl]
    if name == "softcap":
        return scores.softcap(0.7), (lambda s, b, h: 0.7 * torch.tanh(s / 0.7)), []
    if name == "relative_bias":
        R = 3
        t = torch.randn(Hq, 2 * R + 1, dtype=dtype, generator=g).requires_grad_()
        idx = (kpos - qpos).clamp(-R, R) + R
        return scores.relative_bias(t), (lambda s, b, h: s + t[h][idx]), [t]
    if name == "custom":
        w = (torch.rand(Hq, dtype=dtype, generator=g) + 0.5).requires_grad_()
        u = torch.randn(2, dtype=dtype, generator=g).requires_grad_()
        fn = lambda s, b, h, q, kv: s * w[h] + u[b] * torch.cos(0.3 * (kv - q).to(s.dtype))  # noqa: E731
        return (scores.custom(fn, params=[w, u]), (lambda s, b, h: s * w[h] + u[b] * torch.cos(0.3 * d)), [w, u])
    if name == "compose":
        R = 2
        sl = (torch.rand(Hq, dtype=dtype, generator=g) * 0.5).requires_grad_()
        t = torch.randn(Hq, 2 * R + 1, dtype=dtype, generator=g).requires_grad_()
        idx = (kpos - qpos).clamp(-R, R) + R
        mod = scores.compose(scores.alibi(sl), scores.softcap(1.3), scores.relative_bias(t))
        return mod, (lambda s, b, h: 1.3 * torch.tanh((s + sl[h] * d) / 1.3) + t[h][idx]), [sl, t]
    raise KeyError(name)


MODS = ["alibi", "alibi_sym", "softcap", "relative_bias", "custom", "compose"]
# (B, H, Hkv, Nq, Nk, q_offset, kv_offset, mask)
PROBLEMS = {
    "gqa_nomask": (2, 4, 2, 5, 9, None, 0, None),
    "causal_nq_gt_nk": (2, 2, 1, 8, 5, None, 0, masks.causal),  # first rows see nothing
    "window_offsets": (2, 3, 3, 6, 11, 8, 2, lambda: masks.sliding_window(4)),
    "padding_mqa": (2, 2, 1, 4, 7, None, 0, lambda: masks.padding([0, 5])),  # batch 0 fully masked
}


def _run(backend, q, k, v, mask, mod, qo, ko):
    if backend == "flash_tiles":
        Nq, Nk = q.shape[2], k.shape[2]
        qo = ko + Nk - Nq if qo is None else qo
        return flash_attention(q, k, v, mask=mask, score_mod=mod, scale=0.3, q_offset=qo, kv_offset=ko, block=(2, 3))
    return attnlab.attention(
        q, k, v, mask=mask, score_mod=mod, scale=0.3, q_offset=qo, kv_offset=ko, return_lse=True, backend=backend
    )


@pytest.mark.parametrize("prob", list(PROBLEMS))
@pytest.mark.parametrize("name", MODS)
@pytest.mark.parametrize("backend", ["flash", "flash_tiles", "reference"])
def test_attention_with_score_mod_matches_hand_written(backend, name, prob):
    Bq, Hq, Hkv, Nq, Nk, qo, ko, mk = PROBLEMS[prob]
    qo_abs = ko + Nk - Nq if qo is None else qo
    g = torch.Generator().manual_seed(3)
    q = torch.randn(Bq, Hq, Nq, 6, dtype=F64, generator=g).requires_grad_()
    k = torch.randn(Bq, Hkv, Nk, 6, dtype=F64, generator=g).requires_grad_()
    v = torch.randn(Bq, Hkv, Nk, 5, dtype=F64, generator=g).requires_grad_()
    mask = mk() if mk else None
    mod, bias, params = make_case(name, Hq, Nq, Nk, qo_abs, ko)
    out, lse = _run(backend, q, k, v, mask, mod, qo, ko)
    want_out, want_lse = naive(q, k, v, bias, dense_allowed(mask, Bq, Hq, Nq, Nk, qo_abs, ko), 0.3)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, want_out, **F64_REORDER_ABS)
    torch.testing.assert_close(lse, want_lse, **F64_REORDER_ABS)  # -inf rows must match exactly
    # gradients of q, k, v and every learnable parameter of the mod
    gw = torch.Generator().manual_seed(4)
    w_out = torch.randn(out.shape, dtype=F64, generator=gw)
    w_lse = torch.randn(lse.shape, dtype=F64, generator=gw)

    def loss(o, l):
        return (o * w_out).sum() + torch.where(torch.isfinite(l), l * w_lse, torch.zeros_like(l)).sum()

    inputs = [q, k, v, *params]
    got = torch.autograd.grad(loss(out, lse), inputs)
    want = torch.autograd.grad(loss(want_out, want_lse), inputs)
    for nm, a, b in zip(["q", "k", "v"] + [f"param{i}" for i in range(len(params))], got, want, strict=True):
        assert torch.isfinite(a).all(), f"{nm} grad has non-finite values"
        torch.testing.assert_close(a, b, **F64_REORDER_ABS, msg=lambda m, nm=nm: f"grad {nm}: {m}")


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_score_mod_sees_absolute_positions(backend):
    seen = {}

    def spy(s, b, h, q, kv):
        seen.setdefault("q", set()).update(q.flatten().tolist())
        seen.setdefault("kv", set()).update(kv.flatten().tolist())
        return s

    x = torch.randn(1, 1, 3, 4)
    y = torch.randn(1, 1, 7, 4)
    attnlab.attention(x, y, y, score_mod=scores.custom(spy), kv_offset=5, backend=backend)
    assert seen["q"] == {9, 10, 11} and seen["kv"] == set(range(5, 12))


def test_float32_parameter_gets_float32_grad_from_float64_inputs():
    t = torch.zeros(2, 5, requires_grad=True)  # float32 table, float64 activations
    q = torch.randn(1, 2, 4, 3, dtype=F64)
    for backend in ("flash", "reference"):
        t.grad = None
        attnlab.attention(q, q, q, score_mod=scores.relative_bias(t), backend=backend).sum().backward()
        assert t.grad is not None and t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("how", ["compose_shared", "custom_listed_twice"])
def test_shared_parameter_gradient_is_not_double_counted(how):
    s = torch.tensor([0.3, 0.1], dtype=F64, requires_grad=True)
    if how == "compose_shared":
        mod = scores.compose(scores.alibi(s), scores.alibi(s))
    else:
        mod = scores.custom(lambda x, b, h, q, kv: x + s[h] * (kv - q), params=[s, s])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 4, dtype=F64, generator=g)
    v = torch.randn(1, 2, 5, 3, dtype=F64, generator=g)
    grads = []
    for backend in ("reference", "flash"):
        s.grad = None
        attnlab.attention(q, q, v, score_mod=mod, backend=backend).sum().backward()
        grads.append(s.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], **F64_REORDER_ABS)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "build, exc, words",
    [
        (lambda: scores.alibi(torch.tensor([1, 2])), ValueError, "alibi(slopes)"),  # integer slopes
        (lambda: scores.alibi(torch.ones(2, 2, 2)), ValueError, "alibi(slopes)"),
        (lambda: scores.softcap(0), ValueError, "softcap(c)"),
        (lambda: scores.softcap(-2.0), ValueError, "softcap(c)"),
        (lambda: scores.softcap(float("nan")), ValueError, "softcap(c)"),
        (lambda: scores.softcap("30"), ValueError, "softcap(c)"),
        (lambda: scores.softcap(True), ValueError, "softcap(c)"),
        (lambda: scores.relative_bias(torch.zeros(2, 4)), ValueError, "relative_bias(table)"),  # even width
        (lambda: scores.relative_bias(torch.zeros(5)), ValueError, "relative_bias(table)"),
        (lambda: scores.relative_bias(torch.zeros(2, 3, dtype=torch.long)), ValueError, "relative_bias(table)"),
        (lambda: scores.relative_bias([[0.0, 1.0, 2.0]]), ValueError, "relative_bias(table)"),
        (lambda: scores.custom("not a function"), TypeError, "scores.custom(fn)"),
        (lambda: scores.custom(lambda s, b, h, q, kv: s, params=[1.0]), TypeError, "scores.custom(params)"),
        (lambda: scores.custom(lambda s, b, h, q, kv: s, params=[torch.ones(1), [2.0]]), TypeError, "params[1]"),
        (lambda: scores.compose(scores.softcap(1.0), lambda s, b, h, q, kv: s), TypeError, "scores.compose"),
    ],
)
def test_constructor_errors_name_the_argument(build, exc, words):
    with pytest.raises(exc) as e:
        build()
    assert words in str(e.value)


@pytest.mark.parametrize("backend", ["auto", "flash", "reference"])
@pytest.mark.parametrize(
    "mod, words",
    [
        (lambda: scores.alibi(torch.ones(3)), "alibi(slopes): 3 slopes for H=4"),
        (lambda: scores.alibi(torch.ones(2)), "alibi(slopes): 2 slopes for H=4"),  # Hkv heads is not enough
        (lambda: scores.relative_bias(torch.zeros(2, 5)), "relative_bias(table): table has 2 rows for H=4"),
        (lambda: scores.compose(scores.softcap(5.0), scores.alibi(torch.ones(5))), "alibi(slopes)"),
    ],
)
def test_head_count_checked_at_attention_time(backend, mod, words):
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError) as e:
        attnlab.attention(q, k, k, score_mod=mod(), backend=backend)
    assert words in str(e.value)
