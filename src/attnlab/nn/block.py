"""One transformer block: attention and MLP sublayers on the residual stream.

    pre-norm  (GPT-2, Llama):  x = x + attn(norm1(x));   x = x + mlp(norm2(x))
    post-norm (BERT):          x = norm1(x + attn(x));   x = norm2(x + mlp(x))
    attention-only:            x = x + attn(x)           (no norms, no MLP)

``attn`` is the block's sequence mixer, built by :func:`attnlab.nn.mixers.make_mixer`
from ``cfg.mixer``: softmax attention (default), linear attention or a selective SSM.
The attribute keeps the name ``attn`` whatever the mixer, so code and checkpoints that
address ``blocks.i.attn`` keep working.
"""

from __future__ import annotations

from torch import nn

from attnlab.nn.mixers import make_mixer
from attnlab.nn.mlp import MLP, SwiGLU
from attnlab.nn.norms import make_norm


class Block(nn.Module):
    def __init__(self, cfg, *, attn_only: bool = False, positions=None):
        super().__init__()
        self.post = cfg.norm_position == "post"
        self.attn_only = attn_only
        self.attn = make_mixer(cfg, positions)
        self.drop = nn.Dropout(cfg.dropout)
        if attn_only:
            self.norm1 = self.norm2 = self.mlp = None
            return
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        kind = SwiGLU if cfg.mlp == "swiglu" else MLP
        self.mlp = kind(cfg.d_model, cfg.d_mlp, act=cfg.act, bias=cfg.bias)

    def forward(self, x, *, mask=None, pos=None, cache=None, need_weights=False):
        """``x (B, N, d_model)`` -> same; with ``need_weights`` also the pattern ``(B, H, N, M)``."""
        if self.attn_only:
            a = self.attn(x, mask=mask, pos=pos, cache=cache, need_weights=need_weights)
            a, w = a if need_weights else (a, None)
            return x + self.drop(a), w
        if self.post:
            a = self.attn(x, mask=mask, pos=pos, cache=cache, need_weights=need_weights)
            a, w = a if need_weights else (a, None)
            x = self.norm1(x + self.drop(a))
            return self.norm2(x + self.drop(self.mlp(x))), w
        a = self.attn(self.norm1(x), mask=mask, pos=pos, cache=cache, need_weights=need_weights)
        a, w = a if need_weights else (a, None)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x))), w
