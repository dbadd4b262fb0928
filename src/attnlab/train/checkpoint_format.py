"""The names and the ``trainer.json`` of a training checkpoint (:mod:`attnlab.train.checkpoint`):
the files of the folder, the format and its versions, the metadata keys, the JSON codec that
keeps tuples, and :func:`check_meta`, which checks every field of ``trainer.json`` (types,
ranges, no unknown fields) and raises :class:`attnlab.models.checkpoint.CheckpointError`
naming the field.
"""

from __future__ import annotations

import re
from pathlib import Path

from attnlab.models.checkpoint import CheckpointError

__all__ = [
    "ALIAS_KEY",
    "FORMAT",
    "JSON_CRC_KEY",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "RNG_KEY",
    "TRAINER_FILE",
    "TRAINER_JSON",
    "VERSION",
    "VERSIONS",
    "check_meta",
    "from_json",
    "is_nonneg_int",
    "to_json",
]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_FILE = "trainer.safetensors"
TRAINER_JSON = "trainer.json"
FORMAT = "attnlab.train.checkpoint"
VERSION = 2  # 2: trainer.json's CRC-32 in trainer.safetensors (1 still loads)
VERSIONS = (1, 2)
ALIAS_KEY = "attnlab.aliases"
RNG_KEY = "rng.torch_cpu"
JSON_CRC_KEY = "attnlab.trainer_json_crc32"


def to_json(v, where: str):
    """JSON-safe encoding that keeps tuples (``{"__tuple__": [...]}``)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [to_json(x, where) for x in v]}
    if isinstance(v, list):
        return [to_json(x, where) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError(f"{where}: dict keys must be str to go into {TRAINER_JSON}")
        return {k: to_json(x, f"{where}.{k}") for k, x in v.items()}
    raise TypeError(
        f"{where}: a {type(v).__name__} cannot be stored in {TRAINER_JSON} (tensors go into "
        f"the safetensors files; other values must be JSON: None, bool, int, float, str, list, dict)"
    )


def from_json(v):
    """The inverse of :func:`to_json`."""
    if isinstance(v, list):
        return [from_json(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(from_json(x) for x in v["__tuple__"])
        return {k: from_json(x) for k, x in v.items()}
    return v


def _bad(p, field_name: str, got, want: str) -> CheckpointError:
    shown = repr(got) if len(repr(got)) < 60 else f"a {type(got).__name__}"
    return CheckpointError(f"{p}: field {field_name!r} is {shown}, expected {want}")


def is_nonneg_int(v) -> bool:
    """``v`` is an int >= 0 (not a bool): the JSON step and parameter indices."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_keys(p, d: dict, where: str, required: set, optional: set | frozenset = frozenset()) -> None:
    missing = sorted(required - set(d))
    unknown = sorted(set(d) - required - set(optional))
    if missing:
        raise CheckpointError(
            f"{p}: {where} lacks the field {missing[0]!r}" if where else f"{p}: missing the field {missing[0]!r}"
        )
    if unknown:
        raise CheckpointError(
            f"{p}: unknown field {(where + '.' if where else '') + unknown[0]!r} "
            f"(expected {sorted(required | set(optional))})"
        )


def check_meta(p: Path, meta) -> dict:
    """Every field of trainer.json: types, ranges, no unknown fields."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{p}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    version = meta.get("version")
    if isinstance(version, bool) or version not in VERSIONS:
        raise CheckpointError(f"{p}: version {version!r} is not supported (expected one of {VERSIONS})")
    _check_keys(p, meta, "", {"format", "version", "step", "extra", "model", "optimizer", "rng"})
    if not is_nonneg_int(meta["step"]):
        raise CheckpointError(f"{p}: step must be an int >= 0, got {meta['step']!r}")
    if not isinstance(meta["extra"], dict):
        raise _bad(p, "extra", meta["extra"], "a JSON object")
    mm = meta["model"]
    if not isinstance(mm, dict):
        raise _bad(p, "model", mm, "a JSON object")
    _check_keys(p, mm, "model", {"file", "aliases"})
    if mm["file"] != MODEL_FILE:
        raise _bad(p, "model.file", mm["file"], repr(MODEL_FILE))
    if not isinstance(mm["aliases"], dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mm["aliases"].items()
    ):
        raise _bad(p, "model.aliases", mm["aliases"], "an object of str -> str")
    if meta["rng"] != {"torch_cpu": RNG_KEY}:
        raise _bad(p, "rng", meta["rng"], repr({"torch_cpu": RNG_KEY}))
    om = meta["optimizer"]
    if om is None:
        return meta
    if not isinstance(om, dict):
        raise _bad(p, "optimizer", om, "null or a JSON object")
    _check_keys(p, om, "optimizer", {"file", "class", "param_groups", "state", "param_names"})
    if om["file"] != OPTIMIZER_FILE:
        raise _bad(p, "optimizer.file", om["file"], repr(OPTIMIZER_FILE))
    if not isinstance(om["class"], str):
        raise _bad(p, "optimizer.class", om["class"], "a class name (str)")
    if not isinstance(om["param_names"], list) or not all(isinstance(n, str) for n in om["param_names"]):
        raise _bad(p, "optimizer.param_names", om["param_names"], "a list of str")
    groups = om["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _bad(p, "optimizer.param_groups", groups, "a list of JSON objects")
    for g, grp in enumerate(groups):
        ids = grp.get("params")
        if not isinstance(ids, list) or not all(is_nonneg_int(i) for i in ids):
            raise _bad(p, f"optimizer.param_groups[{g}].params", ids, "a list of ints >= 0")
    state = om["state"]
    if not isinstance(state, dict) or not all(
        re.fullmatch(r"0|[1-9][0-9]*", k) and isinstance(v, dict) for k, v in state.items()
    ):
        raise _bad(p, "optimizer.state", state, "an object {parameter index: {key: value}}")
    return meta
