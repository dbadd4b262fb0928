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

import torch

__all__ = ["MAX_INT", "ArgumentTypeError", "integer", "real", "boolean", "finite_tensor", "problem_positions",
           "lossless_cast", "tensor_check"]

#: The largest int any constructor accepts (positions, sizes, windows, offsets): differences
#: of two such numbers, and a position plus a length, stay inside int64.
MAX_INT = 1 << 62


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError`` and, for older callers, a ``ValueError``)."""


def _fmt(x) -> str:
    return f"{type(x).__name__} {x!r:.60}"


def integer(x, name: str, *, lo: int | None = None, hi: int = MAX_INT) -> int:
    """``x`` as an int in ``[lo, hi]``; ``bool`` and floats (even ``2.0``) are refused."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an int, got {_fmt(x)}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {x}")
    if x > hi:
        bound = "2**62 (positions and sizes are int64)" if hi == MAX_INT else str(hi)
        raise ValueError(f"{name}: expected an int <= {bound}, got {x}")
    return x


def real(x, name: str, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
         le: float | None = None) -> float:
    """``x`` as a finite float with the given strict (``gt``, ``lt``) or inclusive (``ge``,
    ``le``) bounds; ``bool``, NaN, ±inf and ints beyond float range are refused."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a number, got {_fmt(x)}")
    try:
        f = float(x)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{name}: must be a finite number, got {x!r:.60}")
    for bound, ok, word in ((gt, lambda: f > gt, ">"), (ge, lambda: f >= ge, ">="),
                            (lt, lambda: f < lt, "<"), (le, lambda: f <= le, "<=")):
        if bound is not None and not ok():
            raise ValueError(f"{name}: must be {word} {bound}, got {x!r:.60}")
    return f


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
            raise ValueError(f"{name}: expected finite values, got {float(t[i])} at index {i}"
                             + ("" if allow_neg_inf else " (hide what must not be attended with a mask)"))
    return t


def problem_positions(Nq: int, Nk: int, q_offset: int, kv_offset: int, where="mask") -> None:
    """The absolute positions of a ``(Nq, Nk)`` problem, ``q_offset .. q_offset + Nq - 1``
    and ``kv_offset .. kv_offset + Nk - 1``, lie in ``[-2**62, 2**62)``, so that positions
    and their differences are exact in int64 (no wrap-around in a predicate or classifier).
    ``where`` (a string, or a callable giving one: only called to word an error) names the
    caller.  Costs a few comparisons when everything is in range (it runs on every call)."""
    ints = (Nq, Nk, q_offset, kv_offset)
    if all(type(x) is int for x in ints) and Nq >= 0 and Nk >= 0 and -MAX_INT <= q_offset \
            and q_offset + Nq <= MAX_INT and -MAX_INT <= kv_offset and kv_offset + Nk <= MAX_INT:
        return
    where = where() if callable(where) else where
    for name, n in (("Nq", Nq), ("Nk", Nk)):
        integer(n, f"{where}: {name}", lo=0)
    for name, off, n in (("q_offset", q_offset, Nq), ("kv_offset", kv_offset, Nk)):
        off = integer(off, f"{where}: {name}", lo=-MAX_INT)
        if off + n > MAX_INT:
            raise ValueError(f"{where}: {name}={off} with {n} positions reaches {off + n - 1}; positions must stay "
                             "below 2**62 so that they and their differences fit in int64")


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
