"""A GPT-style causal decoder: embeddings → blocks → final norm → logits.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> cfg = DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, positions="rope",
...                     norm="rmsnorm", mlp="swiglu", act="silu", bias=False, n_kv_heads=2)
>>> model = Decoder(cfg)
>>> model(torch.randint(0, 50, (2, 7))).logits.shape
torch.Size([2, 7, 50])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab import masks, positions as P
from attnlab.nn.block import Block
from attnlab.nn.config import DecoderConfig
from attnlab.nn.hooks import HookPoint, NormPoints
from attnlab.nn.norms import make_norm
from attnlab.validate import tensor_check

_CAUSAL = masks.causal()  # one object, so its BlockMask cache serves every call


@dataclass
class ModelOutput:
    """``logits (B, N, vocab)`` for a decoder (``None`` for an encoder);
    ``last_hidden_state (B, N, d_model)`` after the final norm;
    ``hidden_states``: the residual stream entering each block and the last one
    (``n_layers + 1`` tensors) when asked; ``attentions``: each layer's pattern
    ``(B, H, N, M)`` when asked; ``pooled``: BERT's pooler output."""

    logits: torch.Tensor | None
    last_hidden_state: torch.Tensor
    hidden_states: list | None = None
    attentions: list | None = None
    pooled: torch.Tensor | None = None


def absolute_positions(kind: str, max_positions: int, d_model: int) -> nn.Module | None:
    if kind == "learned":
        return P.LearnedEmbedding(max_positions, d_model)
    if kind == "sinusoidal":
        return P.SinusoidalEmbedding(d_model, max_positions=max_positions)
    return None


def attention_positions(cfg, *, bidirectional: bool = False):
    """The per-attention position object (RoPE / ALiBi), shared by every layer."""
    if cfg.positions == "rope":
        return P.RoPE(
            cfg.d_head,
            base=cfg.rope_base,
            rotary_dim=cfg.rotary_dim,
            interleaved=cfg.rope_interleaved,
            scaling=cfg.rope_scaling,
        )
    if cfg.positions == "alibi":
        return P.ALiBi(cfg.n_heads, symmetric=bidirectional)
    return None


def token_positions(pos, B, N, start, device):
    """``pos`` as given, or ``start .. start+N-1`` (``start`` an int or ``(B,)`` per sequence)."""
    if pos is None:
        if isinstance(start, torch.Tensor):
            return start.view(-1, 1).to(device) + torch.arange(N, device=device)
        return torch.arange(start, start + N, device=device)
    if isinstance(pos, int):
        return torch.arange(pos, pos + N, device=device)
    if not isinstance(pos, torch.Tensor) or pos.dtype.is_floating_point or pos.shape[-1] != N or pos.dim() > 2:
        raise ValueError(
            f"pos: expected None, an int offset or integer positions (N={N},) / (B, N), got "
            f"{tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__}"
        )
    if pos.dim() == 2 and pos.shape[0] not in (1, B):
        raise ValueError(f"pos: expected (N={N},) or (B={B}, N={N}) positions, got {tuple(pos.shape)}")
    return pos


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        if not isinstance(cfg, DecoderConfig):
            raise TypeError(f"cfg: expected a DecoderConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = absolute_positions(cfg.positions, cfg.max_positions, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        rel = attention_positions(cfg)
        self.blocks = nn.ModuleList(Block(cfg, attn_only=cfg.attn_only, positions=rel) for _ in range(cfg.n_layers))
        self.norm = (
            make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias) if cfg.final_norm and not cfg.attn_only else None
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg.n_layers)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # hook points (attnlab.nn.hooks): hook_embed, hook_pos_embed, ln_final, logits
        self.hook_embed, self.hook_pos_embed, self.hook_logits = HookPoint(), HookPoint(), HookPoint()
        self.ln_final_points = NormPoints()

    def forward(
        self,
        input_ids,
        *,
        attention_mask=None,
        pos=None,
        cache=None,
        mask=None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> ModelOutput:
        """Logits for ``input_ids (B, N)``.

        Args:
            attention_mask: ``(B, M)`` bool/0-1, True for real tokens, covering the cached
                tokens and the new ones (``M = cache.seen + N``); padded keys are hidden
                (:func:`attnlab.masks.key_padding`) on top of the causal mask.
            pos: token positions (default ``cache.seen + arange(N)``, or ``arange(N)``).
            cache: an :class:`attnlab.cache.Cache` (or any sequence of per-layer caches).
            mask: replaces ``masks.causal()`` (e.g. ``masks.tree(parents, prefix_len)`` to
                verify a speculative token tree); absolute positions as always.
        """
        ids = check_ids(input_ids, self.cfg.vocab_size)
        if output_attentions and self.cfg.mixer == "ssm":
            raise ValueError(
                "output_attentions: the SSM mixer (cfg.mixer='ssm') forms no attention pattern; "
                "it is available for mixer='attention' (softmax) and 'linear' (normalised φ(q)·φ(k))"
            )
        B, N = ids.shape
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"cache: expected {len(self.blocks)} per-layer caches, got {len(cache)}")
        start = 0 if cache is None else cache[0].seen
        x = self.hook_embed(self.embed(ids))
        tpos = token_positions(pos, B, N, start, ids.device)
        if self.pos_embed is not None:
            x = x + self.hook_pos_embed(self.pos_embed(tpos).expand(B, N, -1))  # a view: (B, N, d_model)
        x = self.drop(x)
        mask = _CAUSAL if mask is None else mask
        if attention_mask is not None:
            M = (start if isinstance(start, int) else int(start.max())) + N
            mask = mask & masks.key_padding(check_keep(attention_mask, B, M))
        hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        attns: list[torch.Tensor] | None = [] if output_attentions else None
        rel_pos = None if pos is None or getattr(cache, "rotates_keys", False) else tpos
        for i, block in enumerate(self.blocks):
            if hidden is not None:
                hidden.append(x)
            x, w = block(
                x, mask=mask, pos=rel_pos, cache=None if cache is None else cache[i], need_weights=output_attentions
            )
            if attns is not None:
                attns.append(w)
        if self.norm is not None:
            x = self.ln_final_points(self.norm, x)
        if hidden is not None:
            hidden.append(x)
        return ModelOutput(self.hook_logits(self.lm_head(x)), x, hidden, attns)

    def extra_repr(self):
        c = self.cfg
        mixer = "" if c.mixer == "attention" else f", mixer={c.mixer}"
        return (
            f"layers={c.n_layers}, d_model={c.d_model}, heads={c.n_heads}/{c.n_kv_heads}, "
            f"positions={c.positions}{mixer}"
        )


def init_weights(model: nn.Module, n_layers: int, std: float = 0.02) -> None:
    """GPT-2's initialisation: every matrix and embedding N(0, std), biases 0, and the
    projections that write into the residual stream (W_O and the MLP's output)
    N(0, std/sqrt(2·n_layers)) so the stream's variance does not grow with depth.
    Linear-attention and SSM mixers get the same (the SSM's A, Δ bias, D and conv keep
    their own initialisation)."""
    from attnlab.nn.attention import MultiHeadAttention
    from attnlab.nn.mixers import init_mixer_weights
    from attnlab.nn.mlp import MLP, SwiGLU

    resid = std / (2 * n_layers) ** 0.5
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
            bias = getattr(m, "bias", None)
            if bias is not None:
                nn.init.zeros_(bias)
        elif isinstance(m, MultiHeadAttention):
            nn.init.normal_(m.qkv_weight, std=std)
            nn.init.normal_(m.out_weight, std=resid)
            for b in (m.qkv_bias, m.out_bias):
                if b is not None:
                    nn.init.zeros_(b)
    for m in model.modules():
        if isinstance(m, MLP):
            nn.init.normal_(m.fc_out.weight, std=resid)
        elif isinstance(m, SwiGLU):
            nn.init.normal_(m.down.weight, std=resid)
        else:
            init_mixer_weights(m, std, resid)  # linear-attention / SSM mixers (a no-op for other modules)


def check_ids(ids, vocab_size):
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 2:
        raise ValueError(
            f"input_ids: expected an integer tensor (B, N), got "
            f"{(ids.dtype, tuple(ids.shape)) if isinstance(ids, torch.Tensor) else type(ids).__name__}"
        )
    if ids.numel() and not tensor_check(
        (ids >= 0).all() & (ids < vocab_size).all(), f"input_ids: token ids must lie in [0, {vocab_size})"
    ):
        raise ValueError(
            f"input_ids: token ids must lie in [0, {vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]"
        )
    return ids


def check_keep(attention_mask, B, M):
    t = torch.as_tensor(attention_mask)
    if t.dtype.is_floating_point or t.is_complex():
        raise TypeError(f"attention_mask: expected bool or 0/1 integers (1 = real token), got dtype {t.dtype}")
    if t.dim() != 2 or t.shape[0] != B or t.shape[1] != M:
        raise ValueError(f"attention_mask: expected (B={B}, {M}) covering cached and new tokens, got {tuple(t.shape)}")
    return t
