"""Llama checkpoints (transformers' ``LlamaModel`` / ``LlamaForCausalLM``, GQA included)
into a :class:`Decoder` with RMSNorm, SwiGLU and RoPE (half-split pairing, as
transformers stores Llama weights)."""

from __future__ import annotations

import torch

from attnlab.models.checkpoint import CheckpointError, Entry
from attnlab.nn import DecoderConfig
from attnlab.positions import rope_from_hf

PREFIXES = ("model.",)


def ignore(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def config_from_hf(d: dict) -> DecoderConfig:
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"llama: hidden_act {d.get('hidden_act')!r} is not supported (expected 'silu')")
    try:
        heads = d["num_attention_heads"]
        d_head = d.get("head_dim") or d["hidden_size"] // heads
        rope = rope_from_hf(d, d_head)
        if d.get("attention_bias", False) != d.get("mlp_bias", False):
            raise CheckpointError("llama: attention_bias and mlp_bias must agree (attnlab has one `bias` switch)")
        return DecoderConfig(
            vocab_size=d["vocab_size"], d_model=d["hidden_size"], n_layers=d["num_hidden_layers"], n_heads=heads,
            n_kv_heads=d.get("num_key_value_heads") or heads, d_head=d_head, d_mlp=d["intermediate_size"],
            max_positions=d.get("max_position_embeddings", 2048), positions="rope", norm="rmsnorm",
            norm_eps=d.get("rms_norm_eps", 1e-6), mlp="swiglu", act="silu", bias=bool(d.get("attention_bias", False)),
            tie_embeddings=d.get("tie_word_embeddings", False), rope_base=rope.base, rotary_dim=rope.rotary_dim,
            rope_scaling=rope.scaling)
    except KeyError as e:
        raise CheckpointError(f"llama: config.json lacks {e.args[0]!r}") from None


def plan(cfg: DecoderConfig, tensors: dict) -> dict[str, Entry]:
    d, H, Hkv, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp
    cat = lambda *ts: torch.cat(ts, 0)  # noqa: E731
    p = {"embed.weight": Entry([("embed_tokens.weight", (cfg.vocab_size, d))]),
         "norm.weight": Entry([("norm.weight", (d,))])}
    if not cfg.tie_embeddings:
        p["lm_head.weight"] = Entry([("lm_head.weight", (cfg.vocab_size, d))])
    for i in range(cfg.n_layers):
        h, o = f"layers.{i}.", f"blocks.{i}."
        a = h + "self_attn."
        p.update({
            o + "norm1.weight": Entry([(h + "input_layernorm.weight", (d,))]),
            o + "norm2.weight": Entry([(h + "post_attention_layernorm.weight", (d,))]),
            o + "attn.qkv_weight": Entry([(a + "q_proj.weight", (H * dh, d)), (a + "k_proj.weight", (Hkv * dh, d)),
                                          (a + "v_proj.weight", (Hkv * dh, d))], cat),
            o + "attn.out_weight": Entry([(a + "o_proj.weight", (d, H * dh))]),
            o + "mlp.gate_up.weight": Entry([(h + "mlp.gate_proj.weight", (f, d)), (h + "mlp.up_proj.weight", (f, d))],
                                            cat),
            o + "mlp.down.weight": Entry([(h + "mlp.down_proj.weight", (d, f))]),
        })
        if cfg.bias:
            p.update({
                o + "attn.qkv_bias": Entry([(a + "q_proj.bias", (H * dh,)), (a + "k_proj.bias", (Hkv * dh,)),
                                            (a + "v_proj.bias", (Hkv * dh,))], cat),
                o + "attn.out_bias": Entry([(a + "o_proj.bias", (d,))]),
                o + "mlp.gate_up.bias": Entry([(h + "mlp.gate_proj.bias", (f,)), (h + "mlp.up_proj.bias", (f,))], cat),
                o + "mlp.down.bias": Entry([(h + "mlp.down_proj.bias", (d,))]),
            })
    return p
