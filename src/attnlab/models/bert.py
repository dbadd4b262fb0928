"""BERT checkpoints (transformers' ``BertModel``; MiniLM is a small BERT) into an :class:`Encoder`."""

from __future__ import annotations

import torch

from attnlab.models.checkpoint import CheckpointError, Entry
from attnlab.models.hf_config import Fields, build
from attnlab.nn import EncoderConfig

PREFIXES = ("bert.",)
LAYERS_FIELD = "num_hidden_layers"
_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu", "silu": "silu"}


def ignore(name: str) -> bool:
    # the position-id buffer of older checkpoints, and task heads (MLM / NSP / classifier)
    return name == "embeddings.position_ids" or name.startswith(("cls.", "classifier.", "qa_outputs."))


def config_from_hf(d, tensors, where: str = "config.json") -> EncoderConfig:
    """An :class:`EncoderConfig` from ``config.json`` (a dict or :class:`Fields`) and the
    checkpoint's tensor names (``tensors``: any mapping; only membership is read)."""
    f = d if isinstance(d, Fields) else Fields(d, where)
    pet = f.d.get("position_embedding_type", "absolute")
    if pet != "absolute":
        raise CheckpointError(
            f"{f.where}: bert: position_embedding_type {pet!r} is not supported (expected 'absolute')"
        )
    if f.bool("is_decoder", False) or f.bool("add_cross_attention", False):
        raise CheckpointError(f"{f.where}: bert: decoder / cross-attention BERT variants are not supported")
    act = f.d.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in _ACT:
        raise CheckpointError(f"{f.where}: bert: hidden_act {act!r} is not supported; expected one of {sorted(_ACT)}")
    d_model, heads = f.int("hidden_size"), f.int("num_attention_heads")
    if d_model % heads:
        raise CheckpointError(f"{f.where}: field 'num_attention_heads': {heads} must divide hidden_size={d_model}")
    return build(
        EncoderConfig,
        f.where,
        vocab_size=f.int("vocab_size"),
        d_model=d_model,
        n_layers=f.int("num_hidden_layers"),
        n_heads=heads,
        d_mlp=f.int("intermediate_size"),
        max_positions=f.int("max_position_embeddings", 512),
        type_vocab_size=f.int("type_vocab_size", 2, min=0),
        norm_eps=f.float("layer_norm_eps", 1e-12),
        act=_ACT[act],
        pad_token_id=f.int("pad_token_id", 0, min=0, none_is_absent=True),
        pooler="pooler.dense.weight" in tensors,
    )


def plan(cfg: EncoderConfig, tensors: dict) -> dict[str, Entry]:
    d, f = cfg.d_model, cfg.d_mlp
    cat = lambda *ts: torch.cat(ts, 0)  # noqa: E731
    e = "embeddings."
    p = {
        "embed.weight": Entry([(e + "word_embeddings.weight", (cfg.vocab_size, d))]),
        "pos_embed.weight": Entry([(e + "position_embeddings.weight", (cfg.max_positions, d))]),
        "embed_norm.weight": Entry([(e + "LayerNorm.weight", (d,))]),
        "embed_norm.bias": Entry([(e + "LayerNorm.bias", (d,))]),
    }
    if cfg.type_vocab_size:
        p["type_embed.weight"] = Entry([(e + "token_type_embeddings.weight", (cfg.type_vocab_size, d))])
    if cfg.pooler:
        p["pooler.weight"] = Entry([("pooler.dense.weight", (d, d))])
        p["pooler.bias"] = Entry([("pooler.dense.bias", (d,))])
    for i in range(cfg.n_layers):
        h, o = f"encoder.layer.{i}.", f"blocks.{i}."
        s = h + "attention.self."
        p.update(
            {
                o + "attn.qkv_weight": Entry(
                    [(s + "query.weight", (d, d)), (s + "key.weight", (d, d)), (s + "value.weight", (d, d))], cat
                ),
                o + "attn.qkv_bias": Entry(
                    [(s + "query.bias", (d,)), (s + "key.bias", (d,)), (s + "value.bias", (d,))], cat
                ),
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
            }
        )
    return p
