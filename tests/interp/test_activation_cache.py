"""ActivationCache: TransformerLens indexing, names_filter, and the residual-stream tools
(accumulated_resid, decompose_resid, stack_head_results, apply_ln_to_stack, logit_attrs) checked
against the identities they must satisfy on the actual forward."""

import pytest
import torch

from attnlab.interp import ActivationCache, get_act_name, run_with_cache
from attnlab.nn import Decoder, DecoderConfig, Encoder, EncoderConfig
from tests.helpers import F32_ACCUMULATED_SUM, F32_RECOMPUTE

V, D, L, H = 40, 32, 3, 4


def _decoder(kind="gpt2"):
    torch.manual_seed(0)
    kw = dict(vocab_size=V, d_model=D, n_layers=L, n_heads=H)
    if kind == "llama":
        kw.update(positions="rope", norm="rmsnorm", mlp="swiglu", act="silu", bias=False, n_kv_heads=2)
    model = Decoder(DecoderConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so that forgetting them shows
        for m in model.modules():
            if hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 1:
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.3, 0.3)
    return model


def test_indexing_like_transformerlens():
    model = _decoder()
    ids = torch.randint(0, V, (2, 5))
    _, cache = run_with_cache(model, ids)
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]
    assert torch.equal(cache["resid_post", -1], cache[f"blocks.{L - 1}.hook_resid_post"])
    assert torch.equal(cache["resid_pre", -L], cache["blocks.0.hook_resid_pre"])
    assert torch.equal(cache["scale", 0, "ln1"], cache["blocks.0.ln1.hook_scale"])
    assert torch.equal(cache["normalized", 2, "ln2"], cache["blocks.2.ln2.hook_normalized"])
    assert torch.equal(cache["scale"], cache["ln_final.hook_scale"])
    assert torch.equal(cache["embed"], cache["hook_embed"]) and torch.equal(cache["attn", 0], cache["pattern", 0])
    assert torch.equal(cache["post", 1], cache["blocks.1.mlp.hook_post"])
    assert get_act_name("rot_q", -1, n_layers=L) == f"blocks.{L - 1}.attn.hook_rot_q"
    assert ("pattern", 0) in cache and ("pattern", 7) not in cache and "nope" not in cache
    with pytest.raises(ValueError, match="layer"):
        cache["pattern", L]
    with pytest.raises(KeyError, match="hook_rot_q"):
        cache["rot_q", 0]  # no RoPE in this model
    assert not any(t.requires_grad for t in cache.values())  # detached


def test_names_filter_keeps_only_what_is_asked():
    model = _decoder()
    ids = torch.randint(0, V, (1, 5))
    _, c1 = run_with_cache(model, ids, names_filter=lambda n: n.endswith("resid_post"))
    assert c1.keys() == [f"blocks.{l}.hook_resid_post" for l in range(L)]
    _, c2 = run_with_cache(model, ids, names_filter=["blocks.2.attn.hook_pattern", "hook_embed"])
    assert c2.keys() == ["hook_embed", "blocks.2.attn.hook_pattern"] and c2["pattern", -1].shape == (1, H, 5, 5)
    with pytest.raises(KeyError, match="pattern"):
        c2.pattern(0)
    _, c3 = run_with_cache(model, ids, names_filter="logits")
    assert c3.keys() == ["logits"]
    with pytest.raises(ValueError, match="names_filter"):
        run_with_cache(model, ids, names_filter=["blocks.9.hook_resid_pre"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decompose_resid_sums_to_the_stream(kind):
    model = _decoder(kind)
    ids = torch.randint(0, V, (2, 6))
    _, cache = run_with_cache(model, ids)
    for layer in range(L + 1):
        parts, labels = cache.decompose_resid(layer, return_labels=True)
        want = cache["resid_pre", layer] if layer < L else cache["resid_post", -1]
        torch.testing.assert_close(parts.sum(0), want, **F32_ACCUMULATED_SUM)
        assert len(labels) == parts.shape[0] == (2 if kind == "gpt2" else 1) + 2 * layer
        if layer < L:
            mid = cache.decompose_resid(layer, mlp_input=True)
            torch.testing.assert_close(mid.sum(0), cache["resid_mid", layer], **F32_ACCUMULATED_SUM)
    _, labels = cache.decompose_resid(-2, mode="attn", return_labels=True)
    assert labels[-1] == f"{L - 2}_attn_out" and all("mlp" not in s for s in labels)
    one = cache.decompose_resid(pos_slice=-1)
    assert one.shape[-2] == 1
    torch.testing.assert_close(one.sum(0), cache["resid_post", -1][:, -1:], **F32_ACCUMULATED_SUM)


def test_accumulated_resid_and_apply_ln_to_stack():
    model = _decoder()
    ids = torch.randint(0, V, (2, 6))
    _, cache = run_with_cache(model, ids)
    acc, labels = cache.accumulated_resid(return_labels=True)
    assert labels == [f"{l}_pre" for l in range(L)] + ["final_post"]
    assert torch.equal(acc[-1], cache["resid_post", -1]) and torch.equal(acc[1], cache["resid_pre", 1])
    _, labels = cache.accumulated_resid(1, incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre"]
    _, labels = cache.accumulated_resid(1, mlp_input=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "1_mid"]
    # the norm as a linear map on the stack: (x - mean) / cached scale, i.e. its output without weight and bias
    fin = model.norm
    lens = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(lens[-1] * fin.weight + fin.bias, cache["ln_final.hook_normalized"], **F32_RECOMPUTE)
    ln1 = model.blocks[1].norm1
    got = cache.apply_ln_to_stack(cache["resid_pre", 1][None], 1)[0]
    torch.testing.assert_close(got * ln1.weight + ln1.bias, cache["blocks.1.ln1.hook_normalized"], **F32_RECOMPUTE)
    ln2 = model.blocks[0].norm2
    got = cache.apply_ln_to_stack(cache["resid_mid", 0][None], 0, mlp_input=True)[0]
    torch.testing.assert_close(got * ln2.weight + ln2.bias, cache["blocks.0.ln2.hook_normalized"], **F32_RECOMPUTE)
    with pytest.raises(ValueError, match="layer"):
        cache.accumulated_resid(L + 1)


def test_stack_head_results():
    model = _decoder()
    ids = torch.randint(0, V, (2, 6))
    _, cache = run_with_cache(model, ids)
    heads, labels = cache.stack_head_results(return_labels=True)
    assert heads.shape == (L * H, 2, 6, D) and labels[:2] == ["L0H0", "L0H1"] and labels[-1] == f"L{L - 1}H{H - 1}"
    for l in range(L):
        torch.testing.assert_close(
            heads[l * H : (l + 1) * H].sum(0) + model.blocks[l].attn.b_O, cache["attn_out", l], **F32_ACCUMULATED_SUM
        )
    two, labels = cache.stack_head_results(2, incl_remainder=True, return_labels=True)
    assert labels[-1] == "remainder" and two.shape[0] == 2 * H + 1
    torch.testing.assert_close(two.sum(0), cache["resid_post", 1], **F32_ACCUMULATED_SUM)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logit_attrs_sum_to_the_logit(kind):
    model = _decoder(kind)
    ids = torch.randint(0, V, (2, 6))
    logits, cache = run_with_cache(model, ids)
    parts = cache.decompose_resid()
    tok = torch.randint(0, V, (2, 6))
    attrs = cache.logit_attrs(parts, tok)
    assert attrs.shape == (parts.shape[0], 2, 6)
    W_U = model.lm_head.weight
    bias = model.norm.bias if getattr(model.norm, "bias", None) is not None else torch.zeros(D)
    want = logits.gather(-1, tok[..., None])[..., 0] - (bias * W_U[tok]).sum(-1)  # minus ln_final's bias term
    torch.testing.assert_close(attrs.sum(0), want, **F32_ACCUMULATED_SUM)
    # a logit difference: the bias terms cancel only in the sum of the two biases' terms
    bad = (tok + 1) % V
    diff = cache.logit_attrs(parts, tok, incorrect_tokens=bad).sum(0)
    want_d = want - (logits.gather(-1, bad[..., None])[..., 0] - (bias * W_U[bad]).sum(-1))
    torch.testing.assert_close(diff, want_d, **F32_ACCUMULATED_SUM)
    # an int token, one position: [components, B, 1]
    one = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), 3, pos_slice=-1)
    torch.testing.assert_close(one.sum(0)[:, 0], logits[:, -1, 3] - (bias * W_U[3]).sum(), **F32_ACCUMULATED_SUM)
    with pytest.raises(TypeError, match="tokens"):
        cache.logit_attrs(parts, 1.5)
    with pytest.raises(ValueError, match="tokens"):
        cache.logit_attrs(parts, V)


def test_encoder_stream_is_not_a_sum_and_has_no_unembedding():
    torch.manual_seed(0)
    enc = Encoder(EncoderConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=H, norm_position="post")).eval()
    ids = torch.randint(1, V, (1, 5))
    _, cache = run_with_cache(enc, ids)
    with pytest.raises(ValueError, match="not a sum"):
        cache.decompose_resid()
    with pytest.raises(ValueError, match="unembedding"):
        cache.logit_attrs(cache.accumulated_resid(), 3)
    assert cache.stack_head_results().shape == (2 * H, 1, 5, D)


def test_transformers_gpt2_decompose_and_logit_attrs():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tr.GPT2LMHeadModel(
        tr.GPT2Config(vocab_size=V, n_positions=32, n_embd=D, n_layer=2, n_head=H, bos_token_id=1, eos_token_id=2)
    ).eval()
    ids = torch.randint(0, V, (2, 6))
    logits, cache = run_with_cache(model, ids)
    parts = cache.decompose_resid()
    torch.testing.assert_close(parts.sum(0), cache["resid_post", -1], **F32_ACCUMULATED_SUM)
    tok = ids.roll(-1, 1)
    ln_f, W_U = model.transformer.ln_f, model.lm_head.weight
    want = logits.gather(-1, tok[..., None])[..., 0] - (ln_f.bias * W_U[tok]).sum(-1)
    torch.testing.assert_close(cache.logit_attrs(parts, tok).sum(0), want.detach(), **F32_ACCUMULATED_SUM)
    heads = cache.stack_head_results(incl_remainder=True)
    torch.testing.assert_close(heads.sum(0), cache["resid_post", -1], **F32_ACCUMULATED_SUM)
    full = cache.get_full_resid_decomposition()  # heads through c_proj, biases of c_proj, MLPs, embeddings
    torch.testing.assert_close(full.sum(0), cache["resid_post", -1], **F32_ACCUMULATED_SUM)


def test_device_and_kept_bytes():
    model = _decoder()
    ids = torch.randint(0, V, (1, 5))
    _, cache = run_with_cache(model, ids, names_filter=lambda n: "resid" in n, device="cpu")
    assert isinstance(cache, ActivationCache) and len(cache) == 3 * L
    # resid_post of l IS resid_pre of l + 1 (one tensor, kept once): 1 + 2·L distinct (1, 5, D) float32 tensors
    assert cache["resid_post", 0].data_ptr() == cache["resid_pre", 1].data_ptr()
    assert cache.nbytes() == (1 + 2 * L) * 5 * D * 4


def test_the_cache_holds_what_a_hook_in_the_same_pass_edited():
    model = _decoder()
    ids = torch.randint(0, V, (1, 6))
    uni = torch.ones(6, 6).tril()
    uni = uni / uni.sum(-1, keepdim=True)
    _, cache = run_with_cache(
        model,
        ids,
        fwd_hooks=[
            ("blocks.1.attn.hook_pattern", lambda p, h: uni.expand_as(p).clone()),
            ("blocks.0.attn.hook_z", lambda z, h: z * 0),
        ],
    )
    torch.testing.assert_close(cache["pattern", 1], uni.expand(1, H, 6, 6))
    torch.testing.assert_close(cache.pattern(1, heads=[-1]), uni.expand(1, 1, 6, 6))
    assert not torch.allclose(cache["pattern", 0], uni.expand(1, H, 6, 6))  # layer 0 untouched (lazy)
    assert float(cache["z", 0].abs().max()) == 0.0
    torch.testing.assert_close(cache["result", 0], torch.zeros(1, 6, H, D))
    torch.testing.assert_close(cache["attn_out", 0], model.blocks[0].attn.b_O.detach().expand(1, 6, D))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_full_resid_decomposition_and_stack_activation(kind):
    model = _decoder(kind)
    ids = torch.randint(0, V, (2, 6))
    _logits, cache = run_with_cache(model, ids)
    parts, labels = cache.get_full_resid_decomposition(return_labels=True)
    assert labels[:2] == ["L0H0", "L0H1"] and labels[-1] == "bias" and f"{L - 1}_mlp_out" in labels
    assert parts.shape == (L * H + L + (2 if kind == "gpt2" else 1) + 1, 2, 6, D)
    torch.testing.assert_close(parts.sum(0), cache["resid_post", -1], **F32_ACCUMULATED_SUM)
    mid = cache.get_full_resid_decomposition(1, mlp_input=True)
    torch.testing.assert_close(mid.sum(0), cache["resid_mid", 1], **F32_ACCUMULATED_SUM)
    # per-head direct logit attribution sums to the logit (minus ln_final's bias term), as decompose_resid's
    tok = torch.randint(0, V, (2, 6))
    torch.testing.assert_close(
        cache.logit_attrs(parts, tok).sum(0),
        cache.logit_attrs(cache.decompose_resid(), tok).sum(0),
        **F32_ACCUMULATED_SUM,
    )
    st = cache.stack_activation("pattern")
    assert st.shape == (L, 2, H, 6, 6) and torch.equal(st[1], cache["pattern", 1])
    assert cache.stack_activation("scale", 2, "ln1").shape == (2, 2, 6, 1)
