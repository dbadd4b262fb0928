"""Argument checks shared by the modules and configs (clear errors, never ``assert``)."""

from __future__ import annotations

import numbers

from attnlab.validate import ArgumentTypeError, integer, real


def positive_int(x, name: str) -> int:
    """An int in ``[1, 2**62]`` (:func:`attnlab.validate.integer`)."""
    return integer(x, name, lo=1)


def nonneg_int(x, name: str) -> int:
    """An int in ``[0, 2**62]``."""
    return integer(x, name, lo=0)


def probability(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a probability in [0, 1), got {type(x).__name__} {x!r:.60}")
    if not (0.0 <= float(x) < 1.0):
        raise ValueError(f"{name}: expected a probability in [0, 1), got {x!r}")
    return float(x)


def positive_float(x, name: str) -> float:
    """A finite number > 0."""
    return real(x, name, gt=0.0)


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
