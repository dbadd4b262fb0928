"""The fingerprint of a distributed attention call: what every rank must agree on.

Before any data moves, every rank describes its call as a fixed list of *fields*
(:data:`FIELDS`: the function, shapes, dtypes, ``seq_len``, layout, the mask with its
parameters, the score mod with its parameters, the scale, ``return_lse``, the local
backend, whether gradients will be needed, and the local argument error if there is
one).  Each field is a flat dict ``{path: text}`` of *leaves*::

    mask = sliding_window(7) & causal()
    ->  {"mask": "sliding_window & causal", "mask.a": "sliding_window", "mask.a.w": "7",
         "mask.b": "causal"}

read from the public attributes the mask and score-mod objects store (built-ins
and user subclasses alike: ``vars(obj)`` without ``_``-names), recursing through
``&``/``|``/``~`` and :func:`attnlab.scores.compose`.  Leaves are exact:

* numbers by value (``repr`` of a float round-trips), strings, ``None``, bools;
* tensors by shape, dtype, ``requires_grad`` and their values when they are few
  (at most 16), else a digest of their bytes (the device does not count: ranks hold
  their own devices);
* functions (``custom`` masks and score mods) by qualified name and line, and the
  simple values their closures and defaults capture (so ``custom(lambda ...: q - kv < w)``
  with another ``w`` differs); other objects by type.

:func:`digests` hashes each field to one int64 (BLAKE2b, the same in every process —
never Python's salted ``hash``), so the handshake all-gathers one small tensor of
``len(FIELDS) + 1`` numbers whatever the call; only when they differ do the ranks
exchange the texts of the fields that differ (:func:`diff_message`).

>>> from attnlab import masks
>>> leaves(masks.sliding_window(7) & masks.causal(), "mask")
{'mask': 'sliding_window & causal', 'mask.a': 'sliding_window', 'mask.a.w': '7', 'mask.b': 'causal'}
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import types

import torch

from attnlab.masks import Mask
from attnlab.scores import ScoreMod

__all__ = ["FIELDS", "call_fields", "leaves", "digests", "diff_message"]

FIELDS = (
    "function",
    "q.shape",
    "k.shape",
    "v.shape",
    "q.dtype",
    "k.dtype",
    "v.dtype",
    "seq_len",
    "layout",
    "mask",
    "score_mod",
    "scale",
    "return_lse",
    "backend",
    "gradients",
    "error",
)

_MAX_VALUES = 16  # tensors with at most this many elements are shown by value
_MAX_TEXT = 240  # characters of one leaf's text
_MAX_DEPTH = 8
_MAX_LEAVES = 256  # leaves shown one by one; the rest are compared by one digest

# the built-in score mods' classes (attnlab.scores) by the public name that builds them;
# masks name themselves (Mask.kind, the name their structural key uses)
_NAMES = {
    "_Alibi": "alibi",
    "_Softcap": "softcap",
    "_RelativeBias": "relative_bias",
    "_Compose": "compose",
    "_Custom": "custom",
}
_OPS = {"and": "&", "or": "|"}
_SKIP = {"cheap_classify"}  # derived from other attributes


def _clip(s: str) -> str:
    """``s``, or its start and a digest of all of it: still exact, never long."""
    if len(s) <= _MAX_TEXT:
        return s
    digest = hashlib.blake2b(s.encode("utf-8", "backslashreplace"), digest_size=8).hexdigest()
    return s[: _MAX_TEXT - 24] + "… #" + digest


def _tensor_text(t: torch.Tensor) -> str:
    rg = t.requires_grad
    t = t.detach()
    head = f"tensor{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
    if rg:
        head += " requires_grad"
    if t.numel() <= _MAX_VALUES:
        vals = t.cpu().tolist()
        if t.dtype.is_floating_point:  # exact: repr of a Python float round-trips
            vals = _float_list(vals)
        return _clip(f"{head} {vals}")
    raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{head} #{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


def _float_list(x):
    return [_float_list(y) for y in x] if isinstance(x, list) else float(x)


def _is_mask_like(obj) -> bool:
    """Masks and score mods (the built-ins, subclasses, and duck-typed objects of the
    same protocol), whose public attributes are their parameters."""
    if isinstance(obj, (Mask, ScoreMod)):
        return True
    return (
        not isinstance(obj, torch.nn.Module)
        and hasattr(obj, "__dict__")
        and (callable(getattr(obj, "predicate", None)) or callable(getattr(obj, "apply", None)))
    )


def _kind(obj) -> str | None:
    """A built-in mask's own kind (set on its class, not inherited by a user subclass)."""
    return type(obj).__dict__.get("kind") if isinstance(obj, Mask) else None


def _type_name(obj) -> str:
    n = type(obj).__name__
    kind = _kind(obj)
    if kind is not None:
        return kind
    if type(obj).__module__ == "attnlab.scores" and n in _NAMES:
        return _NAMES[n]
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _skeleton(obj, depth=0) -> str:
    """The structure of a mask or score mod without its parameters: ``document & causal``."""
    if obj is None:
        return "None"
    kind = _kind(obj)
    if depth < _MAX_DEPTH:
        if kind in _OPS:
            return f"{_skeleton(obj.a, depth + 1)} {_OPS[kind]} {_skeleton(obj.b, depth + 1)}"
        if kind == "not":
            return f"~{_skeleton(obj.a, depth + 1)}"
    if kind in _OPS or kind == "not":
        return f"({_type_name(obj)})"
    return _type_name(obj)


def _fn_text(fn) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    code = getattr(fn, "__code__", None)
    where = f" line {code.co_firstlineno}" if code is not None else ""
    return f"{getattr(fn, '__module__', '?')}.{name}{where}"


def _walk(obj, path: str, out: dict, depth: int, seen: set) -> None:
    if obj is None or isinstance(obj, (bool, int, str)):
        out[path] = _clip(repr(obj))
        return
    if isinstance(obj, float):
        out[path] = repr(obj) if math.isfinite(obj) else str(obj)
        return
    if isinstance(obj, numbers.Number):  # numpy scalars, fractions, complex
        out[path] = _clip(f"{type(obj).__name__}({obj!r})")
        return
    if isinstance(obj, torch.Tensor):
        out[path] = _tensor_text(obj)
        return
    if isinstance(obj, (torch.dtype, torch.device)):
        out[path] = str(obj) if isinstance(obj, torch.dtype) else "device"
        return
    if depth >= _MAX_DEPTH or id(obj) in seen:
        out[path] = f"<{_type_name(obj)}>"
        return
    seen = seen | {id(obj)}
    if isinstance(obj, (list, tuple)):
        out[path] = f"{type(obj).__name__} of {len(obj)}"
        for i, x in enumerate(obj):
            _walk(x, f"{path}[{i}]", out, depth + 1, seen)
        return
    if isinstance(obj, dict):
        out[path] = f"dict of {len(obj)}"
        for key in sorted(obj, key=repr):
            _walk(obj[key], f"{path}[{key!r}]", out, depth + 1, seen)
        return
    if isinstance(obj, functools.partial):
        out[path] = f"partial({_fn_text(obj.func)})"
        _walk(list(obj.args), f"{path}.args", out, depth + 1, seen)
        _walk(dict(obj.keywords), f"{path}.keywords", out, depth + 1, seen)
        return
    if isinstance(obj, types.MethodType):
        out[path] = _fn_text(obj.__func__)
        _walk(obj.__self__, f"{path}.__self__", out, depth + 1, seen)
        return
    if isinstance(obj, types.FunctionType):
        out[path] = _fn_text(obj)
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                val = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _simple(val):
                _walk(val, f"{path}.{name}", out, depth + 1, seen)
        for i, val in enumerate(obj.__defaults__ or ()):
            if _simple(val):
                _walk(val, f"{path}.defaults[{i}]", out, depth + 1, seen)
        return
    if _is_mask_like(obj):
        out[path] = _skeleton(obj, depth)
        for name, val in sorted(vars(obj).items()):
            if name.startswith("_") or name in _SKIP:
                continue
            _walk(val, f"{path}.{name}", out, depth + 1, seen)
        return
    out[path] = f"<{_type_name(obj)}>"  # any other object: by type only


def _simple(x) -> bool:
    """Values a closure captures that say what a function computes (not modules, objects)."""
    if x is None or isinstance(x, (numbers.Number, str, torch.Tensor)):
        return True
    if isinstance(x, (list, tuple)) and len(x) <= _MAX_VALUES:
        return all(_simple(y) for y in x)
    return False


def leaves(obj, root: str) -> dict:
    """The flat ``{path: text}`` description of ``obj`` (a mask, score mod or value)."""
    out: dict = {}
    _walk(obj, root, out, 0, set())
    if len(out) > _MAX_LEAVES:  # keep the texts short, but compare every leaf
        items = list(out.items())
        rest = "\n".join(f"{p}={t}" for p, t in items[_MAX_LEAVES:])
        out = dict(items[:_MAX_LEAVES])
        out[f"{root}[…]"] = _clip(
            f"{len(items) - _MAX_LEAVES} more leaves #"
            + hashlib.blake2b(rest.encode("utf-8", "backslashreplace"), digest_size=8).hexdigest()
        )
    return out


def _safe(fn, field):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a field of an invalid call: described, never raised here
        return {field: f"<unavailable: {type(e).__name__}>"}


def call_fields(
    op: str,
    q,
    k,
    v,
    *,
    seq_len,
    layout,
    mask,
    score_mod,
    scale,
    return_lse,
    backend="-",
    params=(),
    error: BaseException | None = None,
) -> dict:
    """``{field: {path: text}}`` for every field of :data:`FIELDS`, in that order."""

    def shape(name, t):
        return {name: repr(tuple(t.shape)) if isinstance(t, torch.Tensor) else f"<{type(t).__name__}>"}

    def dtype(name, t):
        return {name: str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else "-"}

    def grads():
        ts = [t for t in (q, k, v, *params) if isinstance(t, torch.Tensor)]
        return {"gradients": repr(bool(torch.is_grad_enabled() and any(t.requires_grad for t in ts)))}

    f = {
        "function": {"function": op},
        "q.shape": shape("q.shape", q),
        "k.shape": shape("k.shape", k),
        "v.shape": shape("v.shape", v),
        "q.dtype": dtype("q.dtype", q),
        "k.dtype": dtype("k.dtype", k),
        "v.dtype": dtype("v.dtype", v),
        "seq_len": _safe(lambda: leaves(seq_len, "seq_len"), "seq_len"),
        "layout": _safe(lambda: leaves(layout, "layout"), "layout"),
        "mask": _safe(lambda: leaves(mask, "mask"), "mask"),
        "score_mod": _safe(lambda: leaves(score_mod, "score_mod"), "score_mod"),
        "scale": _safe(lambda: leaves(scale, "scale"), "scale"),
        "return_lse": _safe(lambda: leaves(return_lse, "return_lse"), "return_lse"),
        "backend": _safe(lambda: leaves(backend, "backend"), "backend"),
        "gradients": _safe(grads, "gradients"),
        "error": {"error": "none" if error is None else _clip(f"{type(error).__name__}: {error}")},
    }
    return f


def _h64(text: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "backslashreplace"), digest_size=8).digest(), "little", signed=True
    )


def _field_text(d: dict) -> str:
    return "\n".join(f"{p}\x1f{t}" for p, t in d.items())


def digests(fields: dict) -> list[int]:
    """One int64 per field, after one for the list of field names (the protocol)."""
    return [_h64("|".join(FIELDS))] + [_h64(_field_text(fields[n])) for n in FIELDS]


def encode(fields: dict, names: list[str]) -> bytes:
    """The texts of the fields ``names`` (those that differ), to send to the other ranks."""
    return "\x1e".join(_field_text(fields[n]) for n in names).encode("utf-8", "backslashreplace")


def decode(raw: bytes, names: list[str]) -> dict:
    parts = raw.decode("utf-8", "replace").split("\x1e")
    out = {}
    for n, part in zip(names, parts, strict=False):
        d = {}
        for line in part.split("\n") if part else []:
            p, _, t = line.partition("\x1f")
            d[p] = t
        out[n] = d
    return out


def _ranks_text(ranks: list[int]) -> str:
    runs, lo = [], None
    for i, r in enumerate(ranks):
        if lo is None:
            lo = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(lo) if lo == r else f"{lo}-{r}")
            lo = None
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(runs)


_MAX_LINES = 12  # groups of ranks listed
_MAX_PATHS = 10  # leaves that differ, listed


def diff_message(op: str, per_rank: list[dict], names: list[str]) -> str:
    """The error every rank raises: which fields differ and each rank's values of the
    leaves that differ (ranks that agree are listed together)."""
    paths: list[str] = []
    for n in names:
        for d in per_rank:
            for p in d.get(n, {}):
                if p not in paths and len({r.get(n, {}).get(p, "(absent)") for r in per_rank}) > 1:
                    paths.append(p)
    more = len(paths) - _MAX_PATHS
    paths = paths[:_MAX_PATHS]
    groups: dict = {}
    for r, d in enumerate(per_rank):
        key = tuple(_lookup(d, p) for p in paths)
        groups.setdefault(key, []).append(r)
    lines = []
    for key, ranks in groups.items():
        lines.append(f"{_ranks_text(ranks)}: " + ", ".join(f"{p}={t}" for p, t in zip(paths, key, strict=True)))
    if len(lines) > _MAX_LINES:
        lines = [*lines[:_MAX_LINES], f"... and {len(groups) - _MAX_LINES} more groups of ranks"]
    differs = (", ".join(paths) if paths else ", ".join(names)) + (f" and {more} more" if more > 0 else "")
    if "function" in names:  # ranks that called different functions: name them all, in rank order
        op = "/".join(dict.fromkeys(d["function"].get("function", "?") for d in per_rank))
    return (
        f"{op}: the ranks called with different arguments (differs: {differs}); every rank must pass shards "
        "of one problem — the same function, shapes, dtypes, seq_len, layout, mask and score mod with their "
        "parameters, scale, return_lse, backend and whether gradients are needed:\n  " + "\n  ".join(lines)
    )


def _lookup(d: dict, path: str) -> str:
    for fields in d.values():
        if path in fields:
            return fields[path]
    return "(absent)"
