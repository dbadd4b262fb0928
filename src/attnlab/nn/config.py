"""Model configs: small dataclasses, validated on construction with clear errors.

>>> from attnlab.nn import DecoderConfig
>>> DecoderConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4).d_mlp
256
>>> DecoderConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=5)
Traceback (most recent call last):
...
ValueError: DecoderConfig: d_model=64 is not divisible by n_heads=5; set d_head explicitly
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attnlab import positions as P
from attnlab.nn.mlp import ACTIVATIONS
from attnlab.nn.norms import NORMS
from attnlab.ops.dispatch import BACKENDS
from attnlab.validate import choice, head_shape, nonneg_int, positive_float, positive_int, probability, real

_SCALINGS = {
    c.__name__: c for c in (P.LinearScaling, P.NTKScaling, P.DynamicNTKScaling, P.YaRNScaling, P.Llama3Scaling)
}
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")
MLPS = ("mlp", "swiglu")
MIXERS = ("attention", "linear", "ssm")
FEATURE_MAPS = ("elu", "favor")


@dataclass
class _Common:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    d_head: int | None = None
    d_mlp: int | None = None  # default 4 * d_model
    max_positions: int = 1024  # for learned / sinusoidal tables
    positions: str = "learned"  # learned | sinusoidal | rope | alibi | none
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    norm_position: str = "pre"  # pre (GPT-2, Llama) | post (BERT)
    mlp: str = "mlp"  # mlp | swiglu
    act: str = "gelu"  # gelu | gelu_tanh | relu | silu
    bias: bool = True  # biases of attention and MLP linears (and LayerNorm shifts)
    dropout: float = 0.0  # embedding / residual dropout
    attn_dropout: float = 0.0  # attention-probability dropout
    backend: str = "auto"  # attnlab.attention backend
    rope_base: float = 10000.0
    rope_interleaved: bool = False  # False: half-split pairing (Llama/NeoX); True: (2i, 2i+1)
    rotary_dim: int | None = None  # partial rotary (default d_head)
    rope_scaling: Any = None  # a positions.*Scaling (a dataclass)
    mixer: str = "attention"  # attention | linear | ssm  (the token mixer of every block)
    d_state: int = 16  # ssm: state size per channel
    ssm_expand: int = 1  # ssm: inner channels = ssm_expand * d_model (1 ~ attention's params)
    ssm_conv: int = 4  # ssm: kernel of the short causal conv (0 = none)
    linear_feature_map: str = "elu"  # linear: "elu" (elu+1) or "favor" (FAVOR+ random features)

    def __post_init__(self):
        name = type(self).__name__
        # fields filled in from others: replace() recomputes them unless given
        self._derived = {f for f in ("n_kv_heads", "d_head", "d_mlp") if getattr(self, f) is None}
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "max_positions"):
            positive_int(getattr(self, f), f"{name}.{f}")
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = head_shape(
            self.d_model, self.n_heads, self.n_kv_heads, self.d_head, where=name
        )
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        positive_int(self.d_mlp, f"{name}.d_mlp")
        choice(self.positions, f"{name}.positions", POSITIONS)
        choice(self.norm, f"{name}.norm", NORMS)
        choice(self.norm_position, f"{name}.norm_position", ("pre", "post"))
        choice(self.mlp, f"{name}.mlp", MLPS)
        choice(self.act, f"{name}.act", ACTIVATIONS)
        choice(self.backend, f"{name}.backend", BACKENDS)
        positive_float(self.norm_eps, f"{name}.norm_eps")
        real(self.rope_base, f"{name}.rope_base", gt=1.0)  # what RoPE needs (base ** (-2i/d) decreasing)
        probability(self.dropout, f"{name}.dropout")
        probability(self.attn_dropout, f"{name}.attn_dropout")
        rd = self.rotary_dim
        if rd is not None and (isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2 or rd > self.d_head):
            raise ValueError(f"{name}.rotary_dim: expected an even int in [2, d_head={self.d_head}], got {rd!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple(_SCALINGS.values())):
            raise TypeError(
                f"{name}.rope_scaling: expected None or one of {sorted(_SCALINGS)}, "
                f"got {type(self.rope_scaling).__name__}"
            )
        for f in ("bias", "rope_interleaved"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"{name}.{f}: expected a bool, got {getattr(self, f)!r}")
        self._check_mixer(name)

    def _check_mixer(self, name):
        choice(self.mixer, f"{name}.mixer", MIXERS)
        positive_int(self.d_state, f"{name}.d_state")
        positive_int(self.ssm_expand, f"{name}.ssm_expand")
        nonneg_int(self.ssm_conv, f"{name}.ssm_conv")
        choice(self.linear_feature_map, f"{name}.linear_feature_map", FEATURE_MAPS)
        if self.mixer == "attention":
            return
        if self.positions == "alibi":
            raise ValueError(
                f"{name}: positions='alibi' biases softmax scores; mixer={self.mixer!r} forms none "
                "(use 'rope', 'learned', 'sinusoidal' or 'none')"
            )
        if self.attn_dropout:
            raise ValueError(
                f"{name}: attn_dropout={self.attn_dropout} drops softmax probabilities; "
                f"mixer={self.mixer!r} has none (set attn_dropout=0)"
            )
        if self.mixer == "ssm":
            if self.n_kv_heads != self.n_heads:
                raise ValueError(
                    f"{name}: n_kv_heads={self.n_kv_heads} (GQA) means nothing to mixer='ssm'; "
                    f"leave it at n_heads={self.n_heads}"
                )
            if (self.ssm_expand * self.d_model) % self.n_heads:
                raise ValueError(
                    f"{name}: mixer='ssm' splits ssm_expand*d_model = {self.ssm_expand * self.d_model} "
                    f"channels into n_heads={self.n_heads} equal heads; choose n_heads dividing it"
                )

    def replace(self, **changes):
        """A copy with some fields changed (validated again).  Fields that were derived
        (``d_head``, ``n_kv_heads``, ``d_mlp`` left at None) are derived again."""
        kw = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in getattr(self, "_derived", ())
        }
        kw.update(changes)
        return type(self)(**kw)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        s = self.rope_scaling
        d["rope_scaling"] = None if s is None else {"type": type(s).__name__, **dataclasses.asdict(s)}
        return d

    @classmethod
    def from_dict(cls, d: dict):
        d = dict(d)
        s = d.get("rope_scaling")
        if isinstance(s, dict):
            s = dict(s)
            kind = s.pop("type", None)
            if kind not in _SCALINGS:
                raise ValueError(f"rope_scaling: unknown type {kind!r}; expected one of {sorted(_SCALINGS)}")
            d["rope_scaling"] = _SCALINGS[kind](**s)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        return cls(**d)


@dataclass
class DecoderConfig(_Common):
    """A GPT-style causal decoder.  Defaults are GPT-2's; Llama is
    ``positions="rope", norm="rmsnorm", mlp="swiglu", act="silu", bias=False, tie_embeddings=False``.

    ``attn_only=True`` drops the MLPs and every norm (the attention-only transformers
    of the circuits work).

    ``mixer`` picks every block's token mixer (:mod:`attnlab.nn.mixers`): ``"attention"``
    (softmax), ``"linear"`` (causal linear attention, feature map ``linear_feature_map``)
    or ``"ssm"`` (a selective state-space scan with ``d_state``, ``ssm_expand``,
    ``ssm_conv``).  Everything else stays the same, so ``cfg.replace(mixer="ssm")`` is
    the same model with another mixer.  RoPE applies to both attentions; the SSM ignores
    it; ALiBi and ``attn_dropout`` belong to softmax attention only."""

    tie_embeddings: bool = True
    attn_only: bool = False
    final_norm: bool = True

    def __post_init__(self):
        super().__post_init__()
        for f in ("tie_embeddings", "attn_only", "final_norm"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"DecoderConfig.{f}: expected a bool, got {getattr(self, f)!r}")


@dataclass
class EncoderConfig(_Common):
    """A BERT-style bidirectional encoder.  Defaults are BERT's (post-LN, GELU, learned
    absolute positions plus token-type embeddings, eps 1e-12)."""

    max_positions: int = 512
    norm_eps: float = 1e-12
    norm_position: str = "post"
    type_vocab_size: int = 2
    pooler: bool = True  # BERT's tanh pooler on the first token
    pad_token_id: int = 0

    def __post_init__(self):
        super().__post_init__()
        nonneg_int(self.type_vocab_size, "EncoderConfig.type_vocab_size")
        nonneg_int(self.pad_token_id, "EncoderConfig.pad_token_id")
        if self.mixer != "attention":
            raise ValueError(
                f"EncoderConfig.mixer: the encoder is bidirectional and attends over padding masks; "
                f"only mixer='attention' is supported, got {self.mixer!r}"
            )
        if self.pad_token_id >= self.vocab_size:
            raise ValueError(
                f"EncoderConfig.pad_token_id: expected an id in [0, vocab_size={self.vocab_size}), "
                f"got {self.pad_token_id}"
            )
