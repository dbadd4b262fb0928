"""``attnlab.attention`` at the public boundary: bad input raises ValueError/TypeError
that names the argument and what it got; nothing is silently broadcast."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import attnlab
from attnlab import masks, scores

BACKENDS = ["auto", "reference", "flash", "sdpa"]


def qkv(B=2, H=4, Hkv=2, Nq=5, Nk=7, D=8, Dv=6, dtype=torch.float32):
    return (
        torch.randn(B, H, Nq, D, dtype=dtype),
        torch.randn(B, Hkv, Nk, D, dtype=dtype),
        torch.randn(B, Hkv, Nk, Dv, dtype=dtype),
    )


def call(q=None, k=None, v=None, **kw):
    dq, dk, dv = qkv()
    return attnlab.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kw)


# (id, thunk, exception, regex the message must match)
CASES = [
    # not tensors
    ("q_list", lambda **x: call(**x, q=[[1.0]]), TypeError, r"^q: .*torch\.Tensor.*list"),
    (
        "k_numpy",
        lambda **x: call(**x, k=np.zeros((2, 2, 7, 8), np.float32)),
        TypeError,
        r"^k: .*torch\.Tensor.*ndarray",
    ),
    ("v_float", lambda **x: call(**x, v=3.0), TypeError, r"^v: .*torch\.Tensor.*float"),
    # wrong ndim
    (
        "q_3d",
        lambda **x: call(**x, q=torch.randn(4, 5, 8)),
        ValueError,
        r"^q: expected 4 dims \(B, H, Nq, D\), got shape \(4, 5, 8\)",
    ),
    (
        "k_5d",
        lambda **x: call(**x, k=torch.randn(1, 2, 2, 7, 8)),
        ValueError,
        r"^k: expected 4 dims .*\(1, 2, 2, 7, 8\)",
    ),
    ("v_2d", lambda **x: call(**x, v=torch.randn(7, 6)), ValueError, r"^v: expected 4 dims .*\(7, 6\)"),
    # shapes that do not fit together
    (
        "batch_q1_k2",
        lambda **x: call(**x, q=torch.randn(1, 4, 5, 8)),
        ValueError,
        r"batch sizes differ: q \(1, 4, 5, 8\), k \(2, 2, 7, 8\), v \(2, 2, 7, 6\)",
    ),
    ("batch_v", lambda **x: call(**x, v=torch.randn(1, 2, 7, 6)), ValueError, r"batch sizes differ.*v \(1, 2, 7, 6\)"),
    ("gqa_indivisible", lambda **x: call(**x, q=torch.randn(2, 3, 5, 8)), ValueError, r"H=3 .*Hkv=2"),
    ("gqa_q_fewer_heads", lambda **x: call(**x, q=torch.randn(2, 1, 5, 8)), ValueError, r"H=1 .*Hkv=2"),
    ("k_zero_heads", lambda **x: call(**x, k=torch.randn(2, 0, 7, 8), v=torch.randn(2, 0, 7, 6)), ValueError, r"Hkv=0"),
    (
        "d_mismatch",
        lambda **x: call(**x, k=torch.randn(2, 2, 7, 6)),
        ValueError,
        r"head dims differ \(D=8 vs 6\).*q \(2, 4, 5, 8\), k \(2, 2, 7, 6\)",
    ),
    (
        "d_zero",
        lambda **x: call(**x, q=torch.randn(2, 4, 5, 0), k=torch.randn(2, 2, 7, 0)),
        ValueError,
        r"D must be >= 1",
    ),
    (
        "kv_nk_mismatch",
        lambda **x: call(**x, v=torch.randn(2, 2, 6, 6)),
        ValueError,
        r"k and v must have the same \(B, Hkv, Nk\).*k \(2, 2, 7, 8\), v \(2, 2, 6, 6\)",
    ),
    ("kv_nk_one_vs_many", lambda **x: call(**x, k=torch.randn(2, 2, 1, 8)), ValueError, r"k and v must have the same"),
    ("kv_heads_mismatch", lambda **x: call(**x, v=torch.randn(2, 1, 7, 6)), ValueError, r"k and v must have the same"),
    # dtypes
    (
        "dtype_mix",
        lambda **x: call(**x, k=torch.randn(2, 2, 7, 8, dtype=torch.bfloat16)),
        TypeError,
        r"q, k, v must share a dtype, got q torch\.float32, k torch\.bfloat16, v torch\.float32",
    ),
    (
        "dtype_mix_v64",
        lambda **x: call(**x, v=torch.randn(2, 2, 7, 6, dtype=torch.float64)),
        TypeError,
        r"v torch\.float64",
    ),
    (
        "int_q",
        lambda **x: call(**x, q=torch.ones(2, 4, 5, 8, dtype=torch.int64)),
        TypeError,
        r"^q: dtype torch\.int64 is not supported",
    ),
    ("bool_v", lambda **x: call(**x, v=torch.ones(2, 2, 7, 6, dtype=torch.bool)), TypeError, r"^v: dtype torch\.bool"),
    (
        "complex_k",
        lambda **x: call(**x, k=torch.ones(2, 2, 7, 8, dtype=torch.complex64)),
        TypeError,
        r"^k: dtype torch\.complex64",
    ),
    # keyword arguments
    (
        "backend_unknown",
        lambda **x: call(**x, backend="cuda"),
        ValueError,
        r"backend: expected one of .*'flash'.*got 'cuda'",
    ),
    ("backend_none", lambda **x: call(**x, backend=None), ValueError, r"backend: expected one of"),
    ("return_lse_int", lambda **x: call(**x, return_lse=1), TypeError, r"return_lse: expected a bool, got int"),
    ("return_lse_str", lambda **x: call(**x, return_lse="yes"), TypeError, r"return_lse: expected a bool, got str"),
    ("q_offset_bool", lambda **x: call(**x, q_offset=True), TypeError, r"q_offset: expected an int, got bool"),
    ("q_offset_float", lambda **x: call(**x, q_offset=2.0), TypeError, r"q_offset: expected an int, got float"),
    ("kv_offset_float", lambda **x: call(**x, kv_offset=0.5), TypeError, r"kv_offset: expected an int, got float"),
    (
        "kv_offset_tensor",
        lambda **x: call(**x, kv_offset=torch.tensor([1, 2])),
        TypeError,
        r"kv_offset: expected an int",
    ),
    ("scale_zero", lambda **x: call(**x, scale=0), ValueError, r"scale: .*got 0"),
    ("scale_zero_float", lambda **x: call(**x, scale=0.0), ValueError, r"scale: .*got 0\.0"),
    ("scale_inf", lambda **x: call(**x, scale=math.inf), ValueError, r"scale: .*got inf"),
    ("scale_neg_inf", lambda **x: call(**x, scale=-math.inf), ValueError, r"scale: .*got -inf"),
    ("scale_nan", lambda **x: call(**x, scale=math.nan), ValueError, r"scale: .*got nan"),
    ("scale_bool", lambda **x: call(**x, scale=True), ValueError, r"scale: .*got True"),
    ("scale_str", lambda **x: call(**x, scale="0.1"), ValueError, r"scale: .*got '0\.1'"),
    ("scale_tensor", lambda **x: call(**x, scale=torch.tensor([0.1, 0.2])), ValueError, r"scale: "),
    # masks and score mods that are not the right kind of object
    # a tensor mask (issue 15: SDPA's attn_mask) must broadcast to (B, H, Nq, Nk) and be bool or float
    (
        "mask_bool_tensor_shape",
        lambda **x: call(**x, mask=torch.ones(5, 6, dtype=torch.bool)),
        ValueError,
        r"mask: shape \(5, 6\) does not broadcast to \(B, H, Nq, Nk\)=\(2, 4, 5, 7\)",
    ),
    (
        "mask_int_tensor",
        lambda **x: call(**x, mask=torch.ones(5, 7, dtype=torch.long)),
        TypeError,
        r"mask: a tensor mask must be bool .* or float .*got torch\.int64",
    ),
    (
        "mask_lambda",
        lambda **x: call(**x, mask=lambda b, h, q, kv: kv <= q),
        TypeError,
        r"mask: .*masks\.custom\(fn\).*got function",
    ),
    ("mask_string", lambda **x: call(**x, mask="causal"), TypeError, r"mask: .*got str"),
    ("mask_factory_uncalled", lambda **x: call(**x, mask=masks.causal), TypeError, r"mask: .*got function"),
    (
        "blockmask_other_shape",
        lambda **x: call(**x, mask=masks.causal().block_mask(2, 4, 5, 8)),
        ValueError,
        r"mask: this BlockMask was built for .*\(2, 4, 5, 8, 3, 0\) but attention got \(2, 4, 5, 7, 2, 0\)",
    ),
    (
        "score_mod_not_callable",
        lambda **x: call(**x, score_mod=3.0),
        TypeError,
        r"score_mod: expected a callable.*got float",
    ),
    ("score_mod_tensor", lambda **x: call(**x, score_mod=torch.zeros(5, 7)), TypeError, r"score_mod: .*got Tensor"),
]


@pytest.mark.parametrize("thunk, exc, pattern", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_bad_input_raises_naming_the_argument(thunk, exc, pattern):
    with pytest.raises(exc) as e:
        thunk()
    assert type(e.value) is exc, f"expected exactly {exc.__name__}, got {type(e.value).__name__}"
    assert re.search(pattern, str(e.value)), f"message {str(e.value)!r} does not match {pattern!r}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [
        "batch_q1_k2",
        "gqa_indivisible",
        "d_mismatch",
        "kv_nk_mismatch",
        "dtype_mix",
        "scale_nan",
        "q_offset_float",
        "mask_lambda",
        "blockmask_other_shape",
    ],
)
def test_validation_happens_for_every_backend(case, backend):
    _, thunk, exc, pattern = next(c for c in CASES if c[0] == case)
    with pytest.raises(exc, match=pattern):
        thunk(backend=backend)


# ----------------------------------------------------------------------------- nothing broadcast silently
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "qs, ks, vs",
    [
        ((1, 2, 3, 4), (2, 2, 3, 4), (2, 2, 3, 4)),  # q batch 1 against k/v batch 2
        # k/v batch 1 against q batch 2 is K/V shared by the batch (issue 15, FlexAttention's
        # convention): tests/ops/test_conventions.py
        ((2, 2, 3, 4), (2, 2, 3, 4), (1, 2, 3, 4)),  # v alone batch 1
        ((2, 2, 3, 4), (2, 2, 3, 4), (2, 2, 1, 4)),  # v with one position
        ((2, 2, 3, 4), (2, 2, 3, 1), (2, 2, 3, 4)),  # k with D = 1
        ((2, 2, 3, 4), (2, 4, 3, 4), (2, 4, 3, 4)),  # more kv heads than q heads
        ((2, 2, 3, 4), (2, 2, 3, 4), (2, 1, 3, 4)),  # v with one head
    ],
)
def test_nothing_is_silently_broadcast(qs, ks, vs, backend):
    with pytest.raises(ValueError):
        attnlab.attention(torch.randn(qs), torch.randn(ks), torch.randn(vs), backend=backend)


def test_mask_with_wrong_batch_is_not_broadcast():
    q, k, v = qkv(B=2)
    with pytest.raises(ValueError, match="padding"):
        attnlab.attention(q, k, v, mask=masks.padding([3]))
    with pytest.raises(ValueError, match="document"):
        attnlab.attention(q, k, v, mask=masks.document(torch.zeros(3, 7, dtype=torch.long)))


# ----------------------------------------------------------------------------- sdpa: only where it means the same
@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(score_mod=scores.softcap(5.0)), r"score_mod"),
        (dict(return_lse=True), r"LSE"),
        (
            dict(mask=masks.sliding_window(3)),
            r"SDPA maps only no mask, causal\(\) or key_padding\(\).*sliding_window\(3\)",
        ),
        (dict(mask=masks.causal() | masks.sliding_window(2)), r"SDPA maps only no mask, causal\(\) or key_padding\(\)"),
        (
            dict(mask=masks.custom(lambda b, h, q, kv: kv <= q)),
            r"SDPA maps only no mask, causal\(\) or key_padding\(\)",
        ),
        (dict(mask=masks.causal(), q_offset=0, kv_offset=2), r"q_offset 0 < kv_offset 2 the first rows see no key"),
        (dict(mask=masks.causal().block_mask(2, 4, 5, 7)), r"SDPA maps only no mask, causal\(\) or key_padding\(\)"),
    ],
)
def test_sdpa_refuses_what_it_cannot_map_and_says_why(kw, why):
    with pytest.raises(ValueError) as e:
        call(backend="sdpa", **kw)
    msg = str(e.value)
    assert msg.startswith("backend='sdpa'") and re.search(why, msg), msg
    assert "backend='flash'" in msg  # says what would work


def test_sdpa_accepts_what_it_can_map():
    torch.manual_seed(0)
    q, k, v = qkv(Nq=7, Nk=7, dtype=torch.float64)
    for kw in (dict(), dict(mask=masks.causal()), dict(scale=0.5)):
        torch.testing.assert_close(
            attnlab.attention(q, k, v, backend="sdpa", **kw),
            attnlab.attention(q, k, v, backend="reference", **kw),
            atol=1e-12,
            rtol=0,
        )
    # causal with Nq != Nk is fine once the offsets agree (top-left)
    q, k, v = qkv(Nq=3, Nk=7, dtype=torch.float64)
    torch.testing.assert_close(
        attnlab.attention(q, k, v, mask=masks.causal(), q_offset=0, backend="sdpa"),
        attnlab.attention(q, k, v, mask=masks.causal(), q_offset=0, backend="reference"),
        atol=1e-12,
        rtol=0,
    )


def test_valid_unusual_arguments_are_accepted():
    q, k, v = qkv(dtype=torch.float64)
    ref = attnlab.attention(q, k, v, backend="reference", scale=-0.25, q_offset=np.int64(1), kv_offset=-3)
    out = attnlab.attention(q, k, v, backend="flash", scale=np.float64(-0.25), q_offset=1, kv_offset=-3)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


def test_gqa_error_names_the_heads_and_every_shape():
    # check_qkv formats the shapes only when it raises (validate.gqa_heads takes them lazily)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8)
    want = r"H=4 must be a multiple of kv heads Hkv=3 .*: q \(1, 4, 5, 8\), k \(1, 3, 5, 8\), v \(1, 3, 5, 8\); .*layout='bnhd'"
    with pytest.raises(ValueError, match=want):
        attnlab.attention(q, k, k)
