"""Training checkpoints as safetensors plus JSON: no pickle anywhere.

A checkpoint is one folder::

    model.safetensors      model.state_dict(), each storage once: a tied alias such as
                           lm_head.weight (= embed.weight) is dropped and recorded in the
                           file's metadata ("attnlab.aliases"), and re-tied on load
    optimizer.safetensors  every tensor of optimizer.state_dict(), flattened:
                           "state.{i}.{key}" (i = the parameter's index, in param_groups
                           order; e.g. "state.3.exp_avg", "state.3.step") and
                           "param_groups.{g}.{key}" for a tensor-valued hyperparameter
    trainer.safetensors    trainer tensors: torch's CPU RNG state "rng.torch_cpu" (uint8);
                           its metadata holds the CRC-32 of trainer.json
                           ("attnlab.trainer_json_crc32")
    trainer.json           format, version, step, ``extra`` (the caller's JSON), the
                           optimizer's class, param_groups hyperparameters, non-tensor
                           state, and the model name of every optimizer index

Every safetensors file carries a CRC-32 of each tensor in its metadata
("attnlab.crc32"), and trainer.safetensors the CRC-32 of trainer.json, so flipped bytes
are reported with the tensor's or the file's name.

**Saving is atomic at every instant** (:mod:`attnlab.train.atomic`): the folder is
written to a fresh temporary sibling, every file and folder fsynced, and switched in by
renames with a backup of the previous checkpoint; a process killed at any point leaves
the complete old or the complete new checkpoint under the name (an interrupted switch
is undone by the next save, load or :func:`latest_checkpoint`).

**Loading checks everything before it modifies anything**: :func:`prepare_load` reads
and validates every field of trainer.json (types, ranges, no unknown fields), the
checksums, the weights (names, shapes, dtypes, ties), the optimizer state against the
optimizer (:func:`attnlab.train.optim_state.check_optimizer_state`: parameter ids,
hyperparameters, every per-parameter entry's kind, shape and dtype) and the RNG state
(size, dtype, a valid generator state), and raises
:class:`attnlab.models.checkpoint.CheckpointError` (a ``ValueError``) naming the field;
only then does ``.apply()`` (or :func:`load_checkpoint`) copy.

>>> import tempfile, torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> cfg = DecoderConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_positions=8)
>>> a, b = Decoder(cfg), Decoder(cfg)
>>> folder = tempfile.mkdtemp()
>>> _ = save_checkpoint(f"{folder}/ckpt", a, None, step=7, extra={"note": "demo"})
>>> info = load_checkpoint(f"{folder}/ckpt", b)
>>> info.step, info.extra["note"], torch.equal(a.embed.weight, b.embed.weight)
(7, 'demo', True)
>>> b.lm_head.weight is b.embed.weight                  # still tied
True
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from attnlab.models.checkpoint import CheckpointError
from attnlab.train.atomic import recover, replace_folder, write_bytes
from attnlab.train.checkpoint_format import (
    ALIAS_KEY,
    FORMAT,
    JSON_CRC_KEY,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_KEY,
    TRAINER_FILE,
    TRAINER_JSON,
    VERSION,
    check_meta,
    from_json,
    is_nonneg_int,
    to_json,
)
from attnlab.train.optim_state import check_optimizer_state
from attnlab.train.tensor_files import read_tensors, safetensors_module, write_tensors
from attnlab.validate import nonneg_int

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "PendingLoad",
    "save_checkpoint",
    "prepare_load",
    "load_checkpoint",
    "latest_checkpoint",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "TRAINER_FILE",
    "TRAINER_JSON",
]


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` returns besides the restored model and optimizer.

    ``rng_state`` is torch's CPU RNG state at save time (a uint8 tensor for
    ``torch.set_rng_state``); ``meta`` is the whole of ``trainer.json``."""

    path: Path
    step: int
    extra: dict
    rng_state: torch.Tensor
    meta: dict = field(repr=False)


# -- small helpers ------------------------------------------------------------------


def _storage_key(t: torch.Tensor):
    ptr = t.untyped_storage().data_ptr()
    if t.numel() == 0 or ptr == 0:
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _param_names(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> list[str]:
    names: dict[int, str] = {}
    if model is not None:
        for n, p in model.named_parameters(remove_duplicate=True):
            names.setdefault(id(p), n)
    return [
        names.get(id(p), f"<param {i}>") for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
    ]


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State-dict tensors with each exact alias dropped, and ``{alias: kept name}``."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[object, str] = {}
    for name, t in model.state_dict().items():
        key = _storage_key(t)
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        kept[name] = t
    return kept, aliases


# -- saving ------------------------------------------------------------------------


def save_checkpoint(
    path_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, extra: dict | None = None
) -> Path:
    """Write a checkpoint folder at ``path_dir`` (atomically) and return its path.

    Args:
        path_dir: the folder to create (its parent is created if needed).  An existing
            folder is replaced only if it is a checkpoint (holds ``trainer.json``) or empty.
        model: its ``state_dict()`` goes to ``model.safetensors`` (tied aliases once).
        optimizer: ``None``, or any ``torch.optim`` optimizer over the model's parameters.
        step: number of completed optimizer steps (int >= 0).
        extra: JSON-serialisable dict kept in ``trainer.json`` (e.g. the train config,
            the data position).

    torch's CPU RNG state at the time of the call is saved too (``rng.torch_cpu``).  A
    process killed at any point of the call leaves under ``path_dir`` the complete
    previous checkpoint or the complete new one (see :mod:`attnlab.train.atomic`).
    """
    st = safetensors_module()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    nonneg_int(step, "step")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise TypeError(f"extra: expected a dict, got {type(extra).__name__}")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra: must be JSON-serialisable ({e})") from None

    model_tensors, aliases = _model_tensors(model)
    meta: dict = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "extra": extra_json,
        "model": {"file": MODEL_FILE, "aliases": aliases},
        "optimizer": None,
        "rng": {"torch_cpu": RNG_KEY},
    }
    opt_tensors: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        sd = optimizer.state_dict()
        nontensor: dict = {}
        for i, state in sd["state"].items():
            for k, v in state.items():
                if torch.is_tensor(v):
                    opt_tensors[f"state.{i}.{k}"] = v
                else:
                    nontensor.setdefault(str(i), {})[k] = to_json(v, f"optimizer state {i}.{k}")
        groups = []
        for g, group in enumerate(sd["param_groups"]):
            enc = {}
            for k, v in group.items():
                if torch.is_tensor(v):
                    opt_tensors[f"param_groups.{g}.{k}"] = v
                    enc[k] = {"__tensor__": f"param_groups.{g}.{k}"}
                else:
                    enc[k] = to_json(v, f"optimizer param_groups[{g}].{k}")
            groups.append(enc)
        meta["optimizer"] = {
            "file": OPTIMIZER_FILE,
            "class": type(optimizer).__name__,
            "param_groups": groups,
            "state": nontensor,
            "param_names": _param_names(model, optimizer),
        }
    meta_bytes = json.dumps(meta, indent=1, sort_keys=True).encode()
    rng = torch.get_rng_state()

    path = Path(path_dir)
    recover(path, TRAINER_JSON)
    if path.exists() and not path.is_dir():
        raise ValueError(f"path_dir: {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not (path / TRAINER_JSON).is_file():
        raise ValueError(f"path_dir: {path} is a non-empty folder that is not a checkpoint; refusing to replace it")

    def write(tmp: Path) -> None:
        write_tensors(st, tmp / MODEL_FILE, model_tensors, {ALIAS_KEY: json.dumps(aliases, sort_keys=True)})
        if optimizer is not None:
            write_tensors(st, tmp / OPTIMIZER_FILE, opt_tensors)
        write_tensors(st, tmp / TRAINER_FILE, {RNG_KEY: rng}, {JSON_CRC_KEY: str(zlib.crc32(meta_bytes))})
        write_bytes(tmp / TRAINER_JSON, meta_bytes)  # last: the marker of a complete folder

    return replace_folder(path, write, marker=TRAINER_JSON)


# -- trainer.json ------------------------------------------------------------------


def _read_meta(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """trainer.json (checked against its CRC-32 and :func:`check_meta`) and the tensors
    of trainer.safetensors."""
    p = path / TRAINER_JSON
    if not p.is_file():
        raise CheckpointError(f"{path}: no {TRAINER_JSON}; not an attnlab training checkpoint")
    raw = p.read_bytes()
    tensors, tmeta = read_tensors(path / TRAINER_FILE)
    crc = tmeta.get(JSON_CRC_KEY)
    if crc is not None and (not crc.isdigit() or int(crc) != zlib.crc32(raw)):
        raise CheckpointError(
            f"{p}: fails its CRC-32 check (recorded in {TRAINER_FILE}; the file is corrupted or was edited)"
        )
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None
    meta = check_meta(p, meta)
    if crc is None and meta["version"] >= 2:
        raise CheckpointError(
            f"{path / TRAINER_FILE}: metadata {JSON_CRC_KEY!r} (the CRC-32 of {TRAINER_JSON}) is missing"
        )
    unknown = sorted(set(tensors) - {RNG_KEY})
    if unknown:
        raise CheckpointError(f"{path / TRAINER_FILE}: unexpected tensor {unknown[0]!r} (expected only {RNG_KEY!r})")
    return meta, tensors


def _check_rng(path: Path, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    where = path / TRAINER_FILE
    rng = tensors.get(RNG_KEY)
    if rng is None:
        raise CheckpointError(f"{where}: no tensor {RNG_KEY!r} (the RNG state)")
    want = torch.get_rng_state()
    if rng.dtype != torch.uint8 or rng.dim() != 1 or rng.numel() != want.numel():
        raise CheckpointError(
            f"{where}: tensor {RNG_KEY!r} is {rng.dtype} of shape {tuple(rng.shape)}, expected "
            f"uint8 of shape {tuple(want.shape)} (torch's CPU generator state)"
        )
    try:
        torch.Generator().set_state(rng)
    except RuntimeError as e:
        raise CheckpointError(f"{where}: tensor {RNG_KEY!r} is not a valid CPU generator state ({e})") from None
    return rng


# -- loading -----------------------------------------------------------------------


def _check_copy(name: str, src: torch.Tensor, dst: torch.Tensor, where: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(
            f"{where}: tensor {name!r} has shape {tuple(src.shape)} in the checkpoint, expected {tuple(dst.shape)}"
        )
    if src.dtype != dst.dtype and not (src.dtype.is_floating_point and dst.dtype.is_floating_point):
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {src.dtype} in the checkpoint, expected {dst.dtype}")


def _plan_model(path: Path, model: nn.Module, meta: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate the model file against ``model``; return (destination, source) pairs."""
    where = str(path / MODEL_FILE)
    tensors, fmeta = read_tensors(path / MODEL_FILE)
    try:
        aliases = json.loads(fmeta.get(ALIAS_KEY, "{}"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: metadata {ALIAS_KEY!r} is not valid JSON ({e})") from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CheckpointError(f"{where}: metadata {ALIAS_KEY!r} must be an object of str -> str")
    if aliases != meta["model"]["aliases"]:
        raise CheckpointError(
            f"{path}: {TRAINER_JSON} field 'model.aliases' {meta['model']['aliases']} differs from "
            f"{MODEL_FILE}'s metadata {aliases}"
        )
    expected = model.state_dict()
    missing = [n for n in expected if n not in tensors and aliases.get(n) not in tensors]
    if missing:
        raise CheckpointError(
            f"{where}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else "")
        )
    unexpected = [n for n in tensors if n not in expected]
    if unexpected:
        raise CheckpointError(
            f"{where}: unexpected tensor {unexpected[0]!r} (the model has no such entry)"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    source_of: dict[tuple, tuple[str, str]] = {}
    for n, dst in expected.items():
        src_name = n if n in tensors else aliases[n]
        _check_copy(n, tensors[src_name], dst, where)
        key = _storage_key(dst)
        if key is not None:
            other = source_of.setdefault(key, (n, src_name))
            if other[1] != src_name and not torch.equal(tensors[other[1]], tensors[src_name]):
                raise CheckpointError(
                    f"{where}: tensors {other[0]!r} and {n!r} are tied in the model but differ in the checkpoint"
                )
        pairs.append((dst, tensors[src_name]))
    return pairs


def _plan_optimizer(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> dict:
    """Validate the optimizer part; return the state_dict to load."""
    where = str(path / OPTIMIZER_FILE)
    om = meta["optimizer"]
    if om is None:
        raise CheckpointError(
            f"{path}: the checkpoint has no optimizer state, but an optimizer was given "
            "(pass optimizer=None to load the model only)"
        )
    if om["class"] != type(optimizer).__name__:
        raise CheckpointError(
            f"{path}: optimizer class is {om['class']!r} in the checkpoint, got a {type(optimizer).__name__}"
        )
    tensors, _ = read_tensors(path / OPTIMIZER_FILE)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = _param_names(model, optimizer)
    saved_names = om["param_names"]
    if len(saved_names) != len(names):
        raise CheckpointError(
            f"{path}: {TRAINER_JSON} field 'optimizer.param_names' lists {len(saved_names)} "
            f"parameters, the optimizer has {len(names)}"
        )
    for i, (a, b) in enumerate(zip(saved_names, names, strict=True)):
        if a != b:
            raise CheckpointError(f"{path}: optimizer parameter {i} is {b!r} in the model but {a!r} in the checkpoint")
    state: dict[int, dict] = {}
    used: set[str] = set()
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] == "param_groups":
            continue
        if len(parts) != 3 or parts[0] != "state" or not re.fullmatch(r"0|[1-9][0-9]*", parts[1]):
            raise CheckpointError(f"{where}: unexpected tensor {name!r} (expected state.<index>.<key>)")
        i = int(parts[1])
        if i >= len(params):
            raise CheckpointError(f"{where}: tensor {name!r} refers to parameter {i}, the optimizer has {len(params)}")
        p = params[i]
        if t.dim() > 0 and tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} ({names[i]}) has shape {tuple(t.shape)} in the "
                f"checkpoint, the parameter has {tuple(p.shape)}"
            )
        state.setdefault(i, {})[parts[2]] = t
        used.add(name)
    for i, kv in om["state"].items():
        if int(i) >= len(params):
            raise CheckpointError(
                f"{path}: optimizer non-tensor state for parameter {i!r} out of range (the optimizer has {len(params)})"
            )
        dup = sorted(set(kv) & set(state.get(int(i), {})))
        if dup:
            raise CheckpointError(f"{path}: optimizer state {i}.{dup[0]} is both a tensor and a {TRAINER_JSON} value")
        state.setdefault(int(i), {}).update(from_json(kv))
    out_groups = []
    for sg in om["param_groups"]:
        dg = {}
        for k, v in sg.items():
            if isinstance(v, dict) and set(v) == {"__tensor__"}:
                if v["__tensor__"] not in tensors:
                    raise CheckpointError(f"{where}: missing tensor {v['__tensor__']!r}")
                dg[k] = tensors[v["__tensor__"]]
                used.add(v["__tensor__"])
            else:
                dg[k] = from_json(v)
        out_groups.append(dg)
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"{where}: unexpected tensor {unused[0]!r} (no param group refers to it)")
    sd = {"state": state, "param_groups": out_groups}
    check_optimizer_state(optimizer, sd, names, str(path))
    return sd


@dataclass
class PendingLoad:
    """A checkpoint read and checked against a model (and optimizer) by
    :func:`prepare_load`; nothing is modified until :meth:`apply`."""

    info: CheckpointInfo
    model: nn.Module = field(repr=False)
    optimizer: torch.optim.Optimizer | None = field(repr=False)
    _pairs: list = field(repr=False)
    _opt_sd: dict | None = field(repr=False)

    def apply(self, *, restore_rng: bool = False) -> CheckpointInfo:
        """Copy the weights into the model, load the optimizer state, and with
        ``restore_rng=True`` set torch's CPU RNG state; return the :class:`CheckpointInfo`."""
        opt = self.optimizer  # prepare_load plans an optimizer state exactly when given one
        before = None
        if opt is not None and self._opt_sd is not None:
            before = opt.state_dict()
            opt.load_state_dict(self._opt_sd)
        try:
            with torch.no_grad():
                for dst, src in self._pairs:
                    dst.copy_(src)
        except BaseException:
            if opt is not None and before is not None:  # keep the optimizer consistent with the model
                opt.load_state_dict(before)
            raise
        if restore_rng:
            torch.set_rng_state(self.info.rng_state)
        return self.info


def prepare_load(path_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> PendingLoad:
    """Read and check a checkpoint written by :func:`save_checkpoint` against ``model``
    (and ``optimizer``) without modifying either; ``.apply()`` then restores them.

    Checked: every field of trainer.json (types and ranges, no unknown field) and its
    CRC-32; the tensors' CRC-32s; missing or unexpected tensors, shapes, dtypes (floating
    casts are allowed) and ties of the weights; the optimizer's class, param groups,
    parameter ids, the model name of each index, hyperparameters, and every
    per-parameter state entry (:func:`attnlab.train.optim_state.check_optimizer_state`);
    the RNG state's dtype, size and validity.  Any problem raises ``CheckpointError``
    (a ``ValueError``) naming the file and the field or tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    safetensors_module()
    path = recover(Path(path_dir), TRAINER_JSON)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    meta, trainer_tensors = _read_meta(path)
    rng = _check_rng(path, trainer_tensors)
    pairs = _plan_model(path, model, meta)
    opt_sd = _plan_optimizer(path, model, optimizer, meta) if optimizer is not None else None
    info = CheckpointInfo(path=path, step=meta["step"], extra=meta["extra"], rng_state=rng, meta=meta)
    return PendingLoad(info, model, optimizer, pairs, opt_sd)


def load_checkpoint(
    path_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = False
) -> CheckpointInfo:
    """Restore ``model`` (and ``optimizer``) from a folder written by :func:`save_checkpoint`.

    Everything is read and checked first (:func:`prepare_load` says what); any problem
    raises ``CheckpointError`` (a ``ValueError``) naming the field or tensor, and then
    neither the model nor the optimizer has been modified.  Tied parameters stay tied
    (values are copied into the existing tensors).  ``restore_rng=True`` also calls
    ``torch.set_rng_state`` with the saved state; it is returned either way.
    """
    return prepare_load(path_dir, model, optimizer).apply(restore_rng=restore_rng)


def _saved_step(d: Path) -> int | None:
    try:
        step = json.loads((d / TRAINER_JSON).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if is_nonneg_int(step) else None


def latest_checkpoint(root) -> Path | None:
    """The checkpoint folder under ``root`` with the highest step (``trainer.json``'s
    ``step``), or ``root`` itself if it is a checkpoint; ``None`` if there is none.

    A save interrupted while switching folders is undone first (see
    :mod:`attnlab.train.atomic`), so a checkpoint that existed is always found."""
    root = Path(root)
    found = recover(root, TRAINER_JSON)
    if (found / TRAINER_JSON).is_file():
        return root if found == root else found
    best, best_step = None, -1
    if root.is_dir():
        candidates = []
        for d in sorted(root.iterdir()):
            m = re.fullmatch(r"\.(.+)\.old", d.name)
            if m and not os.path.lexists(root / m.group(1)):
                candidates.append(recover(root / m.group(1), TRAINER_JSON))
            elif not d.name.startswith("."):
                candidates.append(d)
        for d in candidates:
            step = _saved_step(d) if (d / TRAINER_JSON).is_file() else None
            if step is not None and step > best_step:
                best, best_step = d, step
    return best
