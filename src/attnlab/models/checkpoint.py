"""Reading checkpoint files safely and mapping them onto attnlab modules, all or nothing.

Only safetensors files (or ``torch.load(weights_only=True)`` for ``.bin``/``.pt``) are
read: no pickled code runs.  Loading goes in two phases: first the JSON files and the
tensor *headers* (names, shapes, dtypes: no data) are checked against the model built
on the meta device (:func:`read_headers`, :func:`check_plan`), so a hostile config
cannot make the loader allocate what the checkpoint does not hold; then the data is
read and checked again (values finite) and copied (:func:`assign`).  A corrupt or truncated file, a missing tensor, an
unexpected tensor or a shape that does not match raises :class:`CheckpointError`
naming the tensor and the shapes *before* anything is copied into the model, so a
failed load never leaves a half-loaded model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names what is wrong."""


# A transformers config.json is a few KB and a shard index at most a few MB (thousands of
# tensor names); anything far larger is not one, and reading it whole would be the attack.
MAX_JSON_BYTES = 64 << 20
# dtypes a weight may have (safetensors' names); everything else is refused by name
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_TORCH_NAME = {v: k for k, v in FLOAT_DTYPES.items()} | {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _no_duplicate_keys(where):
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise CheckpointError(f"{where}: key {k!r} appears twice in one JSON object (which one is meant?)")
            seen[k] = v
        return seen

    return hook


def read_json_object(p: Path) -> dict:
    """The JSON object in file ``p``: size-capped, valid JSON, no duplicate keys, an
    object at the top.  Anything else is a :class:`CheckpointError` naming the file."""
    size = p.stat().st_size
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{p}: {size} bytes is not a config or index file (at most {MAX_JSON_BYTES} bytes)")
    try:
        d = json.loads(p.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicate_keys(p))
    except CheckpointError:
        raise
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int of more than 4300 digits
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{p}: JSON nested too deeply to be a config") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{p}: expected a JSON object at the top, got {type(d).__name__}")
    return d


def read_config(folder: Path) -> dict:
    """``config.json`` of ``folder`` as a dict (see :func:`read_json_object`)."""
    p = Path(folder) / "config.json"
    if not p.is_file():
        raise CheckpointError(
            f"{folder}: no config.json (a transformers checkpoint folder has config.json and model.safetensors)"
        )
    return read_json_object(p)


def _hub_blob(root: Path, target: Path) -> bool:
    # huggingface_hub's cache: snapshots/<rev>/<file> is a symlink to ../../blobs/<sha>
    return root.parent.name == "snapshots" and target.parent == root.parent.parent / "blobs"


def shard_path(folder: Path, name, index: Path, tensor: str) -> Path:
    """The file a shard index names, which must stay inside ``folder``: a relative path
    of plain parts (no ``..``, not absolute), ending in ``.safetensors``, that does not
    resolve (through symlinks) outside the folder — except into the huggingface_hub
    cache's own ``blobs/``, where hub snapshots point."""
    where = f"{index}: weight_map[{tensor!r}]"
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{where}: expected a shard file name (a non-empty string), got {name!r}")
    pure = PurePosixPath(name)
    if pure.is_absolute() or PureWindowsPath(name).anchor or "\\" in name or ".." in pure.parts:
        raise CheckpointError(
            f"{where}: shard {name!r} must be a relative path inside {folder} (no absolute paths, no '..')"
        )
    if not name.endswith(".safetensors"):
        raise CheckpointError(f"{where}: shard {name!r} is not a .safetensors file")
    root, target = Path(folder).resolve(), (Path(folder) / name).resolve()
    if not target.is_relative_to(root) and not _hub_blob(root, target):
        raise CheckpointError(f"{where}: shard {name!r} resolves to {target}, outside the checkpoint folder {root}")
    return Path(folder) / name


def read_index(folder: Path) -> dict[str, Path] | None:
    """``{tensor name: shard path}`` of ``model.safetensors.index.json`` (``None`` where the
    folder has none), every shard name checked by :func:`shard_path`."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    wm = read_json_object(index).get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(
            f"{index}: field 'weight_map': expected a non-empty JSON object "
            f"{{tensor name: shard file}}, got {type(wm).__name__}"
        )
    shards, out = {}, {}
    for tensor, name in wm.items():
        if not isinstance(name, str) or name not in shards:
            shards[name] = shard_path(folder, name, index, tensor)
        out[tensor] = shards[name]
    return out


def weight_files(folder: Path) -> list[Path]:
    """``model.safetensors``, the shards of ``model.safetensors.index.json``, or a
    ``pytorch_model.bin`` (read with ``weights_only=True``)."""
    folder = Path(folder)
    index = read_index(folder)
    if index is not None:
        return sorted(set(index.values()))
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
    raise CheckpointError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def check_index(index: dict[str, Path] | None, headers: dict, where: str) -> None:
    """The shard index and the shards agree: every tensor the index names is in the shard it
    names, and every tensor of a shard is in the index (an index that disagrees with its
    shards is stale or tampered with; which of them is right is not for the loader to guess)."""
    if index is None:
        return
    errors = [
        f"{n!r} is listed in {index[n].name} but found in {h.file.name}"
        for n, h in headers.items()
        if n in index and index[n] != h.file
    ]
    errors += [f"{n!r} is in {h.file.name} but not in the index" for n, h in headers.items() if n not in index]
    errors += [f"{n!r} is listed in {f.name}, which does not hold it" for n, f in index.items() if n not in headers]
    if errors:
        raise CheckpointError(
            f"{where}/model.safetensors.index.json: field 'weight_map' disagrees with the shards: "
            + "; ".join(errors[:5])
            + (f"; and {len(errors) - 5} more" if len(errors) > 5 else "")
        )


@dataclass(frozen=True)
class Header:
    """A tensor as a checkpoint declares it, read without its data."""

    shape: tuple
    dtype: str  # safetensors' name: F32, BF16, I64, ...
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE.get(self.dtype, 1)


def _torch_load(f: Path, **kw):
    try:
        part = torch.load(f, weights_only=True, **kw)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad archive
        raise CheckpointError(
            f"{f}: cannot be read with torch.load(weights_only=True): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(part, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in part.items()
    ):
        raise CheckpointError(f"{f}: expected a dict of tensors with string names")
    return part


def read_headers(files: list[Path]) -> dict[str, Header]:
    """Every tensor's name, shape and dtype, without reading (or allocating) its data:
    safetensors headers through ``safe_open``, ``.bin`` files loaded to the meta device.
    A name in two files is refused."""
    out: dict[str, Header] = {}
    for f in files:
        if not Path(f).is_file():
            raise CheckpointError(f"{f}: file not found")
        if str(f).endswith(".safetensors"):
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(f), "pt") as h:
                    part = {
                        k: Header(tuple(h.get_slice(k).get_shape()), h.get_slice(k).get_dtype(), Path(f))
                        for k in h.keys()  # noqa: SIM118 - a safe_open handle is not iterable
                    }
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(
                    f"{f} ({os.path.getsize(f)} bytes): not a readable safetensors file — corrupt or truncated? ({e})"
                ) from None
        else:
            part = {
                k: Header(tuple(t.shape), _TORCH_NAME.get(t.dtype, str(t.dtype)), Path(f))
                for k, t in _torch_load(f, map_location="meta").items()
            }
        dup = set(part) & set(out)
        if dup:
            raise CheckpointError(f"{f}: tensors {sorted(dup)[:3]} also appear in {out[min(dup)].file}")
        out.update(part)
    return out


def read_tensors(files: list[Path], names=None) -> dict[str, torch.Tensor]:
    """The tensors of ``files`` (only ``names`` if given).  ``.bin`` files are memory-mapped
    where their format allows (torch's zip format), so unread tensors cost no memory."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not Path(f).is_file():
            raise CheckpointError(f"{f}: file not found")
        if str(f).endswith(".safetensors"):
            from safetensors import SafetensorError, safe_open

            size = os.path.getsize(f)
            try:
                with safe_open(str(f), "pt") as h:
                    part = {
                        k: h.get_tensor(k)
                        for k in h.keys()  # noqa: SIM118 - a safe_open handle is not iterable
                        if names is None or k in names
                    }
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(
                    f"{f} ({size} bytes): not a readable safetensors file — corrupt or truncated? ({e})"
                ) from None
        else:
            try:
                part = _torch_load(f, map_location="cpu", mmap=True)
            except CheckpointError:  # the legacy (non-zip) format cannot be mapped
                part = _torch_load(f, map_location="cpu")
            if names is not None:
                part = {k: v for k, v in part.items() if k in names}
        dup = set(part) & set(out)
        if dup:
            raise CheckpointError(f"{f}: tensors {sorted(dup)[:3]} also appear in another shard")
        out.update(part)
    return out


@dataclass
class Entry:
    """One attnlab tensor made of checkpoint tensors ``sources`` (with their expected
    shapes), combined by ``combine`` (default: the single source as is)."""

    sources: list[tuple[str, tuple]]
    combine: Callable | None = None


def strip_prefix(tensors: dict, prefixes: tuple[str, ...], *, where: str = "checkpoint") -> dict:
    """Drop a leading model prefix (``transformer.``, ``model.``, ``bert.``): checkpoints of
    the bare model and of the head model name the same tensors with and without it.  Two
    names that become one (``transformer.wte.weight`` and ``wte.weight``) are refused,
    both named: which of them is meant is not for the loader to guess."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, t in tensors.items():
        short = name
        for p in prefixes:
            if name.startswith(p):
                short = name[len(p) :]
                break
        if short in out:
            raise CheckpointError(
                f"{where}: tensors {origin[short]!r} and {name!r} are both {short!r} once the "
                f"prefix {prefixes} is dropped; a checkpoint must hold one of them"
            )
        out[short], origin[short] = t, name
    return out


def _raise(where: str, what: str, errors: list[str]) -> None:
    if errors:
        raise CheckpointError(
            f"{where}: cannot load {what}: "
            + "; ".join(errors[:8])
            + (f"; and {len(errors) - 8} more problems" if len(errors) > 8 else "")
        )


def check_plan(
    build: Callable[[], torch.nn.Module],
    headers: dict[str, Header],
    plan: dict[str, Entry],
    *,
    ignore: Callable[[str], bool] = lambda n: False,
    where: str = "checkpoint",
    what: str = "model",
) -> None:
    """Every check of :func:`assign` that needs no data; nothing is allocated or read.

    First the plan against the tensor ``headers``: missing, unexpected, misshapen or
    non-float tensors.  Only then is the model built, by ``build()`` on the meta device,
    and compared: the combined shapes, and the parameter count the config implies
    against the count the headers declare; the bytes the headers declare must fit in
    the files.  Raises :class:`CheckpointError` naming the tensors and shapes.
    """
    used, errors, parts = set(), [], {}
    for ours, entry in plan.items():
        ok = True
        for name, shape in entry.sources:
            h = headers.get(name)
            used.add(name)
            ok = False
            if h is None:
                errors.append(f"missing tensor {name!r} (expected shape {tuple(shape)})")
            elif h.shape != tuple(shape):
                errors.append(f"tensor {name!r} has shape {h.shape}, expected {tuple(shape)}")
            elif h.dtype not in FLOAT_DTYPES:
                errors.append(f"tensor {name!r} has dtype {h.dtype}, expected a float dtype {sorted(FLOAT_DTYPES)}")
            else:
                ok = True
        if ok:
            parts[ours] = [headers[n] for n, _ in entry.sources]
    unexpected = sorted(n for n in headers if n not in used and not ignore(n))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        errors.append(f"unexpected tensors {unexpected[:5]}{more}: the config does not describe them")
    _raise(where, what, errors)
    with torch.device("meta"):
        model = build()
    state = model.state_dict(keep_vars=True)
    n_ckpt = 0
    for ours, entry in plan.items():
        metas = [torch.empty(h.shape, dtype=FLOAT_DTYPES[h.dtype], device="meta") for h in parts[ours]]
        n_ckpt += sum(h.numel for h in parts[ours])
        value = entry.combine(*metas) if entry.combine else metas[0]
        if ours not in state:
            raise RuntimeError(f"loader bug: {ours!r} is not a tensor of {type(model).__name__}")
        if tuple(value.shape) != tuple(state[ours].shape):
            errors.append(
                f"{[n for n, _ in entry.sources]} give shape {tuple(value.shape)} for {ours}, "
                f"expected {tuple(state[ours].shape)}"
            )
    _raise(where, what, errors)
    n_model = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    if n_model != n_ckpt:
        raise CheckpointError(
            f"{where}: the config implies {n_model} parameters ({4 * n_model} bytes in float32) "
            f"but the checkpoint's headers declare {n_ckpt} for the tensors it maps"
        )
    declared = sum(h.nbytes for h in headers.values())
    held = sum(os.path.getsize(f) for f in {h.file for h in headers.values()})
    if declared > held:
        raise CheckpointError(f"{where}: the tensor headers declare {declared} bytes but the files hold only {held}")


def assign(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    plan: dict[str, Entry],
    *,
    ignore: Callable[[str], bool] = lambda n: False,
    where: str = "checkpoint",
) -> None:
    """Check everything, then copy: ``plan[attnlab_name] = Entry(...)``.

    Raises :class:`CheckpointError` for missing, unexpected or misshapen tensors
    (naming them, with expected and found shapes) before touching ``model``.
    """
    used = set()
    state = model.state_dict()
    new = {}
    errors = []
    for ours, entry in plan.items():
        parts = []
        for name, shape in entry.sources:
            t = tensors.get(name)
            used.add(name)
            if t is None:
                errors.append(f"missing tensor {name!r} (expected shape {tuple(shape)})")
                continue
            if tuple(t.shape) != tuple(shape):
                errors.append(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
                continue
            if not t.dtype.is_floating_point:
                errors.append(f"tensor {name!r} has dtype {t.dtype}, expected a float dtype")
                continue
            if not torch.isfinite(t).all():
                errors.append(f"tensor {name!r} holds NaN or inf values")
                continue
            parts.append(t)
        if len(parts) != len(entry.sources):
            continue
        value = entry.combine(*parts) if entry.combine else parts[0]
        if ours not in state:
            raise RuntimeError(f"loader bug: {ours!r} is not a tensor of {type(model).__name__}")
        if tuple(value.shape) != tuple(state[ours].shape):
            errors.append(
                f"{[n for n, _ in entry.sources]} give shape {tuple(value.shape)} for {ours}, "
                f"expected {tuple(state[ours].shape)}"
            )
            continue
        new[ours] = value.to(state[ours].dtype)
    unexpected = sorted(n for n in tensors if n not in used and not ignore(n))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        errors.append(f"unexpected tensors {unexpected[:5]}{more}: the config does not describe them")
    _raise(where, type(model).__name__, errors)
    # Tensors the plan does not name: tied weights take their partner's new value
    # (same storage); anything else would stay as initialised, which is a loader bug.
    params = dict(model.named_parameters(remove_duplicate=False))
    for k in [k for k in state if k not in new]:
        partner = next((o for o in new if o in params and k in params and params[o] is params[k]), None)
        if partner is None:
            raise RuntimeError(f"loader bug: {type(model).__name__}.{k} is not in the plan")
        new[k] = new[partner]
    model.load_state_dict(new, strict=True)
