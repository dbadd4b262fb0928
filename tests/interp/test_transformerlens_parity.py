"""Parity with TransformerLens itself (transformer-lens 4.3.0, the `interp-parity` extra): the same
random-weight transformers model is loaded into TransformerLens' TransformerBridge and run through
attnlab's hook points; every hook name the two share holds the same activation."""

import re

import pytest
import torch

from tests.helpers import F32_MODEL_PARITY, MOVED, MOVED_SLIGHTLY

transformers = pytest.importorskip("transformers")

from attnlab.interp import hook_names, run_with_cache, run_with_hooks  # noqa: E402

# Names TransformerLens has and attnlab does not: TL's generic per-module hook_in / hook_out aliases,
# its RoPE tables (hook_cos / hook_sin), attn.hook_hidden_states (= the attention output before the
# block adds it: attnlab's hook_attn_out) and hook_unembed (= attnlab's "logits").  Listed in docs/interp.md.
TL_ONLY = re.compile(r"(\.|^)hook_(in|out)$|\.hook_(cos|sin)$|attn\.hook_hidden_states$|^hook_unembed$")
ALIASES = {"logits": "hook_unembed"}  # attnlab name -> TL name for the same tensor


def _tokenizer(folder, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="t1", eos_token="t2", unk_token="t0", pad_token="t3"
    )
    tok.save_pretrained(folder)


def _models(kind, folder):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2
        )
        cls = transformers.GPT2LMHeadModel
    else:  # GQA Llama: 4 query heads over 2 kv heads
        cfg = transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
        )
        cls = transformers.LlamaForCausalLM
    ours = cls(cfg).eval()
    ours.save_pretrained(folder)
    _tokenizer(folder, 100)
    theirs = cls.from_pretrained(folder).eval()  # TL switches its model to eager attention: its own copy
    return ours, theirs


@pytest.fixture(scope="module")
def tl_bridge():
    """TransformerLens, imported when a test here runs rather than at collection: it pulls in
    datasets, pandas and pyarrow, which every pytest-xdist worker would otherwise import just
    to collect this file."""
    return pytest.importorskip("transformer_lens.model_bridge", reason="needs the interp-parity extra")


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_shared_hook_name_holds_the_same_activation(kind, tmp_path, offline, tl_bridge):
    ours, theirs = _models(kind, tmp_path)
    bridge = tl_bridge.TransformerBridge.boot_transformers(str(tmp_path), hf_model=theirs, device="cpu")
    ids = torch.randint(4, 100, (2, 7))
    tl_logits, tl_cache = bridge.run_with_cache(ids)
    with torch.no_grad():
        hf_logits = ours(ids).logits
    torch.testing.assert_close(tl_logits, hf_logits, **F32_MODEL_PARITY)
    logits, cache = run_with_cache(ours, ids)
    torch.testing.assert_close(logits, hf_logits, **F32_MODEL_PARITY)
    tl_names = set(tl_cache.keys())
    if kind == "gpt2":
        assert len(tl_names) == 93  # the count for a 2-layer GPT-2
    shared = [n for n in hook_names(ours) if ALIASES.get(n, n) in tl_names]
    for n in shared:
        a, b = cache[n], tl_cache[ALIASES.get(n, n)]
        assert a.shape == b.shape, n
        if n.endswith("hook_attn_scores"):
            # masked entries: attnlab's -inf (the design's rule), TL's eager finfo.min
            hidden = torch.isinf(a)
            assert bool((a[hidden] < 0).all()) and bool((b[hidden] <= torch.finfo(b.dtype).min / 2).all()), n
            torch.testing.assert_close(a[~hidden], b[~hidden].to(a.dtype), **F32_MODEL_PARITY, msg=n)
        else:
            torch.testing.assert_close(a, b.to(a.dtype), **F32_MODEL_PARITY, msg=n)
    ours_only = set(hook_names(ours)) - tl_names - set(ALIASES)
    assert ours_only == {f"blocks.{l}.attn.hook_result" for l in range(2)}  # TL's bridge keeps no per-head result
    tl_only = {n for n in tl_names - set(shared) - set(ALIASES.values())}
    assert all(TL_ONLY.search(n) for n in tl_only), sorted(n for n in tl_only if not TL_ONLY.search(n))
    names = set(hook_names(ours))
    want_shared = {
        "hook_embed",
        "blocks.1.hook_resid_mid",
        "blocks.0.ln1.hook_scale",
        "blocks.1.attn.hook_pattern",
        "blocks.0.attn.hook_z",
        "blocks.1.mlp.hook_post",
        "ln_final.hook_normalized",
    }
    assert want_shared <= set(shared)
    if kind == "llama":
        assert {"blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k", "blocks.0.mlp.hook_pre_linear"} <= set(shared)
        assert "hook_pos_embed" not in names and cache["k", 0].shape == (2, 7, 2, 8)
    # the same edits give the same logits in both: a head's z zeroed, a position of the stream replaced,
    # the pattern of a layer made uniform
    N = ids.shape[1]
    uniform = torch.ones(N, N).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    edits = [
        ("blocks.0.attn.hook_z", lambda z, hook: z.index_fill(2, torch.tensor([1]), 0.0)),
        ("blocks.1.hook_resid_pre", lambda x, hook: x.index_fill(1, torch.tensor([3]), 0.5)),
        ("blocks.0.hook_mlp_out", lambda x, hook: x * 2),
        ("blocks.1.attn.hook_pattern", lambda p, hook: uniform.expand_as(p).to(p.dtype).clone()),
    ]
    for edit in edits:
        want = bridge.run_with_hooks(ids, fwd_hooks=[edit])
        got = run_with_hooks(ours, ids, fwd_hooks=[edit])
        assert not torch.allclose(got, hf_logits, **MOVED_SLIGHTLY), edit[0]  # the edit does something
        torch.testing.assert_close(got, want, **F32_MODEL_PARITY, msg=edit[0])
    # where they differ: a replaced resid_mid reaches only ln2's input in TL 4.3.0's bridge (its hook sits on
    # ln2's input), while here it is the stream (ln2's input and the residual branch), as HookedTransformer had
    edit = ("blocks.1.hook_resid_mid", lambda x, hook: x.index_fill(1, torch.tensor([3]), 0.5))
    ln2 = ours.transformer.h[1].ln_2 if kind == "gpt2" else ours.model.layers[1].post_attention_layernorm
    h = ln2.register_forward_pre_hook(lambda mod, args: (args[0].index_fill(1, torch.tensor([3]), 0.5),))
    with torch.no_grad():
        ln2_only = ours(ids).logits
    h.remove()
    torch.testing.assert_close(bridge.run_with_hooks(ids, fwd_hooks=[edit]), ln2_only, **F32_MODEL_PARITY)
    assert not torch.allclose(run_with_hooks(ours, ids, fwd_hooks=[edit]), ln2_only, **MOVED)
