"""`auto`'s choice follows the measured policy (docs/benchmarks.md), and every explicit
backend is reachable by name."""

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.ops.dispatch import choose_backend as _auto


def _qk(dtype, D, Nq=8, Nk=8, grad=False):
    q = torch.randn(1, 2, Nq, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(1, 2, Nk, D, dtype=dtype, requires_grad=grad)
    return q, k


@pytest.mark.parametrize(
    "dtype, D, grad, mask, want",
    [
        (torch.float32, 64, False, None, "sdpa"),
        (torch.float32, 64, True, "causal", "sdpa"),
        (torch.float64, 32, False, None, "sdpa"),
        (torch.bfloat16, 64, False, "causal", "flash"),  # fwd: flash 1.06x SDPA at D=64
        (torch.bfloat16, 64, True, "causal", "sdpa"),  # fwd+bwd: 0.96x at D=64
        (torch.bfloat16, 128, True, None, "flash"),  # fwd+bwd: 1.10x at D=128
        (torch.bfloat16, 32, False, None, "sdpa"),  # unmeasured: keep torch's kernel
        (torch.float32, 64, False, "window", "flash"),  # SDPA would need a dense mask
    ],
)
def test_auto_policy(dtype, D, grad, mask, want):
    q, k = _qk(dtype, D, grad=grad)
    m = {None: None, "causal": masks.causal(), "window": masks.sliding_window(4)}[mask]
    assert _auto(q, k, m, None, 0, 0, False) == _native_for_flash(want)


def _native_for_flash(want):
    """Where the policy picks the torch-ops flash path, the native CPU kernel replaces it
    when it is built (tests/ops/native/test_native_dispatch.py)."""
    from attnlab.ops.native import build

    return "native" if want == "flash" and build.load() is not None else want


def test_auto_never_picks_sdpa_when_it_would_mean_something_else():
    q, k = _qk(torch.float32, 16, Nq=3, Nk=8)
    assert _auto(q, k, masks.causal(), None, 0, 3, False) == _native_for_flash(
        "flash"
    )  # rows before every key: SDPA gives NaN
    assert _auto(q, k, masks.causal(), None, 5, 0, False) == "sdpa"  # bottom-right chunk: a dense bool mask
    assert _auto(q, k, None, scores.softcap(5.0), 5, 0, False) == _native_for_flash("flash")  # a built-in mod
    assert _auto(q, k, None, None, 5, 0, True) == _native_for_flash("flash")  # LSE wanted


def test_auto_results_equal_the_reference_on_each_branch():
    for dtype, D, mask in (
        (torch.float32, 16, masks.causal()),
        (torch.float32, 16, masks.sliding_window(3)),
        (torch.float64, 8, None),
    ):
        q = torch.randn(1, 2, 9, D, dtype=dtype)
        k = torch.randn(1, 2, 9, D, dtype=dtype)
        v = torch.randn(1, 2, 9, D, dtype=dtype)
        a = attnlab.attention(q, k, v, mask=mask)
        r = attnlab.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
        assert (a.double() - r).abs().max() < 1e-5


def test_reference_called_directly_handles_no_keys():
    from attnlab.ops import reference_attention

    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 0, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 0, 5, dtype=torch.float64, requires_grad=True)
    out, lse = reference_attention(q, k, v, scale=0.5, q_offset=0)
    assert out.shape == (1, 2, 3, 5) and (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    assert (q.grad == 0).all()


def test_small_inference_problems_with_masks_take_a_dense_sdpa_mask(monkeypatch):
    import attnlab.ops.dispatch as D

    calls = []
    real = D.sdpa_dense_mask
    monkeypatch.setattr(D, "sdpa_dense_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = torch.randn(1, 4, 3, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 9, 16, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 16, dtype=torch.float64)
    for mask in (
        masks.sliding_window(4),
        masks.tree(torch.tensor([-1, 0, 0]), 6),
        masks.causal() | masks.sliding_window(2),
    ):
        with torch.no_grad():
            got = attnlab.attention(q, k, v, mask=mask)
        want = attnlab.attention(q, k, v, mask=mask, backend="reference")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert len(calls) == 3
    # a row with no visible key: SDPA would give NaN, so the flash path answers (zeros)
    with torch.no_grad():
        out = attnlab.attention(q, k, v, mask=masks.custom(lambda b, h, qp, kp: (kp < qp) & (qp > 6)))
    assert torch.isfinite(out).all() and (out[:, :, 0] == 0).all()
    # with gradients, the flash path (whose backward meets the accuracy rule) keeps it
    qg = q.clone().requires_grad_()
    attnlab.attention(qg, k, v, mask=masks.sliding_window(4))
    assert len(calls) == 4
