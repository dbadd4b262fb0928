"""Reading checkpoint files safely and mapping them onto attnlab modules, all or nothing.

Only safetensors files (or ``torch.load(weights_only=True)`` for ``.bin``/``.pt``) are
read: no pickled code runs.  A corrupt or truncated file, a missing tensor, an
unexpected tensor or a shape that does not match raises :class:`CheckpointError`
naming the tensor and the shapes *before* anything is copied into the model, so a
failed load never leaves a half-loaded model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names what is wrong."""


def read_config(folder: Path) -> dict:
    p = Path(folder) / "config.json"
    if not p.is_file():
        raise CheckpointError(f"{folder}: no config.json (a transformers checkpoint folder has config.json "
                              "and model.safetensors)")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None


def weight_files(folder: Path) -> list[Path]:
    """``model.safetensors``, the shards of ``model.safetensors.index.json``, or a
    ``pytorch_model.bin`` (read with ``weights_only=True``)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({e})") from None
        return [folder / s for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
    raise CheckpointError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not Path(f).is_file():
            raise CheckpointError(f"{f}: file not found")
        if str(f).endswith(".safetensors"):
            from safetensors import SafetensorError
            from safetensors.torch import load_file
            size = os.path.getsize(f)
            try:
                part = load_file(str(f))
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"{f} ({size} bytes): not a readable safetensors file — corrupt or "
                                      f"truncated? ({e})") from None
        else:
            try:
                part = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:  # torch raises many kinds for a bad archive
                raise CheckpointError(f"{f}: cannot be read with torch.load(weights_only=True): "
                                      f"{type(e).__name__}: {e}") from None
            if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
                raise CheckpointError(f"{f}: expected a dict of tensors")
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


def strip_prefix(tensors: dict, prefixes: tuple[str, ...]) -> dict:
    """Drop a leading model prefix (``transformer.``, ``model.``, ``bert.``) where every
    name that has one shares it (checkpoints of the bare model and of the head model)."""
    out = {}
    for name, t in tensors.items():
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        out[name] = t
    return out


def assign(model: torch.nn.Module, tensors: dict[str, torch.Tensor], plan: dict[str, Entry], *,
           ignore: Callable[[str], bool] = lambda n: False, where: str = "checkpoint") -> None:
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
            errors.append(f"{[n for n, _ in entry.sources]} give shape {tuple(value.shape)} for {ours}, "
                          f"expected {tuple(state[ours].shape)}")
            continue
        new[ours] = value.to(state[ours].dtype)
    unexpected = sorted(n for n in tensors if n not in used and not ignore(n))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        errors.append(f"unexpected tensors {unexpected[:5]}{more}: the config does not describe them")
    if errors:
        raise CheckpointError(f"{where}: cannot load {type(model).__name__}: " + "; ".join(errors[:8])
                              + (f"; and {len(errors) - 8} more problems" if len(errors) > 8 else ""))
    # Tensors the plan does not name: tied weights take their partner's new value
    # (same storage); anything else would stay as initialised, which is a loader bug.
    params = dict(model.named_parameters(remove_duplicate=False))
    for k in [k for k in state if k not in new]:
        partner = next((o for o in new if o in params and k in params and params[o] is params[k]), None)
        if partner is None:
            raise RuntimeError(f"loader bug: {type(model).__name__}.{k} is not in the plan")
        new[k] = new[partner]
    model.load_state_dict(new, strict=True)
