"""MultiHeadAttention's argument errors: each bad constructor argument or forward input raises
``ValueError`` / ``TypeError`` naming what is wrong (split from test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from attnlab.nn import MultiHeadAttention
from attnlab.positions import ALiBi, RoPE


@pytest.mark.parametrize(
    "build, exc, words",
    [
        (lambda: MultiHeadAttention(30, 4), ValueError, "d_model=30 is not divisible by n_heads=4"),
        (lambda: MultiHeadAttention(32, 8, 3), ValueError, "n_heads=8 must be a multiple of n_kv_heads=3"),
        (lambda: MultiHeadAttention(32, 4, 8), ValueError, "n_kv_heads=8"),
        (lambda: MultiHeadAttention(32, 0), ValueError, "n_heads"),
        (lambda: MultiHeadAttention(0, 4), ValueError, "d_model"),
        (lambda: MultiHeadAttention(32, 4, 0), ValueError, "n_kv_heads"),
        (lambda: MultiHeadAttention(32, 4, d_head=0), ValueError, "d_head"),
        (lambda: MultiHeadAttention(32, 4.0), ValueError, "n_heads"),
        (lambda: MultiHeadAttention(32, 4, positions=RoPE(16)), ValueError, "RoPE built for d_head=16"),
        (lambda: MultiHeadAttention(30, 4, d_head=6, positions=RoPE(8)), ValueError, "d_head=6"),
        (lambda: MultiHeadAttention(32, 4, positions=ALiBi(8)), ValueError, "ALiBi has 8 slopes for n_heads=4"),
        (lambda: MultiHeadAttention(32, 4, positions="rope"), TypeError, "positions"),
        (lambda: MultiHeadAttention(32, 4, backend="cuda"), ValueError, "backend"),
        (lambda: MultiHeadAttention(32, 4, dropout=1.0), ValueError, "dropout"),
        (lambda: MultiHeadAttention(32, 4, dropout=-0.1), ValueError, "dropout"),
    ],
)
def test_constructor_errors(build, exc, words):
    with pytest.raises(exc) as e:
        build()
    assert words in str(e.value)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda m: m(torch.randn(5, 32)), ValueError, "x: expected (B, N, d_model=32), got (5, 32)"),
        (lambda m: m(torch.randn(1, 5, 16)), ValueError, "x: expected (B, N, d_model=32), got (1, 5, 16)"),
        (lambda m: m([[0.0] * 32]), ValueError, "got list"),
        (
            lambda m: m(torch.randn(2, 5, 32), torch.randn(3, 4, 32)),
            ValueError,
            "context: expected (B=2, M, d_model=32)",
        ),
        (lambda m: m(torch.randn(2, 5, 32), torch.randn(2, 4, 16)), ValueError, "context"),
        (
            lambda m: m(torch.randn(2, 5, 32), mask=masks.key_padding(torch.ones(3, 5, dtype=torch.bool))),
            ValueError,
            "key_padding(keep): got 3 rows for batch size B=2",
        ),
        (
            lambda m: m(torch.randn(2, 5, 32), mask=masks.key_padding(torch.ones(2, 4, dtype=torch.bool))),
            ValueError,
            "key_padding(keep)",
        ),
        (lambda m: m(torch.randn(2, 5, 32), mask="causal"), TypeError, "mask"),
    ],
)
def test_forward_errors(call, exc, words):
    m = MultiHeadAttention(32, 4)
    with pytest.raises(exc) as e:
        call(m)
    assert words in str(e.value)


def test_context_with_rope_is_rejected():
    m = MultiHeadAttention(32, 4, positions=RoPE(8))
    with pytest.raises(ValueError, match=r"cross-attention .* RoPE"):
        m(torch.randn(1, 3, 32), torch.randn(1, 4, 32))


def test_rope_positions_of_wrong_shape_are_rejected():
    m = MultiHeadAttention(32, 4, positions=RoPE(8))
    with pytest.raises(ValueError, match="positions"):
        m(torch.randn(2, 3, 32), pos=torch.arange(4))
    with pytest.raises(TypeError, match="positions"):
        m(torch.randn(2, 3, 32), pos=torch.arange(3.0))


@pytest.mark.parametrize("scale", [0, float("nan"), "x", True])
def test_scale_is_validated_at_construction(scale):
    with pytest.raises(ValueError, match="scale: expected a finite non-zero number"):
        MultiHeadAttention(16, 4, scale=scale)
