"""Position information: sinusoidal and learned embeddings, RoPE with its context-extension
scalings (linear, NTK, dynamic NTK, YaRN, Llama 3), ALiBi, and RoPE from transformers configs.

>>> import torch
>>> from attnlab.positions import alibi_slopes, RoPE
>>> alibi_slopes(4).tolist()
[0.25, 0.0625, 0.015625, 0.00390625]
>>> RoPE(8)(torch.randn(1, 2, 5, 8), 0).shape    # (B, H, N, D), positions 0..4
torch.Size([1, 2, 5, 8])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab import scores
from attnlab.validate import MAX_INT, boolean, finite_tensor, integer, real, tensor_check

#: The most heads ``alibi_slopes`` builds (a Python list; a typo such as ``2**40`` would
#: otherwise run for hours): far beyond any model's head count.
MAX_HEADS = 1 << 16

__all__ = [
    "alibi_slopes",
    "sinusoidal",
    "SinusoidalEmbedding",
    "LearnedEmbedding",
    "LinearScaling",
    "NTKScaling",
    "DynamicNTKScaling",
    "YaRNScaling",
    "Llama3Scaling",
    "RoPE",
    "ALiBi",
    "rope_from_hf",
]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al., 2022), float32 ``(n_heads,)``.

    For ``n`` a power of two: the geometric sequence ``2^(-8/n), 2^(-16/n), ..., 2^(-8)``.
    Otherwise, as in the paper's reference code: the slopes of the largest power of two
    ``p < n``, then every other slope of ``2p`` for the remaining ``n - p`` heads.
    """
    n_heads = integer(n_heads, "alibi_slopes(n_heads)", lo=1, hi=MAX_HEADS)

    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        s = pow2(n_heads)
    else:
        p = 2 ** math.floor(math.log2(n_heads))
        s = pow2(p) + pow2(2 * p)[0::2][: n_heads - p]
    return torch.tensor(s, dtype=torch.float32)


# ----------------------------------------------------------------------------- validation
def _positions(where, positions, alt=""):
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dtype.is_floating_point
        or positions.dtype.is_complex
        or positions.dtype == torch.bool
    ):
        dt = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"{where}: positions must be an integer tensor (torch.long){alt}, got {dt}")
    return positions.long()


# ----------------------------------------------------------------------------- sinusoidal
def sinusoidal(n_positions: int, d_model: int, *, base: float = 10000.0, dtype=torch.float32) -> torch.Tensor:
    """The ``(n_positions, d_model)`` table of Vaswani et al. (2017), computed in float64.

    ``PE[p, 2i] = sin(p / base^(2i/d))``, ``PE[p, 2i+1] = cos(p / base^(2i/d))``; an odd
    ``d_model`` ends with a sin column.

    >>> pe = sinusoidal(3, 4)
    >>> pe.shape, pe[0].tolist()
    (torch.Size([3, 4]), [0.0, 1.0, 0.0, 1.0])
    """
    where = "sinusoidal"
    integer(n_positions, f"{where}: n_positions", lo=0)
    integer(d_model, f"{where}: d_model", lo=1)
    base = real(base, f"{where}: base", gt=1.0)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{where}: dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    p = torch.arange(n_positions, dtype=torch.float64)[:, None]
    i2 = torch.arange(0, d_model, 2, dtype=torch.float64)
    ang = p * base ** (-i2 / d_model)  # (n, ceil(d/2))
    pe = torch.empty(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = ang.sin()
    pe[:, 1::2] = ang[:, : d_model // 2].cos()
    return pe.to(dtype)


class SinusoidalEmbedding(torch.nn.Module):
    """Fixed sinusoidal embeddings, looked up by position; no parameters.

    The table is a non-persistent buffer of ``max_positions`` rows that doubles when a larger
    position arrives (so reading positions costs one host sync).  ``forward(positions)``:
    integer tensor of any shape, values >= 0 -> ``(*positions.shape, d_model)`` in the
    buffer's dtype (float32 unless the module was cast).

    >>> SinusoidalEmbedding(6)(torch.tensor([[0, 5000]])).shape
    torch.Size([1, 2, 6])
    """

    table: torch.Tensor  # (rows, d_model) buffer

    def __init__(self, d_model: int, *, base: float = 10000.0, max_positions: int = 2048):
        super().__init__()
        self.d_model = integer(d_model, "SinusoidalEmbedding: d_model", lo=1)
        self.base = real(base, "SinusoidalEmbedding: base", gt=1.0)
        integer(max_positions, "SinusoidalEmbedding: max_positions", lo=1)
        self.register_buffer("table", sinusoidal(max_positions, d_model, base=self.base), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        pos = _positions("SinusoidalEmbedding", positions)
        if pos.numel() and torch.compiler.is_compiling():  # traced: an in-graph check
            # (the table cannot grow inside a graph: positions must fall in the rows it has)
            tensor_check(
                (pos >= 0).all() & (pos < self.table.shape[0]).all(),
                f"SinusoidalEmbedding: positions must lie in [0, {self.table.shape[0] - 1}] under torch.compile",
            )
        elif pos.numel():
            lo, hi = (int(v) for v in torch.aminmax(pos))
            if lo < 0:
                raise ValueError(f"SinusoidalEmbedding: positions must be >= 0, got a minimum of {lo}")
            if hi >= self.table.shape[0]:
                n = max(hi + 1, 2 * self.table.shape[0])
                self.table = sinusoidal(n, self.d_model, base=self.base).to(self.table)
        return self.table[pos.to(self.table.device)]


class LearnedEmbedding(torch.nn.Module):
    """Learned absolute positions (GPT-2 / BERT): ``weight`` ``(max_positions, d_model)``,
    initialised N(0, 0.02²).  ``forward(positions)``: integer tensor of any shape with values
    in ``[0, max_positions)`` -> ``(*positions.shape, d_model)``.

    >>> LearnedEmbedding(16, 8)(torch.arange(4)).shape
    torch.Size([4, 8])
    """

    def __init__(self, max_positions: int, d_model: int):
        super().__init__()
        self.max_positions = integer(max_positions, "LearnedEmbedding: max_positions", lo=1)
        self.d_model = integer(d_model, "LearnedEmbedding: d_model", lo=1)
        self.weight = torch.nn.Parameter(torch.empty(max_positions, d_model))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        pos = _positions("LearnedEmbedding", positions)
        if pos.numel() and torch.compiler.is_compiling():  # traced: an in-graph check
            tensor_check(
                (pos >= 0).all() & (pos < self.max_positions).all(),
                f"LearnedEmbedding: positions must lie in [0, {self.max_positions - 1}]",
            )
        elif pos.numel():
            lo, hi = (int(v) for v in torch.aminmax(pos))
            if lo < 0 or hi >= self.max_positions:
                raise ValueError(
                    f"LearnedEmbedding: positions span [{lo}, {hi}] but max_positions="
                    f"{self.max_positions}; positions must lie in [0, {self.max_positions - 1}]"
                )
        return torch.nn.functional.embedding(pos.to(self.weight.device), self.weight)


# ----------------------------------------------------------------------------- RoPE scalings
class _Checked:
    """Validates a frozen scaling dataclass: ``_rules`` = (field, lower bound or the field it
    must exceed, bound allowed?); ``original_max_positions`` must be an int >= 1."""

    _rules: tuple = ()

    def __post_init__(self):
        w = type(self).__name__
        if hasattr(self, "original_max_positions"):
            integer(self.original_max_positions, f"{w}: original_max_positions", lo=1)
        if hasattr(self, "truncate"):
            boolean(self.truncate, f"{w}: truncate")
        for name, lo, inclusive in self._rules:
            if name != "attention_factor" or getattr(self, "attention_factor", None) is not None:
                bound, hint = (getattr(self, lo), f"must exceed {lo}") if isinstance(lo, str) else (lo, "")
                v = getattr(self, name)
                f = real(v, f"{w}: {name}", ge=bound if inclusive else None, gt=None if inclusive else bound, hint=hint)
                object.__setattr__(self, name, f)  # a float: an int such as 10**30 would overflow in torch


@dataclass(frozen=True)
class LinearScaling(_Checked):
    """Position interpolation (Chen et al., 2023): positions divided by ``factor``."""

    factor: float
    _rules = (("factor", 0.0, False),)


@dataclass(frozen=True)
class NTKScaling(_Checked):
    """Static "NTK-aware" scaling: ``base' = base * factor ** (rotary_dim / (rotary_dim - 2))``."""

    factor: float
    _rules = (("factor", 1.0, True),)


@dataclass(frozen=True)
class DynamicNTKScaling(_Checked):
    """transformers' "dynamic" NTK: with ``seq_len = max(position) + 1 > original_max_positions``,
    ``base' = base * (factor * seq_len / original - (factor - 1)) ** (dim / (dim - 2))``.

    Stateless: the base follows the positions of the current call (transformers keeps the
    largest ``seq_len`` seen so far until a call falls back under the original length; the
    two agree while positions grow, as in decoding)."""

    factor: float
    original_max_positions: int
    _rules = (("factor", 1.0, True),)


@dataclass(frozen=True)
class YaRNScaling(_Checked):
    """YaRN (Peng et al., 2023), as transformers computes it.  ``attention_factor`` defaults to
    ``0.1 ln(factor) + 1`` and multiplies cos and sin; ``truncate`` rounds the correction range
    outwards (transformers' default; gpt-oss sets it False)."""

    factor: float
    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True
    _rules = (
        ("factor", 1.0, True),
        ("beta_slow", 0.0, False),
        ("beta_fast", "beta_slow", False),
        ("attention_factor", 0.0, False),
    )


@dataclass(frozen=True)
class Llama3Scaling(_Checked):
    """Llama 3.1: wavelengths above ``original/low_freq_factor`` are divided by ``factor``,
    those below ``original/high_freq_factor`` kept, the band between smoothly interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int
    _rules = (("factor", 1.0, True), ("low_freq_factor", 0.0, False), ("high_freq_factor", "low_freq_factor", False))


_SCALINGS = (LinearScaling, NTKScaling, DynamicNTKScaling, YaRNScaling, Llama3Scaling)


def _default_freqs(base, dim: int, dtype) -> torch.Tensor:
    # Same ops and order as transformers / Meta's code, so float32 frequencies match bit for bit.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim))


def _yarn_freqs(s: YaRNScaling, base: float, dim: int, dtype) -> torch.Tensor:
    def corr_dim(rot):
        return dim * math.log(s.original_max_positions / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype) / dim)
    extra = 1 - ((torch.arange(dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    return 1.0 / (s.factor * pos_freqs) * (1 - extra) + 1.0 / pos_freqs * extra


def _llama3_freqs(freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    wavelen = 2 * math.pi / freq
    low_wl, high_wl = s.original_max_positions / s.low_freq_factor, s.original_max_positions / s.high_freq_factor
    out = torch.where(wavelen > low_wl, freq / s.factor, freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * out / s.factor + smooth * out
    return torch.where(~(wavelen < high_wl) & ~(wavelen > low_wl), mid, out)


# ----------------------------------------------------------------------------- RoPE
class RoPE(torch.nn.Module):
    """Rotary position embedding (Su et al., 2021) with partial rotary dims and scalings.

    ``interleaved=False`` pairs channel ``i`` with ``i + rotary_dim/2`` (transformers'
    ``rotate_half``: Llama / GPT-NeoX as transformers stores them); ``interleaved=True`` pairs
    ``(2i, 2i+1)`` (RoFormer, GPT-J, Meta's original Llama code).

    ``forward(x, positions)``: ``x`` ``(B, H, N, d_head)`` of any float dtype; ``positions``
    an int offset (or 0-dim integer tensor: positions ``offset .. offset+N-1``), a LongTensor
    ``(N,)``, or ``(B, N)`` per sequence.  Returns rotated ``x``, same shape and dtype, math
    in float32 (float64 for float64 input).  Only the first ``rotary_dim`` channels rotate;
    the rest pass through unchanged.  Positions are absolute: rotating a new token at offset
    ``L`` equals row ``L`` of rotating the whole sequence (what a KV cache needs).

    ``inv_freq``: float32 ``(rotary_dim/2,)`` non-persistent buffer, after static scaling,
    equal bit for bit to transformers'; it stays float32 when the module is cast.
    ``attention_factor`` (1.0 except YaRN) multiplies cos and sin.

    >>> rope = RoPE(64, base=500000.0, scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192))
    >>> q = torch.randn(2, 4, 3, 64, dtype=torch.bfloat16)
    >>> rope(q, torch.tensor([[0, 1, 2], [5, 6, 7]])).dtype
    torch.bfloat16
    """

    inv_freq: torch.Tensor  # (rotary_dim/2,) float32 buffer

    def __init__(
        self,
        d_head: int,
        *,
        base: float = 10000.0,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scaling=None,
    ):
        super().__init__()
        self.d_head = integer(d_head, "RoPE: d_head", lo=1)
        self.base = real(base, "RoPE: base", gt=1.0)
        rd = d_head if rotary_dim is None else rotary_dim
        if isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2 or rd > d_head:
            raise ValueError(
                f"RoPE: rotary_dim must be an even int in [2, d_head={d_head}], got {rd!r}"
                + (" (d_head is odd: pass an even rotary_dim)" if rotary_dim is None else "")
            )
        if scaling is not None and not isinstance(scaling, _SCALINGS):
            raise TypeError(
                f"RoPE: scaling must be None or one of {[c.__name__ for c in _SCALINGS]}, got {type(scaling).__name__}"
            )
        if isinstance(scaling, (NTKScaling, DynamicNTKScaling)) and rd <= 2:
            raise ValueError(f"RoPE: {type(scaling).__name__} needs rotary_dim > 2, got {rd}")
        self.rotary_dim, self.interleaved, self.scaling = rd, boolean(interleaved, "RoPE: interleaved"), scaling
        self.attention_factor = 1.0
        if isinstance(scaling, YaRNScaling):
            af = scaling.attention_factor
            self.attention_factor = (
                float(af) if af is not None else (0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0)
            )
        # CPU master copies; the buffers are derived from them (see _apply).  Built on the CPU
        # even under a ``torch.device("meta")`` context (a loader sizing a model before it
        # allocates): the frequency check below must read real values.
        with torch.device("cpu"):
            try:
                self._masters = {dt: self._static_freqs(dt) for dt in (torch.float32, torch.float64)}
            except OverflowError:
                self._masters = {torch.float32: torch.tensor([math.nan])}
        probe = self._masters[torch.float32]
        if isinstance(scaling, DynamicNTKScaling):  # the base it reaches at a long context
            with torch.device("cpu"):
                probe = self._dynamic_freqs_at(1 << 24, probe)
        if not bool(torch.isfinite(probe).all() & (probe > 0).all()):
            raise ValueError(
                f"RoPE: base={self.base:g} with scaling={scaling} gives frequencies that are not finite "
                "positive float32 numbers (0, inf or nan); use a smaller base or scaling factor"
            )
        self.register_buffer("inv_freq", self._masters[torch.float32].clone(), persistent=False)
        self._freq64 = self._masters[torch.float64]

    def _static_freqs(self, dtype):
        s, base, rd = self.scaling, self.base, self.rotary_dim
        if isinstance(s, NTKScaling):
            base = base * s.factor ** (rd / (rd - 2))
        if isinstance(s, YaRNScaling):
            return _yarn_freqs(s, base, rd, dtype)
        freq = _default_freqs(base, rd, dtype)
        if isinstance(s, LinearScaling):
            freq /= s.factor
        return _llama3_freqs(freq, s) if isinstance(s, Llama3Scaling) else freq

    def _apply(self, fn, recurse=True):
        # Keep inv_freq float32 (and exact) whatever dtype the module is cast to.
        super()._apply(fn, recurse)
        dev = self.inv_freq.device
        self.inv_freq = self._masters[torch.float32].to(dev, copy=True)
        self._freq64 = self._masters[torch.float64].to(dev, copy=True)
        return self

    def _dynamic_freqs_at(self, seq_len: int, default: torch.Tensor) -> torch.Tensor:
        s, r = self.scaling, self.rotary_dim
        if not isinstance(s, DynamicNTKScaling):
            return default
        seq = torch.tensor(max(seq_len, s.original_max_positions), dtype=torch.float32)
        b = self.base * (s.factor * seq / s.original_max_positions - (s.factor - 1)) ** (r / (r - 2))
        return _default_freqs(b, r, torch.float32)

    def inv_freq_at(self, seq_len, *, dtype=torch.float32) -> torch.Tensor:
        """The ``(rotary_dim/2,)`` frequencies in use when the largest position is ``seq_len - 1``
        (int or integer tensor); they differ from ``inv_freq`` only under ``DynamicNTKScaling``."""
        s, r = self.scaling, self.rotary_dim
        if not isinstance(s, DynamicNTKScaling):
            return self._freq64.to(dtype) if dtype == torch.float64 else self.inv_freq.to(dtype)
        seq = torch.as_tensor(seq_len, device=self.inv_freq.device).clamp_min(s.original_max_positions)
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        b = self.base * (s.factor * seq.to(cdt) / s.original_max_positions - (s.factor - 1)) ** (r / (r - 2))
        return _default_freqs(b, r, cdt).to(dtype)

    def cos_sin(self, positions: torch.Tensor, *, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions * inv_freq`` (times ``attention_factor``): positions
        ``(N,)`` or ``(B, N)`` -> two ``(..., N, rotary_dim/2)`` tensors, computed in float32
        (float64 when ``dtype`` is float64), then cast to ``dtype``.

        >>> c, s = RoPE(8).cos_sin(torch.arange(3))
        >>> c.shape, c[0].tolist()
        (torch.Size([3, 4]), [1.0, 1.0, 1.0, 1.0])
        """
        pos = _positions("RoPE.cos_sin", positions)
        if pos.dim() not in (1, 2):
            raise ValueError(f"RoPE.cos_sin: positions must be (N,) or (B, N), got shape {tuple(pos.shape)}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"RoPE.cos_sin: dtype must be a floating torch.dtype, got {dtype!r}")
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        pos = pos.to(self.inv_freq.device)
        dynamic = isinstance(self.scaling, DynamicNTKScaling) and pos.numel()
        freq = self.inv_freq_at(pos.max() + 1 if dynamic else 0, dtype=cdt)
        ang = pos.to(cdt)[..., None] * freq
        cos, sin = ang.cos(), ang.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def forward(self, x: torch.Tensor, positions) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(
                f"RoPE: x must be a floating tensor (B, H, N, D), got {getattr(x, 'dtype', type(x).__name__)}"
            )
        if x.dim() != 4 or x.shape[-1] != self.d_head:
            raise ValueError(f"RoPE: x must be (B, H, N, D={self.d_head}), got shape {tuple(x.shape)}")
        B, _, N, _ = x.shape
        if isinstance(positions, int) and not isinstance(positions, bool):
            if positions < 0:
                raise ValueError(f"RoPE: an int positions offset must be >= 0, got {positions}")
            integer(positions, "RoPE: positions offset", hi=MAX_INT - N)
            pos = torch.arange(positions, positions + N, device=x.device)
        else:
            pos = _positions("RoPE", positions, " (or an int offset)")
            if pos.dim() == 0:  # a tensor offset
                pos = pos.to(x.device) + torch.arange(N, device=x.device)
        if tuple(pos.shape) not in ((N,), (B, N)):
            raise ValueError(
                f"RoPE: positions must have shape (N,)=({N},) or (B, N)=({B}, {N}) for x of "
                f"shape {tuple(x.shape)}, got {tuple(pos.shape)}"
            )
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(pos, dtype=cdt)
        if cos.dim() == 3:  # (B, N, R/2) -> (B, 1, N, R/2)
            cos, sin = cos[:, None], sin[:, None]
        r = self.rotary_dim
        xr = x[..., :r].to(cdt)
        if self.interleaved:
            a, b = xr[..., 0::2], xr[..., 1::2]
            rot = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        else:
            a, b = xr[..., : r // 2], xr[..., r // 2 :]
            rot = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        rot = rot.to(x.dtype)
        return rot if r == self.d_head else torch.cat((rot, x[..., r:]), dim=-1)

    def extra_repr(self):
        return (
            f"d_head={self.d_head}, rotary_dim={self.rotary_dim}, base={self.base:g}, "
            f"interleaved={self.interleaved}, scaling={self.scaling}"
        )


# ----------------------------------------------------------------------------- ALiBi
class ALiBi:
    """ALiBi (Press et al., 2022) for ``n_heads`` heads; ``slopes`` default to
    :func:`alibi_slopes`.  ``symmetric=True`` biases by ``-m·|i-j|`` (encoders, which
    have no causal mask to hide the positive bias of future keys).  :meth:`score_mod` gives the score mod for :func:`attnlab.attention`.

    >>> ALiBi(4).score_mod()
    alibi((4,) slopes)
    """

    def __init__(self, n_heads: int, *, slopes: torch.Tensor | None = None, symmetric: bool = False):
        self.n_heads = integer(n_heads, "ALiBi: n_heads", lo=1)
        if not isinstance(symmetric, bool):
            raise TypeError(f"ALiBi: symmetric must be a bool, got {symmetric!r}")
        self.symmetric = symmetric  # -m|i-j| for bidirectional (encoder) attention
        slopes = alibi_slopes(n_heads) if slopes is None else torch.as_tensor(slopes)
        if not slopes.dtype.is_floating_point or tuple(slopes.shape) != (n_heads,):
            raise ValueError(
                f"ALiBi: slopes must be a float tensor of shape (n_heads,)=({n_heads},), "
                f"got {slopes.dtype} {tuple(slopes.shape)}"
            )
        self.slopes = finite_tensor(slopes, "ALiBi: slopes")

    def score_mod(self) -> scores.ScoreMod:
        return scores.alibi(self.slopes, symmetric=self.symmetric)

    def __repr__(self):
        return f"ALiBi(n_heads={self.n_heads}{', symmetric' if self.symmetric else ''})"


# ----------------------------------------------------------------------------- transformers configs
_HF_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_from_hf(config_dict: dict, d_head: int) -> RoPE:
    """A :class:`RoPE` from a transformers ``config.json`` dict (half-split convention).

    Reads ``rope_theta``, ``partial_rotary_factor`` and ``rope_parameters`` (or the older
    ``rope_scaling``) with ``rope_type`` (or ``type``) among ``default, linear, dynamic, yarn,
    llama3``.  ``dynamic`` uses ``max_position_embeddings`` as the original length, as
    transformers does.

    >>> cfg = {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    >>> rope_from_hf(cfg, 128).scaling
    LinearScaling(factor=2.0)
    """
    if not isinstance(config_dict, dict):
        raise TypeError(
            f"rope_from_hf: config_dict must be a dict (the contents of config.json), got {type(config_dict).__name__}"
        )
    c, p = config_dict, config_dict.get("rope_parameters") or config_dict.get("rope_scaling") or {}
    if not isinstance(p, dict) or (p and all(isinstance(v, dict) or v is None for v in p.values())):
        raise ValueError(
            f"rope_from_hf: rope parameters must be one flat dict; got {p!r} (per-layer "
            "parameters: pass a config whose 'rope_parameters' is the entry of one layer type)"
        )
    kind = p.get("rope_type", p.get("type", "default"))

    def need(key, *values):  # the first value that is not None, else a ValueError naming key
        v = next((v for v in values if v is not None), None)
        if v is None:
            raise ValueError(f"rope_from_hf: rope_type={kind!r} needs {key!r} in the config; rope parameters: {p!r}")
        return v

    max_pos = c.get("max_position_embeddings")
    if kind in ("yarn", "llama3"):  # transformers: a top-level value wins (Phi-3), then the dict's, then max_pos
        orig = need(
            "original_max_position_embeddings",
            c.get("original_max_position_embeddings"),
            p.get("original_max_position_embeddings"),
            max_pos,
        )
    scaling: LinearScaling | DynamicNTKScaling | YaRNScaling | Llama3Scaling | None
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = LinearScaling(need("factor", p.get("factor")))
    elif kind == "dynamic":  # transformers scales from max_position_embeddings
        scaling = DynamicNTKScaling(need("factor", p.get("factor")), need("max_position_embeddings", max_pos))
    elif kind == "yarn":
        factor = p.get("factor") or need("max_position_embeddings", max_pos) / orig
        af, ms, ms_all = p.get("attention_factor"), p.get("mscale"), p.get("mscale_all_dim")
        if af is None and ms and ms_all and factor > 1:  # DeepSeek's mscale ratio
            af = (0.1 * ms * math.log(factor) + 1.0) / (0.1 * ms_all * math.log(factor) + 1.0)
        scaling = YaRNScaling(
            factor, orig, p.get("beta_fast") or 32.0, p.get("beta_slow") or 1.0, af, bool(p.get("truncate", True))
        )
    elif kind == "llama3":
        scaling = Llama3Scaling(
            need("factor", p.get("factor")),
            need("low_freq_factor", p.get("low_freq_factor")),
            need("high_freq_factor", p.get("high_freq_factor")),
            orig,
        )
    else:
        raise ValueError(f"rope_from_hf: unsupported rope_type {kind!r}; supported: {', '.join(_HF_TYPES)}")
    theta = need("rope_theta", p.get("rope_theta"), c.get("rope_theta"), 10000.0)
    theta = real(theta, "rope_from_hf: rope_theta", gt=1.0)
    prf = need("partial_rotary_factor", p.get("partial_rotary_factor"), c.get("partial_rotary_factor"), 1.0)
    prf = real(prf, "rope_from_hf: partial_rotary_factor", gt=0.0, le=1.0)
    d_head = integer(d_head, "rope_from_hf: d_head", lo=1)
    return RoPE(d_head, base=theta, rotary_dim=int(d_head * prf), scaling=scaling)
