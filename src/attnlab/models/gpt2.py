"""GPT-2 checkpoints (transformers' ``GPT2Model`` / ``GPT2LMHeadModel``) into a :class:`Decoder`.

GPT-2 stores its projections as ``Conv1D`` weights of shape ``(in, out)``, the
transpose of ``nn.Linear``; ``c_attn`` is ``[W_Q | W_K | W_V]`` along ``out``, heads
contiguous inside each block, which is attnlab's fused QKV layout after a transpose.
"""

from __future__ import annotations

from attnlab.models.checkpoint import CheckpointError, Entry
from attnlab.models.hf_config import Fields, build
from attnlab.nn import DecoderConfig

PREFIXES = ("transformer.",)
LAYERS_FIELD = "n_layer"
_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def ignore(name: str) -> bool:
    # causal-mask buffers saved by old transformers versions
    return name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")


def config_from_hf(d, where: str = "config.json") -> DecoderConfig:
    """A :class:`DecoderConfig` from ``config.json`` (a dict or :class:`Fields`), every
    field it reads checked (:class:`CheckpointError` naming the field)."""
    f = d if isinstance(d, Fields) else Fields(d, where)
    if not f.bool("scale_attn_weights", True) or f.bool("scale_attn_by_inverse_layer_idx", False):
        raise CheckpointError(
            f"{f.where}: gpt2: only the standard 1/sqrt(d_head) attention scale is supported "
            "(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)"
        )
    if f.bool("add_cross_attention", False):
        raise CheckpointError(f"{f.where}: gpt2: add_cross_attention=True is not supported")
    act = f.d.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in _ACT:
        raise CheckpointError(
            f"{f.where}: gpt2: activation_function {act!r} is not supported; expected one of {sorted(_ACT)}"
        )
    d_model, heads = f.int("n_embd"), f.int("n_head")
    if d_model % heads:
        raise CheckpointError(f"{f.where}: field 'n_head': {heads} must divide n_embd={d_model}")
    return build(
        DecoderConfig,
        f.where,
        vocab_size=f.int("vocab_size"),
        d_model=d_model,
        n_layers=f.int("n_layer"),
        n_heads=heads,
        d_mlp=f.int("n_inner", 4 * d_model, none_is_absent=True),
        max_positions=f.int("n_positions"),
        positions="learned",
        norm="layernorm",
        norm_eps=f.float("layer_norm_epsilon", 1e-5),
        mlp="mlp",
        act=_ACT[act],
        bias=True,
        tie_embeddings=f.bool("tie_word_embeddings", True),
    )


def plan(cfg: DecoderConfig, tensors: dict) -> dict[str, Entry]:
    d, L = cfg.d_model, cfg.n_layers
    t = lambda w: w.t()  # noqa: E731  Conv1D (in, out) -> Linear (out, in)
    p = {
        "embed.weight": Entry([("wte.weight", (cfg.vocab_size, d))]),
        "pos_embed.weight": Entry([("wpe.weight", (cfg.max_positions, d))]),
        "norm.weight": Entry([("ln_f.weight", (d,))]),
        "norm.bias": Entry([("ln_f.bias", (d,))]),
    }
    if not cfg.tie_embeddings:
        p["lm_head.weight"] = Entry([("lm_head.weight", (cfg.vocab_size, d))])
    for i in range(L):
        h, o = f"h.{i}.", f"blocks.{i}."
        p.update(
            {
                o + "norm1.weight": Entry([(h + "ln_1.weight", (d,))]),
                o + "norm1.bias": Entry([(h + "ln_1.bias", (d,))]),
                o + "norm2.weight": Entry([(h + "ln_2.weight", (d,))]),
                o + "norm2.bias": Entry([(h + "ln_2.bias", (d,))]),
                o + "attn.qkv_weight": Entry([(h + "attn.c_attn.weight", (d, 3 * d))], t),
                o + "attn.qkv_bias": Entry([(h + "attn.c_attn.bias", (3 * d,))]),
                o + "attn.out_weight": Entry([(h + "attn.c_proj.weight", (d, d))], t),
                o + "attn.out_bias": Entry([(h + "attn.c_proj.bias", (d,))]),
                o + "mlp.fc_in.weight": Entry([(h + "mlp.c_fc.weight", (d, cfg.d_mlp))], t),
                o + "mlp.fc_in.bias": Entry([(h + "mlp.c_fc.bias", (cfg.d_mlp,))]),
                o + "mlp.fc_out.weight": Entry([(h + "mlp.c_proj.weight", (cfg.d_mlp, d))], t),
                o + "mlp.fc_out.bias": Entry([(h + "mlp.c_proj.bias", (d,))]),
            }
        )
    return p
