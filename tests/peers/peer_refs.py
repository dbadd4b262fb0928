"""The peers' own references, re-implemented as their sources define them (no einops):

* flash-attn ``tests/test_flash_attn.py`` (Dao-AILab/flash-attention @0251105a):
  ``attn_bias_from_alibi_slopes``, ``construct_local_mask``, ``attention_ref``,
  ``generate_random_padding_mask``; and its tolerance rule (``out`` within 2x, grads 3x
  the error of the same-dtype PyTorch implementation ``attention_ref(upcast=False,
  reorder_ops=True)``, both against ``attention_ref`` in float32).
* FlexAttention ``test/inductor/test_flex_attention.py`` (pytorch/pytorch):
  ``TestFlexAttention._check_equal``: mean abs error against the float64 golden at most
  ``fudge_factor`` times the same-dtype eager reference's (10.0 for float32, 1.1 else),
  and eager FlexAttention on the CPU (forward).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.helpers import FLEX_BF16_FACTOR, FLOOR


# ----------------------------------------------------------------------------- flash-attn
def attn_bias_from_alibi_slopes(
    slopes, seqlen_q, seqlen_k, query_padding_mask=None, key_padding_mask=None, causal=False
):
    batch, nheads = slopes.shape
    slopes = slopes.view(batch, nheads, 1, 1)
    if causal:
        return torch.arange(-seqlen_k + 1, 1, dtype=torch.float32) * slopes
    row_idx = torch.arange(seqlen_q, dtype=torch.long).view(-1, 1)
    col_idx = torch.arange(seqlen_k, dtype=torch.long)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).view(-1, 1, 1, 1)
    relative_pos = torch.abs(row_idx + sk - sq - col_idx)
    return -slopes * relative_pos.to(dtype=slopes.dtype)


def construct_local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), query_padding_mask=None, key_padding_mask=None):
    """True = masked out (flash-attn's polarity)."""
    row_idx = torch.arange(seqlen_q, dtype=torch.long).view(-1, 1)
    col_idx = torch.arange(seqlen_k, dtype=torch.long)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).view(-1, 1, 1, 1)
    if window_size[0] < 0:
        return col_idx > row_idx + sk - sq + window_size[1]
    sk = torch.full_like(col_idx, seqlen_k) if key_padding_mask is None else sk
    return torch.logical_or(
        col_idx > torch.minimum(row_idx + sk - sq + window_size[1], sk), col_idx < row_idx + sk - sq - window_size[0]
    )


def attention_ref(
    q,
    k,
    v,
    query_padding_mask=None,
    key_padding_mask=None,
    attn_bias=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    upcast=True,
    reorder_ops=False,
):
    """q (B, Sq, H, D), k/v (B, Sk, Hkv, D) -> (out (B, Sq, H, D), attention (B, H, Sq, Sk))."""
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    d = q.shape[-1]
    if not reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(d))
    if softcap > 0:
        scores = scores / softcap
        scores = scores.tanh()
        scores = scores * softcap
    if key_padding_mask is not None:
        scores.masked_fill_(~key_padding_mask.view(key_padding_mask.shape[0], 1, 1, -1), float("-inf"))
    local_mask = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(seqlen_q, seqlen_k, window_size, query_padding_mask, key_padding_mask)
        scores.masked_fill_(local_mask, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    if local_mask is not None:
        attention = attention.masked_fill(torch.all(local_mask, dim=-1, keepdim=True), 0.0)
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask.view(query_padding_mask.shape[0], 1, -1, 1), 0.0)
    output = torch.einsum("bhts,bshd->bthd", attention, v)
    if query_padding_mask is not None:
        output.masked_fill_(~query_padding_mask.view(query_padding_mask.shape[0], -1, 1, 1), 0.0)
    return output.to(dtype=dtype_og), attention.to(dtype=dtype_og)


def generate_random_padding_mask(max_seqlen, batch_size, mode="random", generator=None):
    """flash-attn's helper (mode "random": lengths in [max(1, max_seqlen - 20), max_seqlen])."""
    assert mode in ["full", "random", "third"]
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen, dtype=torch.int32)
    elif mode == "random":
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch_size, 1), generator=generator)
    else:
        lengths = torch.randint(max_seqlen // 3, max_seqlen + 1, (batch_size, 1), generator=generator)
    return torch.arange(max_seqlen).view(1, -1).expand(batch_size, -1) < lengths


def flash_rule(got, ref, pt, factor, dtype, what, rows=None):
    """flash-attn: ``(got - ref).abs().max() <= factor * (pt - ref).abs().max()`` (+ the
    dtype floor of tests/helpers.py: on the CPU the PyTorch error can be exactly 0).
    ``rows``: a bool mask of the entries to compare (flash-attn's reference gives NaN
    gradients on rows with no visible key, where attnlab's contract gives 0)."""
    got, ref, pt = got.float(), ref.float(), pt.float()
    if rows is not None:
        got, ref, pt = got[rows], ref[rows], pt[rows]
    e, e_pt = (got - ref).abs().max().item(), (pt - ref).abs().max().item()
    assert e <= factor * e_pt + FLOOR[dtype], f"{what}: attnlab error {e:.3e} > {factor}x PyTorch error {e_pt:.3e}"


# ----------------------------------------------------------------------------- FlexAttention
def flex():
    """``(flex_attention, create_block_mask)`` if eager FlexAttention runs on this CPU."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch.randn(1, 1, 8, 4)
            flex_attention(q, q, q)
    except Exception as e:  # noqa: BLE001  # pragma: no cover - depends on the torch build
        pytest.skip(f"eager FlexAttention does not run on this CPU: {e!r}")
    return flex_attention, create_block_mask


def run_flex(q, k, v, score_mod=None, mask_mod=None, B=None, H=None):
    flex_attention, create_block_mask = flex()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        if mask_mod is None and q.shape[0] != k.shape[0]:  # FlexAttention wants a block mask to broadcast K/V
            mask_mod = lambda b, h, qi, ki: torch.ones((), dtype=torch.bool)  # noqa: E731  (its noop_mask)
            B = q.shape[0]
        bm = None if mask_mod is None else create_block_mask(mask_mod, B, H, q.shape[2], k.shape[2], device="cpu")
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])


def flex_check_equal(golden, ref, got, what):
    """``TestFlexAttention._check_equal`` with ``_check_out``'s fudge factors."""
    fudge = 10.0 if ref.dtype == torch.float32 else FLEX_BF16_FACTOR
    e = (golden.double() - got.double()).abs().mean().item()
    e_ref = (golden.double() - ref.double()).abs().mean().item()
    assert not math.isnan(e), f"{what}: NaN"
    # a same-dtype reference that is exact (float64 golden vs float32 ref can agree to 0) gets the dtype floor
    assert e <= e_ref * fudge + FLOOR[ref.dtype] * 1e-2, f"{what}: error {e:.3e} > {fudge}x ref error {e_ref:.3e}"
