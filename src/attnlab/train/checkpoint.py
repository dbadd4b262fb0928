"""Training checkpoints as safetensors plus JSON: no pickle anywhere.

A checkpoint is one folder::

    model.safetensors      model.state_dict(), each storage once: a tied alias such as
                           lm_head.weight (= embed.weight) is dropped and recorded in the
                           file's metadata ("attnlab.aliases"), and re-tied on load
    optimizer.safetensors  every tensor of optimizer.state_dict(), flattened:
                           "state.{i}.{key}" (i = the parameter's index, in param_groups
                           order; e.g. "state.3.exp_avg", "state.3.step") and
                           "param_groups.{g}.{key}" for a tensor-valued hyperparameter
    trainer.safetensors    trainer tensors: torch's CPU RNG state "rng.torch_cpu" (uint8)
    trainer.json           format, step, ``extra`` (the caller's JSON), the optimizer's class,
                           param_groups hyperparameters, non-tensor state, and the model name
                           of every optimizer index

Every safetensors file carries a CRC-32 of each tensor in its metadata
("attnlab.crc32"), so flipped bytes in the data are reported with the tensor's name.

The folder is written to a temporary sibling and renamed into place, so a crash
never leaves a half-written checkpoint under the final name (an existing checkpoint
of the same name is replaced).  :func:`load_checkpoint` reads and checks everything
(names, shapes, dtypes, checksums, optimizer layout) and raises
:class:`attnlab.models.checkpoint.CheckpointError` (a ``ValueError``) naming the
offending tensor *before* it copies anything.

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
import shutil
import tempfile
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from attnlab.models.checkpoint import CheckpointError

__all__ = ["CheckpointError", "CheckpointInfo", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "MODEL_FILE", "OPTIMIZER_FILE", "TRAINER_FILE", "TRAINER_JSON"]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_FILE = "trainer.safetensors"
TRAINER_JSON = "trainer.json"
FORMAT = "attnlab.train.checkpoint"
VERSION = 1
_CRC_KEY = "attnlab.crc32"
_ALIAS_KEY = "attnlab.aliases"
_RNG = "rng.torch_cpu"


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` returns besides the restored model and optimizer.

    ``rng_state`` is torch's CPU RNG state at save time (a uint8 tensor for
    ``torch.set_rng_state``); ``meta`` is the whole of ``trainer.json``."""
    path: Path
    step: int
    extra: dict
    rng_state: torch.Tensor | None
    meta: dict = field(repr=False)


# -- small helpers ------------------------------------------------------------------

def _st():
    try:
        import safetensors.torch as st
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("attnlab.train.checkpoint needs the 'safetensors' package: pip install safetensors") from e
    return st


def _crc(t: torch.Tensor) -> int:
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(b.numpy()) if b.numel() else 0


def _storage_key(t: torch.Tensor):
    ptr = t.untyped_storage().data_ptr()
    if t.numel() == 0 or ptr == 0:
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _write(st, path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """Save ``tensors`` (contiguous CPU copies where storages are shared) with checksums."""
    ptrs: dict[int, int] = {}
    for t in tensors.values():
        p = t.untyped_storage().data_ptr()
        ptrs[p] = ptrs.get(p, 0) + 1
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        if ptrs[t.untyped_storage().data_ptr()] > 1 or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)   # safetensors refuses shared storage
        out[name] = t
    meta = dict(metadata or {})
    meta["format"] = "pt"
    meta[_CRC_KEY] = json.dumps({n: _crc(t) for n, t in out.items()}, sort_keys=True)
    st.save_file(out, str(path), metadata=meta)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors and the metadata of one file; checksums verified.  Errors name the file
    (unreadable) or the tensor (checksum)."""
    from safetensors import safe_open
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            names = list(f.keys())
            tensors = {}
            for n in names:
                try:
                    tensors[n] = f.get_tensor(n)
                except Exception as e:  # noqa: BLE001 - safetensors raises several kinds
                    raise CheckpointError(f"{path}: tensor {n!r} cannot be read ({e})") from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...
        size = path.stat().st_size
        raise CheckpointError(f"{path} ({size} bytes): not a readable safetensors file, corrupt or truncated? "
                              f"({type(e).__name__}: {e})") from None
    crcs = meta.get(_CRC_KEY)
    if crcs is not None:
        try:
            crcs = json.loads(crcs)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: metadata {_CRC_KEY!r} is not valid JSON ({e})") from None
        for n, t in tensors.items():
            if n in crcs and _crc(t) != crcs[n]:
                raise CheckpointError(f"{path}: tensor {n!r} fails its CRC-32 check (the file is corrupted)")
    return tensors, meta


def _to_json(v, where: str):
    """JSON-safe encoding that keeps tuples (``{"__tuple__": [...]}``)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [_to_json(x, where) for x in v]}
    if isinstance(v, list):
        return [_to_json(x, where) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError(f"{where}: dict keys must be str to go into {TRAINER_JSON}")
        return {k: _to_json(x, f"{where}.{k}") for k, x in v.items()}
    raise TypeError(f"{where}: a {type(v).__name__} cannot be stored in {TRAINER_JSON} (tensors go into "
                    f"the safetensors files; other values must be JSON: None, bool, int, float, str, list, dict)")


def _from_json(v):
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(_from_json(x) for x in v["__tuple__"])
        return {k: _from_json(x) for k, x in v.items()}
    return v


def _param_names(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {}
    if model is not None:
        for n, p in model.named_parameters(remove_duplicate=True):
            names.setdefault(id(p), n)
    return [names.get(id(p), f"<param {i}>")
            for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])]


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State-dict tensors with each exact alias dropped, and ``{alias: kept name}``."""
    kept, aliases, first = {}, {}, {}
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

def save_checkpoint(path_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
                    extra: dict | None = None) -> Path:
    """Write a checkpoint folder at ``path_dir`` (atomically) and return its path.

    Args:
        path_dir: the folder to create (its parent is created if needed).  An existing
            folder is replaced only if it is a checkpoint (holds ``trainer.json``) or empty.
        model: its ``state_dict()`` goes to ``model.safetensors`` (tied aliases once).
        optimizer: ``None``, or any ``torch.optim`` optimizer over the model's parameters.
        step: number of completed optimizer steps (int >= 0).
        extra: JSON-serialisable dict kept in ``trainer.json`` (e.g. the train config,
            the data position).

    torch's CPU RNG state at the time of the call is saved too (``rng.torch_cpu``).
    """
    st = _st()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise TypeError(f"extra: expected a dict, got {type(extra).__name__}")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra: must be JSON-serialisable ({e})") from None

    model_tensors, aliases = _model_tensors(model)
    meta: dict = {"format": FORMAT, "version": VERSION, "step": step, "extra": extra_json,
                  "model": {"file": MODEL_FILE, "aliases": aliases}, "optimizer": None,
                  "rng": {"torch_cpu": _RNG}}
    opt_tensors: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        sd = optimizer.state_dict()
        nontensor: dict = {}
        for i, state in sd["state"].items():
            for k, v in state.items():
                if torch.is_tensor(v):
                    opt_tensors[f"state.{i}.{k}"] = v
                else:
                    nontensor.setdefault(str(i), {})[k] = _to_json(v, f"optimizer state {i}.{k}")
        groups = []
        for g, group in enumerate(sd["param_groups"]):
            enc = {}
            for k, v in group.items():
                if torch.is_tensor(v):
                    opt_tensors[f"param_groups.{g}.{k}"] = v
                    enc[k] = {"__tensor__": f"param_groups.{g}.{k}"}
                else:
                    enc[k] = _to_json(v, f"optimizer param_groups[{g}].{k}")
            groups.append(enc)
        meta["optimizer"] = {"file": OPTIMIZER_FILE, "class": type(optimizer).__name__, "param_groups": groups,
                             "state": nontensor, "param_names": _param_names(model, optimizer)}

    path = Path(path_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"path_dir: {path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not (path / TRAINER_JSON).is_file():
        raise ValueError(f"path_dir: {path} is a non-empty folder that is not a checkpoint; refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.chmod(tmp, 0o755)
        _write(st, tmp / MODEL_FILE, model_tensors, {_ALIAS_KEY: json.dumps(aliases, sort_keys=True)})
        if optimizer is not None:
            _write(st, tmp / OPTIMIZER_FILE, opt_tensors)
        _write(st, tmp / TRAINER_FILE, {_RNG: torch.get_rng_state()})
        (tmp / TRAINER_JSON).write_text(json.dumps(meta, indent=1, sort_keys=True))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _fsync_dir(d: Path) -> None:
    """Make the rename durable (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- loading -----------------------------------------------------------------------

def _read_meta(path: Path) -> dict:
    p = path / TRAINER_JSON
    if not p.is_file():
        raise CheckpointError(f"{path}: no {TRAINER_JSON}; not an attnlab training checkpoint")
    try:
        meta = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{p}: format is {meta.get('format') if isinstance(meta, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{p}: version {meta.get('version')!r} is not supported (expected {VERSION})")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{p}: step must be an int >= 0, got {step!r}")
    return meta


def _check_copy(name: str, src: torch.Tensor, dst: torch.Tensor, where: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(src.shape)} in the checkpoint, "
                              f"expected {tuple(dst.shape)}")
    if src.dtype != dst.dtype and not (src.dtype.is_floating_point and dst.dtype.is_floating_point):
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {src.dtype} in the checkpoint, expected {dst.dtype}")


def _plan_model(path: Path, model: nn.Module, meta: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate the model file against ``model``; return (destination, source) pairs."""
    where = str(path / MODEL_FILE)
    tensors, fmeta = _read(path / MODEL_FILE)
    try:
        aliases = json.loads(fmeta.get(_ALIAS_KEY, "{}"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: metadata {_ALIAS_KEY!r} is not valid JSON ({e})") from None
    expected = model.state_dict()
    missing = [n for n in expected if n not in tensors and aliases.get(n) not in tensors]
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r}" +
                              (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else ""))
    unexpected = [n for n in tensors if n not in expected]
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} (the model has no such entry)" +
                              (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    pairs, source_of = [], {}
    for n, dst in expected.items():
        src_name = n if n in tensors else aliases[n]
        _check_copy(n, tensors[src_name], dst, where)
        key = _storage_key(dst)
        if key is not None:
            other = source_of.setdefault(key, (n, src_name))
            if other[1] != src_name and not torch.equal(tensors[other[1]], tensors[src_name]):
                raise CheckpointError(f"{where}: tensors {other[0]!r} and {n!r} are tied in the model but differ "
                                      "in the checkpoint")
        pairs.append((dst, tensors[src_name]))
    return pairs


def _plan_optimizer(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> dict:
    """Validate the optimizer part; return the state_dict to load."""
    where = str(path / OPTIMIZER_FILE)
    om = meta.get("optimizer")
    if om is None:
        raise CheckpointError(f"{path}: the checkpoint has no optimizer state, but an optimizer was given "
                              "(pass optimizer=None to load the model only)")
    if om.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"{path}: optimizer class is {om.get('class')!r} in the checkpoint, "
                              f"got a {type(optimizer).__name__}")
    tensors, _ = _read(path / OPTIMIZER_FILE)
    current = optimizer.state_dict()
    groups = om.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(current["param_groups"]):
        raise CheckpointError(f"{path}: optimizer has {len(current['param_groups'])} param groups, the checkpoint "
                              f"{len(groups) if isinstance(groups, list) else groups!r}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = _param_names(model, optimizer)
    saved_names = om.get("param_names") or []
    for g, (sg, cg) in enumerate(zip(groups, current["param_groups"])):
        if len(sg.get("params", [])) != len(cg["params"]):
            raise CheckpointError(f"{path}: optimizer param group {g} holds {len(cg['params'])} parameters, "
                                  f"the checkpoint's {len(sg.get('params', []))}")
    for i, (a, b) in enumerate(zip(saved_names, names)):
        if a != b:
            raise CheckpointError(f"{path}: optimizer parameter {i} is {b!r} in the model but {a!r} in the checkpoint")
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] == "param_groups":
            continue
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise CheckpointError(f"{where}: unexpected tensor {name!r} (expected state.<index>.<key>)")
        i = int(parts[1])
        if i >= len(params):
            raise CheckpointError(f"{where}: tensor {name!r} refers to parameter {i}, the optimizer has {len(params)}")
        p = params[i]
        if t.dim() > 0 and tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{where}: tensor {name!r} ({names[i]}) has shape {tuple(t.shape)} in the "
                                  f"checkpoint, the parameter has {tuple(p.shape)}")
        state.setdefault(i, {})[parts[2]] = t
    for i, kv in (om.get("state") or {}).items():
        if not i.isdigit() or int(i) >= len(params):
            raise CheckpointError(f"{path}: optimizer non-tensor state for parameter {i!r} out of range")
        state.setdefault(int(i), {}).update(_from_json(kv))
    out_groups = []
    for g, sg in enumerate(groups):
        dg = {}
        for k, v in sg.items():
            if isinstance(v, dict) and set(v) == {"__tensor__"}:
                if v["__tensor__"] not in tensors:
                    raise CheckpointError(f"{where}: missing tensor {v['__tensor__']!r}")
                dg[k] = tensors[v["__tensor__"]]
            else:
                dg[k] = _from_json(v)
        out_groups.append(dg)
    return {"state": state, "param_groups": out_groups}


def load_checkpoint(path_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    restore_rng: bool = False) -> CheckpointInfo:
    """Restore ``model`` (and ``optimizer``) from a folder written by :func:`save_checkpoint`.

    Everything is read and checked first: missing or unexpected tensors, shapes, dtypes
    (floating casts are allowed), CRC-32 checksums, and the optimizer's layout (class,
    param groups, the model name of each parameter index, each state tensor's shape
    against its parameter).  Any problem raises ``CheckpointError`` (a ``ValueError``)
    naming the tensor, and nothing has been modified.  Tied parameters stay tied (values
    are copied into the existing tensors).  ``restore_rng=True`` also calls
    ``torch.set_rng_state`` with the saved state; it is returned either way.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected None or a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _st()
    path = Path(path_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    meta = _read_meta(path)
    pairs = _plan_model(path, model, meta)
    opt_sd = _plan_optimizer(path, model, optimizer, meta) if optimizer is not None else None
    rng = None
    if (path / TRAINER_FILE).is_file():
        tt, _ = _read(path / TRAINER_FILE)
        rng = tt.get(_RNG)
        if rng is not None and rng.dtype != torch.uint8:
            raise CheckpointError(f"{path / TRAINER_FILE}: tensor {_RNG!r} must be uint8, got {rng.dtype}")
    if restore_rng and rng is None:
        raise CheckpointError(f"{path}: no RNG state saved ({_RNG!r} in {TRAINER_FILE})")
    # -- everything checked: copy.
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    if opt_sd is not None:
        optimizer.load_state_dict(opt_sd)
    if restore_rng:
        torch.set_rng_state(rng)
    return CheckpointInfo(path=path, step=meta["step"], extra=meta.get("extra") or {}, rng_state=rng, meta=meta)


def latest_checkpoint(root) -> Path | None:
    """The checkpoint folder under ``root`` with the highest step (``trainer.json``'s
    ``step``), or ``root`` itself if it is a checkpoint; ``None`` if there is none."""
    root = Path(root)
    if (root / TRAINER_JSON).is_file():
        return root
    best, best_step = None, -1
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".") or not (d / TRAINER_JSON).is_file():
                continue
            try:
                step = json.loads((d / TRAINER_JSON).read_text()).get("step", -1)
            except (OSError, ValueError):
                continue
            if isinstance(step, int) and step > best_step:
                best, best_step = d, step
    return best
