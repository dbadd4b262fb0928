"""Ports of flash-attn's tests/test_flash_attn.py (Dao-AILab/flash-attention @0251105a) onto
attnlab, CPU-sized: its ``attention_ref`` (tests/peers/peer_refs.py, as the source defines
it) with the causal / local window / softcap / ALiBi / MHA-MQA-GQA matrix, its odd shapes
and head dims, varlen and kvcache, under flash-attn's own tolerance rule: attnlab's error
against ``attention_ref`` (float32) at most 2x (output) / 3x (gradients) the error of the
same-dtype PyTorch implementation ``attention_ref(upcast=False, reorder_ops=True)``.

flash-attn's calls map onto attnlab as docs/conventions.md says: ``(B, N, H, D)`` is
``layout="bnhd"``; ``window_size=(l, r)`` is ``masks.band(l, r)``; ``causal`` is
``band(l, 0)`` (bottom-right, attnlab's default alignment); ``alibi_slopes (B, H)`` is
``scores.alibi(slopes, symmetric=True)`` after ``scores.softcap``.  Shapes are smaller
than upstream's (batch 2, 4 heads) so the whole folder runs in seconds on 2 cores;
the matrix is sampled, every value of every axis appearing at least once."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnlab
from attnlab import masks, scores
from tests.peers.peer_refs import attention_ref, attn_bias_from_alibi_slopes, flash_rule, generate_random_padding_mask

# upstream's test_flash_attn_output / test_flash_attn_causal shape lists, the odd ones
SHAPES = [(113, 203), (128, 217), (113, 211), (108, 256), (239, 1), (799, 3), (3, 799), (1, 239), (97, 97)]
HEAD_DIMS = [40, 59, 111, 256]
AXES = dict(
    causal=[False, True],
    local=[False, True],
    alibi=[False, True],
    softcap=[0.0, 50.0],
    mha_type=["mha", "mqa", "gqa"],
    dtype=[torch.bfloat16, torch.float16],
)


def _matrix(n):
    """``n`` cases cycling through every axis (a Latin-style sample of upstream's product)."""
    keys = list(AXES)
    out = []
    for i in range(n):
        case = {kk: AXES[kk][(i * (j + 1) + i // len(AXES[kk])) % len(AXES[kk])] for j, kk in enumerate(keys)}
        out.append(case)
    return out


OUTPUT_CASES = [
    dict(sq=sq, sk=sk, d=d, **c)
    for (sq, sk), d, c in zip(
        [s for s in SHAPES for _ in HEAD_DIMS],
        HEAD_DIMS * len(SHAPES),
        _matrix(len(SHAPES) * len(HEAD_DIMS)),
        strict=True,
    )
]


def _ids(c):
    return (
        f"{c['sq']}x{c['sk']}-d{c['d']}-{'causal' if c['causal'] else 'full'}{'-local' if c['local'] else ''}"
        f"{'-alibi' if c['alibi'] else ''}{'-softcap' if c['softcap'] else ''}-{c['mha_type']}-"
        f"{str(c['dtype']).replace('torch.', '')}"
    )


# Strict xfails for known divergences: (test, case id).  Empty since the flash backward computes
# dP = dO·Vᵀ in float32 for bf16 inputs (ops/tiling.score_dtype): with one key (Sk = 1)
# dS = P∘(dP − Δ) is exactly 0 in the math, and the two bf16 cases that got ~1e-2 now pass.
BF16_DP_ROUNDING = "flash backward rounds dP to bf16 (bf16 bmm output): nonzero dq/dk where the math gives 0"
KNOWN: set[tuple[str, str]] = set()


def _xfail_known(request, c, test):
    if (test, _ids(c)) in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=BF16_DP_ROUNDING))


def _attnlab_args(window, causal, alibi_slopes, softcap):
    left, right = window
    if causal:
        right = 0
    mask = None if (left < 0 and right < 0) else masks.band(left if left >= 0 else None, right if right >= 0 else None)
    mods = ([scores.softcap(softcap)] if softcap else []) + (
        [scores.alibi(alibi_slopes, symmetric=True)] if alibi_slopes is not None else []
    )
    return mask, (None if not mods else scores.compose(*mods))


@pytest.mark.parametrize("c", OUTPUT_CASES, ids=_ids)
def test_flash_attn_output(c, request):
    """Port of test_flash_attn.py::test_flash_attn_output (with its (113, 203)-style shapes,
    head dims 40/59/111/256, causal/local/alibi/softcap, mha/mqa/gqa): forward and backward."""
    _xfail_known(request, c, "output")
    g = torch.Generator().manual_seed(0)
    batch_size, nheads = 2, 4
    nheads_k = nheads if c["mha_type"] == "mha" else (1 if c["mha_type"] == "mqa" else 2)
    sq, sk, d, dtype = c["sq"], c["sk"], c["d"], c["dtype"]
    window_size = (-1, -1) if not c["local"] else tuple(torch.randint(0, sk, (2,), generator=g).tolist())
    q = torch.randn(batch_size, sq, nheads, d, generator=g).to(dtype)
    if c["softcap"] > 0:
        q = q * c["softcap"]  # upstream: "Ensure the values of qk are at least within softcap range."
    k = torch.randn(batch_size, sk, nheads_k, d, generator=g).to(dtype)
    v = torch.randn(batch_size, sk, nheads_k, d, generator=g).to(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    alibi_slopes, attn_bias = None, None
    if c["alibi"]:
        alibi_slopes = torch.rand(batch_size, nheads, generator=g, dtype=torch.float32) * 0.3
        attn_bias = attn_bias_from_alibi_slopes(alibi_slopes, sq, sk, causal=c["causal"])
    mask, mod = _attnlab_args(window_size, c["causal"], alibi_slopes, c["softcap"])
    out = attnlab.attention(q, k, v, mask=mask, score_mod=mod, layout="bnhd", backend="flash")
    kw = dict(attn_bias=attn_bias, causal=c["causal"], window_size=window_size, softcap=c["softcap"])
    out_ref, _ = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    flash_rule(out, out_ref, out_pt, 2.0, dtype, "out")
    gout = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), gout)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), gout)
    grads_pt = torch.autograd.grad(out_pt, (q, k, v), gout)
    for name, a, r, p in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt, strict=True):
        ok = ~torch.isnan(r)  # the reference's softmax gives NaN gradients on rows with no visible key
        flash_rule(a, r, p, 3.0, dtype, name, rows=ok)


VARLEN_CASES = [
    dict(sq=sq, sk=sk, d=d, **c)
    for (sq, sk), d, c in zip(
        [(113, 203), (239, 1), (799, 3), (128, 217), (97, 97), (1, 239)],
        [40, 59, 111, 256, 59, 40],
        _matrix(6),
        strict=True,
    )
]


@pytest.mark.parametrize("c", VARLEN_CASES, ids=_ids)
def test_flash_attn_varlen_output(c, request):
    """Port of test_flash_attn.py::test_flash_attn_varlen_output: random padding masks
    (generate_random_padding_mask), unpadded into packed (total, H, D) with cu_seqlens,
    against attention_ref on the padded batch with query/key padding masks."""
    _xfail_known(request, c, "varlen")
    g = torch.Generator().manual_seed(1)
    batch_size, nheads = 3, 4
    nheads_k = nheads if c["mha_type"] == "mha" else (1 if c["mha_type"] == "mqa" else 2)
    sq, sk, d, dtype = c["sq"], c["sk"], c["d"], c["dtype"]
    window_size = (-1, -1) if not c["local"] else tuple(torch.randint(0, sk, (2,), generator=g).tolist())
    q = torch.randn(batch_size, sq, nheads, d, generator=g).to(dtype)
    if c["softcap"] > 0:
        q = q * c["softcap"]
    k = torch.randn(batch_size, sk, nheads_k, d, generator=g).to(dtype)
    v = torch.randn(batch_size, sk, nheads_k, d, generator=g).to(dtype)
    qpm = generate_random_padding_mask(sq, batch_size, "random", generator=g)
    kpm = generate_random_padding_mask(sk, batch_size, "random", generator=g)
    alibi_slopes, attn_bias = None, None
    if c["alibi"]:
        alibi_slopes = torch.rand(batch_size, nheads, generator=g, dtype=torch.float32) * 0.3
        attn_bias = attn_bias_from_alibi_slopes(alibi_slopes, sq, sk, qpm, kpm, causal=c["causal"])
    q_unpad, k_unpad, v_unpad = q[qpm], k[kpm], v[kpm]  # (total, H, D), sequences in batch order
    cu_q = torch.nn.functional.pad(qpm.sum(-1).cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(kpm.sum(-1).cumsum(0), (1, 0)).to(torch.int32)
    q_unpad, k_unpad, v_unpad = (t.detach().requires_grad_() for t in (q_unpad, k_unpad, v_unpad))
    out_unpad = attnlab.varlen_attention(
        q_unpad,
        k_unpad,
        v_unpad,
        cu_q,
        cu_k,
        sq,
        sk,
        causal=c["causal"],
        window_size=window_size,
        softcap=c["softcap"],
        alibi_slopes=alibi_slopes,
    )
    out = torch.zeros(batch_size, sq, nheads, d, dtype=dtype)
    out[qpm] = out_unpad.detach()
    kw = dict(attn_bias=attn_bias, causal=c["causal"], window_size=window_size, softcap=c["softcap"])
    out_ref, _ = attention_ref(q, k, v, qpm, kpm, **kw)
    out_pt, _ = attention_ref(q, k, v, qpm, kpm, upcast=False, reorder_ops=True, **kw)
    flash_rule(out, out_ref, out_pt, 2.0, dtype, "out")
    # gradients: the padded reference's, gathered at the real tokens
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    gout = torch.randn(out_unpad.shape, generator=g).to(dtype)
    gpad = torch.zeros(batch_size, sq, nheads, d, dtype=dtype)
    gpad[qpm] = gout
    grads = torch.autograd.grad(out_unpad, (q_unpad, k_unpad, v_unpad), gout)
    for upcast, name in ((True, "ref"), (False, "pt")):
        o, _ = attention_ref(qr, kr, vr, qpm, kpm, upcast=upcast, reorder_ops=not upcast, **kw)
        gq, gk, gv = torch.autograd.grad(o, (qr, kr, vr), gpad)
        if name == "ref":
            ref = (gq[qpm], gk[kpm], gv[kpm])
        else:
            pt = (gq[qpm], gk[kpm], gv[kpm])
    for name, a, r, p in zip(("dq", "dk", "dv"), grads, ref, pt, strict=True):
        flash_rule(a, r, p, 3.0, dtype, name, rows=~torch.isnan(r))


KVCACHE_CASES = [
    dict(sq=sq, sk=sk, d=d, new=new, **c)
    for (sq, sk), d, new, c in zip(
        [(1, 128), (1, 339), (3, 1024)[:2], (64, 800), (1, 799), (4, 203)],
        [59, 40, 111, 256, 59, 40],
        [False, True, False, True, True, False],
        _matrix(6),
        strict=True,
    )
]


@pytest.mark.parametrize("c", KVCACHE_CASES, ids=lambda c: _ids(c) + ("-new_kv" if c["new"] else ""))
def test_flash_attn_kvcache(c):
    """Port of test_flash_attn.py::test_flash_attn_kvcache (no rotary, no paging): per-batch
    ``cache_seqlens``, optionally appending ``seqlen_new = seqlen_q`` new keys first; the
    query of batch b sits at the end of its own cache (attnlab: a (B,) ``q_offset`` and
    ``masks.padding(lengths)``)."""
    g = torch.Generator().manual_seed(2)
    batch_size, nheads = 2, 4
    nheads_k = nheads if c["mha_type"] == "mha" else (1 if c["mha_type"] == "mqa" else 2)
    sq, sk, d, dtype = c["sq"], c["sk"], c["d"], c["dtype"]
    window_size = (-1, -1) if not c["local"] else tuple(torch.randint(0, sk, (2,), generator=g).tolist())
    seqlen_new = sq if c["new"] else 0
    q = torch.randn(batch_size, sq, nheads, d, generator=g).to(dtype)
    k_cache = torch.randn(batch_size, sk, nheads_k, d, generator=g).to(dtype)
    v_cache = torch.randn(batch_size, sk, nheads_k, d, generator=g).to(dtype)
    cache_seqlens = torch.randint(0 if seqlen_new else 1, sk - seqlen_new + 1, (batch_size,), generator=g)
    if seqlen_new:  # flash_attn_with_kvcache's k/v append, done by hand (a cache's job in attnlab)
        k_new = torch.randn(batch_size, seqlen_new, nheads_k, d, generator=g).to(dtype)
        v_new = torch.randn(batch_size, seqlen_new, nheads_k, d, generator=g).to(dtype)
        for b in range(batch_size):
            s = int(cache_seqlens[b])
            k_cache[b, s : s + seqlen_new], v_cache[b, s : s + seqlen_new] = k_new[b], v_new[b]
    lengths = cache_seqlens + seqlen_new
    key_padding_mask = torch.arange(sk).view(1, -1) < lengths.view(-1, 1)
    alibi_slopes, attn_bias = None, None
    if c["alibi"]:
        alibi_slopes = torch.rand(batch_size, nheads, generator=g, dtype=torch.float32) * 0.3
        attn_bias = attn_bias_from_alibi_slopes(alibi_slopes, sq, sk, None, key_padding_mask, causal=c["causal"])
    mask, mod = _attnlab_args(window_size, c["causal"], alibi_slopes, c["softcap"])
    mask = masks.padding(lengths) if mask is None else masks.padding(lengths) & mask
    out = attnlab.attention(
        q, k_cache, v_cache, mask=mask, score_mod=mod, q_offset=lengths - sq, layout="bnhd", backend="flash"
    )
    kw = dict(attn_bias=attn_bias, causal=c["causal"], window_size=window_size, softcap=c["softcap"])
    out_ref, _ = attention_ref(q, k_cache, v_cache, None, key_padding_mask, **kw)
    out_pt, _ = attention_ref(q, k_cache, v_cache, None, key_padding_mask, upcast=False, reorder_ops=True, **kw)
    flash_rule(out, out_ref, out_pt, 2.0, dtype, "out")


def test_matrix_covers_every_axis_value():
    """The sampled matrix is not a subset that misses a value of some axis."""
    for cases in (OUTPUT_CASES,):
        for key, values in AXES.items():
            assert {str(c[key]) for c in cases} == {str(x) for x in values}, key
    assert {c["d"] for c in OUTPUT_CASES} == set(HEAD_DIMS)
    assert set(itertools.chain(*[((c["sq"], c["sk"]),) for c in OUTPUT_CASES])) == set(SHAPES)
