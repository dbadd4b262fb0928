"""The selective scan (chunked vs the sequential loop), its step function, and SSMMixer."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import masks
from attnlab.nn.ssm import RecurrentCache, SSMMixer, selective_scan, selective_scan_reference, selective_scan_step
from tests.helpers import EXACT, F64_REORDER, F64_REORDER_DEEP

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the root conftest's one-thread fixture


def scan_inputs(b=2, N=23, H=3, P=4, S=5, *, seed=0, dtype=torch.float64, dt_scale=1.0, with_D=True, with_state=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = r(b, N, H, P)
    dt = torch.nn.functional.softplus(r(b, N, H)) * dt_scale
    A = -(torch.rand(H, generator=g, dtype=torch.float64) * 3 + 0.1)
    B, C = r(b, N, S), r(b, N, S)
    D = r(H) if with_D else None
    state = r(b, H, P, S) if with_state else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return dict(x=cast(x), dt=cast(dt), A=cast(A), B=cast(B), C=cast(C), D=cast(D), state=cast(state))


def call(fn, inp, **kw):
    a = dict(inp)
    return fn(a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"), a.pop("D"), **a, **kw)


# ----------------------------------------------------------------------------- the math, by hand
def test_reference_is_the_recurrence_by_hand():
    """One channel, S = 2: h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t, y_t = C_t·h_t + D x_t."""
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    dt = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    A, D = -0.7, 0.3
    B = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0]], dtype=torch.float64)
    C = torch.tensor([[0.5, 0.5], [1.0, 0.0], [-1.0, 2.0]], dtype=torch.float64)
    h, want = torch.zeros(2, dtype=torch.float64), []
    for t in range(3):
        h = math.exp(dt[t] * A) * h + dt[t] * x[t] * B[t]
        want.append(float(C[t] @ h + D * x[t]))
    args = (
        x.view(1, 3, 1, 1),
        dt.view(1, 3, 1),
        torch.tensor([A], dtype=torch.float64),
        B[None],
        C[None],
        torch.tensor([D], dtype=torch.float64),
    )
    for fn in (selective_scan_reference, selective_scan):
        torch.testing.assert_close(fn(*args, chunk_size=2).flatten(), torch.tensor(want, dtype=torch.float64))


# ----------------------------------------------------------------------------- chunked == loop
@pytest.mark.parametrize("N,chunk", [(1, 32), (23, 1), (23, 5), (23, 23), (23, 64), (40, 8)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_reference_float64(N, chunk, with_state):
    inp = scan_inputs(N=N, with_state=with_state)
    y_ref, h_ref = call(selective_scan_reference, inp, return_state=True)
    y, h = call(selective_scan, inp, chunk_size=chunk, return_state=True)
    assert y.dtype == h.dtype == torch.float64 and y.shape == (2, N, 3, 4) and h.shape == (2, 3, 4, 5)
    torch.testing.assert_close(y, y_ref, **F64_REORDER)
    torch.testing.assert_close(h, h_ref, **F64_REORDER)


def test_chunked_equals_reference_per_channel_heads_without_D():
    inp = scan_inputs(b=1, N=19, H=6, P=1, S=3, with_D=False)  # P = 1: one decay per channel
    torch.testing.assert_close(
        call(selective_scan, inp, chunk_size=4), call(selective_scan_reference, inp), **F64_REORDER
    )


def test_gradients_match_reference_float64():
    inp = scan_inputs(N=17, with_state=True)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items()}
    w = torch.randn(2, 17, 3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for fn, kw in ((selective_scan_reference, {}), (selective_scan, {"chunk_size": 6})):
        y, h = call(fn, leaves, return_state=True, **kw)
        g = torch.autograd.grad((y * w).sum() + h.square().sum(), list(leaves.values()))
        grads.append(g)
    for name, a, b in zip(leaves, *grads, strict=True):
        torch.testing.assert_close(b, a, **F64_REORDER_DEEP, msg=lambda m, n=name: f"grad of {n}: {m}")
        assert a.abs().max() > 0  # not vacuous


def test_gradcheck_chunked():
    inp = scan_inputs(b=1, N=5, H=2, P=1, S=2, with_state=True)
    names = list(inp)
    leaves = [inp[k].clone().requires_grad_(True) for k in names]

    def f(*t):
        return call(selective_scan, dict(zip(names, t, strict=True)), chunk_size=2)

    assert torch.autograd.gradcheck(f, leaves)


def test_float32_error_is_within_the_float32_reference_error():
    """DESIGN: the fast path's error <= 2x the same-dtype reference's (both against float64)."""
    inp64 = scan_inputs(N=150, with_state=True)
    inp32 = {k: v.float() for k, v in inp64.items()}
    want = call(selective_scan_reference, inp64)
    ref_err = (call(selective_scan_reference, inp32).double() - want).abs().max()
    fast_err = (call(selective_scan, inp32, chunk_size=32).double() - want).abs().max()
    assert fast_err <= 2 * ref_err + 1e-6 * want.abs().max()  # + a floor: ref_err can be ~0 by luck


def test_large_steps_stay_finite_and_exact():
    """Chunks that decay by e^-1000 and more: every exponent is <= 0, so nothing overflows."""
    inp = scan_inputs(N=40, dt_scale=300.0, with_state=True)
    y = call(selective_scan, inp, chunk_size=16)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, call(selective_scan_reference, inp), **F64_REORDER)


def test_half_precision_inputs_accumulate_in_float32():
    inp = {k: (None if v is None else v.to(torch.bfloat16)) for k, v in scan_inputs(N=12).items()}
    y = call(selective_scan, inp, chunk_size=5)
    assert y.dtype == torch.bfloat16
    want = call(selective_scan_reference, {k: (None if v is None else v.double()) for k, v in inp.items()})
    # the sums run in float32; what is left is rounding the output to bfloat16 (unit roundoff 2^-8)
    assert (y.double() - want).abs().max() <= 2 * 2**-8 * want.abs().max()


# ----------------------------------------------------------------------------- step == scan
def test_steps_equal_the_scan():
    inp = scan_inputs(N=13, with_state=True)
    y_scan, h_scan = call(selective_scan, inp, chunk_size=4, return_state=True)
    h, ys = inp["state"], []
    for t in range(13):
        y, h = selective_scan_step(
            inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t], inp["C"][:, t], inp["D"], state=h
        )
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_scan, **F64_REORDER)
    torch.testing.assert_close(h, h_scan, **F64_REORDER)


def test_scan_in_pieces_carries_the_state():
    inp = scan_inputs(N=30)
    whole, h_whole = call(selective_scan, inp, return_state=True)
    first = {k: (v[:, :11] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    second = {k: (v[:, 11:] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    y1, h1 = call(selective_scan, first, chunk_size=4, return_state=True)
    second["state"] = h1
    y2, h2 = call(selective_scan, second, chunk_size=7, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), whole, **F64_REORDER)
    torch.testing.assert_close(h2, h_whole, **F64_REORDER)


def test_empty_sequence_returns_the_state_unchanged():
    inp = scan_inputs(N=0, with_state=True)
    y, h = call(selective_scan, inp, return_state=True)
    assert y.shape == (2, 0, 3, 4)
    torch.testing.assert_close(h, inp["state"])


# ----------------------------------------------------------------------------- causality
@pytest.mark.parametrize("fn", [selective_scan, selective_scan_reference])
def test_scan_is_causal(fn):
    inp = scan_inputs(N=20)
    t0 = 9
    later = {k: v.clone() for k, v in inp.items() if v is not None}
    for k in ("x", "dt", "B", "C"):
        later[k][:, t0 + 1 :] = later[k][:, t0 + 1 :] * 3 + 1  # change everything after t0
    y, y2 = call(fn, inp, chunk_size=8), call(fn, {**inp, **later}, chunk_size=8)
    torch.testing.assert_close(y2[:, : t0 + 1], y[:, : t0 + 1], **EXACT)
    assert (y2[:, t0 + 1 :] - y[:, t0 + 1 :]).abs().max() > 1e-3


def test_mixer_is_causal_including_its_conv():
    torch.manual_seed(0)
    m = SSMMixer(16, n_heads=2, d_state=4, d_conv=4).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    t0 = 5
    y = m(x)
    (gx,) = torch.autograd.grad(y[:, t0].sum(), x)
    assert gx[:, t0 + 1 :].abs().max() == 0
    assert gx[:, t0 - 3 : t0 + 1].abs().min() > 0  # it does read the conv window and the present


# ----------------------------------------------------------------------------- the module
def test_mixer_shapes_and_parameter_count():
    m = SSMMixer(32, n_heads=4, d_state=8, expand=2, d_conv=3, bias=False)
    assert m(torch.randn(3, 7, 32)).shape == (3, 7, 32)
    E, S, H = 64, 8, 4
    want = 32 * (2 * E + 2 * S + H) + (E + 2 * S) * (3 + 1) + 3 * H + E + E * 32
    assert sum(p.numel() for p in m.parameters()) == want
    assert (m.A < 0).all()
    dt0 = torch.nn.functional.softplus(m.dt_bias)
    assert ((dt0 >= 1e-3 - 1e-9) & (dt0 <= 1e-1 + 1e-9)).all()


@pytest.mark.parametrize("d_conv", [0, 1, 4])
def test_mixer_cache_token_by_token_equals_full(d_conv):
    torch.manual_seed(1)
    m = SSMMixer(16, n_heads=4, d_state=4, d_conv=d_conv).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    full = m(x, mask=masks.causal())
    cache = RecurrentCache()
    pieces = [m(x[:, :3], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(3, 7)]
    pieces.append(m(x[:, 7:], cache=cache))
    torch.testing.assert_close(torch.cat(pieces, 1), full, **F64_REORDER)
    assert cache.seen == 11


def test_mixer_gradients_reach_every_parameter():
    torch.manual_seed(2)
    m = SSMMixer(16, n_heads=2, d_state=4)
    m(torch.randn(2, 9, 16)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


def test_scan_errors_name_the_argument():
    inp = scan_inputs(N=5)
    bad = [
        (dict(x=inp["x"][0]), ValueError, r"x: expected \(b, N, H, P\)"),
        (dict(dt=inp["dt"][:, :4]), ValueError, r"dt: expected \(2, 5, 3\)"),
        (dict(B=inp["B"][..., :2]), ValueError, r"C: expected the state size S=2"),
        (dict(A=inp["A"].abs()), ValueError, r"A: expected finite values <= 0"),
        (dict(A=inp["A"][:2]), ValueError, r"A: expected one decay per head, \(H=3,\)"),
        (dict(dt=-inp["dt"]), ValueError, r"dt: expected finite step sizes >= 0"),
        (dict(D=torch.ones(4, dtype=torch.float64)), ValueError, r"D: expected None or one skip weight"),
        (dict(state=torch.zeros(2, 3, 4, 4, dtype=torch.float64)), ValueError, r"state: expected \(b, H, P, S\)"),
        (dict(x=inp["x"].long()), TypeError, r"x: expected a floating-point tensor"),
        (dict(C=[1.0]), TypeError, r"C: expected a torch.Tensor"),
    ]
    for change, exc, msg in bad:
        for fn in (selective_scan, selective_scan_reference):
            with pytest.raises(exc, match=msg):
                call(fn, {**inp, **change})
    with pytest.raises(ValueError, match="chunk_size: expected an int >= 1"):
        call(selective_scan, inp, chunk_size=0)
    with pytest.raises(ValueError, match=r"x: expected one token \(b, H, P\)"):
        selective_scan_step(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])


def test_mixer_errors():
    m = SSMMixer(16, n_heads=2, d_state=4)
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match=r"x: expected \(B, N, d_model=16\)"):
        m(torch.randn(4, 16))
    with pytest.raises(ValueError, match="mask: the SSM scan is causal"):
        m(x, mask=masks.sliding_window(2))
    with pytest.raises(ValueError, match="need_weights: an SSM mixer has no attention pattern"):
        m(x, need_weights=True)
    with pytest.raises(TypeError, match="cache: the SSM mixer keeps a recurrent state"):
        m(x, cache=object())
    cache = RecurrentCache()
    m(x, cache=cache)
    with pytest.raises(ValueError, match="cache: holds a state for batch 1"):
        m(torch.randn(2, 1, 16), cache=cache)
    with pytest.raises(TypeError, match=r"softmax attention .* needs a KV cache"):
        cache.update(None, None)
    with pytest.raises(ValueError, match="n_heads: expand·d_model = 16 inner channels"):
        SSMMixer(16, n_heads=3)
