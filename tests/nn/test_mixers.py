"""LinearAttentionMixer against a hand computation, make_mixer, the mixer config fields, and
Decoders that differ only in their mixer."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from attnlab.nn import Block, Decoder, DecoderConfig, EncoderConfig, MultiHeadAttention
from attnlab.nn.mixers import LinearAttentionMixer, make_mixer
from attnlab.nn.ssm import RecurrentCache, SSMMixer
from attnlab.ops.linear import FavorFeatures, naive_linear_attention
from attnlab.positions import RoPE
from attnlab.train.data import TokenStream
from attnlab.train.loop import TrainConfig, train
from tests.helpers import F32_REORDER, F64_REORDER, F64_REORDER_DEEP

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the root conftest's one-thread fixture


def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
    return module


def hand_linear(m, x, causal, feature_map="elu", pos=0):
    """q, k, v from the per-head weight views, the quadratic reference, then W_O."""
    q = torch.einsum("bnd,hde->bhne", x, m.W_Q)
    k = torch.einsum("bnd,hde->bhne", x, m.W_K)
    v = torch.einsum("bnd,hde->bhne", x, m.W_V)
    if m.qkv_bias is not None:
        H, Hkv, dh = m.n_heads, m.n_kv_heads, m.d_head
        bq, bk, bv = m.qkv_bias.split((H * dh, Hkv * dh, Hkv * dh))
        q, k, v = q + bq.view(H, 1, dh), k + bk.view(Hkv, 1, dh), v + bv.view(Hkv, 1, dh)
    if m.positions is not None:
        q, k = m.positions(q, pos), m.positions(k, pos)
    z = naive_linear_attention(q, k, v, feature_map=feature_map, causal=causal)
    out = torch.einsum("bhne,hed->bnd", z, m.W_O)
    return out if m.out_bias is None else out + m.out_bias


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kw", [dict(), dict(n_kv_heads=2), dict(bias=False, d_head=5)])
def test_linear_mixer_equals_hand_computation(causal, kw):
    m = randomize(LinearAttentionMixer(24, 4, **kw)).double()
    x = torch.randn(2, 13, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = m(x, mask=masks.causal() if causal else None)
    torch.testing.assert_close(got, hand_linear(m, x, causal), **F64_REORDER)


def test_linear_mixer_with_rope_and_favor_equals_hand_computation():
    rope = RoPE(8)
    m = randomize(LinearAttentionMixer(16, 2, feature_map="favor", positions=rope, chunk_size=4)).double()
    assert isinstance(m.feature_map, FavorFeatures) and m.feature_map.n_features == 32
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = m(x, mask=masks.causal(), pos=5)
    torch.testing.assert_close(got, hand_linear(m, x, True, m.feature_map, pos=5), **F64_REORDER_DEEP)
    # the positions matter: a different offset gives a different output
    assert (m(x, mask=masks.causal(), pos=0) - got).abs().max() > 1e-6


def test_linear_mixer_pattern_averages_v():
    m = randomize(LinearAttentionMixer(16, 2, n_kv_heads=1)).double()
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out, w = m(x, mask=masks.causal(), need_weights=True)
    assert w.shape == (2, 2, 7, 7) and (w.triu(1) == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 7, dtype=w.dtype))
    _, _, v = m.project(x)
    z = w.double() @ v.expand(-1, 2, -1, -1)
    want = torch.einsum("bhne,hed->bnd", z, m.W_O) + m.out_bias
    torch.testing.assert_close(out, want, **F32_REORDER)  # the pattern is float32


def test_linear_mixer_has_multiheadattention_parameters():
    lin, mha = LinearAttentionMixer(32, 4, n_kv_heads=2), MultiHeadAttention(32, 4, n_kv_heads=2)
    assert {k: v.shape for k, v in lin.state_dict().items()} == {k: v.shape for k, v in mha.state_dict().items()}
    mha.load_state_dict(lin.state_dict())
    torch.testing.assert_close(mha.W_Q, lin.W_Q)
    torch.testing.assert_close(mha.W_O, lin.W_O)


def test_linear_mixer_cache_equals_full():
    m = randomize(LinearAttentionMixer(16, 2, positions=RoPE(8))).double()
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    full = m(x, mask=masks.causal())
    c = RecurrentCache()
    parts = [m(x[:, :4], mask=masks.causal(), cache=c)] + [
        m(x[:, t : t + 1], mask=masks.causal(), cache=c) for t in range(4, 10)
    ]
    torch.testing.assert_close(torch.cat(parts, 1), full, **F64_REORDER)
    assert c.seen == 10


def test_linear_mixer_errors():
    m = LinearAttentionMixer(16, 2)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="mask: linear attention takes None"):
        m(x, mask=masks.sliding_window(2))
    with pytest.raises(ValueError, match=r"pass masks.causal"):
        m(x, cache=RecurrentCache())
    with pytest.raises(TypeError, match="cache: linear attention keeps a recurrent state"):
        m(x, mask=masks.causal(), cache=[])
    with pytest.raises(ValueError, match="feature_map: expected one of"):
        LinearAttentionMixer(16, 2, feature_map="relu")
    from attnlab.positions import ALiBi

    with pytest.raises(TypeError, match=r"positions: linear attention takes None or a positions.RoPE"):
        LinearAttentionMixer(16, 2, positions=ALiBi(2))


# ----------------------------------------------------------------------------- config and factory
def cfg(**kw):
    base = dict(vocab_size=16, d_model=16, n_layers=2, n_heads=2, max_positions=32)
    base.update(kw)
    return DecoderConfig(**base)


def test_make_mixer_and_block_keep_the_attn_name():
    assert type(make_mixer(cfg())) is MultiHeadAttention
    assert type(make_mixer(cfg(mixer="linear", linear_feature_map="favor"))) is LinearAttentionMixer
    ssm = make_mixer(cfg(mixer="ssm", d_state=4, ssm_expand=2, ssm_conv=0))
    assert isinstance(ssm, SSMMixer) and (ssm.d_state, ssm.d_inner, ssm.conv) == (4, 32, None)
    assert isinstance(Block(cfg(mixer="ssm")).attn, SSMMixer)
    names = set(Decoder(cfg(mixer="linear")).state_dict())
    assert names == set(Decoder(cfg()).state_dict())  # same checkpoint layout as softmax attention


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match=r"DecoderConfig.mixer: expected one of \('attention', 'linear', 'ssm'\)"):
        cfg(mixer="mamba")
    with pytest.raises(ValueError, match=r"DecoderConfig.d_state: expected an int >= 1"):
        cfg(mixer="ssm", d_state=0)
    with pytest.raises(ValueError, match=r"DecoderConfig.linear_feature_map"):
        cfg(linear_feature_map="relu")
    with pytest.raises(ValueError, match="positions='alibi' biases softmax scores"):
        cfg(mixer="linear", positions="alibi")
    with pytest.raises(ValueError, match=r"attn_dropout=0.1 drops softmax probabilities"):
        cfg(mixer="ssm", attn_dropout=0.1)
    with pytest.raises(ValueError, match=r"n_kv_heads=1 .GQA. means nothing"):
        cfg(mixer="ssm", n_kv_heads=1)
    with pytest.raises(ValueError, match=r"EncoderConfig.mixer"):
        EncoderConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, mixer="linear")
    c = cfg(mixer="ssm", d_state=8, positions="rope")
    assert DecoderConfig.from_dict(c.to_dict()) == c
    assert c.replace(mixer="linear").mixer == "linear" and c.replace(mixer="linear").d_state == 8
    old = cfg().to_dict()
    for f in ("mixer", "d_state", "ssm_expand", "ssm_conv", "linear_feature_map"):
        old.pop(f)
    assert DecoderConfig.from_dict(old).mixer == "attention"  # configs saved before the field existed


# ----------------------------------------------------------------------------- decoders
@pytest.mark.parametrize("mixer", ["attention", "linear", "ssm"])
def test_decoder_trains_with_each_mixer(mixer):
    torch.manual_seed(0)
    model = Decoder(cfg(mixer=mixer, positions="rope", d_state=8))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".attn." in n}
    data = TokenStream(torch.arange(400) % 8).batches(8, 12, seed=0)  # 0 1 2 ... 7 0 1 ...
    res = train(model, data, TrainConfig(steps=15, batch_size=8, seq_len=12, lr=1e-2, warmup_steps=2), progress=False)
    first, last = sum(res.losses[:3]) / 3, sum(res.losses[-3:]) / 3
    assert last < 0.75 * first, (mixer, first, last)
    after = dict(model.named_parameters())
    for name, p0 in before.items():  # every parameter of the mixer was trained
        assert not torch.equal(after[name].detach(), p0), name


@pytest.mark.parametrize("mixer", ["linear", "ssm"])
def test_decoder_recurrent_cache_equals_full_forward(mixer):
    torch.manual_seed(1)
    model = Decoder(cfg(mixer=mixer, positions="rope")).double().eval()
    ids = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits
    cache = RecurrentCache.for_layers(2)
    parts = [model(ids[:, :5], cache=cache).logits] + [
        model(ids[:, t : t + 1], cache=cache).logits for t in range(5, 9)
    ]
    torch.testing.assert_close(torch.cat(parts, 1), full, **F64_REORDER)


def test_decoder_mixer_errors_and_patterns():
    ids = torch.randint(0, 16, (2, 5))
    with pytest.raises(ValueError, match="output_attentions: the SSM mixer"):
        Decoder(cfg(mixer="ssm"))(ids, output_attentions=True)
    with pytest.raises(ValueError, match="mask: the SSM scan is causal"):
        Decoder(cfg(mixer="ssm"))(ids, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    out = Decoder(cfg(mixer="linear"))(ids, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 2, 5, 5)


def test_equal_size_models():
    """Defaults keep the three mixers' parameter counts within 10% of softmax attention's."""
    counts = {
        m: sum(p.numel() for p in Decoder(cfg(mixer=m, d_model=64, n_heads=4)).blocks[0].attn.parameters())
        for m in ("attention", "linear", "ssm")
    }
    assert counts["linear"] == counts["attention"]
    assert abs(counts["ssm"] - counts["attention"]) <= 0.1 * counts["attention"], counts


@pytest.mark.parametrize("mixer", ["linear", "ssm"])
def test_generate_with_a_recurrent_cache_equals_recomputing(mixer):
    from attnlab.generate import generate

    torch.manual_seed(3)
    model = Decoder(cfg(mixer=mixer, positions="rope")).eval()
    prompt = [[1, 2, 3, 4], [5, 6, 7, 8]]
    fast = generate(model, prompt, max_new_tokens=6, cache=RecurrentCache.for_layers(2)).new_tokens
    slow = generate(model, prompt, max_new_tokens=6, cache=None).new_tokens
    assert torch.equal(torch.as_tensor(fast), torch.as_tensor(slow))
    # a KV-cache name picks the recurrent state for these mixers (tests/test_generate.py covers the errors)
    assert generate(model, prompt, max_new_tokens=6, cache="dynamic").new_tokens == fast
