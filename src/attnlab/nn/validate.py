"""Argument checks shared by the modules and configs (clear errors, never ``assert``)."""

from __future__ import annotations

import math
import numbers


def positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {x!r}")
    return int(x)


def nonneg_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {x!r}")
    return int(x)


def probability(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not (0.0 <= x < 1.0):
        raise ValueError(f"{name}: expected a probability in [0, 1), got {x!r}")
    return float(x)


def positive_float(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {x!r}")
    return float(x)


def choice(x, name: str, options) -> str:
    if x not in options:
        raise ValueError(f"{name}: expected one of {tuple(options)}, got {x!r}")
    return x


def head_shape(d_model, n_heads, n_kv_heads, d_head):
    """``(d_model, n_heads, n_kv_heads, d_head)`` checked: positive ints, ``n_heads`` a
    multiple of ``n_kv_heads`` (default ``n_heads``), ``d_head`` default ``d_model // n_heads``."""
    d_model = positive_int(d_model, "d_model")
    n_heads = positive_int(n_heads, "n_heads")
    n_kv_heads = n_heads if n_kv_heads is None else positive_int(n_kv_heads, "n_kv_heads")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} (GQA groups)")
    if d_head is None:
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass d_head explicitly")
        d_head = d_model // n_heads
    return d_model, n_heads, n_kv_heads, positive_int(d_head, "d_head")
