"""Modules: attention, MLPs, norms, blocks, and the Decoder / Encoder models.

Layering: :func:`attnlab.attention` (functional) → :class:`MultiHeadAttention`
(projections, heads, positions, W_O, cache) → :class:`Block` → :class:`Decoder` /
:class:`Encoder`.  A block's mixer is softmax attention, :class:`LinearAttentionMixer` or
:class:`SSMMixer` (``cfg.mixer``), so models can differ in the mixer alone.
"""

from attnlab.nn.additive import AdditiveAttention
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.block import Block
from attnlab.nn.config import DecoderConfig, EncoderConfig
from attnlab.nn.decoder import Decoder, ModelOutput
from attnlab.nn.encoder import Encoder, mean_pool
from attnlab.nn.mixers import LinearAttentionMixer, make_mixer
from attnlab.nn.mlp import MLP, SwiGLU
from attnlab.nn.norms import RMSNorm
from attnlab.nn.ssm import RecurrentCache, SSMMixer

__all__ = [
    "MultiHeadAttention",
    "Block",
    "DecoderConfig",
    "EncoderConfig",
    "Decoder",
    "Encoder",
    "ModelOutput",
    "mean_pool",
    "MLP",
    "SwiGLU",
    "RMSNorm",
    "AdditiveAttention",
    "LinearAttentionMixer",
    "make_mixer",
    "RecurrentCache",
    "SSMMixer",
]
