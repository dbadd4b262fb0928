"""Llama checkpoints (transformers' ``LlamaModel`` / ``LlamaForCausalLM``, GQA included)
into a :class:`Decoder` with RMSNorm, SwiGLU and RoPE (half-split pairing, as
transformers stores Llama weights)."""

from __future__ import annotations

import torch

from attnlab.models.checkpoint import CheckpointError, Entry
from attnlab.models.hf_config import Fields, build, numbers_finite
from attnlab.nn import DecoderConfig
from attnlab.positions import rope_from_hf

PREFIXES = ("model.",)
LAYERS_FIELD = "num_hidden_layers"


def ignore(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def _rope(f: Fields, d_head: int):
    """The RoPE fields, checked: ``rope_theta`` > 0 finite, ``partial_rotary_factor`` in
    (0, 1], the scaling dict flat with finite numbers; then :func:`rope_from_hf`."""
    f.float("rope_theta", 10000.0)
    prf = f.float("partial_rotary_factor", 1.0, high=1.0)
    f.int("original_max_position_embeddings", None, none_is_absent=True)
    for key in ("rope_parameters", "rope_scaling"):
        p = f.dict_or_none(key)
        if p:
            numbers_finite(p, f.where, key)
            sub = Fields(p, f"{f.where} [{key}]")
            sub.str("rope_type", None)
            sub.str("type", None)
            for k in (
                "factor",
                "rope_theta",
                "beta_fast",
                "beta_slow",
                "attention_factor",
                "low_freq_factor",
                "high_freq_factor",
            ):
                sub.float(k, None, none_is_absent=True)
            for k in ("mscale", "mscale_all_dim"):
                sub.float(k, None, low_inclusive=True, none_is_absent=True)
            sub.float("partial_rotary_factor", None, high=1.0, none_is_absent=True)
            sub.int("original_max_position_embeddings", None, none_is_absent=True)
            sub.bool("truncate", None, none_is_absent=True)
    if prf is not None and int(d_head * prf) % 2:
        raise CheckpointError(
            f"{f.where}: field 'partial_rotary_factor': {prf} x head_dim {d_head} must give an even rotary dimension"
        )
    try:
        return rope_from_hf(f.d, d_head)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{f.where}: {e}") from None


def config_from_hf(d, where: str = "config.json") -> DecoderConfig:
    """A :class:`DecoderConfig` from ``config.json`` (a dict or :class:`Fields`), every
    field it reads checked (:class:`CheckpointError` naming the field)."""
    f = d if isinstance(d, Fields) else Fields(d, where)
    act = f.d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{f.where}: llama: hidden_act {act!r} is not supported (expected 'silu')")
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    d_head = f.int("head_dim", hidden // heads, none_is_absent=True)
    if d_head < 1:
        raise CheckpointError(f"{f.where}: hidden_size={hidden} // num_attention_heads={heads} is 0; set head_dim")
    kv = f.int("num_key_value_heads", heads, none_is_absent=True)
    if heads % kv:
        raise CheckpointError(
            f"{f.where}: field 'num_key_value_heads': {kv} must divide "
            f"num_attention_heads={heads} (each kv head serves a group of query heads)"
        )
    rope = _rope(f, d_head)
    attention_bias, mlp_bias = f.bool("attention_bias", False), f.bool("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise CheckpointError(
            f"{f.where}: llama: attention_bias and mlp_bias must agree (attnlab has one `bias` switch)"
        )
    return build(
        DecoderConfig,
        f.where,
        vocab_size=f.int("vocab_size"),
        d_model=hidden,
        n_layers=f.int("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=kv,
        d_head=d_head,
        d_mlp=f.int("intermediate_size"),
        max_positions=f.int("max_position_embeddings", 2048),
        positions="rope",
        norm="rmsnorm",
        norm_eps=f.float("rms_norm_eps", 1e-6),
        mlp="swiglu",
        act="silu",
        bias=attention_bias,
        tie_embeddings=f.bool("tie_word_embeddings", False),
        rope_base=rope.base,
        rotary_dim=rope.rotary_dim,
        rope_scaling=rope.scaling,
    )


def plan(cfg: DecoderConfig, tensors: dict) -> dict[str, Entry]:
    d, H, Hkv, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp
    if Hkv is None or dh is None or f is None:  # DecoderConfig.__post_init__ derives them
        raise ValueError(f"plan: expected a DecoderConfig with n_kv_heads, d_head and d_mlp set, got {cfg!r}")
    cat = lambda *ts: torch.cat(ts, 0)  # noqa: E731
    p = {
        "embed.weight": Entry([("embed_tokens.weight", (cfg.vocab_size, d))]),
        "norm.weight": Entry([("norm.weight", (d,))]),
    }
    if not cfg.tie_embeddings:
        p["lm_head.weight"] = Entry([("lm_head.weight", (cfg.vocab_size, d))])
    for i in range(cfg.n_layers):
        h, o = f"layers.{i}.", f"blocks.{i}."
        a = h + "self_attn."
        p.update(
            {
                o + "norm1.weight": Entry([(h + "input_layernorm.weight", (d,))]),
                o + "norm2.weight": Entry([(h + "post_attention_layernorm.weight", (d,))]),
                o + "attn.qkv_weight": Entry(
                    [
                        (a + "q_proj.weight", (H * dh, d)),
                        (a + "k_proj.weight", (Hkv * dh, d)),
                        (a + "v_proj.weight", (Hkv * dh, d)),
                    ],
                    cat,
                ),
                o + "attn.out_weight": Entry([(a + "o_proj.weight", (d, H * dh))]),
                o + "mlp.gate_up.weight": Entry(
                    [(h + "mlp.gate_proj.weight", (f, d)), (h + "mlp.up_proj.weight", (f, d))], cat
                ),
                o + "mlp.down.weight": Entry([(h + "mlp.down_proj.weight", (d, f))]),
            }
        )
        if cfg.bias:
            p.update(
                {
                    o + "attn.qkv_bias": Entry(
                        [
                            (a + "q_proj.bias", (H * dh,)),
                            (a + "k_proj.bias", (Hkv * dh,)),
                            (a + "v_proj.bias", (Hkv * dh,)),
                        ],
                        cat,
                    ),
                    o + "attn.out_bias": Entry([(a + "o_proj.bias", (d,))]),
                    o + "mlp.gate_up.bias": Entry(
                        [(h + "mlp.gate_proj.bias", (f,)), (h + "mlp.up_proj.bias", (f,))], cat
                    ),
                    o + "mlp.down.bias": Entry([(h + "mlp.down_proj.bias", (d,))]),
                }
            )
    return p
