"""BERT checkpoints (transformers' ``BertModel``; MiniLM is a small BERT) into an :class:`Encoder`."""

from __future__ import annotations

import torch

from attnlab.models.checkpoint import CheckpointError, Entry
from attnlab.nn import EncoderConfig

PREFIXES = ("bert.",)
_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu", "silu": "silu"}


def ignore(name: str) -> bool:
    # the position-id buffer of older checkpoints, and task heads (MLM / NSP / classifier)
    return name == "embeddings.position_ids" or name.startswith(("cls.", "classifier.", "qa_outputs."))


def config_from_hf(d: dict, tensors: dict) -> EncoderConfig:
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"bert: position_embedding_type {d['position_embedding_type']!r} is not supported "
                              "(expected 'absolute')")
    if d.get("is_decoder", False) or d.get("add_cross_attention", False):
        raise CheckpointError("bert: decoder / cross-attention BERT variants are not supported")
    act = d.get("hidden_act", "gelu")
    if act not in _ACT:
        raise CheckpointError(f"bert: hidden_act {act!r} is not supported; expected one of {sorted(_ACT)}")
    try:
        return EncoderConfig(
            vocab_size=d["vocab_size"], d_model=d["hidden_size"], n_layers=d["num_hidden_layers"],
            n_heads=d["num_attention_heads"], d_mlp=d["intermediate_size"],
            max_positions=d.get("max_position_embeddings", 512), type_vocab_size=d.get("type_vocab_size", 2),
            norm_eps=d.get("layer_norm_eps", 1e-12), act=_ACT[act], pad_token_id=d.get("pad_token_id") or 0,
            pooler="pooler.dense.weight" in tensors)
    except KeyError as e:
        raise CheckpointError(f"bert: config.json lacks {e.args[0]!r}") from None


def plan(cfg: EncoderConfig, tensors: dict) -> dict[str, Entry]:
    d, f = cfg.d_model, cfg.d_mlp
    cat = lambda *ts: torch.cat(ts, 0)  # noqa: E731
    e = "embeddings."
    p = {"embed.weight": Entry([(e + "word_embeddings.weight", (cfg.vocab_size, d))]),
         "pos_embed.weight": Entry([(e + "position_embeddings.weight", (cfg.max_positions, d))]),
         "embed_norm.weight": Entry([(e + "LayerNorm.weight", (d,))]),
         "embed_norm.bias": Entry([(e + "LayerNorm.bias", (d,))])}
    if cfg.type_vocab_size:
        p["type_embed.weight"] = Entry([(e + "token_type_embeddings.weight", (cfg.type_vocab_size, d))])
    if cfg.pooler:
        p["pooler.weight"] = Entry([("pooler.dense.weight", (d, d))])
        p["pooler.bias"] = Entry([("pooler.dense.bias", (d,))])
    for i in range(cfg.n_layers):
        h, o = f"encoder.layer.{i}.", f"blocks.{i}."
        s = h + "attention.self."
        p.update({
            o + "attn.qkv_weight": Entry([(s + "query.weight", (d, d)), (s + "key.weight", (d, d)),
                                          (s + "value.weight", (d, d))], cat),
            o + "attn.qkv_bias": Entry([(s + "query.bias", (d,)), (s + "key.bias", (d,)), (s + "value.bias", (d,))],
                                       cat),
            o + "attn.out_weight": Entry([(h + "attention.output.dense.weight", (d, d))]),
            o + "attn.out_bias": Entry([(h + "attention.output.dense.bias", (d,))]),
            o + "norm1.weight": Entry([(h + "attention.output.LayerNorm.weight", (d,))]),
            o + "norm1.bias": Entry([(h + "attention.output.LayerNorm.bias", (d,))]),
            o + "mlp.fc_in.weight": Entry([(h + "intermediate.dense.weight", (f, d))]),
            o + "mlp.fc_in.bias": Entry([(h + "intermediate.dense.bias", (f,))]),
            o + "mlp.fc_out.weight": Entry([(h + "output.dense.weight", (d, f))]),
            o + "mlp.fc_out.bias": Entry([(h + "output.dense.bias", (d,))]),
            o + "norm2.weight": Entry([(h + "output.LayerNorm.weight", (d,))]),
            o + "norm2.bias": Entry([(h + "output.LayerNorm.bias", (d,))]),
        })
    return p
