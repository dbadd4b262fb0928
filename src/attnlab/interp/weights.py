"""One description of a model's attention weights, whatever the model is built from.

Circuits (:mod:`attnlab.interp.circuits`) read a :class:`ModelWeights`, never a model
class.  :func:`model_weights` builds one from

* an attnlab :class:`~attnlab.nn.Decoder` or :class:`~attnlab.nn.Encoder` (the module's
  parameters, live views: gradients flow);
* a transformers GPT-2, Llama / Mistral (GQA) or BERT model (bare or with a head): the
  module's ``state_dict`` mapped to attnlab's names by the same loader plans
  :func:`attnlab.models.load` uses (:mod:`attnlab.models.gpt2`, ``llama``, ``bert``), so
  a circuit of a transformers model equals the circuit of the same weights loaded into
  attnlab (tested).  These tensors are detached copies.

Per layer (:class:`LayerWeights`, row-vector convention ``q = x W_Q + b_Q``)::

    W_Q [H, d_model, d_head]    W_K, W_V [Hkv, d_model, d_head]    W_O [H, d_head, d_model]
    b_Q [H, d_head]   b_K, b_V [Hkv, d_head]   b_O [d_model]       (None without biases)
    read_norm: the norm the attention reads its input through (pre-norm models), else None

Query head ``h`` reads kv head ``h // (H // Hkv)`` (:attr:`LayerWeights.kv_index`).
Model level: ``W_E [vocab, d_model]``; ``W_U [d_model, vocab]``, the unembedding the
residual stream is read by, and ``final_norm`` in front of it (pre-norm only).  An
encoder has no LM head: its ``W_U`` is ``W_Eᵀ``, the tied decoder matrix of BERT's MLM
head (``unembed = "tied W_E"``; the head's dense + LayerNorm transform is left out).
Post-norm models (BERT) normalise the residual stream *after* each sublayer, not a
head's read: ``read_norm`` and ``final_norm`` are ``None`` there.

>>> import torch
>>> from attnlab.nn import Encoder, EncoderConfig
>>> w = model_weights(Encoder(EncoderConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=4)))
>>> len(w.layers), tuple(w.layers[0].W_Q.shape), tuple(w.W_U.shape), w.unembed
(2, (4, 16, 4), (16, 30), 'tied W_E')
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.decoder import Decoder, attention_positions
from attnlab.nn.encoder import Encoder
from attnlab.nn.norms import RMSNorm

__all__ = ["NormWeights", "LayerWeights", "ModelWeights", "model_weights", "HF_ALIASES"]

#: transformers ``model_type``s read with another architecture's loader plan (same layout).
HF_ALIASES = {"mistral": "llama"}


@dataclass
class NormWeights:
    """The linear part of a norm: ``kind`` ``"layernorm"`` (centring, then ``weight``) or
    ``"rmsnorm"`` (``weight`` only); ``bias`` (LayerNorm's shift) is kept but never folded."""

    kind: str
    weight: torch.Tensor | None
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, norm) -> NormWeights | None:
        if norm is None:
            return None
        if isinstance(norm, nn.LayerNorm):
            return cls("layernorm", norm.weight, norm.bias)
        if isinstance(norm, RMSNorm):
            return cls("rmsnorm", norm.weight)
        raise TypeError(f"fold_ln: cannot fold a {type(norm).__name__}; pass fold_ln=False")

    def fold(self, W: torch.Tensor) -> torch.Tensor:
        """``N W`` with ``N`` this norm's linear part (row vectors), ``W [..., d_model, n]``."""
        G = W if self.weight is None else self.weight.to(W.dtype).unsqueeze(-1) * W
        if self.kind == "layernorm":
            return G - G.mean(dim=-2, keepdim=True)  # (I - 11ᵀ/d) diag(γ) W
        return G


@dataclass
class LayerWeights:
    """One attention layer's per-head weights (shapes in the module docstring)."""

    W_Q: torch.Tensor
    W_K: torch.Tensor
    W_V: torch.Tensor
    W_O: torch.Tensor
    b_Q: torch.Tensor | None = None
    b_K: torch.Tensor | None = None
    b_V: torch.Tensor | None = None
    b_O: torch.Tensor | None = None
    read_norm: NormWeights | None = None
    scale: float | None = None
    positions: object = None  # a positions.RoPE (for query_pos / key_pos), ALiBi, or None

    @property
    def n_heads(self) -> int:
        return self.W_Q.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.W_K.shape[0]

    @property
    def d_model(self) -> int:
        return self.W_Q.shape[1]

    @property
    def d_head(self) -> int:
        return self.W_Q.shape[2]

    @property
    def kv_index(self) -> torch.Tensor:
        """``(H,)``: the kv head ``h // (H // Hkv)`` each query head reads."""
        return torch.arange(self.n_heads, device=self.W_Q.device) // (self.n_heads // self.n_kv_heads)

    @classmethod
    def of(cls, attn: MultiHeadAttention, read_norm=None) -> LayerWeights:
        return cls(
            attn.W_Q,
            attn.W_K,
            attn.W_V,
            attn.W_O,
            attn.b_Q,
            attn.b_K,
            attn.b_V,
            attn.b_O,
            NormWeights.of(read_norm),
            attn.scale,
            attn.positions,
        )


@dataclass
class ModelWeights:
    """Every layer's :class:`LayerWeights` plus the embedding and unembedding."""

    layers: list
    W_E: torch.Tensor | None
    W_U: torch.Tensor | None
    final_norm: NormWeights | None
    source: str
    unembed: str = "lm_head"

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def layer(self, layer) -> LayerWeights:
        """Layer ``layer`` (negative indices count from the end, as in Python)."""
        L = len(self.layers)
        if isinstance(layer, bool) or not isinstance(layer, int) or not -L <= layer < L:
            raise ValueError(f"layer: expected an int in [-{L}, {L}) for a model with n_layers={L}, got {layer!r}")
        return self.layers[layer % L]


# -- attnlab models ----------------------------------------------------------------------
def _attn_of(block, l, what):
    if not isinstance(block.attn, MultiHeadAttention):
        raise TypeError(
            f"model: layer {l} of this {what} mixes with {type(block.attn).__name__}, not softmax "
            "attention; QK/OV circuits exist only for MultiHeadAttention layers"
        )
    return block.attn


def _from_attnlab(model, fold_ln: bool) -> ModelWeights:
    cfg = model.cfg
    pre = cfg.norm_position == "pre"
    layers = []
    for l, b in enumerate(model.blocks):
        norm = b.norm1 if fold_ln and pre and not b.attn_only else None
        layers.append(LayerWeights.of(_attn_of(b, l, type(model).__name__), norm))
    if isinstance(model, Decoder):
        final = model.norm if fold_ln and pre else None
        return ModelWeights(
            layers, model.embed.weight, model.lm_head.weight.T, NormWeights.of(final), "attnlab Decoder"
        )
    final = model.final_norm if fold_ln and pre else None
    return ModelWeights(
        layers, model.embed.weight, model.embed.weight.T, NormWeights.of(final), "attnlab Encoder", unembed="tied W_E"
    )


# -- transformers models -----------------------------------------------------------------
def _is_hf(model) -> bool:
    cfg = getattr(model, "config", None)
    return isinstance(model, nn.Module) and hasattr(cfg, "model_type") and hasattr(cfg, "to_dict")


def _fused_heads(t: dict, o: str, H: int, Hkv: int, dh: int, d: int):
    """attnlab's fused ``qkv_weight (H+2Hkv)·dh × d`` / ``out_weight d × H·dh`` as per-head
    views (the layout of :class:`MultiHeadAttention`'s ``W_Q`` ... properties)."""
    w, ow = t[o + "attn.qkv_weight"], t[o + "attn.out_weight"]
    rows = {"Q": (0, H), "K": (H * dh, Hkv), "V": ((H + Hkv) * dh, Hkv)}
    W = {k: w[lo : lo + n * dh].view(n, dh, d).transpose(1, 2) for k, (lo, n) in rows.items()}
    bias = t.get(o + "attn.qkv_bias")
    b = {k: None if bias is None else bias[lo : lo + n * dh].view(n, dh) for k, (lo, n) in rows.items()}
    W_O = ow.view(d, H, dh).permute(1, 2, 0)
    return W, b, W_O, t.get(o + "attn.out_bias")


def _hf_norm(t, name, kind):
    w = t.get(name + ".weight")
    return None if w is None else NormWeights(kind, w, t.get(name + ".bias"))


def _from_hf(model, fold_ln: bool) -> ModelWeights:
    from attnlab.models import ARCHITECTURES
    from attnlab.models.checkpoint import strip_prefix

    mt = model.config.model_type
    arch_name = HF_ALIASES.get(mt, mt)
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise TypeError(
            f"model: transformers model_type {mt!r} has no weight adapter; supported: "
            f"{sorted(ARCHITECTURES) + sorted(HF_ALIASES)}"
        )
    raw = strip_prefix({k: v.detach() for k, v in model.state_dict().items()}, arch.PREFIXES)
    d = model.config.to_dict()
    cfg = arch.config_from_hf(d, raw) if arch_name == "bert" else arch.config_from_hf(d)
    plan = arch.plan(cfg, raw)
    want = ("attn.", "norm1.", "embed.weight", "norm.", "lm_head.")
    t = {}
    for ours, entry in plan.items():
        if not any(w in ours for w in want) or "mlp" in ours:
            continue
        parts = [raw[n] for n, _ in entry.sources]
        t[ours] = entry.combine(*parts) if entry.combine else parts[0]
    H, Hkv, dh, dm = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model
    pre = cfg.norm_position == "pre"
    kind = cfg.norm
    rope = attention_positions(cfg) if cfg.positions in ("rope", "alibi") else None
    layers = []
    for l in range(cfg.n_layers):
        o = f"blocks.{l}."
        W, b, W_O, b_O = _fused_heads(t, o, H, Hkv, dh, dm)
        norm = _hf_norm(t, o + "norm1", kind) if fold_ln and pre else None
        layers.append(LayerWeights(W["Q"], W["K"], W["V"], W_O, b["Q"], b["K"], b["V"], b_O, norm, dh**-0.5, rope))
    W_E = t["embed.weight"]
    if arch_name == "bert":
        return ModelWeights(layers, W_E, W_E.T, None, f"transformers {type(model).__name__}", unembed="tied W_E")
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    W_U, how = (out.weight.detach().T, "lm_head") if out is not None else (W_E.T, "tied W_E")
    final = _hf_norm(t, "norm", kind) if fold_ln and pre else None
    return ModelWeights(layers, W_E, W_U, final, f"transformers {type(model).__name__}", unembed=how)


def model_weights(model, *, fold_ln: bool = True) -> ModelWeights:
    """The :class:`ModelWeights` of an attnlab Decoder / Encoder or a transformers GPT-2 /
    Llama / Mistral / BERT model.  ``fold_ln`` records the norms that
    :mod:`~attnlab.interp.circuits` folds (pre-norm models only); ``False`` leaves them out.
    A :class:`ModelWeights` passes through unchanged."""
    if isinstance(model, ModelWeights):
        return model
    if isinstance(model, (Decoder, Encoder)):
        return _from_attnlab(model, fold_ln)
    if _is_hf(model):
        return _from_hf(model, fold_ln)
    raise TypeError(
        f"model: expected an attnlab Decoder or Encoder, or a transformers GPT-2 / Llama / Mistral / "
        f"BERT model, got {type(model).__name__}"
    )
