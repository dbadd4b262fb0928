"""The transformers bridge: tiny random-weight models under attn_implementation="attnlab"
must match the same weights under "eager" (float32, 1e-5 absolute) — plain forward,
padded batches (compared where eager's output is defined: not on padded query rows),
greedy generation with a KV cache, and gradients."""

from __future__ import annotations

import types

import pytest
import torch

from tests.helpers import F32_MODEL_PARITY, F32_MODEL_PARITY_GRAD

T = pytest.importorskip("transformers")
from attnlab.models import bridge  # noqa: E402

V = 61  # vocabulary


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert bridge.register() == "attnlab"


def _gpt2():
    return T.GPT2LMHeadModel(
        T.GPT2Config(
            n_layer=2,
            n_head=4,
            n_embd=64,
            vocab_size=V,
            n_positions=64,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
        )
    )


def _llama():  # GQA 4:2
    return T.LlamaForCausalLM(
        T.LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )


def _mistral():  # sliding window 4 < sequence length: the windowed mask is really used
    return T.MistralForCausalLM(
        T.MistralConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=4,
            max_position_embeddings=64,
        )
    )


def _gemma2():  # alternating sliding (4) / full layers; softcap 0.5 and larger weights, so the cap bites
    return T.Gemma2ForCausalLM(
        T.Gemma2Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            attn_logit_softcapping=0.5,
            query_pre_attn_scalar=8,
            max_position_embeddings=64,
            initializer_range=0.3,
        )
    )


DECODERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "gemma2": _gemma2}
_cache: dict = {}


def model_for(family):
    if family not in _cache:
        torch.manual_seed(0)
        _cache[family] = DECODERS[family]().float().eval()
    return _cache[family]


def run(model, impl, **inputs):
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        return model(**inputs)


def left_padded(n=11, pads=(0, 3, 6)):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (len(pads), n), generator=g)
    am = torch.ones_like(ids)
    for b, p in enumerate(pads):
        ids[b, :p], am[b, :p] = 0, 0
    return ids, am


@pytest.mark.parametrize("family", DECODERS)
def test_plain_forward_matches_eager(family):
    m = model_for(family)
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(2))
    want, got = run(m, "eager", input_ids=ids).logits, run(m, "attnlab", input_ids=ids).logits
    torch.testing.assert_close(got, want, **F32_MODEL_PARITY)


@pytest.mark.parametrize("family", DECODERS)
def test_left_padded_batch_matches_eager_on_real_tokens(family):
    m = model_for(family)
    ids, am = left_padded()
    want = run(m, "eager", input_ids=ids, attention_mask=am).logits
    got = run(m, "attnlab", input_ids=ids, attention_mask=am).logits
    assert torch.isfinite(got).all()  # padded rows are fully masked: zeros, never NaN
    real = am.bool()
    torch.testing.assert_close(got[real], want[real], **F32_MODEL_PARITY)


@pytest.mark.parametrize("family", DECODERS)
def test_greedy_generate_with_kv_cache_is_token_identical(family):
    m = model_for(family)
    ids, am = left_padded(n=6, pads=(0, 2))
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    m.set_attn_implementation("eager")
    want = m.generate(**kw)
    m.set_attn_implementation("attnlab")
    got = m.generate(**kw)
    assert torch.equal(got, want)


def test_static_cache_generate_uses_top_left_prefill():
    # StaticCache prefill: the mask is skipped (None) with Nk = max_cache_len > Nq and
    # q_offset 0, so causal must be aligned top-left, not bottom-right.
    m = model_for("llama")
    ids = torch.randint(1, V, (1, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(
        input_ids=ids,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        cache_implementation="static",
    )
    m.set_attn_implementation("eager")
    want = m.generate(**kw)
    m.set_attn_implementation("attnlab")
    assert torch.equal(m.generate(**kw), want)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradients_match_eager(family):
    m = model_for(family)
    ids, am = left_padded(n=9, pads=(0, 2))
    grads = {}
    for impl in ("eager", "attnlab"):
        m.set_attn_implementation(impl)
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=ids, attention_mask=am).logits
        valid = (am[:, :-1] & am[:, 1:]).bool()  # a padded row's logits are not eager's to define
        torch.nn.functional.cross_entropy(logits[:, :-1][valid], ids[:, 1:][valid]).backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    assert grads["eager"].keys() == grads["attnlab"].keys() and len(grads["eager"]) > 5
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["attnlab"][n], g, **F32_MODEL_PARITY_GRAD, msg=n)


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    cfg = T.BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return T.BertModel(cfg).float().eval()


def test_bert_right_padding_and_gradients(bert):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, V, (3, 10), generator=g)
    am = torch.ones_like(ids)
    am[1, 7:], am[2, 4:] = 0, 0
    for inputs in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=am)):
        want = run(bert, "eager", **inputs).last_hidden_state
        got = run(bert, "attnlab", **inputs).last_hidden_state
        real = inputs.get("attention_mask", torch.ones_like(ids)).bool()
        torch.testing.assert_close(got[real], want[real], **F32_MODEL_PARITY)
    grads, w = [], torch.randn(32, generator=g)  # (not h**2: LayerNorm makes that nearly constant)
    for impl in ("eager", "attnlab"):
        bert.set_attn_implementation(impl)
        bert.zero_grad(set_to_none=True)
        h = bert(input_ids=ids, attention_mask=am).last_hidden_state
        (h[am.bool()] @ w).sin().sum().backward()
        grads.append({n: p.grad.clone() for n, p in bert.named_parameters() if p.grad is not None})
    bert.zero_grad(set_to_none=True)
    for n, gr in grads[0].items():
        torch.testing.assert_close(grads[1][n], gr, **F32_MODEL_PARITY_GRAD, msg=n)


def test_the_bridge_really_runs(monkeypatch):
    m = model_for("llama")
    calls = []
    real = bridge.attention
    monkeypatch.setattr(bridge, "attention", lambda *a, **k: calls.append(k["mask"]) or real(*a, **k))
    ids, am = left_padded()
    run(m, "attnlab", input_ids=ids, attention_mask=am)
    assert len(calls) == m.config.num_hidden_layers
    assert calls[0] is calls[1] and calls[0] is not None  # one attnlab mask shared by the layers
    run(m, "eager", input_ids=ids)
    assert len(calls) == m.config.num_hidden_layers


def test_output_attentions_returns_weights():
    m = model_for("llama")
    ids, am = left_padded(pads=(0, 4))
    want = run(m, "eager", input_ids=ids, attention_mask=am, output_attentions=True).attentions
    got = run(m, "attnlab", input_ids=ids, attention_mask=am, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    real = am.bool()
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.transpose(1, 2)[real], w.transpose(1, 2)[real], **F32_MODEL_PARITY)
        assert (g.transpose(1, 2)[~real] == 0).all()  # fully masked rows: zeros, not eager's uniform


def test_output_attentions_weights_carry_the_gradient():
    """As eager: the returned weights are the ones the output is computed from, so they get
    gradients (transformers' test_retain_grad_hidden_states_attentions; Gemma-2 via eager)."""
    m = model_for("llama")  # GQA 4:2
    ids, am = left_padded(pads=(0, 4))
    want = run(m, "eager", input_ids=ids, attention_mask=am).logits
    m.set_attn_implementation("attnlab")
    out = m(input_ids=ids, attention_mask=am, output_attentions=True)
    real = am.bool()
    torch.testing.assert_close(out.logits[real], want[real], **F32_MODEL_PARITY)
    grads = torch.autograd.grad(out.logits[real].sum(), out.attentions, allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_training_with_attention_dropout_runs_it():
    """(Was refused with NotImplementedError; tests/models/test_bridge_dropout.py covers it.)"""
    torch.manual_seed(0)
    m = T.GPT2LMHeadModel(
        T.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=V, attn_pdrop=0.5, embd_pdrop=0.0, resid_pdrop=0.0)
    )
    m.set_attn_implementation("attnlab")
    ids = torch.randint(1, V, (1, 5))
    m.eval()
    assert torch.equal(m(input_ids=ids).logits, m(input_ids=ids).logits)  # dropout is off in eval mode
    m.train()
    assert not torch.equal(m(input_ids=ids).logits, m(input_ids=ids).logits)  # on in training


def test_register_names_and_backend():
    assert bridge.register() == bridge.register() == "attnlab"
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    assert "attnlab" in T.AttentionInterface._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS["attnlab"] is sdpa_mask
    for bad in ("attnlab_flash", "my_sdpa", "eager", "", "flex_x"):
        with pytest.raises(ValueError, match="register"):
            bridge.register(name=bad)
    with pytest.raises(ValueError, match="backend"):
        bridge.register(name="attnlab_x", backend="cuda")
    assert bridge.register(name="attnlab_ref", backend="reference") == "attnlab_ref"
    m = model_for("mistral")
    ids, am = left_padded()
    want = run(m, "eager", input_ids=ids, attention_mask=am).logits
    got = run(m, "attnlab_ref", input_ids=ids, attention_mask=am).logits
    torch.testing.assert_close(got[am.bool()], want[am.bool()], **F32_MODEL_PARITY)


# --------------------------------------------------------------- the function itself
def _qkv(B=2, H=4, Hkv=2, Nq=7, Nk=7, D=8, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, Nq, D, generator=g),
        torch.randn(B, Hkv, Nk, D, generator=g),
        torch.randn(B, Hkv, Nk, D, generator=g),
    )


def _module(H=4, Hkv=2, **kw):
    return types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=H // Hkv, head_dim=8, **kw)


def _eager(mod, q, k, v, mask, **kw):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    return eager_attention_forward(mod, q, k, v, mask, **kw)


def _mask(fn, Nq, Nk, q_offset, B=2):
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(B, Nq, Nk, q_offset=q_offset, mask_function=fn, allow_is_causal_skip=False)


def test_mask_none_alignment_decode_and_sliding_window():
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    mod = _module()
    for Nq, Nk, w in ((7, 7, None), (1, 9, None), (7, 7, 3), (1, 9, 3)):
        q, k, v = _qkv(Nq=Nq, Nk=Nk)
        fn = causal_mask_function if w is None else sliding_window_causal_mask_function(w)
        dense = _mask(fn, Nq, Nk, q_offset=Nk - Nq)  # cache positions: the queries are the newest tokens
        want = _eager(mod, q, k, v, torch.zeros(dense.shape).masked_fill(~dense, float("-inf")))[0]
        got = bridge.attention_forward(mod, q, k, v, None, sliding_window=w)[0]
        torch.testing.assert_close(got, want, **F32_MODEL_PARITY)
    # static-cache prefill: Nk > Nq > 1 with mask None means q_offset = 0 (top-left)
    q, k, v = _qkv(Nq=4, Nk=9)
    dense = _mask(causal_mask_function, 4, 9, q_offset=0)
    want = _eager(mod, q, k, v, torch.zeros(dense.shape).masked_fill(~dense, float("-inf")))[0]
    torch.testing.assert_close(bridge.attention_forward(mod, q, k, v, None)[0], want, **F32_MODEL_PARITY)
    # not causal: no mask at all
    got = bridge.attention_forward(_module(), q, k, v, None, is_causal=False)[0]
    torch.testing.assert_close(got, _eager(mod, q, k, v, None)[0], **F32_MODEL_PARITY)


def test_dense_masks_bool_additive_bias_and_empty_rows():
    mod = _module()
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(6)
    keep = torch.rand(2, 4, 7, 7, generator=g) > 0.4  # per-head boolean mask
    keep[1, 2, 3] = False  # one fully masked row
    bias = torch.randn(2, 1, 7, 7, generator=g)
    for hide in (float("-inf"), torch.finfo(torch.float32).min):
        add = bias.expand(2, 4, 7, 7).masked_fill(~keep, hide)  # additive mask with real bias values
        want = _eager(mod, q, k, v, add)[0]
        for mask in (add, keep):
            got = bridge.attention_forward(mod, q, k, v, mask)[0]
            assert torch.isfinite(got).all()
            defined = keep.any(-1).transpose(1, 2)  # (B, Nq, H) rows with a visible key
            ref = want if mask is add else _eager(mod, q, k, v, torch.zeros(keep.shape).masked_fill(~keep, hide))[0]
            torch.testing.assert_close(got[defined], ref[defined], **F32_MODEL_PARITY)
            assert (got[~defined] == 0).all()


def test_softcap_and_position_bias():
    mod = _module()
    q, k, v = _qkv()
    q = q * 4  # scores well beyond the cap
    causal = torch.ones(7, 7).tril().bool().expand(2, 1, 7, 7)
    add = torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))
    want = _eager(mod, q, k, v, add, softcap=0.7, scaling=0.3)[0]
    got = bridge.attention_forward(mod, q, k, v, causal, softcap=0.7, scaling=0.3)[0]
    torch.testing.assert_close(got, want, **F32_MODEL_PARITY)
    assert (got - bridge.attention_forward(mod, q, k, v, causal, scaling=0.3)[0]).abs().max() > 1e-2
    pb = torch.randn(1, 4, 7, 7, requires_grad=True)
    got = bridge.attention_forward(mod, q, k, v, None, position_bias=pb)[0]
    want = _eager(mod, q, k, v, add + pb)[0]
    torch.testing.assert_close(got, want, **F32_MODEL_PARITY)
    (gb,) = torch.autograd.grad(got.square().sum(), pb)
    (wb,) = torch.autograd.grad(want.square().sum(), pb)
    torch.testing.assert_close(gb, wb, **F32_MODEL_PARITY_GRAD)


def test_gpt_oss_sinks():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv()
    sinks = torch.randn(4, requires_grad=True)
    mod = _module(sinks=sinks)
    causal = torch.ones(7, 7).tril().bool().expand(2, 1, 7, 7)
    add = torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))
    want, want_w = eager_attention_forward(mod, q, k, v, add, scaling=0.35)
    got, got_w = bridge.attention_forward(mod, q, k, v, causal, scaling=0.35, s_aux=sinks, output_attentions=True)
    torch.testing.assert_close(got, want, **F32_MODEL_PARITY)
    torch.testing.assert_close(got_w, want_w, **F32_MODEL_PARITY)
    (gs,) = torch.autograd.grad(got.sum(), sinks)
    (ws,) = torch.autograd.grad(want.sum(), sinks)
    torch.testing.assert_close(gs, ws, **F32_MODEL_PARITY_GRAD)


def test_bad_masks_and_unsupported_options():
    mod = _module()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="attention_mask"):
        bridge.attention_forward(mod, q, k, v, torch.ones(2, 1, 7, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask"):
        bridge.attention_forward(mod, q, k, v, torch.ones(2, 7))
    with pytest.raises(NotImplementedError, match="sinks"):
        bridge.attention_forward(mod, q, k, v, None, sinks=torch.zeros(2, 4, 7, 1))


def test_dense_mask_cache_follows_the_tensor():
    mod = _module()
    q, k, v = _qkv()
    keep = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    a = bridge.attention_forward(mod, q, k, v, keep)[0]
    keep[:, :, :, 0] = False  # in place: must not reuse the mask derived before
    b = bridge.attention_forward(mod, q, k, v, keep)[0]
    assert (b[:, 0] == 0).all() and not torch.equal(a, b)
    del keep
    assert bridge._last[0] is None  # nothing is kept alive once the model's mask is gone
