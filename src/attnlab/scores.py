"""Score mods: functions of the scaled score, applied before masking.

A score mod is called as ``mod(score, b, h, q_pos, kv_pos) -> score`` where ``score``
is the float32 (float64 for float64 inputs) tile ``scale * q @ k^T`` of shape
``(B, H, n, m)`` and ``b, h, q_pos, kv_pos`` are broadcastable int64 index tensors
with **absolute** positions (see :mod:`attnlab.masks`).  The mod must be elementwise
in ``score`` (no mixing across keys) and pure: every backend calls it on tiles of
its own choosing, and the flash backward calls it again to recompute.

Learnable tensors a mod reads are returned by ``mod.parameters()``; gradients flow
to them through every backend.

>>> import torch, attnlab
>>> from attnlab import scores
>>> q = k = v = torch.randn(1, 2, 4, 8)
>>> mod = scores.alibi(torch.tensor([0.5, 0.25]))
>>> attnlab.attention(q, k, v, score_mod=mod).shape
torch.Size([1, 2, 4, 8])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from attnlab.validate import boolean, finite_tensor, real, tensor_check

__all__ = ["ScoreMod", "ScoreTerm", "alibi", "softcap", "relative_bias", "custom", "compose", "bias"]


@dataclass(frozen=True, eq=False)
class ScoreTerm:
    """One step of a score mod's structured description (:meth:`ScoreMod.lower`), what a
    kernel reads instead of the mod's class.  For the score ``s`` at absolute positions
    ``q``, ``kv`` of batch ``b``, head ``h``:

    * ``"softcap"``: ``value · tanh(s / value)``;
    * ``"alibi"``: ``s + m · (kv − q)`` (``symmetric``: ``s − m·|kv − q|``), ``m`` the slope
      ``tensor[h]`` (``(H,)``) or ``tensor[b|0, h]`` (``(B|1, H)``);
    * ``"relative_bias"``: ``s + tensor[h, clamp(kv − q, −R, R) + R]``, ``tensor (H, 2R+1)``.

    A tensor that requires grad is learned: a kernel that runs the term returns its gradient.
    """

    kind: str
    tensor: torch.Tensor | None = None
    value: float = 0.0
    symmetric: bool = False


class ScoreMod:
    """Base class: implement :meth:`apply`; list learnable tensors in :meth:`parameters`."""

    def apply(self, score, b, h, q_pos, kv_pos):  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, score, b, h, q_pos, kv_pos):
        return self.apply(score, b, h, q_pos, kv_pos)

    def parameters(self) -> list[torch.Tensor]:
        return []

    def validate(self, B: int, H: int) -> None:
        """Raise ``ValueError`` if this mod cannot serve ``B`` batches of ``H`` heads."""

    def key(self):
        """``(spec, tensors, ints)``: this mod by structure and parameters, what compiled code
        and the ``attnlab::flash_*`` custom ops read (:func:`mod_key`); None for ``custom``."""
        return mod_key(self)

    def lower(self) -> tuple[ScoreTerm, ...] | None:
        """This mod as the sequence of :class:`ScoreTerm` it applies in order, or None when it
        has no such description (``custom``, ``bias``)."""
        return None


class _Alibi(ScoreMod):
    def __init__(self, slopes, symmetric):
        self.slopes, self.symmetric = slopes, symmetric

    def apply(self, score, b, h, q, kv):
        s = self.slopes.to(score.dtype)
        if s.dim() == 1:
            m = s[h]
        else:  # (B, H) or (1, H): per-(batch, head) slopes, flash-attn's alibi_slopes (B, H)
            m = s[b if s.shape[0] > 1 else torch.zeros_like(b), h]
        d = (kv - q).abs().neg() if self.symmetric else (kv - q)
        return score + m * d.to(score.dtype)

    def parameters(self):
        return [self.slopes] if self.slopes.requires_grad else []

    def lower(self):
        return (ScoreTerm("alibi", tensor=self.slopes, symmetric=self.symmetric),)

    def validate(self, B, H):
        if self.slopes.shape[-1] != H:
            raise ValueError(
                f"alibi(slopes): {self.slopes.shape[-1]} slopes for H={H} query heads "
                f"(slopes shape {tuple(self.slopes.shape)}; expected (H,) or (B, H))"
            )
        if self.slopes.dim() == 2 and self.slopes.shape[0] not in (1, B):
            raise ValueError(f"alibi(slopes): (B, H) slopes of shape {tuple(self.slopes.shape)} for batch size B={B}")

    def __repr__(self):
        return f"alibi({tuple(self.slopes.shape)} slopes{', symmetric' if self.symmetric else ''})"


def alibi(slopes, symmetric: bool = False) -> _Alibi:
    """ALiBi (Press et al., 2022): ``score + slopes[h] * (kv_pos - q_pos)``.

    The bias is ``-m·(i-j)`` for a key ``i-j`` tokens in the past; keys in the
    future get a positive bias, so pair it with ``causal()`` as the paper does, or
    pass ``symmetric=True`` for ``-m·|i-j|`` (encoders).  ``slopes``: ``(H,)``, or
    ``(B, H)`` for per-(batch, head) slopes (flash-attn's ``alibi_slopes``);
    :func:`attnlab.positions.alibi_slopes` gives the paper's geometric sequence.
    A slopes tensor with ``requires_grad`` is learned.  Sign: the slopes are positive
    and the bias ``slopes·(kv_pos − q_pos)`` is ≤ 0 on past keys; flash-attn's
    ``-slope·|q_pos − kv_pos|`` is ``alibi(s)`` under ``causal()`` and
    ``alibi(s, symmetric=True)`` without a mask (docs/conventions.md).
    """
    s = torch.as_tensor(slopes)
    if not s.dtype.is_floating_point or s.dim() not in (1, 2):
        raise ValueError(f"alibi(slopes): expected a float tensor (H,) or (B, H), got {s.dtype} {tuple(s.shape)}")
    finite_tensor(s, "alibi(slopes)")
    return _Alibi(s, boolean(symmetric, "alibi(symmetric)"))


class _Softcap(ScoreMod):
    def __init__(self, c):
        self.c = c

    def apply(self, score, b, h, q, kv):
        return torch.tanh(score / self.c) * self.c

    def lower(self):
        return (ScoreTerm("softcap", value=float(self.c)),)

    def __repr__(self):
        return f"softcap({self.c})"


def softcap(c: float) -> ScoreMod:
    """Gemma-2 / Grok logit soft-capping: ``c * tanh(score / c)``; ``c`` a finite number > 0
    (``inf`` would give ``inf * tanh(0) = nan``: no cap is ``score_mod=None``)."""
    return _Softcap(real(c, "softcap(c)", gt=0.0))


class _RelativeBias(ScoreMod):
    def __init__(self, table, max_distance):
        self.table, self.max_distance = table, max_distance

    def apply(self, score, b, h, q, kv):
        idx = (kv - q).clamp(-self.max_distance, self.max_distance) + self.max_distance
        return score + self.table.to(score.dtype)[h, idx]

    def parameters(self):
        return [self.table] if self.table.requires_grad else []

    def lower(self):
        return (ScoreTerm("relative_bias", tensor=self.table),)

    def validate(self, B, H):
        if self.table.shape[0] != H:
            raise ValueError(f"relative_bias(table): table has {self.table.shape[0]} rows for H={H} query heads")

    def __repr__(self):
        return f"relative_bias(H={self.table.shape[0]}, max_distance={self.max_distance})"


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """A learned bias per head and clipped relative distance (T5/Shaw style, unbucketed).

    ``table``: ``(H, 2*R + 1)``; entry ``[h, R + d]`` is added where
    ``kv_pos - q_pos = d``, with ``d`` clipped to ``[-R, R]``.  Gradients reach ``table``
    when it requires grad.
    """
    if not isinstance(table, torch.Tensor) or not table.dtype.is_floating_point or table.dim() != 2:
        raise ValueError(
            "relative_bias(table): expected a float tensor of shape (H, 2*R+1), got "
            f"{getattr(table, 'dtype', type(table).__name__)} {tuple(getattr(table, 'shape', ()))}"
        )
    if table.shape[1] % 2 != 1:
        raise ValueError(f"relative_bias(table): the second dim must be odd (2*R+1), got {table.shape[1]}")
    finite_tensor(table, "relative_bias(table)")
    return _RelativeBias(table, table.shape[1] // 2)


class _Custom(ScoreMod):
    def __init__(self, fn, params):
        self.fn, self.params = fn, params

    def apply(self, score, b, h, q, kv):
        return self.fn(score, b, h, q, kv)

    def parameters(self):
        return [p for p in self.params if p.requires_grad]

    def __repr__(self):
        return f"custom({getattr(self.fn, '__name__', 'fn')})"


def custom(fn: Callable, params: Sequence[torch.Tensor] = ()) -> ScoreMod:
    """Any elementwise ``fn(score, b, h, q_pos, kv_pos) -> score``.

    List the learnable tensors ``fn`` reads in ``params`` so that their gradients
    are computed (the flash backward differentiates ``fn`` tile by tile).
    """
    if not callable(fn):
        raise TypeError(f"scores.custom(fn): fn must be callable, got {type(fn).__name__}")
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"scores.custom(params): params[{i}] is a {type(p).__name__}, not a tensor")
    return _Custom(fn, params)


class _Compose(ScoreMod):
    def __init__(self, mods):
        self.mods = mods

    def apply(self, score, b, h, q, kv):
        for m in self.mods:
            score = m(score, b, h, q, kv)
        return score

    def parameters(self):
        return [p for m in self.mods for p in m.parameters()]

    def lower(self):
        parts = [m.lower() for m in self.mods]
        return None if any(p is None for p in parts) else tuple(t for p in parts if p is not None for t in p)

    def validate(self, B, H):
        for m in self.mods:
            m.validate(B, H)

    def __repr__(self):
        return " then ".join(map(repr, self.mods))


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply ``mods`` in order: ``compose(alibi(s), softcap(30))`` caps the biased score."""
    for i, m in enumerate(mods):
        if not isinstance(m, ScoreMod):
            raise TypeError(f"scores.compose: argument {i} is a {type(m).__name__}, not a score mod")
    return _Compose(list(mods))


# ----------------------------------------------------------------------------- structural keys
# See :func:`attnlab.masks.mask_key`: the same scheme for score mods.  Floats (softcap's
# ``c``) are written into the spec (dynamo specializes Python floats anyway); tensors
# (ALiBi slopes, bias tables, a dense additive bias) are inputs, so a learnable one gets its
# gradient.


def _key_into(mod, kb) -> str | None:
    t = type(mod)
    if t is _Alibi:
        return f"alibi({kb.tensor(mod.slopes)},{int(mod.symmetric)})"
    if t is _Softcap:
        return f"softcap({float(mod.c)!r})"
    if t is _RelativeBias:
        return f"relative_bias({kb.tensor(mod.table)})"
    if t is _Bias:  # its offsets bind the rows/columns: written into the spec (dynamo specializes ints here)
        return f"bias({kb.tensor(mod.t)},{int(mod.q_offset)},{int(mod.kv_offset)})"
    if t is _Compose:
        parts = [_key_into(m, kb) for m in mod.mods]
        known = [p for p in parts if p is not None]
        if len(known) < len(parts):
            return None
        return f"compose({','.join(known)})"
    return None


def mod_key(mod):
    """``(spec, tensors, ints)`` describing a built-in score mod by structure and parameters,
    or None (``custom``, or a plain callable)."""
    from attnlab.masks import KeyBuilder

    kb = KeyBuilder()
    spec = _key_into(mod, kb)
    return None if spec is None else (spec, kb.tensors, kb.ints)


def mod_from_key(spec: str, tensors, ints) -> ScoreMod:
    """The score mod :func:`mod_key` described (no validation: the original was validated)."""
    from attnlab.masks import parse_key

    def build(node):
        name, args = node
        if name == "alibi":
            return _Alibi(tensors[int(args[0][1:])], args[1] == "1")
        if name == "softcap":
            return _Softcap(float(args[0]))
        if name == "relative_bias":
            tab = tensors[int(args[0][1:])]
            return _RelativeBias(tab, tab.shape[1] // 2)
        if name == "bias":
            return _Bias(tensors[int(args[0][1:])], int(args[1]), int(args[2]))
        if name == "compose":
            return _Compose([build(a) for a in args])
        raise ValueError(f"structural key: unknown score mod {name!r}")

    return build(parse_key(spec))


class _Bias(ScoreMod):
    def __init__(self, t, q_offset, kv_offset):
        self.t, self.q_offset, self.kv_offset = t, q_offset, kv_offset

    def apply(self, score, b, h, q, kv):
        idx = [b, h, q - self.q_offset, kv - self.kv_offset]
        idx = [x if self.t.shape[d] > 1 else torch.zeros_like(x) for d, x in enumerate(idx)]
        return score + self.t[tuple(idx)].to(score.dtype)

    def parameters(self):
        return [self.t] if self.t.requires_grad else []

    def validate(self, B, H):
        for s, w in zip(self.t.shape[:2], (B, H), strict=True):
            if s not in (1, w):
                raise ValueError(f"scores.bias(t): shape {tuple(self.t.shape)} does not broadcast to (B, H)=({B}, {H})")

    def __repr__(self):
        return f"bias(<{tuple(self.t.shape)}>)"


def bias(t: torch.Tensor, *, q_offset: int, kv_offset: int = 0) -> ScoreMod:
    """An additive float mask/bias ``(B?, H?, Nq, Nk)`` added to the scaled score, indexed by
    query **row** and key **column** like torch SDPA's float ``attn_mask`` (``-inf`` hides a
    pair).  ``q_offset``/``kv_offset``: those of the problem it is for (row ``i`` is the query
    at ``q_offset + i``); ``attention(mask=float_tensor)`` binds them.  A ``t`` that
    requires grad is learned: its gradient is computed tile by tile (FlexAttention's
    learnable biases)."""
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        raise TypeError(
            f"scores.bias(t): expected a float tensor, got "
            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
        )
    if t.dim() > 4:
        raise ValueError(f"scores.bias(t): at most 4 dims (B, H, Nq, Nk), got shape {tuple(t.shape)}")
    while t.dim() < 4:
        t = t.unsqueeze(0)
    msg = "scores.bias(t): holds NaN or +inf; an additive mask may hold finite values and -inf"
    with torch.no_grad():  # under torch.compile an in-graph assertion (no data-dependent branch)
        if not tensor_check(~(torch.isnan(t) | torch.isposinf(t)).any(), msg):
            raise ValueError(msg)
    return _Bias(t, int(q_offset), int(kv_offset))
