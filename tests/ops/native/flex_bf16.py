"""FlexAttention's bf16 accuracy rule, as its tests apply it (test_flex_attention.py's
``_check_out``): a kernel's mean absolute error against a float64 reference at most
``FLEX_BF16_FACTOR`` (1.1) times that of the same-dtype eager reference, where every op runs in
bf16 (S = QKᵀ rounded).  Shared by the native kernel's bf16 tests."""

from __future__ import annotations

import torch

from tests.helpers import FLEX_BF16_FACTOR


def eager_bf16(q, k, v, allowed, scale):
    """FlexAttention's same-dtype eager reference (float64 inputs: the gold reference):
    ``softmax(QKᵀ · scale, hidden -inf) · V`` in the inputs' dtype, GQA by repeated kv heads."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


def assert_flex_bf16(e_kernel: float, e_eager: float, what: str) -> None:
    """The rule on two mean errors against the float64 reference: the kernel's and eager bf16's."""
    assert e_kernel <= FLEX_BF16_FACTOR * e_eager, (
        f"{what}: mean error {e_kernel:.3e} > {FLEX_BF16_FACTOR}x eager bf16 {e_eager:.3e}"
    )
