"""Hook points on attnlab models: every name exists with its documented shape, observing changes
nothing, edits propagate exactly as a by-hand reference says, hooks are removed after errors, and
nothing runs (no pattern, no extra tensor) for points without functions."""

import pytest
import torch

import attnlab.nn.attention as attn_mod
from attnlab.interp import hook_names, hook_points, hooks, run_with_cache, run_with_hooks
from attnlab.nn import Decoder, DecoderConfig, Encoder, EncoderConfig
from tests.helpers import EXACT, F32_PROBS, F32_RECOMPUTE, MOVED

V, D, L, H = 40, 32, 3, 4

KINDS = {
    "gpt2": dict(),
    "llama_gqa": dict(positions="rope", norm="rmsnorm", mlp="swiglu", act="silu", bias=False, n_kv_heads=2),
    "alibi_mqa": dict(positions="alibi", n_kv_heads=1),
    "attn_only": dict(attn_only=True),
}


def _decoder(kind="gpt2", **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, d_model=D, n_layers=L, n_heads=H)
    cfg.update(KINDS[kind])
    cfg.update(kw)
    return Decoder(DecoderConfig(**cfg)).eval()


def _encoder():
    torch.manual_seed(0)
    return Encoder(EncoderConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=H, norm_position="post")).eval()


def _shapes(model, B, N, vocab=V):
    """The documented shape of every name (HOOK_API.md)."""
    cfg = model.cfg
    Hkv, dh, dm = cfg.n_kv_heads, cfg.d_head, cfg.d_mlp
    per = {
        "hook_resid_pre": (B, N, D),
        "hook_resid_mid": (B, N, D),
        "hook_resid_post": (B, N, D),
        "ln1.hook_scale": (B, N, 1),
        "ln1.hook_normalized": (B, N, D),
        "ln2.hook_scale": (B, N, 1),
        "ln2.hook_normalized": (B, N, D),
        "attn.hook_q": (B, N, H, dh),
        "attn.hook_k": (B, N, Hkv, dh),
        "attn.hook_v": (B, N, Hkv, dh),
        "attn.hook_rot_q": (B, N, H, dh),
        "attn.hook_rot_k": (B, N, Hkv, dh),
        "attn.hook_z": (B, N, H, dh),
        "attn.hook_attn_scores": (B, H, N, N),
        "attn.hook_pattern": (B, H, N, N),
        "attn.hook_result": (B, N, H, D),
        "hook_attn_out": (B, N, D),
        "mlp.hook_pre": (B, N, dm),
        "mlp.hook_pre_linear": (B, N, dm),
        "mlp.hook_post": (B, N, dm),
        "hook_mlp_out": (B, N, D),
    }
    top = {
        "hook_embed": (B, N, D),
        "hook_pos_embed": (B, N, D),
        "hook_token_type_embed": (B, N, D),
        "ln_final.hook_scale": (B, N, 1),
        "ln_final.hook_normalized": (B, N, D),
        "logits": (B, N, vocab),
    }
    out = {}
    for n in hook_names(model):
        out[n] = top[n] if n in top else per[n.split(".", 2)[2]]
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_name_has_its_documented_shape_and_caching_changes_no_logit(kind):
    model = _decoder(kind)
    ids = torch.randint(0, V, (2, 7))
    want = model(ids).logits
    logits, cache = run_with_cache(model, ids)
    assert torch.equal(logits, want)
    shapes = _shapes(model, 2, 7)
    assert cache.keys() == hook_names(model)
    for n, s in shapes.items():
        assert tuple(cache[n].shape) == s, n
    names = set(shapes)
    assert ("blocks.0.attn.hook_rot_q" in names) == (kind == "llama_gqa")
    assert ("blocks.0.hook_resid_mid" in names) == (kind != "attn_only")
    assert ("hook_pos_embed" in names) == (kind in ("gpt2", "attn_only"))


def test_encoder_names_shapes_and_post_norm_order():
    enc = _encoder()
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    keep = ids != 0
    want = enc(ids, attention_mask=keep).last_hidden_state
    out, cache = run_with_cache(enc, ids, attention_mask=keep)
    assert torch.equal(out, want)  # an encoder returns its final hidden states
    for n, s in _shapes(enc, 2, 5).items():
        assert tuple(cache[n].shape) == s, n
    # TransformerLens' BERT: resid_mid / resid_post before their norm; the block's output is ln2's
    b0 = enc.blocks[0]
    torch.testing.assert_close(cache["blocks.0.ln1.hook_normalized"], b0.norm1(cache["resid_mid", 0]))
    torch.testing.assert_close(cache["blocks.0.ln2.hook_normalized"], cache["resid_pre", 1])
    torch.testing.assert_close(cache["blocks.1.ln2.hook_normalized"], want)
    # patterns of a padded batch: masked keys get 0, as output_attentions
    ref = enc(ids, attention_mask=keep, output_attentions=True).attentions
    for l in range(2):
        torch.testing.assert_close(cache["pattern", l], ref[l], **F32_PROBS)


def test_hook_info_and_forward_order():
    model = _decoder()
    seen = []
    run_with_hooks(
        model,
        torch.randint(0, V, (1, 5)),
        fwd_hooks=[(lambda n: True, lambda x, hook: seen.append((hook.name, hook.layer())))],
    )
    # lazy points run where they belong in the forward (scores, pattern after q/k/v, result before attn_out)
    assert [n for n, _ in seen] == hook_names(model)
    assert dict(seen)["blocks.2.mlp.hook_post"] == 2 and dict(seen)["hook_embed"] is None


def _manual_forward(model, ids, *, drop_attn_layer=None, z_edit=None):
    """GPT-2-style decoder by hand (learned positions, LayerNorm, GELU MLP)."""
    x = model.embed(ids) + model.pos_embed(torch.arange(ids.shape[1]))
    for l, b in enumerate(model.blocks):
        h = b.norm1(x)
        a = b.attn
        q = torch.einsum("bnm,hmd->bhnd", h, a.W_Q) + a.b_Q[None, :, None]
        k = torch.einsum("bnm,hmd->bhnd", h, a.W_K) + a.b_K[None, :, None]
        v = torch.einsum("bnm,hmd->bhnd", h, a.W_V) + a.b_V[None, :, None]
        s = q @ k.transpose(-1, -2) / a.d_head**0.5
        N = ids.shape[1]
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
        z = s.softmax(-1) @ v
        if z_edit is not None and z_edit[0] == l:
            z = z_edit[1](z)
        out = torch.einsum("bhnd,hdm->bnm", z, a.W_O) + a.b_O
        if l != drop_attn_layer:
            x = x + out
        x = x + b.mlp(b.norm2(x))
    return model.lm_head(model.norm(x))


def test_zeroing_attn_out_equals_the_model_without_that_attention():
    model = _decoder()
    ids = torch.randint(0, V, (2, 6))
    torch.testing.assert_close(_manual_forward(model, ids), model(ids).logits, **F32_RECOMPUTE)
    got = run_with_hooks(model, ids, fwd_hooks=[("blocks.1.hook_attn_out", lambda x, hook: torch.zeros_like(x))])
    torch.testing.assert_close(got, _manual_forward(model, ids, drop_attn_layer=1), **F32_RECOMPUTE)
    assert not torch.allclose(got, model(ids).logits, **MOVED)


def test_z_edits_in_place_and_returned_propagate():
    model = _decoder()
    ids = torch.randint(0, V, (1, 6))

    def zero_head(z):  # (B, H, N, d) in the manual forward
        z = z.clone()
        z[:, 2] = 0
        return z

    want = _manual_forward(model, ids, z_edit=(0, zero_head))

    def in_place(z, hook):  # (B, N, H, d) at the hook point
        z[:, :, 2] = 0

    got = run_with_hooks(model, ids, fwd_hooks=[("blocks.0.attn.hook_z", in_place)])
    torch.testing.assert_close(got, want, **F32_RECOMPUTE)

    def returned(z, hook):
        z = z.clone()
        z[:, :, 2] = 0
        return z

    got2 = run_with_hooks(model, ids, fwd_hooks=[("blocks.0.attn.hook_z", returned)])
    torch.testing.assert_close(got2, want, **F32_RECOMPUTE)


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa"])
def test_pattern_result_scores_and_scale_edits_recompute_downstream(kind):
    model = _decoder(kind)
    ids = torch.randint(0, V, (2, 6))
    _, cache = run_with_cache(model, ids)
    # pattern edit: uniform causal attention in layer 1 -> z = p·v (GQA: kv head h // 2)
    N = 6
    uni = torch.ones(N, N).tril()
    uni = uni / uni.sum(-1, keepdim=True)
    v = cache["v", 1]  # (B, N, Hkv, d)
    G = H // v.shape[2]
    z_want = torch.einsum("qk,bkhd->bqhd", uni, v.repeat_interleave(G, dim=2))
    z_seen = {}
    got = run_with_hooks(
        model,
        ids,
        fwd_hooks=[
            ("blocks.1.attn.hook_pattern", lambda p, hook: uni.expand_as(p).clone()),
            ("blocks.1.attn.hook_z", lambda z, hook: z_seen.setdefault("z", z.clone())),
        ],
    )
    torch.testing.assert_close(z_seen["z"], z_want, **F32_RECOMPUTE)

    # the same through the scores: a -inf everywhere but the diagonal gives z = v
    def diag(s, hook):
        return s.masked_fill(~torch.eye(N, dtype=torch.bool), float("-inf"))

    run_with_hooks(
        model,
        ids,
        fwd_hooks=[
            ("blocks.1.attn.hook_attn_scores", diag),
            ("blocks.1.attn.hook_z", lambda z, hook: z_seen.update(d=z.clone())),
        ],
    )
    torch.testing.assert_close(z_seen["d"], v.repeat_interleave(G, dim=2), **F32_RECOMPUTE)
    # result edit == z edit: dropping head 3's result is zeroing its z
    a = run_with_hooks(
        model,
        ids,
        fwd_hooks=[("blocks.0.attn.hook_result", lambda r, hook: torch.cat([r[:, :, :3], 0 * r[:, :, 3:]], 2))],
    )
    b = run_with_hooks(
        model, ids, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: torch.cat([z[:, :, :3], 0 * z[:, :, 3:]], 2))]
    )
    torch.testing.assert_close(a, b, **F32_RECOMPUTE)
    assert not torch.allclose(a, got)
    # scale edit: the norm recomputed from the edited scale (doubling it halves ln1's output)
    out = {}
    run_with_hooks(
        model,
        ids,
        fwd_hooks=[
            ("blocks.0.ln1.hook_scale", lambda s, hook: s * 2),
            ("blocks.0.ln1.hook_normalized", lambda x, hook: out.update(x=x)),
        ],
    )
    norm = model.blocks[0].norm1
    bias = getattr(norm, "bias", None)
    base = cache["blocks.0.ln1.hook_normalized"] - (0 if bias is None else bias)
    torch.testing.assert_close(out["x"], base / 2 + (0 if bias is None else bias), **F32_RECOMPUTE)


def test_q_k_v_edits_propagate_and_rot_points_see_rope():
    model = _decoder("llama_gqa")
    ids = torch.randint(0, V, (1, 6))
    _, cache = run_with_cache(model, ids)
    rope = model.blocks[0].attn.positions
    q = cache["q", 0].transpose(1, 2)
    torch.testing.assert_close(cache["rot_q", 0], rope(q, 0).transpose(1, 2), **F32_RECOMPUTE)
    # zeroing k makes every visible key score 0: the pattern is uniform over the causal prefix
    _, c2 = run_with_cache(model, ids, fwd_hooks=[("blocks.0.attn.hook_k", lambda k, hook: torch.zeros_like(k))])
    uni = torch.ones(6, 6).tril()
    torch.testing.assert_close(c2["pattern", 0][0, 0], uni / uni.sum(-1, keepdim=True), **F32_PROBS)
    # editing v by a factor scales z
    _, c3 = run_with_cache(model, ids, fwd_hooks=[("blocks.0.attn.hook_v", lambda v, hook: v * 3)])
    torch.testing.assert_close(c3["z", 0], cache["z", 0] * 3, **F32_RECOMPUTE)
    assert not torch.allclose(c3["resid_post", 0], cache["resid_post", 0])


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "alibi_mqa"])
def test_patterns_equal_output_attentions(kind):
    model = _decoder(kind)
    ids = torch.randint(0, V, (2, 9))
    ref = model(ids, output_attentions=True).attentions
    _, cache = run_with_cache(model, ids, names_filter=lambda n: "pattern" in n or "scores" in n)
    for l in range(L):
        torch.testing.assert_close(cache["pattern", l], ref[l], **F32_PROBS)
        torch.testing.assert_close(cache.pattern(l - L, heads=[-1]), ref[l][:, [H - 1]], **F32_PROBS)
        torch.testing.assert_close(cache["attn_scores", l].softmax(-1), ref[l], **F32_PROBS)


def test_hooks_removed_after_an_exception_and_nothing_runs_without_hooks(monkeypatch):
    model = _decoder()
    ids = torch.randint(0, V, (1, 5))

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, ids, fwd_hooks=[("blocks.1.hook_resid_mid", boom), (lambda n: True, lambda x, h: None)])
    with pytest.raises(RuntimeError, match="boom"), hooks(model, [("blocks.0.attn.hook_pattern", boom)]):
        model(ids)
    assert all(not p.point.fns for p in hook_points(model).values())

    def forbidden(*a, **k):
        raise AssertionError("a pattern was materialised")

    monkeypatch.setattr(attn_mod, "attention_probs", forbidden)
    model(ids)  # no hook point active: no pattern, the fast op
    run_with_cache(model, ids)  # patterns are lazy: not formed unless read
    with pytest.raises(AssertionError, match="materialised"):
        run_with_cache(model, ids)[1]["pattern", 0]


def test_bad_names_and_hooks_are_refused():
    model = _decoder()
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match=r"blocks.9.hook_resid_pre"):
        run_with_hooks(model, ids, fwd_hooks=[("blocks.9.hook_resid_pre", lambda x, h: None)])
    with pytest.raises(TypeError, match="fwd_hooks"):
        run_with_hooks(model, ids, fwd_hooks=[("hook_embed",)])
    with pytest.raises(ValueError, match="shape"):
        run_with_hooks(model, ids, fwd_hooks=[("hook_embed", lambda x, h: x[:, :1])])
    with pytest.raises(TypeError, match="names_filter"):
        run_with_cache(model, ids, names_filter=3)
    with pytest.raises(TypeError, match="model"):
        hook_names(torch.nn.Linear(2, 2))
    assert all(not p.point.fns for p in hook_points(model).values())


def test_hooks_with_a_kv_cache_decode():
    from attnlab.cache import DynamicCache

    model = _decoder("llama_gqa")
    ids = torch.randint(0, V, (1, 6))
    full = model(ids).logits
    cache = DynamicCache(L)
    model(ids[:, :5], cache=cache)
    seen = {}
    step = run_with_hooks(
        model,
        ids[:, 5:],
        cache=cache,
        fwd_hooks=[
            ("blocks.0.attn.hook_pattern", lambda p, h: seen.update(p=p)),
            ("blocks.0.attn.hook_z", lambda z, h: None),
        ],
    )
    torch.testing.assert_close(step[:, -1], full[:, -1], **F32_RECOMPUTE)
    assert seen["p"].shape == (1, H, 1, 6)


# -- transformers models through the bridge -------------------------------------------------------


def _hf(kind):
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        return tr.GPT2LMHeadModel(
            tr.GPT2Config(vocab_size=V, n_positions=32, n_embd=D, n_layer=2, n_head=H, bos_token_id=1, eos_token_id=2)
        ).eval()
    if kind == "llama":
        return tr.LlamaForCausalLM(
            tr.LlamaConfig(
                vocab_size=V,
                hidden_size=D,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=H,
                num_key_value_heads=2,
            )
        ).eval()
    if kind == "mistral":
        return tr.MistralForCausalLM(
            tr.MistralConfig(
                vocab_size=V,
                hidden_size=D,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=H,
                num_key_value_heads=1,
            )
        ).eval()
    return tr.BertModel(
        tr.BertConfig(
            vocab_size=V,
            hidden_size=D,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=H,
            max_position_embeddings=32,
        ),
        add_pooling_layer=False,
    ).eval()


def _no_torch_hooks(model):
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__
        pts = m.__dict__.get("attnlab_points")
        assert pts is None or not pts.active()


HF_SHAPES = {  # per family: (Hkv, d_mlp, has pos_embed, has rot, has ln_final, has logits)
    "gpt2": (H, 4 * D, True, False, True, True),
    "llama": (2, 64, False, True, True, True),
    "mistral": (1, 64, False, True, True, True),
    "bert": (H, 64, True, False, False, False),
}


@pytest.mark.parametrize("kind", list(HF_SHAPES))
def test_transformers_models_names_shapes_and_unchanged_outputs(kind):
    model = _hf(kind)
    impl = model.config._attn_implementation
    ids = torch.randint(4, V, (2, 6))
    with torch.no_grad():
        out = model(ids)
    want = out.logits if kind != "bert" else out.last_hidden_state
    got, cache = run_with_cache(model, ids)
    torch.testing.assert_close(got, want, **F32_RECOMPUTE)
    assert model.config._attn_implementation == impl  # switched back after the call
    Hkv, dm, pos, rot, lnf, logits = HF_SHAPES[kind]
    names = hook_names(model)
    assert ("hook_pos_embed" in names) == pos and ("blocks.0.attn.hook_rot_q" in names) == rot
    assert ("ln_final.hook_scale" in names) == lnf and ("logits" in names) == logits
    per = {
        "hook_resid_pre": (2, 6, D),
        "hook_resid_mid": (2, 6, D),
        "hook_resid_post": (2, 6, D),
        "attn.hook_q": (2, 6, H, 8),
        "attn.hook_k": (2, 6, Hkv, 8),
        "attn.hook_v": (2, 6, Hkv, 8),
        "attn.hook_rot_q": (2, 6, H, 8),
        "attn.hook_rot_k": (2, 6, Hkv, 8),
        "attn.hook_z": (2, 6, H, 8),
        "attn.hook_attn_scores": (2, H, 6, 6),
        "attn.hook_pattern": (2, H, 6, 6),
        "attn.hook_result": (2, 6, H, D),
        "hook_attn_out": (2, 6, D),
        "mlp.hook_pre": (2, 6, dm),
        "mlp.hook_pre_linear": (2, 6, dm),
        "mlp.hook_post": (2, 6, dm),
        "hook_mlp_out": (2, 6, D),
        "ln1.hook_scale": (2, 6, 1),
        "ln2.hook_scale": (2, 6, 1),
        "ln1.hook_normalized": (2, 6, D),
        "ln2.hook_normalized": (2, 6, D),
    }
    top = {
        "hook_embed": (2, 6, D),
        "hook_pos_embed": (2, 6, D),
        "hook_token_type_embed": (2, 6, D),
        "ln_final.hook_scale": (2, 6, 1),
        "ln_final.hook_normalized": (2, 6, D),
        "logits": (2, 6, V),
    }
    for n in names:
        assert tuple(cache[n].shape) == (top[n] if n in top else per[n.split(".", 2)[2]]), n
    _no_torch_hooks(model)
    # the stream is what the model's own hidden states say (transformers installs hooks of its own for these)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    for l in range(2):
        torch.testing.assert_close(cache["resid_pre", l], hs[l], **F32_RECOMPUTE)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_transformers_edits_propagate_like_zeroed_weights(kind):
    model = _hf(kind)
    ids = torch.randint(4, V, (2, 6))
    got = run_with_hooks(model, ids, fwd_hooks=[("blocks.1.hook_attn_out", lambda x, h: torch.zeros_like(x))])
    b = {
        "gpt2": lambda: model.transformer.h[1].attn.c_proj,
        "llama": lambda: model.model.layers[1].self_attn.o_proj,
        "bert": lambda: model.encoder.layer[1].attention.output.dense,
    }[kind]()
    with torch.no_grad():
        b.weight.zero_()
        if b.bias is not None:
            b.bias.zero_()
        out = model(ids)
    want = out.logits if kind != "bert" else out.last_hidden_state
    torch.testing.assert_close(got, want, **F32_RECOMPUTE)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_resid_mid_replacement_reaches_both_branches(kind):
    model = _hf(kind)
    ids = torch.randint(4, V, (1, 5))
    _, cache = run_with_cache(model, ids, fwd_hooks=[("blocks.0.hook_resid_mid", lambda x, h: torch.ones_like(x))])
    blk = model.transformer.h[0] if kind == "gpt2" else model.model.layers[0]
    ln2 = blk.ln_2 if kind == "gpt2" else blk.post_attention_layernorm
    with torch.no_grad():
        want = 1 + blk.mlp(ln2(torch.ones(1, 5, D)))
    torch.testing.assert_close(cache["resid_post", 0], want, **F32_RECOMPUTE)
    torch.testing.assert_close(cache["resid_mid", 0], torch.ones(1, 5, D))


def test_transformers_patterns_and_z_edits_gqa():
    model = _hf("llama")
    ids = torch.randint(4, V, (2, 6))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(ids, output_attentions=True).attentions
    _, cache = run_with_cache(model, ids)
    for l in range(2):
        torch.testing.assert_close(cache["pattern", l], ref[l], **F32_PROBS)
        torch.testing.assert_close(cache.pattern(-2 + l, heads=[-1])[:, 0], ref[l][:, -1], **F32_PROBS)
    # zeroing head 3's z equals zeroing its columns of o_proj; the result edit does the same
    a = run_with_hooks(
        model, ids, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, h: z.index_fill(2, torch.tensor([3]), 0))]
    )
    r = run_with_hooks(
        model, ids, fwd_hooks=[("blocks.0.attn.hook_result", lambda r, h: r.index_fill(2, torch.tensor([3]), 0))]
    )
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[:, 24:32] = 0
        want = model(ids).logits
    torch.testing.assert_close(a, want, **F32_RECOMPUTE)
    torch.testing.assert_close(r, want, **F32_RECOMPUTE)


def test_transformers_hooks_removed_after_an_exception():
    model = _hf("gpt2")
    impl = model.config._attn_implementation
    ids = torch.randint(4, V, (1, 5))

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, ids, fwd_hooks=[(lambda n: True, lambda x, h: None), ("blocks.1.hook_mlp_out", boom)])
    with pytest.raises(RuntimeError, match="boom"):
        run_with_hooks(model, ids, fwd_hooks=[("blocks.0.attn.hook_pattern", boom)])
    _no_torch_hooks(model)
    assert model.config._attn_implementation == impl


def test_copied_and_pickled_models_start_without_hooks():
    import copy
    import pickle

    model = _decoder("llama_gqa")
    ids = torch.randint(0, V, (1, 5))
    with hooks(model, [(lambda n: True, lambda x, h: None)]):
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert all(not p.point.fns for p in hook_points(other).values())
            torch.testing.assert_close(other(ids).logits, model(ids).logits, **EXACT)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_scale_edit_recomputes_the_norm_and_the_cache_sees_it(kind):
    model = _hf(kind)
    ids = torch.randint(4, V, (1, 5))
    _, base = run_with_cache(model, ids)
    _, cache = run_with_cache(model, ids, fwd_hooks=[("blocks.1.ln2.hook_scale", lambda s, h: s * 2)])
    norm = model.transformer.h[1].ln_2 if kind == "gpt2" else model.model.layers[1].post_attention_layernorm
    bias = getattr(norm, "bias", None)
    bias = 0 if bias is None else bias.detach()
    torch.testing.assert_close(cache["scale", 1, "ln2"], base["scale", 1, "ln2"] * 2, **F32_RECOMPUTE)
    torch.testing.assert_close(
        cache["normalized", 1, "ln2"], (base["normalized", 1, "ln2"] - bias) / 2 + bias, **F32_RECOMPUTE
    )
    assert not torch.allclose(cache["logits"], base["logits"])
    _no_torch_hooks(model)


def test_transformers_fast_path_stays_on_and_patterns_are_lazy(monkeypatch):
    model = _hf("gpt2")
    ids = torch.randint(4, V, (1, 6))

    def forbidden(*a, **k):
        raise AssertionError("a pattern was materialised")

    monkeypatch.setattr(attn_mod, "attention_probs", forbidden)
    _, cache = run_with_cache(model, ids)  # every name, patterns included: kept lazily
    with pytest.raises(AssertionError, match="materialised"):
        cache["pattern", 0]


def test_bert_padding_mask_reaches_the_patterns():
    model = _hf("bert")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 0, 0]])
    keep = (ids != 0).long()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(ids, attention_mask=keep, output_attentions=True)
    out, cache = run_with_cache(model, ids, attention_mask=keep)
    torch.testing.assert_close(out, ref.last_hidden_state, **F32_RECOMPUTE)
    for l in range(2):
        torch.testing.assert_close(cache["pattern", l], ref.attentions[l], **F32_PROBS)
    assert float(cache["pattern", 0][1, :, :, 4:].abs().max()) == 0.0  # padded keys get no weight
