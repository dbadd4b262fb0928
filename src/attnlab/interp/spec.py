"""What the activation cache needs to know about a model: layers, norms, W_O, the unembedding.

:func:`model_spec` reads it from an attnlab :class:`~attnlab.nn.Decoder` / :class:`~attnlab.nn.Encoder`
or (through :mod:`attnlab.models.hf_points`) from a transformers GPT-2, Llama/Mistral or BERT model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ModelSpec", "model_spec"]


@dataclass
class ModelSpec:
    """``norm``: "layernorm", "rmsnorm" or None (no norms); ``additive_resid``: the residual stream is the
    sum of the embeddings and the sublayer outputs (pre-norm, no embedding norm); ``unembed``: ``(vocab,
    d_model)`` or None; ``ln_final_weight``: ``(d_model,)`` or None; ``W_O(l)``: ``[H, d_head, d_model]``;
    ``b_O(l)``: ``(d_model,)`` or None."""

    n_layers: int
    n_heads: int
    norm: str | None
    additive_resid: bool
    has_mlp: bool
    has_pos_embed: bool
    has_ln_final: bool
    unembed: torch.Tensor | None
    ln_final_weight: torch.Tensor | None
    W_O: Callable[[int], torch.Tensor]
    b_O: Callable[[int], torch.Tensor | None] = lambda l: None  # (d_model,) or None


def model_spec(model) -> ModelSpec:
    from attnlab.interp.hooks import is_attnlab_model

    if not is_attnlab_model(model):
        from attnlab.models.hf_points import hf_spec

        return ModelSpec(**hf_spec(model))
    cfg = model.cfg
    decoder = hasattr(model, "lm_head")
    final = model.norm if decoder else model.final_norm
    attn_only = bool(getattr(cfg, "attn_only", False))
    return ModelSpec(
        n_layers=len(model.blocks),
        n_heads=cfg.n_heads,
        norm=None if attn_only and final is None else cfg.norm,
        additive_resid=decoder and cfg.norm_position == "pre",
        has_mlp=not attn_only,
        has_pos_embed=model.pos_embed is not None,
        has_ln_final=final is not None,
        unembed=model.lm_head.weight if decoder else None,
        ln_final_weight=None if final is None else getattr(final, "weight", None),
        W_O=lambda l: model.blocks[l].attn.W_O,
        b_O=lambda l: getattr(model.blocks[l].attn, "out_bias", None),
    )
