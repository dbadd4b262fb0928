"""Argument checks shared by every constructor in attnlab: masks, score mods, positions,
caches and configs (the lowest layer: this module imports nothing from attnlab).

One rule for every number a user passes:

* **ints** are Python/NumPy integers, never ``bool`` and never floats (``2.0`` is refused:
  nothing is silently truncated), within ``[lo, MAX_INT]``.  ``MAX_INT = 2**62`` keeps
  every position, size and the *difference* of two positions inside int64, which is what
  the mask predicates and block classifiers compute (``q_pos - kv_pos < w``).
* **reals** are ints or floats (not ``bool``), finite (no NaN, no ±inf, no int too large
  for a float), within the stated bounds.
* **bools** are ``bool``.
* **tensors of numbers** (ALiBi slopes, bias tables) hold finite values.
* **tensors** passed as data are ``torch.Tensor`` (:func:`tensor`) with the stated number
  of dims (:func:`ndim`) and a floating dtype of :data:`FLOAT_DTYPES`
  (:func:`float_dtype`); tensors that work together share a dtype and a device
  (:func:`same_dtype`, :func:`same_device`); GQA head counts divide (:func:`gqa_heads`).

A wrong type raises :class:`ArgumentTypeError`, which subclasses both ``TypeError`` and
``ValueError`` (so code that catches either keeps working); a value out of range raises
``ValueError``.  Every message names the argument, what it got and what would work.

>>> integer(3, "n_heads", lo=1)
3
>>> integer(-3, "n_heads", lo=1)
Traceback (most recent call last):
...
ValueError: n_heads: expected an int >= 1, got -3
>>> integer(2.0, "n_heads", lo=1)
Traceback (most recent call last):
...
attnlab.validate.ArgumentTypeError: n_heads: expected an int, got float 2.0
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from typing import cast

import torch

__all__ = [
    "MAX_INT",
    "FLOAT_DTYPES",
    "ArgumentTypeError",
    "integer",
    "int_in",
    "int_sequence",
    "SEED_RANGE",
    "rng_seed",
    "real",
    "nonzero_real",
    "boolean",
    "finite_tensor",
    "problem_positions",
    "lossless_cast",
    "tensor_check",
    "tensor",
    "ndim",
    "float_dtype",
    "same_dtype",
    "same_device",
    "gqa_heads",
    "positive_int",
    "nonneg_int",
    "probability",
    "positive_float",
    "choice",
    "head_shape",
]

#: The largest int any constructor accepts (positions, sizes, windows, offsets): differences
#: of two such numbers, and a position plus a length, stay inside int64.
MAX_INT = 1 << 62

#: The floating dtypes every op accepts (inputs, weights); accumulators are float32 (float64 for float64).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError`` and, for older callers, a ``ValueError``)."""


def _fmt(x) -> str:
    return f"{type(x).__name__} {x!r:.60}"


def integer(
    x,
    name: str,
    *,
    lo: int | None = None,
    hi: int | None = MAX_INT,
    what: str = "",
    hint: str = "",
    type_error: type = ArgumentTypeError,
) -> int:
    """``x`` as an int in ``[lo, hi]`` (``hi=None``: no upper bound); ``bool`` and floats
    (even ``2.0``) are refused.  ``what`` words the int in the message ("tile size");
    ``hint`` ends every message, in parentheses ("256 bytes + <|endoftext|>", "or None");
    ``type_error`` is the class raised for a wrong type (the op entry points raise a plain
    ``TypeError``, as they always have)."""
    tail = f" ({hint})" if hint else ""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise type_error(f"{name}: expected an int{what and ' ' + what}, got {_fmt(x)}{tail}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name}: expected an int{what and ' ' + what} >= {lo}, got {x}{tail}")
    if hi is not None and x > hi:
        bound = "2**62 (positions and sizes are int64)" if hi == MAX_INT else str(hi)
        raise ValueError(f"{name}: expected an int <= {bound}, got {x}{tail}")
    return x


def int_in(
    x,
    name: str,
    lo: int,
    hi: int,
    *,
    closed: bool = False,
    interval: str = "",
    note: str = "",
    type_error: type = ArgumentTypeError,
) -> int:
    """``x`` as an int in ``[lo, hi)`` (``[lo, hi]`` with ``closed``): an index, or a count
    bounded by another argument; ``bool`` and floats are refused.  The message states the
    interval (``interval`` words it where the numbers alone do not: ``"[0, steps=10]"``,
    ``"[-2**63, 2**64)"``), then ``note``.

    >>> int_in(3, "layer", 0, 2)
    Traceback (most recent call last):
    ...
    ValueError: layer: expected an int in [0, 2), got 3
    """
    interval = interval or f"[{lo}, {hi}{']' if closed else ')'}"
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise type_error(f"{name}: expected an int in {interval}{note}, got {_fmt(x)}")
    x = int(x)
    if not (lo <= x <= hi if closed else lo <= x < hi):
        raise ValueError(f"{name}: expected an int in {interval}{note}, got {x}")
    return x


def int_sequence(xs, name: str, *, lo: int = 1) -> tuple[int, ...]:
    """``xs`` (a non-empty iterable, not a string) as a tuple of ints >= ``lo`` (tree
    branchings, sweep sizes); the message names the sequence and, for a bad element, its index."""
    want = f"{name}: expected a non-empty sequence of ints >= {lo}"
    if isinstance(xs, (str, bytes)):
        raise ArgumentTypeError(f"{want}, got {_fmt(xs)}")
    try:
        xs = tuple(xs)
    except TypeError:
        raise ArgumentTypeError(f"{want}, got {_fmt(xs)}") from None
    if not xs:
        raise ValueError(f"{want}, got an empty one")
    return tuple(integer(x, f"{name}[{i}]", lo=lo) for i, x in enumerate(xs))


#: What ``torch.Generator.manual_seed`` accepts: ``[-2**63, 2**64)``.
SEED_RANGE = (-(2**63), 2**64)


def rng_seed(x, name: str = "seed") -> int:
    """``x`` as an int seed for ``torch.Generator.manual_seed`` (:data:`SEED_RANGE`)."""
    return int_in(x, name, *SEED_RANGE, interval="[-2**63, 2**64)", note=" (torch.Generator's range)")


def real(
    x,
    name: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    hint: str = "",
) -> float:
    """``x`` as a finite float with the given strict (``gt``, ``lt``) or inclusive (``ge``,
    ``le``) bounds; ``bool``, NaN, ±inf and ints beyond float range are refused.  ``hint``
    (e.g. "seconds, or a datetime.timedelta") ends every message, in parentheses."""
    tail = f" ({hint})" if hint else ""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a number, got {_fmt(x)}{tail}")
    try:
        f = float(x)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{name}: must be a finite number, got {x!r:.60}{tail}")
    for bound, ok, word in (
        (gt, operator.gt, ">"),
        (ge, operator.ge, ">="),
        (lt, operator.lt, "<"),
        (le, operator.le, "<="),
    ):
        if bound is not None and not ok(f, bound):
            raise ValueError(f"{name}: must be {word} {bound}, got {x!r:.60}{tail}")
    return f


def nonzero_real(x, name: str, *, hint: str = "") -> float:
    """``x`` as a finite float other than 0 (a softmax scale); ``bool`` is refused.
    ``hint`` (e.g. "default 1/sqrt(D)") is added to the message."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x == 0:
        raise ValueError(f"{name}: expected a finite non-zero number{f' ({hint})' if hint else ''}, got {x!r}")
    return float(x)


def boolean(x, name: str) -> bool:
    """``x`` itself when it is a ``bool`` (``0``, ``1``, ``"no"`` are refused)."""
    if not isinstance(x, bool):
        raise ArgumentTypeError(f"{name}: expected a bool (True or False), got {_fmt(x)}")
    return x


def finite_tensor(t: torch.Tensor, name: str, *, allow_neg_inf: bool = False) -> torch.Tensor:
    """``t`` when every element is finite (``-inf`` allowed with ``allow_neg_inf``)."""
    with torch.no_grad():
        bad = torch.isnan(t) | (t == math.inf) if allow_neg_inf else ~torch.isfinite(t)
        if torch.compiler.is_compiling():  # traced: checked when the graph runs (RuntimeError)
            torch._assert_async(~bad.any(), f"{name}: expected finite values")
            return t
        if bool(bad.any()):
            i = tuple(int(j) for j in torch.nonzero(bad)[0])
            raise ValueError(
                f"{name}: expected finite values, got {float(t[i])} at index {i}"
                + ("" if allow_neg_inf else " (hide what must not be attended with a mask)")
            )
    return t


def problem_positions(Nq: int, Nk: int, q_offset: int, kv_offset: int, where="mask") -> None:
    """The absolute positions of a ``(Nq, Nk)`` problem, ``q_offset .. q_offset + Nq - 1``
    and ``kv_offset .. kv_offset + Nk - 1``, lie in ``[-2**62, 2**62)``, so that positions
    and their differences are exact in int64 (no wrap-around in a predicate or classifier).
    ``where`` (a string, or a callable giving one: only called to word an error) names the
    caller.  Costs a few comparisons when everything is in range (it runs on every call)."""
    ints = (Nq, Nk, q_offset, kv_offset)
    if (
        all(type(x) is int for x in ints)
        and Nq >= 0
        and Nk >= 0
        and -MAX_INT <= q_offset
        and q_offset + Nq <= MAX_INT
        and -MAX_INT <= kv_offset
        and kv_offset + Nk <= MAX_INT
    ):
        return
    where = where() if callable(where) else where
    for name, n in (("Nq", Nq), ("Nk", Nk)):
        integer(n, f"{where}: {name}", lo=0)
    for name, off, n in (("q_offset", q_offset, Nq), ("kv_offset", kv_offset, Nk)):
        off = integer(off, f"{where}: {name}", lo=-MAX_INT)
        if off + n > MAX_INT:
            raise ValueError(
                f"{where}: {name}={off} with {n} positions reaches {off + n - 1}; positions must stay "
                "below 2**62 so that they and their differences fit in int64"
            )


def tensor_check(ok: torch.Tensor, message: str) -> bool:
    """``bool(ok)`` eagerly; under ``torch.compile`` an in-graph assertion instead (no graph
    break: a failure raises ``RuntimeError`` with ``message`` when the graph runs) and True."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
        return True
    return bool(ok)


def lossless_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when every value of ``src`` is exactly representable in ``dst``."""
    return src == dst or (src.is_floating_point == dst.is_floating_point and torch.promote_types(src, dst) == dst)


def tensor(x, name: str) -> torch.Tensor:
    """``x`` when it is a ``torch.Tensor`` (``TypeError`` naming what it is otherwise)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def ndim(t: torch.Tensor, name: str, n, layout: str = "") -> torch.Tensor:
    """``t`` when it has ``n`` dims (an int or a tuple of allowed counts); ``layout`` (e.g.
    ``"(B, H, Nq, D)"``) says what the dims mean."""
    ok = t.dim() in n if isinstance(n, tuple) else t.dim() == n
    if not ok:
        want = " or ".join(map(str, n)) if isinstance(n, tuple) else str(n)
        raise ValueError(f"{name}: expected {want} dims{' ' + layout if layout else ''}, got shape {tuple(t.shape)}")
    return t


def float_dtype(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` when its dtype is one of :data:`FLOAT_DTYPES`."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; use float16, bfloat16, float32 or float64")
    return t


def same_dtype(**named: torch.Tensor) -> torch.dtype:
    """The one dtype of the named tensors (``same_dtype(q=q, k=k, v=v)``), or ``TypeError``
    listing each one's."""
    dts = {t.dtype for t in named.values()}
    if len(dts) > 1:
        raise TypeError(
            f"{', '.join(named)} must share a dtype, got " + ", ".join(f"{n} {t.dtype}" for n, t in named.items())
        )
    return next(iter(dts))


def same_device(**named: torch.Tensor) -> torch.device:
    """The one device of the named tensors, or ``ValueError`` listing each one's."""
    devs = [t.device for t in named.values()]
    if any(d != devs[0] for d in devs):
        raise ValueError(
            f"{', '.join(named)} must be on one device, got " + ", ".join(f"{n} {t.device}" for n, t in named.items())
        )
    return devs[0]


def gqa_heads(H: int, Hkv: int, context: str | Callable[[], str] = "") -> None:
    """The GQA rule: ``Hkv >= 1`` kv heads and ``H % Hkv == 0`` query heads (query head ``h``
    reads kv head ``h // (H // Hkv)``).  ``context`` (the shapes, or a function that formats
    them, called only for the message) ends the message."""
    if Hkv == 0 or H % Hkv != 0:
        if callable(context):
            context = context()
        raise ValueError(
            f"query heads H={H} must be a multiple of kv heads Hkv={Hkv} (GQA; the kv heads must "
            f"divide the query heads){': ' + context if context else ''}"
        )


# ----------------------------------------------------------------------------- modules and configs
def positive_int(x, name: str) -> int:
    """An int in ``[1, 2**62]`` (:func:`integer`)."""
    return integer(x, name, lo=1)


def nonneg_int(x, name: str) -> int:
    """An int in ``[0, 2**62]``."""
    return integer(x, name, lo=0)


def probability(x, name: str, *, hint: str = "") -> float:
    """A float in ``[0, 1)`` (a dropout rate); ``hint`` ends the range message, in parentheses."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a probability in [0, 1), got {type(x).__name__} {x!r:.60}")
    if not (0.0 <= cast(float, x) < 1.0):  # a numbers.Real compares with floats; NaN fails
        raise ValueError(f"{name}: expected a probability in [0, 1), got {x!r}{f' ({hint})' if hint else ''}")
    return float(x)


def positive_float(x, name: str) -> float:
    """A finite number > 0."""
    return real(x, name, gt=0.0)


def choice(x, name: str, options) -> str:
    """``x`` when it is one of ``options``."""
    if x not in options:
        raise ValueError(f"{name}: expected one of {tuple(options)}, got {x!r}")
    return x


def head_shape(d_model, n_heads, n_kv_heads, d_head, where: str = ""):
    """``(d_model, n_heads, n_kv_heads, d_head)`` checked: positive ints, ``n_heads`` a
    multiple of ``n_kv_heads`` (default ``n_heads``), ``d_head`` default ``d_model // n_heads``.
    ``where`` (a config's class name) prefixes the names: ``DecoderConfig.n_heads``."""
    dot, colon = (f"{where}.", f"{where}: ") if where else ("", "")
    d_model = positive_int(d_model, f"{dot}d_model")
    n_heads = positive_int(n_heads, f"{dot}n_heads")
    n_kv_heads = n_heads if n_kv_heads is None else positive_int(n_kv_heads, f"{dot}n_kv_heads")
    if n_heads % n_kv_heads:
        raise ValueError(f"{colon}n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} (GQA groups)")
    if d_head is None:
        if d_model % n_heads:
            raise ValueError(f"{colon}d_model={d_model} is not divisible by n_heads={n_heads}; set d_head explicitly")
        d_head = d_model // n_heads
    return d_model, n_heads, n_kv_heads, positive_int(d_head, f"{dot}d_head")
