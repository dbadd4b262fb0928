"""A BERT-style bidirectional encoder: word + position + token-type embeddings,
post-LN blocks, an optional tanh pooler.

>>> import torch
>>> from attnlab.nn import Encoder, EncoderConfig
>>> enc = Encoder(EncoderConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4)).eval()
>>> ids = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
>>> out = enc(ids, attention_mask=ids != 0)
>>> out.last_hidden_state.shape, mean_pool(out.last_hidden_state, ids != 0).shape
(torch.Size([2, 4, 32]), torch.Size([2, 32]))
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import masks
from attnlab.nn.block import Block
from attnlab.nn.config import EncoderConfig
from attnlab.nn.decoder import (
    ModelOutput,
    absolute_positions,
    attention_positions,
    check_ids,
    check_keep,
    init_weights,
    token_positions,
)
from attnlab.nn.hooks import HookPoint, NormPoints
from attnlab.nn.norms import make_norm


class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if not isinstance(cfg, EncoderConfig):
            raise TypeError(f"cfg: expected an EncoderConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.pos_embed = absolute_positions(cfg.positions, cfg.max_positions, cfg.d_model)
        self.type_embed = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.embed_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        rel = attention_positions(cfg, bidirectional=True)
        self.blocks = nn.ModuleList(Block(cfg, positions=rel) for _ in range(cfg.n_layers))
        self.final_norm = (
            make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias) if cfg.norm_position == "pre" else None
        )
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler else None
        init_weights(self, cfg.n_layers)
        # hook points (attnlab.nn.hooks): word / position / token-type embeddings, ln_final (pre-norm only)
        self.hook_embed, self.hook_pos_embed, self.hook_token_type_embed = HookPoint(), HookPoint(), HookPoint()
        self.ln_final_points = NormPoints()

    def forward(
        self,
        input_ids,
        *,
        attention_mask=None,
        token_type_ids=None,
        pos=None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        """Encode ``input_ids (B, N)``; ``attention_mask (B, N)`` marks real tokens (True/1).

        Padded keys are hidden from every query (:func:`attnlab.masks.key_padding`); the
        outputs at padded positions are defined but meaningless.
        """
        ids = check_ids(input_ids, self.cfg.vocab_size)
        B, N = ids.shape
        x = self.hook_embed(self.embed(ids))
        if self.pos_embed is not None:
            x = x + self.hook_pos_embed(self.pos_embed(token_positions(pos, B, N, 0, ids.device)).expand(B, N, -1))
        if self.type_embed is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(ids)
            elif token_type_ids.shape != ids.shape:
                raise ValueError(f"token_type_ids: expected {tuple(ids.shape)}, got {tuple(token_type_ids.shape)}")
            x = x + self.hook_token_type_embed(self.type_embed(token_type_ids))
        x = self.drop(self.embed_norm(x))
        mask = None if attention_mask is None else masks.key_padding(check_keep(attention_mask, B, N))
        hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        attns: list[torch.Tensor] | None = [] if output_attentions else None
        rel_pos = None if pos is None or isinstance(pos, int) else pos
        for block in self.blocks:
            if hidden is not None:
                hidden.append(x)
            x, w = block(x, mask=mask, pos=rel_pos, need_weights=output_attentions)
            if attns is not None:
                attns.append(w)
        if self.final_norm is not None:
            x = self.ln_final_points(self.final_norm, x)
        if hidden is not None:
            hidden.append(x)
        pooled = torch.tanh(self.pooler(x[:, 0])) if self.pooler is not None else None
        return ModelOutput(None, x, hidden, attns, pooled)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``hidden (B, N, d)`` over the real tokens of each row -> ``(B, d)``
    (sentence-transformers' pooling; an all-padding row gives zeros)."""
    if attention_mask is None:
        return hidden.mean(1)
    m = torch.as_tensor(attention_mask).to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
