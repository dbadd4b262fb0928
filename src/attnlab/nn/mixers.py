"""Sequence mixers that can stand where :class:`~attnlab.nn.MultiHeadAttention` stands in a
:class:`~attnlab.nn.Block`, and :func:`make_mixer`, which picks one by ``cfg.mixer``:

==========  ==================================  =========================================
``mixer``   module                              token mixing
==========  ==================================  =========================================
attention   :class:`MultiHeadAttention`         ``softmax(QKᵀ/√d)V``
linear      :class:`LinearAttentionMixer`       ``φ(Q)(φ(K)ᵀV) / φ(Q)(φ(K)ᵀ1)`` (causal: chunked)
ssm         :class:`~attnlab.nn.ssm.SSMMixer`   selective state-space scan (Mamba-style)
==========  ==================================  =========================================

All three take ``x (B, N, d_model)`` and return ``(B, N, d_model)``, called as
``mixer(x, mask=..., pos=..., cache=..., need_weights=...)``, so models built from one
config differ only in the mixer (``cfg.replace(mixer="ssm")``).

Positions: RoPE rotates queries and keys of softmax *and* linear attention (for
linear attention before the feature map φ — a position signal, not the relative-position
kernel RoPE gives softmax attention); the SSM has no queries or keys and ignores it
(its recurrence is ordered).  ALiBi is a bias on softmax scores; linear attention and the
SSM have none, and the config refuses the combination.

>>> import torch
>>> from attnlab.nn import DecoderConfig
>>> cfg = DecoderConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, mixer="linear")
>>> type(make_mixer(cfg)).__name__, type(make_mixer(cfg.replace(mixer="ssm"))).__name__
('LinearAttentionMixer', 'SSMMixer')
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.nn.attention import FusedQKV, MultiHeadAttention
from attnlab.nn.config import FEATURE_MAPS, MIXERS
from attnlab.nn.ssm import RecurrentCache, SSMMixer, check_recurrent_cache
from attnlab.ops.linear import FavorFeatures, elu_feature, linear_attention, linear_attention_step
from attnlab.ops.sdpa import is_causal_mask
from attnlab.validate import head_shape, positive_int

__all__ = ["LinearAttentionMixer", "SSMMixer", "RecurrentCache", "make_mixer", "MIXERS", "FEATURE_MAPS"]


class LinearAttentionMixer(FusedQKV):  # MultiHeadAttention's fused parameters, views and projection
    """Multi-head *linear* attention with :class:`MultiHeadAttention`'s projections.

    The weights have MultiHeadAttention's names, shapes and fused layout (``qkv_weight``
    ``((H + 2·Hkv)·d_head, d_model)``, ``qkv_bias``, ``out_weight``, ``out_bias``; per-head
    views ``W_Q [H, d_model, d_head]`` ... ``W_O [H, d_head, d_model]``), so the two
    modules have the same parameter count and a state dict moves between them::

        x (B,N,d_model) --W_Q,W_K,W_V--> q (B,H,N,d_head), k, v (B,Hkv,N,d_head) [--RoPE q, k]
            --> linear_attention(q, k, v, feature_map, causal) -> z (B,H,N,d_head) --W_O--> (B,N,d_model)

    Args:
        d_model, n_heads, n_kv_heads, d_head, bias: as for :class:`MultiHeadAttention`.
        feature_map: ``"elu"`` (``elu(x)+1``) or ``"favor"`` (FAVOR+ positive random
            features, :class:`attnlab.ops.linear.FavorFeatures`, ``n_features`` of them,
            drawn from ``seed``; the draw is fixed, not a parameter, and not saved).
        positions: None or a :class:`attnlab.positions.RoPE` (applied to q and k before φ).
        chunk_size: rows per chunk of the causal computation.

    ``forward(x, *, mask=None, pos=None, cache=None, need_weights=False)``:
    ``mask`` is None (every token sees every token) or ``masks.causal()``; other masks
    raise.  ``cache`` is a :class:`~attnlab.nn.ssm.RecurrentCache` (the running sums
    ``S = Σ φ(k)vᵀ``, ``z = Σ φ(k)``; needs the causal mask).  ``need_weights`` also
    returns the normalised pattern ``φ(q_i)·φ(k_j) / Σ_j' φ(q_i)·φ(k_j')`` ``(B, H, N, N)``.

    >>> import torch
    >>> from attnlab import masks
    >>> m = LinearAttentionMixer(32, n_heads=4)
    >>> x = torch.randn(2, 6, 32)
    >>> y, w = m(x, mask=masks.causal(), need_weights=True)
    >>> y.shape, w.shape, torch.allclose(w.sum(-1), torch.ones(2, 4, 6))
    (torch.Size([2, 6, 32]), torch.Size([2, 4, 6, 6]), True)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        *,
        bias: bool = True,
        feature_map: str = "elu",
        n_features: int | None = None,
        seed: int = 0,
        positions=None,
        chunk_size: int = 64,
    ):
        super().__init__()
        d_model, n_heads, n_kv_heads, d_head = head_shape(d_model, n_heads, n_kv_heads, d_head)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map: expected one of {FEATURE_MAPS}, got {feature_map!r}")
        if positions is not None and not hasattr(positions, "cos_sin"):
            raise TypeError(
                f"positions: linear attention takes None or a positions.RoPE (ALiBi biases softmax "
                f"scores, which linear attention does not form), got {type(positions).__name__}"
            )
        if positions is not None and positions.d_head != d_head:
            raise ValueError(f"positions: RoPE built for d_head={positions.d_head}, the mixer has d_head={d_head}")
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = d_model, n_heads, n_kv_heads, d_head
        self.chunk_size = positive_int(chunk_size, "chunk_size")
        self.feature_map_name = feature_map
        if feature_map == "favor":
            m = 4 * d_head if n_features is None else positive_int(n_features, "n_features")
            self.feature_map: FavorFeatures | str = FavorFeatures(d_head, m, seed=seed)
        else:
            self.feature_map = "elu"
        self.positions = positions
        n_qkv = (n_heads + 2 * n_kv_heads) * d_head
        self.qkv_weight = nn.Parameter(torch.empty(n_qkv, d_model))
        self.qkv_bias = nn.Parameter(torch.zeros(n_qkv)) if bias else None
        self.out_weight = nn.Parameter(torch.empty(d_model, n_heads * d_head))
        self.out_bias = nn.Parameter(torch.zeros(d_model)) if bias else None
        self.reset_parameters()

    def forward(self, x, *, mask=None, pos=None, cache=None, need_weights: bool = False):
        """``x (B, N, d_model)`` -> ``(B, N, d_model)`` (and the pattern with ``need_weights``)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x: expected (B, N, d_model={self.d_model}), got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
        if mask is not None and not is_causal_mask(mask):
            raise ValueError(
                f"mask: linear attention takes None (bidirectional) or masks.causal(), got {mask!r}; "
                "padding, document or tree masks need mixer='attention'"
            )
        causal = mask is not None
        check_recurrent_cache(cache, "linear attention")
        if cache is not None and not causal:
            raise ValueError("mask: with a cache the new tokens follow the cached ones; pass masks.causal()")
        if cache is not None and need_weights:
            raise ValueError("need_weights: with a RecurrentCache the past keys are summed away; no pattern exists")
        B, N, _ = x.shape
        q, k, v = self.project(x)
        if self.positions is not None:
            p = (0 if cache is None else cache.seen) if pos is None else pos
            q, k = self.positions(q, p), self.positions(k, p)
        if cache is not None:
            st = cache.state
            if st is not None and st.S.shape[0] != B:
                raise ValueError(f"cache: holds a state for batch {st.S.shape[0]}, got x {tuple(x.shape)}")
            z, st = linear_attention_step(q, k, v, st, feature_map=self.feature_map)
            cache.advance(N, type(st)(st.S.detach(), st.z.detach(), None if st.m is None else st.m.detach()))
        else:
            z = linear_attention(q, k, v, feature_map=self.feature_map, causal=causal, chunk_size=self.chunk_size)
        out = F.linear(z.transpose(1, 2).reshape(B, N, self.n_heads * self.d_head), self.out_weight, self.out_bias)
        if need_weights:
            return out, self.pattern(q, k, causal)
        return out

    def pattern(self, q, k, causal: bool, eps: float = 1e-6) -> torch.Tensor:
        """The normalised linear-attention pattern ``(B, H, N, N)`` (float32) of positioned
        ``q (B, H, N, d_head)`` and ``k (B, Hkv, N, d_head)``: what each row averages v with."""
        fm = self.feature_map
        qf, kf = q.float(), k.float()
        pq, pk = (fm.query(qf), fm.key(kf)) if isinstance(fm, FavorFeatures) else (elu_feature(qf), elu_feature(kf))
        pk = pk.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        a = pq @ pk.transpose(-1, -2)
        if causal:
            N = a.shape[-1]
            a = a * torch.ones(N, N, dtype=torch.bool, device=a.device).tril()
        return a / a.sum(-1, keepdim=True).clamp_min(eps)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"d_head={self.d_head}, bias={self.qkv_bias is not None}, feature_map={self.feature_map_name!r}"
        )


def make_mixer(cfg, positions=None) -> nn.Module:
    """The sequence mixer of one block for ``cfg`` (a Decoder/EncoderConfig):
    :class:`MultiHeadAttention`, :class:`LinearAttentionMixer` or :class:`SSMMixer` by
    ``cfg.mixer``.  ``positions`` is the shared RoPE/ALiBi object (or None)."""
    kind = getattr(cfg, "mixer", "attention")
    if kind == "attention":
        return MultiHeadAttention(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.d_head,
            bias=cfg.bias,
            dropout=cfg.attn_dropout,
            positions=positions,
            backend=cfg.backend,
        )
    if kind in ("linear", "ssm") and positions is not None and not hasattr(positions, "cos_sin"):
        raise ValueError(
            f"positions: mixer={kind!r} takes no ALiBi (a bias on softmax scores); use positions "
            "'rope', 'learned', 'sinusoidal' or 'none'"
        )
    if kind == "linear":
        return LinearAttentionMixer(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.d_head,
            bias=cfg.bias,
            feature_map=cfg.linear_feature_map,
            positions=positions,
        )
    if kind == "ssm":
        return SSMMixer(
            cfg.d_model, cfg.n_heads, cfg.d_state, expand=cfg.ssm_expand, d_conv=cfg.ssm_conv, bias=cfg.bias
        )
    raise ValueError(f"cfg.mixer: expected one of {MIXERS}, got {kind!r}")


def init_mixer_weights(m: nn.Module, std: float, resid: float) -> None:
    """GPT-2-style init of a non-attention mixer (used by the Decoder's ``init_weights``):
    matrices N(0, std), the projection into the residual stream N(0, resid), biases 0;
    the SSM's own parameters (A, Δ bias, D, conv, norm) keep their initialisation."""
    if isinstance(m, LinearAttentionMixer):
        nn.init.normal_(m.qkv_weight, std=std)
        nn.init.normal_(m.out_weight, std=resid)
        for b in (m.qkv_bias, m.out_bias):
            if b is not None:
                nn.init.zeros_(b)
    elif isinstance(m, SSMMixer):
        for lin, s in ((m.in_proj, std), (m.out_proj, resid)):
            nn.init.normal_(lin.weight, std=s)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
