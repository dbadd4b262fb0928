"""Capture: the recorded tensors and recomputed patterns equal the reference, outputs are
unchanged, the fast path stays on, hooks are removed, transformers models work via the bridge."""

import pytest
import torch

import attnlab.nn.attention as attn_mod
from attnlab import masks
from attnlab.interp import attention_modules, capture
from attnlab.nn import Decoder, DecoderConfig, MultiHeadAttention
from attnlab.positions import RoPE
from tests.helpers import F32_ACCUMULATED_SUM, F32_MODEL_PARITY, F32_PROBS, F32_RECOMPUTE


def _decoder(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, d_model=32, n_layers=3, n_heads=4, positions="rope")
    cfg.update(kw)
    return Decoder(DecoderConfig(**cfg)).eval()


@pytest.mark.parametrize(
    "kw", [dict(), dict(n_kv_heads=2), dict(n_kv_heads=1, positions="alibi"), dict(positions="learned", attn_only=True)]
)
def test_patterns_equal_output_attentions(kw):
    model = _decoder(**kw)
    ids = torch.randint(0, 40, (2, 11))
    want = model(ids, output_attentions=True)
    with capture(model) as cap:
        got = model(ids)
    assert torch.equal(got.logits, model(ids).logits)  # observing changes nothing
    for l in range(3):
        torch.testing.assert_close(cap.pattern(l), want.attentions[l], **F32_PROBS)
        # a subset of heads, in any order: head-dependent mods (ALiBi) keep their head index
        torch.testing.assert_close(cap.pattern(l, heads=[3, 1]), want.attentions[l][:, [3, 1]], **F32_PROBS)
    assert cap.patterns().shape == (3, 2, 4, 11, 11)


def test_z_is_the_per_head_output_before_W_O():
    torch.manual_seed(1)
    mha = MultiHeadAttention(24, 6, 2, positions=RoPE(4)).eval()
    x = torch.randn(2, 7, 24)
    with capture(mha) as cap:
        out = mha(x, mask=masks.causal())
    z = cap[0].z
    assert z.shape == (2, 6, 7, 4)
    recon = torch.einsum("bhnd,hdm->bnm", z, mha.W_O) + mha.b_O
    torch.testing.assert_close(recon, out, **F32_ACCUMULATED_SUM)
    # z equals pattern @ v for each head, with v read through the GQA mapping
    p = cap.pattern(0)
    v = cap[0].v.repeat_interleave(3, dim=1)
    torch.testing.assert_close(p @ v, z, **F32_RECOMPUTE)


def test_fast_path_stays_on_and_nothing_materializes_during_forward(monkeypatch):
    model = _decoder()
    ids = torch.randint(0, 40, (1, 16))

    def forbidden(*a, **k):
        raise AssertionError("attention_probs was called during the forward pass")

    monkeypatch.setattr(attn_mod, "attention_probs", forbidden)
    with capture(model, layers=[0, 2], keep=("q", "k")) as cap:
        model(ids)
    assert cap[0].v is None and cap[0].z is None and cap[2].q.shape == (1, 4, 16, 8)
    with pytest.raises(ValueError, match="layer"):
        cap[1]


def test_hooks_removed_even_after_an_error():
    model = _decoder()
    with pytest.raises(RuntimeError), capture(model):
        raise RuntimeError("boom")
    assert all(not m.hooks for _, m, _ in attention_modules(model))


def test_capture_with_kv_cache_records_each_step():
    from attnlab.cache import DynamicCache

    model = _decoder(n_kv_heads=2)
    ids = torch.randint(0, 40, (1, 8))
    full = model(ids, output_attentions=True).attentions
    cache = DynamicCache(3)
    with capture(model, layers=[1]) as cap:
        model(ids[:, :6], cache=cache)
        model(ids[:, 6:], cache=cache)
    calls = cap.calls(1)
    assert len(calls) == 2 and calls[1].k.shape[2] == 8
    # the second call's pattern is the last two rows of the full pattern
    torch.testing.assert_close(calls[1].pattern(), full[1][:, :, 6:], **F32_PROBS)


def test_bad_arguments():
    model = _decoder()
    with pytest.raises(ValueError, match="layers"), capture(model, layers=[7]):
        pass
    with pytest.raises(ValueError, match="keep"), capture(model, keep=("q", "attn")):
        pass
    with pytest.raises(ValueError, match="heads"):
        with capture(model) as cap:
            model(torch.randint(0, 40, (1, 4)))
        cap.pattern(0, heads=[4])
    with pytest.raises(ValueError, match="no attention modules"), capture(torch.nn.Linear(2, 2)):
        pass


def test_transformers_model_through_the_bridge():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=60,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 60, (2, 9))
    want = model(ids, output_attentions=True)
    with capture(model, heads=[0, 3]) as cap:
        got = model(ids)
    assert model.config._attn_implementation == "eager"  # switched back
    torch.testing.assert_close(got.logits, want.logits, **F32_MODEL_PARITY)
    for l in range(2):
        torch.testing.assert_close(cap.pattern(l), want.attentions[l][:, [0, 3]].float(), **F32_MODEL_PARITY)
    assert cap[1].k.shape == (2, 2, 9, 8)


def test_negative_layers_and_heads_mean_what_they_mean_in_python():
    model = _decoder()
    ids = torch.randint(0, 40, (1, 8))
    want = model(ids, output_attentions=True).attentions
    with capture(model, layers=[-1, 0]) as cap:
        model(ids)
    assert cap.layers == [2, 0]
    torch.testing.assert_close(cap.pattern(-1), want[2], **F32_PROBS)
    torch.testing.assert_close(cap.pattern(2, heads=[-1, -4]), want[2][:, [3, 0]], **F32_PROBS)
    assert cap[-3] is cap[0]
    with pytest.raises(ValueError, match="layers"), capture(model, layers=[-4]):
        pass
    with pytest.raises(ValueError, match="heads"):
        cap.pattern(0, heads=[-5])
