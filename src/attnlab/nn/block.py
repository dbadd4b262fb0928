"""One transformer block: attention and MLP sublayers on the residual stream.

    pre-norm  (GPT-2, Llama):  x = x + attn(norm1(x));   x = x + mlp(norm2(x))
    post-norm (BERT):          x = norm1(x + attn(x));   x = norm2(x + mlp(x))
    attention-only:            x = x + attn(x)           (no norms, no MLP)

``attn`` is the block's sequence mixer, built by :func:`attnlab.nn.mixers.make_mixer`
from ``cfg.mixer``: softmax attention (default), linear attention or a selective SSM.
The attribute keeps the name ``attn`` whatever the mixer, so code and checkpoints that
address ``blocks.i.attn`` keep working.

Hook points (:mod:`attnlab.nn.hooks`; names given by :func:`attnlab.interp.hook_names`)::

    pre-norm:   resid_pre ─┬─ ln1 ─ attn ─ attn_out ─(+)─ resid_mid ─┬─ ln2 ─ mlp ─ mlp_out ─(+)─ resid_post
                           └──────────────────────────┘               └──────────────────────────┘
    post-norm:  resid_pre ─ attn ─ attn_out ─(+ resid_pre)─ resid_mid ─ ln1 ─ mlp ─ mlp_out ─(+)─ resid_post ─ ln2
                (TransformerLens' BERT: resid_mid and resid_post are *before* their norm; the
                block's output, the next resid_pre, is ``ln2.hook_normalized``)

``attn_out`` and ``mlp_out`` are what is added to the stream (after dropout).  An
attention-only block has resid_pre, attn_out and resid_post.
"""

from __future__ import annotations

from torch import nn

from attnlab.nn.hooks import HookPoint, NormPoints
from attnlab.nn.mixers import make_mixer
from attnlab.nn.mlp import MLP, SwiGLU
from attnlab.nn.norms import make_norm


class Block(nn.Module):
    # None in an attention-only block (see :meth:`_sublayers`)
    norm1: nn.Module | None
    norm2: nn.Module | None
    mlp: nn.Module | None
    hook_resid_mid: HookPoint | None
    hook_mlp_out: HookPoint | None
    ln1_points: NormPoints | None
    ln2_points: NormPoints | None

    def __init__(self, cfg, *, attn_only: bool = False, positions=None):
        super().__init__()
        self.post = cfg.norm_position == "post"
        self.attn_only = attn_only
        self.attn = make_mixer(cfg, positions)
        self.drop = nn.Dropout(cfg.dropout)
        self.hook_resid_pre, self.hook_attn_out, self.hook_resid_post = HookPoint(), HookPoint(), HookPoint()
        if attn_only:
            self.norm1 = self.norm2 = self.mlp = None
            self.hook_resid_mid = self.hook_mlp_out = self.ln1_points = self.ln2_points = None
            return
        self.hook_resid_mid, self.hook_mlp_out = HookPoint(), HookPoint()
        self.ln1_points, self.ln2_points = NormPoints(), NormPoints()
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        kind = SwiGLU if cfg.mlp == "swiglu" else MLP
        self.mlp = kind(cfg.d_model, cfg.d_mlp, act=cfg.act, bias=cfg.bias)

    def forward(self, x, *, mask=None, pos=None, cache=None, need_weights=False):
        """``x (B, N, d_model)`` -> same; with ``need_weights`` also the pattern ``(B, H, N, M)``."""
        x = self.hook_resid_pre(x)
        parts = self._sublayers()
        if parts is None:  # attention-only
            a = self.attn(x, mask=mask, pos=pos, cache=cache, need_weights=need_weights)
            a, w = a if need_weights else (a, None)
            return self.hook_resid_post(x + self.hook_attn_out(self.drop(a))), w
        norm1, norm2, mlp, ln1_points, ln2_points, hook_resid_mid, hook_mlp_out = parts
        if self.post:
            a = self.attn(x, mask=mask, pos=pos, cache=cache, need_weights=need_weights)
            a, w = a if need_weights else (a, None)
            x = ln1_points(norm1, hook_resid_mid(x + self.hook_attn_out(self.drop(a))))
            x = self.hook_resid_post(x + hook_mlp_out(self.drop(mlp(x))))
            return ln2_points(norm2, x), w
        a = self.attn(ln1_points(norm1, x), mask=mask, pos=pos, cache=cache, need_weights=need_weights)
        a, w = a if need_weights else (a, None)
        x = hook_resid_mid(x + self.hook_attn_out(self.drop(a)))
        x = x + hook_mlp_out(self.drop(mlp(ln2_points(norm2, x))))
        return self.hook_resid_post(x), w

    def _sublayers(self):
        """``(norm1, norm2, mlp, ln1_points, ln2_points, hook_resid_mid, hook_mlp_out)``, or None
        for an attention-only block (which has none of them)."""
        n1, n2, mlp = self.norm1, self.norm2, self.mlp
        l1, l2, mid, out = self.ln1_points, self.ln2_points, self.hook_resid_mid, self.hook_mlp_out
        if n1 is None or n2 is None or mlp is None or l1 is None or l2 is None or mid is None or out is None:
            return None
        return n1, n2, mlp, l1, l2, mid, out
