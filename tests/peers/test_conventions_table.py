"""One test per row of docs/conventions.md: the stated equivalence against the peer itself
(torch SDPA, eager FlexAttention on the CPU, flash-attn's attention_ref as its source defines it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks, scores
from tests.helpers import FLOOR, max_err
from tests.peers.peer_refs import attention_ref, attn_bias_from_alibi_slopes, run_flex

F32, F64 = torch.float32, torch.float64
TOL = 1e-5  # float32 against float32 references: a few ulps of O(1) values, summed over <= 64 keys


def _qkv(B=2, H=4, Hkv=2, Nq=7, Nk=12, D=16, dtype=F32, seed=0, bnhd=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype)
    return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)) if bnhd else (q, k, v)


def _rep(q, k):
    return k.repeat_interleave(q.shape[1] // k.shape[1], 1)


def test_row1_layout_bnhd_is_flash_attn_layout():
    q, k, v = _qkv(bnhd=True)
    ref, _ = attention_ref(q, k, v)
    assert max_err(attnlab.attention(q, k, v, layout="bnhd", backend="flash"), ref) <= TOL
    with pytest.raises(ValueError, match="layout='bnhd'"):  # read as (B, H, N, D): 7 heads vs 12
        attnlab.attention(q, k, v)


@pytest.mark.parametrize("Nq, Nk", [(7, 12), (12, 7)])
def test_row2_causal_top_left_vs_bottom_right_sdpa(Nq, Nk):
    q, k, v = _qkv(Nq=Nq, Nk=Nk, dtype=F64)
    kr, vr = _rep(q, k), _rep(q, v)
    top_left = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    ok = top_left.isfinite().all(-1, keepdim=True)  # SDPA's rows with no key (Nq > Nk) are NaN
    got = attnlab.attention(q, k, v, mask=masks.causal(), q_offset=0)
    assert max_err(torch.where(ok, got, 0), torch.where(ok, top_left, 0)) <= FLOOR[F64] * 10
    from torch.nn.attention.bias import causal_lower_right

    lower_right = torch.ones(Nq, Nk, dtype=torch.bool).tril(diagonal=Nk - Nq)
    br = F.scaled_dot_product_attention(q, kr, vr, attn_mask=lower_right)
    ok = lower_right.any(-1).view(1, 1, -1, 1)
    got = attnlab.attention(q, k, v, mask=masks.causal())
    assert max_err(torch.where(ok, got, 0), torch.where(ok, br, 0)) <= FLOOR[F64] * 10
    if Nq <= Nk:
        br2 = F.scaled_dot_product_attention(q, kr, vr, attn_mask=causal_lower_right(Nq, Nk))
        assert max_err(got, br2) <= FLOOR[F64] * 10


def test_row3_flex_indices_are_top_left():
    q, k, v = _qkv(Nq=7, Nk=12)
    rel = lambda s, b, h, qi, ki: s + 0.1 * (qi - ki)  # noqa: E731
    flex_out = run_flex(q, k, v, score_mod=rel, mask_mod=lambda b, h, qi, ki: qi >= ki)
    assert max_err(attnlab.attention(q, k, v, score_mod=rel, mask=masks.causal(), q_offset=0), flex_out) <= TOL
    shifted = run_flex(q, k, v, mask_mod=lambda b, h, qi, ki: qi + (12 - 7) >= ki)
    assert max_err(attnlab.attention(q, k, v, mask=masks.causal()), shifted) <= TOL


def test_row4_flash_causal_is_bottom_right():
    q, k, v = _qkv(Nq=7, Nk=12, bnhd=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert max_err(attnlab.attention(q, k, v, mask=masks.causal(), layout="bnhd"), ref) <= TOL


@pytest.mark.parametrize("left, right", [(3, 0), (0, 0), (4, 2), (-1, 3), (6, 30)])
def test_row5_window_counts_the_query(left, right):
    """(l, -1) is left out: flash-attn's reference reads that -1 literally (construct_local_mask's
    second branch), unlike its kernel; tests/test_masks_extra.py checks band(l, None) itself."""
    q, k, v = _qkv(Nq=9, Nk=13, bnhd=True)
    ref, _ = attention_ref(q, k, v, window_size=(left, right))
    band = masks.band(None if left < 0 else left, None if right < 0 else right)
    assert max_err(attnlab.attention(q, k, v, mask=band, layout="bnhd"), ref) <= TOL
    if left >= 0 and right >= 0:
        sw = masks.sliding_window(left + 1, right=right)
        assert max_err(attnlab.attention(q, k, v, mask=sw, layout="bnhd"), ref) <= TOL


@pytest.mark.parametrize("causal", [False, True])
def test_row6_alibi_sign_and_symmetric(causal):
    q, k, v = _qkv(Nq=9, Nk=13, bnhd=True)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) * 0.3
    bias = attn_bias_from_alibi_slopes(slopes, 9, 13, causal=causal)
    ref, _ = attention_ref(q, k, v, attn_bias=bias, causal=causal)
    m = masks.causal() if causal else None
    sym = attnlab.attention(q, k, v, mask=m, score_mod=scores.alibi(slopes, symmetric=True), layout="bnhd")
    assert max_err(sym, ref) <= TOL
    plain = attnlab.attention(q, k, v, mask=m, score_mod=scores.alibi(slopes), layout="bnhd")
    assert (max_err(plain, ref) <= TOL) == causal  # without a mask the signs differ on future keys
    # FlexAttention's _alibi_bias test mod: score + (kv - q) * s  ==  alibi(s) on top-left indices
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    s = torch.exp2(-(torch.arange(4) + 1) * 8.0 / 4)
    flex_out = run_flex(qh, kh, vh, score_mod=lambda sc, b, h, qi, ki: sc + (ki - qi) * s[h])
    assert max_err(attnlab.attention(qh, kh, vh, score_mod=scores.alibi(s), q_offset=0), flex_out) <= TOL


def test_row7_key_padding_does_not_mask_query_rows():
    q, k, v = _qkv(Nq=10, Nk=10, Hkv=4, bnhd=True)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 7:] = False
    keep[1, :2] = False  # left padding
    got = attnlab.attention(q, k, v, mask=masks.key_padding(keep), layout="bnhd")
    assert got[0, 8].abs().sum() > 0  # a padded query row still attends the real keys
    ref, _ = attention_ref(q, k, v, query_padding_mask=keep, key_padding_mask=keep)
    assert max_err(got * keep[:, :, None, None], ref) <= TOL


def test_row8_fully_masked_rows_are_zero():
    q, k, v = _qkv(Nq=12, Nk=5, bnhd=True)
    ref, _ = attention_ref(q, k, v, causal=True)  # bottom-right: rows 0..6 see no key
    out, lse = attnlab.attention(q, k, v, mask=masks.causal(), layout="bnhd", return_lse=True)
    assert (out[:, :7] == 0).all() and torch.isneginf(lse[:, :, :7]).all() and max_err(out, ref) <= TOL
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    flex_out = run_flex(qh, kh, vh, mask_mod=lambda b, h, qi, ki: (ki < 2) & (qi > 100))
    got = attnlab.attention(qh, kh, vh, mask=masks.custom(lambda b, h, qi, ki: (ki < 2) & (qi > 100)), q_offset=0)
    assert (flex_out == 0).all() and (got == 0).all()


def test_row9_tensor_masks_are_sdpa_attn_mask():
    q, k, v = _qkv(dtype=F64)
    kr, vr = _rep(q, k), _rep(q, v)
    m = torch.rand(1, 4, 7, 12, generator=torch.Generator().manual_seed(2)) > 0.3
    m[..., 0] = True
    assert max_err(attnlab.attention(q, k, v, mask=m), F.scaled_dot_product_attention(q, kr, vr, attn_mask=m)) <= 1e-12
    b = torch.randn(7, 12, dtype=F64)
    assert max_err(attnlab.attention(q, k, v, mask=b), F.scaled_dot_product_attention(q, kr, vr, attn_mask=b)) <= 1e-12


def test_row10_lse_is_flex_lse():
    q, k, v = _qkv()
    from torch.nn.attention.flex_attention import flex_attention

    run_flex(q, k, v)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            _, aux = flex_attention(q, k, v, enable_gqa=True, return_aux=AuxRequest(lse=True))
            flex_lse = aux.lse
        except ImportError:  # older API
            _, flex_lse = flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    _, lse = attnlab.attention(q, k, v, return_lse=True)
    assert lse.dtype == F32 and lse.shape == flex_lse.shape and max_err(lse, flex_lse) <= TOL


def test_row11_softcap_before_alibi():
    q, k, v = _qkv(Nq=9, Nk=13, bnhd=True)
    q = q * 5
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(3)) * 0.3
    ref, _ = attention_ref(q, k, v, attn_bias=attn_bias_from_alibi_slopes(slopes, 9, 13), softcap=2.0)
    mod = scores.compose(scores.softcap(2.0), scores.alibi(slopes, symmetric=True))
    assert max_err(attnlab.attention(q, k, v, score_mod=mod, layout="bnhd"), ref) <= TOL


def test_row12_kv_batch_broadcast_is_flex():
    q, _, _ = _qkv(B=3)
    _, k, v = _qkv(B=1, seed=1)
    flex_out = run_flex(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= ki, B=3, H=None)
    assert max_err(attnlab.attention(q, k, v, mask=masks.causal(), q_offset=0), flex_out) <= TOL
