"""Ports of FlexAttention's tests onto attnlab, CPU-sized:
pytorch/pytorch test/inductor/test_flex_attention.py (score mods, mask mods, GQA,
Bkv broadcast, strided inputs, learnable biases) and test_flex_decoding.py (one query).

FlexAttention's mods see **top-left row/column indices** (``q_idx = i``); attnlab's see
absolute positions with bottom-right default, so every call here passes ``q_offset=0``
(docs/conventions.md).  Tolerance: upstream's ``TestFlexAttention._check_equal`` with
``_check_out``'s fudge factors (mean abs error against the float64 golden at most 10x
(float32) / 1.1x (bf16) the same-dtype eager reference's), where golden and reference are
eager FlexAttention itself (CPU forward).  FlexAttention has no CPU backward, so the
gradient checks take the math (attnlab's materialized reference, float64 and same dtype)
as golden/reference under the same rule."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from tests.peers.peer_refs import flex, flex_check_equal, run_flex

Tensor = torch.Tensor


# Strict xfails for known divergences from upstream: (test name, callspec id).  Empty since the flash
# path computes S = QKᵀ and dP = dO·Vᵀ in float32 for bf16 inputs (ops/tiling.score_dtype): the 21 bf16
# cases that missed FlexAttention's 1.1x rule (S rounded to bf16 by the CPU bf16 bmm) now pass.
BF16_S_ROUNDING = "flash bf16 rounds S and P·V to bf16 (CPU bf16 bmm output): > 1.1x eager FlexAttention's error"
KNOWN: set[tuple[str, str]] = set()


@pytest.fixture(autouse=True)
def _known_failures(request):
    cs = getattr(request.node, "callspec", None)
    if cs is not None and (request.node.originalname, cs.id) in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=BF16_S_ROUNDING))


# --------- upstream's score mods (test_flex_attention.py, "Useful score mod functions") ---------
def _identity(score, b, h, q, kv):
    return score


def _causal(score, batch, head, token_q, token_kv):
    return torch.where(token_q >= token_kv, score, float("-inf"))


def _rel_bias(score, batch, head, token_q, token_kv):
    return score + (token_q - token_kv)


def _rel_causal(score, batch, head, token_q, token_kv):
    return torch.where(token_q >= token_kv, score + (token_q - token_kv), float("-inf"))


def _generate_alibi_bias(num_heads):
    def _alibi_bias(score, batch, head, token_q, token_kv):
        scale = torch.exp2(-((head + 1) * 8.0 / num_heads))
        return score + (token_kv - token_q) * scale

    return _alibi_bias


def _inverse_causal(score, b, h, m, n):
    return torch.where(m <= n, score, float("-inf"))


def _times_two(score, b, h, m, n):
    return score * 2


def _squared(score, b, h, m, n):
    return score * score


def _trig(score, b, h, m, n):
    return torch.sin(torch.cos(score)) + torch.tan(b)


TEST_SCORE_MODS = [
    _identity,
    _times_two,
    _squared,
    _causal,
    _inverse_causal,
    _rel_bias,
    _rel_causal,
    _generate_alibi_bias(8),
    _trig,
]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(QB, QH, QS, D, KB=None, KH=None, KS=None, VD=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    KB, KH, KS, VD = KB or QB, KH or QH, KS or QS, VD or D
    return (
        torch.randn(QB, QH, QS, D, generator=g).to(dtype),
        torch.randn(KB, KH, KS, D, generator=g).to(dtype),
        torch.randn(KB, KH, KS, VD, generator=g).to(dtype),
    )


def _run_test(
    score_mod, dtype, QB=2, QH=4, QS=40, D=16, KB=None, KH=None, KS=None, VD=None, mask_mod=None, am_mask=None
):
    """upstream's run_test: golden = FlexAttention in float64, ref = FlexAttention in dtype,
    the candidate = attnlab's flash path in dtype."""
    q, k, v = _inputs(QB, QH, QS, D, KB, KH, KS, VD, dtype)
    H = q.shape[1]
    golden = run_flex(q.double(), k.double(), v.double(), score_mod, mask_mod, B=None, H=None)
    ref = run_flex(q, k, v, score_mod, mask_mod)
    got = attnlab.attention(q, k, v, score_mod=score_mod, mask=am_mask, q_offset=0, backend="flash")
    assert got.shape == ref.shape and got.dtype == dtype and H == got.shape[1]
    flex_check_equal(golden, ref, got, "Out")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score_mod", TEST_SCORE_MODS, ids=lambda f: f.__name__)
def test_builtin_score_mods(dtype, score_mod):
    """test_flex_attention.py::TestFlexAttention::test_builtin_score_mods."""
    _run_test(score_mod, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score_mod", [_rel_bias, _generate_alibi_bias(8)], ids=lambda f: f.__name__)
def test_builtin_score_mods_different_seqlen(dtype, score_mod):
    """test_flex_attention.py::test_builtin_score_mods_different_seqlen (Q_S != KV_S, top-left
    indices): here Q_S = 33, KV_S = 97 and the reverse."""
    _run_test(score_mod, dtype, QS=17, KS=53)
    _run_test(score_mod, dtype, QS=53, KS=17)


@pytest.mark.parametrize("head_dims", [(4, 2), (4, 1)], ids=str)
@pytest.mark.parametrize("score_mod", [_causal, _generate_alibi_bias(4)], ids=lambda f: f.__name__)
def test_GQA(score_mod, head_dims):
    """test_flex_attention.py::test_GQA (test_Hq_Hkv = [(4, 2), (4, 1)])."""
    Hq, Hkv = head_dims
    _run_test(score_mod, torch.bfloat16, QH=Hq, KH=Hkv)


@pytest.mark.parametrize("batch_dims", [(3, 1), (4, 1), (5, 1)], ids=str)
@pytest.mark.parametrize("score_mod", [_rel_bias], ids=lambda f: f.__name__)
def test_kv_batch_broadcast(batch_dims, score_mod):
    """test_flex_attention.py::test_kv_batch_broadcast (test_Bq_Bkv: K/V with batch 1)."""
    Bq, Bkv = batch_dims
    _run_test(score_mod, torch.bfloat16, QB=Bq, KB=Bkv, QH=4, KH=2)


def _input_strides_1(B, H, S, D):
    return ((H * S * D, S * D, D, 1), 997)  # offset


def _input_strides_2(B, H, S, D):
    return ((H * D, D, B * H * D, 1), 499)  # transposed dimensions


def _input_strides_3(B, H, S, D):
    return ((S * (D + 1), B * S * (D + 1), (D + 1), 1), 293)  # additional buffer


def _input_strides_4(B, H, S, D):
    return ((1, D, (B + 1) * (H + 1) * D, 1), 97)  # shared dimension


STRIDES = [_input_strides_1, _input_strides_2, _input_strides_3, _input_strides_4]


@pytest.mark.parametrize(
    "k_s, v_s", list(zip(STRIDES, STRIDES[1:] + STRIDES[:1], strict=True)), ids=lambda f: f.__name__[1:]
)
@pytest.mark.parametrize("decode", [False, True], ids=["attention", "decoding"])
def test_strided_inputs(k_s, v_s, decode):
    """test_flex_attention.py::test_strided_inputs / test_flex_decoding.py::test_strided_inputs:
    K/V as as_strided views (offset, transposed, padded, shared dims) with Hq/Hkv = 4/2; the
    decoding variant's q is ``q1.view(Hq // Hkv, Hkv, B, D).transpose(0, 2)`` (one query)."""
    B, Hq, Hkv, S, D = 2, 4, 2, 24, 16
    g = torch.Generator().manual_seed(0)
    if decode:
        q = torch.randn(B * Hq * D, generator=g).view(Hq // Hkv, Hkv, B, D).transpose(0, 2).reshape(B, Hq, 1, D)
    else:
        q = torch.randn(B, Hq, S, D, generator=g)
    k1 = torch.randn(B * Hkv * S * D * 4, generator=g)
    v1 = torch.randn(B * Hkv * S * D * 4, generator=g)
    k = torch.as_strided(k1, (B, Hkv, S, D), *k_s(B, Hkv, S, D))
    v = torch.as_strided(v1, (B, Hkv, S, D), *v_s(B, Hkv, S, D))
    golden = run_flex(q.double(), k.double(), v.double())
    ref = run_flex(q, k, v)
    got = attnlab.attention(q, k, v, q_offset=0, backend="flash")
    flex_check_equal(golden, ref, got, "Out")
    assert torch.equal(got, attnlab.attention(q, k.contiguous(), v.contiguous(), q_offset=0, backend="flash"))


# --------- mask mods ---------
def _causal_mask(b, h, q, kv):
    return q >= kv


def _noop_mask(b, h, q, kv):
    return torch.ones((), dtype=torch.bool)  # upstream's noop_mask: a 0-d result


def _odd_batch(b, h, q, kv):
    return (b % 2 == 0) | (kv <= q)  # depends on b only: broadcasts from (B, 1, 1, 1)


MASK_CASES = {
    "causal": (_causal_mask, masks.custom(_causal_mask)),
    "noop_0d": (_noop_mask, masks.custom(_noop_mask)),
    "and_masks": (
        lambda b, h, q, kv: (q >= kv) & (q - kv < 9),
        masks.custom(_causal_mask) & masks.custom(lambda b, h, q, kv: q - kv < 9),
    ),
    "or_masks": (
        lambda b, h, q, kv: (q >= kv) | (kv < 4),
        masks.custom(_causal_mask) | masks.custom(lambda b, h, q, kv: kv < 4),
    ),
    "batch_dependent": (_odd_batch, masks.custom(_odd_batch)),
    "builtin_causal_top_left": (_causal_mask, masks.causal()),
}


@pytest.mark.parametrize("name", list(MASK_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_mods(name, dtype):
    """test_flex_attention.py::test_mask_mod_combiners (and_masks / or_masks), the noop_mask
    (0-d result) block masks, and a batch-dependent mask mod; with FlexAttention's
    create_block_mask against attnlab's masks (q_offset=0: top-left)."""
    fm, am = MASK_CASES[name]
    q, k, v = _inputs(2, 2, 40, 16, dtype=dtype)
    flex_attention, create_block_mask = flex()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bm = create_block_mask(fm, 2, 2, 40, 40, device="cpu")
        golden = flex_attention(q.double(), k.double(), v.double(), block_mask=bm)
        ref = flex_attention(q, k, v, block_mask=bm)
    got = attnlab.attention(q, k, v, mask=am, q_offset=0, backend="flash")
    flex_check_equal(golden, ref, got, "Out")


# --------- decoding (test_flex_decoding.py) ---------
@pytest.mark.parametrize("score_mod", [_rel_bias, _causal], ids=lambda f: f.__name__)
@pytest.mark.parametrize("head_dims", [(8, 8), (8, 2), (8, 1)], ids=str)
def test_flex_decoding_builtin_score_mods(score_mod, head_dims):
    """test_flex_decoding.py::test_builtin_score_mods / test_GQA: one query (Q_S = 1) over
    KV_S = 256 keys; the query is index 0 (top-left) as FlexAttention numbers it."""
    Hq, Hkv = head_dims
    _run_test(score_mod, torch.bfloat16, QB=2, QH=Hq, QS=1, KH=Hkv, KS=128, D=32)


# --------- learnable biases ---------
def _bias_cases(B, H, S):
    g = torch.Generator().manual_seed(4)
    return {
        "relative_1d": (torch.randn(2 * S, generator=g), lambda t: lambda s, b, h, q, kv: s + t[q - kv + S]),
        "absolute_2d": (torch.randn(S, S, generator=g), lambda t: lambda s, b, h, q, kv: s + t[q, kv]),
        "head_specific": (torch.randn(H, S, S, generator=g), lambda t: lambda s, b, h, q, kv: s + t[h, q, kv]),
        "batch_head": (torch.randn(B, H, S, S, generator=g), lambda t: lambda s, b, h, q, kv: s + t[b, h, q, kv]),
        "multiplicative": (torch.randn(S, generator=g), lambda t: lambda s, b, h, q, kv: s * t[q]),
        "head_specific_gate": (torch.randn(H, generator=g), lambda t: lambda s, b, h, q, kv: s * torch.sigmoid(t[h])),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(_bias_cases(2, 2, 8)))
def test_learnable_biases(case, dtype):
    """FlexAttention's learnable-bias tests (test_flex_attention.py, TestLearnableBiases: relative
    1-D, absolute 2-D, head-specific, batch-head, multiplicative, head gate): a score mod that
    reads a tensor requiring grad; attnlab's flash backward must return its gradient.
    Forward: golden/ref are eager FlexAttention; gradients: the float64 math and the
    same-dtype reference (no CPU backward in FlexAttention), same rule."""
    B, H, S, D = 2, 2, 24, 16
    t0, make = _bias_cases(B, H, S)[case]
    q, k, v = _inputs(B, H, S, D, dtype=dtype, seed=5)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    bias = t0.to(dtype).requires_grad_()
    out = attnlab.attention(q, k, v, score_mod=make(bias), q_offset=0, backend="flash")
    with torch.no_grad():
        golden = run_flex(q.double(), k.double(), v.double(), make(bias.detach().double()))
        ref = run_flex(q.detach(), k.detach(), v.detach(), make(bias.detach()))
    flex_check_equal(golden, ref, out, "Out")
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, bias), gout)
    q64, k64, v64, b64 = (x.detach().double().requires_grad_() for x in (q, k, v, bias))
    o64 = attnlab.attention(q64, k64, v64, score_mod=make(b64), q_offset=0, backend="reference")
    g64 = torch.autograd.grad(o64, (q64, k64, v64, b64), gout.double())
    qr, kr, vr, br = (x.detach().requires_grad_() for x in (q, k, v, bias))
    orf = attnlab.attention(qr, kr, vr, score_mod=make(br), q_offset=0, backend="reference")
    gr = torch.autograd.grad(orf, (qr, kr, vr, br), gout)
    for name, a, r, gg in zip(("Grad_Query", "Grad_Key", "Grad_Value", "Grad_Bias"), grads, gr, g64, strict=True):
        assert a.shape == r.shape
        flex_check_equal(gg, r, a, name)
