"""Reading a transformers ``config.json`` field by field, each one checked.

A loader asks :class:`Fields` for every value it uses, with its type and range, so a
hostile or careless config (a string where an int belongs, ``NaN`` for an epsilon,
``0`` heads, an unknown activation) raises :class:`CheckpointError` naming the file,
the field, what it holds and what would work — before anything reads a tensor.

JSON has no int/float distinction that Python's ``json`` keeps loosely: ints must be
JSON integers (``64``, not ``64.0`` or ``1e8``, never ``true``); floats may be any finite
JSON number.  ``null`` counts as absent where transformers treats it so (``n_inner``,
``head_dim``, ``num_key_value_heads``, ``pad_token_id``).

>>> f = Fields({"n_embd": 64, "eps": float("nan")}, "ckpt/config.json")
>>> f.int("n_embd")
64
>>> f.float("eps", 1e-5)
Traceback (most recent call last):
...
attnlab.models.checkpoint.CheckpointError: ckpt/config.json: field 'eps': expected a finite number > 0, got nan
"""

from __future__ import annotations

import builtins
import math

from attnlab.models.checkpoint import CheckpointError

_REQUIRED = object()


class Fields:
    """Typed, range-checked access to a config dict; ``where`` names the file in errors."""

    def __init__(self, d: dict, where):
        if not isinstance(d, dict):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(d).__name__}")
        self.d, self.where = d, str(where)

    def error(self, key: str, want: str, got) -> CheckpointError:
        return CheckpointError(f"{self.where}: field {key!r}: expected {want}, got {got!r}")

    def _get(self, key, default, none_is_absent):
        if key not in self.d or (none_is_absent and self.d[key] is None):
            if default is _REQUIRED:
                raise CheckpointError(f"{self.where}: config.json lacks {key!r} (a required field)")
            return default, False
        return self.d[key], True

    def int(self, key: str, default=_REQUIRED, *, min: int = 1, none_is_absent: bool = False):
        """An int ``>= min`` (``default`` if absent, which may be ``None``)."""
        v, present = self._get(key, default, none_is_absent)
        if present and (isinstance(v, bool) or not isinstance(v, int) or v < min):
            raise self.error(key, f"a JSON integer >= {min}", v)
        return v

    def float(
        self,
        key: str,
        default=_REQUIRED,
        *,
        low: float = 0.0,
        high: float = math.inf,
        low_inclusive: bool = False,
        none_is_absent: bool = False,
    ):
        """A finite number in ``(low, high]`` (``[low, high]`` with ``low_inclusive``)."""
        v, present = self._get(key, default, none_is_absent)
        if present:
            ok = (
                not isinstance(v, bool)
                and isinstance(v, (int, float))
                and math.isfinite(v)
                and (v >= low if low_inclusive else v > low)
                and v <= high
            )
            if not ok:
                lo = f">= {low:g}" if low_inclusive else f"> {low:g}"
                raise self.error(key, f"a finite number {lo}" + (f" and <= {high:g}" if high < math.inf else ""), v)
            v = float(v)
        return v

    def bool(self, key: str, default=_REQUIRED, *, none_is_absent: bool = False) -> bool:
        v, present = self._get(key, default, none_is_absent)
        if present and not isinstance(v, bool):
            raise self.error(key, "true or false", v)
        return v

    def str(self, key: str, default=_REQUIRED, *, choices=None) -> str:
        v, present = self._get(key, default, False)
        if present and (not isinstance(v, str) or (choices is not None and v not in choices)):
            raise self.error(key, f"one of {sorted(choices)}" if choices is not None else "a string", v)
        return v

    def dict_or_none(self, key: builtins.str):  # (`str` here is the method above)
        v = self.d.get(key)
        if v is not None and not isinstance(v, dict):
            raise self.error(key, "a JSON object or null", v)
        return v


def numbers_finite(d: dict, where: str, key: str) -> None:
    """Every number inside the (flat) dict ``d`` (read from field ``key``) is finite."""
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise CheckpointError(f"{where}: field {key!r}: {k!r} must be finite, got {v!r}")


def build(cls, where: str, **kw):
    """``cls(**kw)`` (an attnlab config), its ValueError/TypeError re-raised as
    :class:`CheckpointError` naming the file."""
    try:
        return cls(**kw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: the config describes no valid {cls.__name__}: {e}") from None
