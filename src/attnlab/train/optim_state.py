"""Checking a saved optimizer state against the optimizer that will receive it.

``torch.optim.Optimizer.load_state_dict`` checks little: a state whose parameter ids do
not match is kept under ids no parameter has (the optimizer then starts from nothing), a
0-d ``exp_avg`` or a missing ``exp_avg_sq`` loads and crashes at the next ``step()``, and
a string learning rate waits for the first update.  :func:`check_optimizer_state`
refuses all of these up front, with a :class:`~attnlab.models.checkpoint.CheckpointError`
naming the field.

What each parameter's state must hold is asked of the optimizer class itself: a shadow
optimizer of the same class, built with the *saved* hyperparameters (so the class's own
range checks run: ``lr >= 0``, ``0 <= beta < 1`` ...), takes one step on a one-element
dummy parameter of the same rank, dtype and device.  Each of its state entries is then
either a 0-d tensor (``step``), a tensor shaped like the parameter (``exp_avg``), or a
plain value; a saved state must have exactly those keys, kinds and shapes.  Optimizers
whose ``step`` needs a closure (LBFGS) fall back to the shape rule alone (a tensor with
``dim > 0`` has the parameter's shape).

>>> import torch
>>> p = torch.nn.Parameter(torch.zeros(3))
>>> opt = torch.optim.AdamW([p])
>>> sd = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.tensor(0.0), "exp_avg_sq": torch.zeros(3)}},
...       "param_groups": opt.state_dict()["param_groups"]}
>>> check_optimizer_state(opt, sd, ["w"], "ck")
Traceback (most recent call last):
...
attnlab.models.checkpoint.CheckpointError: ck: optimizer state of parameter 0 (w): 'exp_avg' is a 0-d tensor, expected a tensor of the parameter's shape (3,)
"""

from __future__ import annotations

import inspect
import math
import numbers

import torch

from attnlab.models.checkpoint import CheckpointError

__all__ = ["check_optimizer_state"]

_SCALAR, _PARAM = "a 0-d tensor", "a tensor of the parameter's shape"


def _kind(v) -> str:
    if torch.is_tensor(v):
        return f"a {v.dim()}-d {v.dtype} tensor"
    return f"a {type(v).__name__} ({v!r})" if not isinstance(v, (list, tuple, dict)) else f"a {type(v).__name__}"


def _check_hyper(saved, current, where: str) -> None:
    """``saved`` must be the same kind of value as the optimizer's ``current`` one."""
    if isinstance(current, bool):
        ok = isinstance(saved, bool)
        want = "a bool"
    elif current is None:
        ok = saved is None or isinstance(saved, (bool, numbers.Real, str))
        want = "None or a scalar"
    elif torch.is_tensor(current) or isinstance(current, numbers.Real):
        if torch.is_tensor(saved):
            ok = saved.numel() == 1 or (torch.is_tensor(current) and saved.shape == current.shape)
            ok = ok and bool(torch.isfinite(saved.detach().float()).all())
        else:
            ok = isinstance(saved, numbers.Real) and not isinstance(saved, bool) and math.isfinite(saved)
        want = "a finite number"
    elif isinstance(current, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(current):
            raise CheckpointError(
                f"{where}: is {_kind(saved)} in the checkpoint, expected a sequence of {len(current)} like {current!r}"
            )
        for i, (s, c) in enumerate(zip(saved, current, strict=True)):
            _check_hyper(s, c, f"{where}[{i}]")
        return
    else:
        ok, want = type(saved) is type(current), f"a {type(current).__name__}"
    if not ok:
        raise CheckpointError(f"{where}: is {_kind(saved)} in the checkpoint, expected {want}")


def _ctor_kwargs(cls, hyper: dict) -> dict:
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return {}
    names = {n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in hyper.items() if k in names - {"self", "params"}}


def _schema(optimizer, hyper: dict, param: torch.Tensor, where: str) -> dict | None:
    """``{key: _SCALAR | _PARAM | type}`` of one parameter's state, from a shadow step;
    ``None`` when the class cannot be stepped that way."""
    cls = type(optimizer)
    dummy = torch.zeros((1,) * param.dim(), dtype=param.dtype, device=param.device, requires_grad=True)
    try:
        shadow = cls([{"params": [dummy], **hyper}], **_ctor_kwargs(cls, hyper))
    except ValueError as e:  # the class's own range checks on the saved hyperparameters
        raise CheckpointError(f"{where}: {cls.__name__} refuses the checkpoint's hyperparameters ({e})") from None
    except Exception:  # noqa: BLE001 - a constructor this generic call does not fit
        return None
    dummy.grad = torch.zeros_like(dummy)
    try:
        shadow.step()
    except Exception:  # noqa: BLE001 - e.g. LBFGS needs a closure
        return None
    out: dict[str, tuple] = {}
    for k, v in shadow.state.get(dummy, {}).items():
        if torch.is_tensor(v):
            out[k] = (_SCALAR if v.dim() == 0 and param.dim() > 0 else _PARAM, v.dtype)
        else:
            out[k] = (type(v), None)
    return out


def _dtype_ok(saved: torch.dtype, want: torch.dtype) -> bool:
    # torch casts floating state to the parameter's dtype; other dtypes must match.
    return saved == want or (saved.is_floating_point and want.is_floating_point)


def _check_entry(key, v, spec, p: torch.Tensor, where: str) -> None:
    kind, dtype = spec
    if kind in (_SCALAR, _PARAM):
        if not torch.is_tensor(v):
            raise CheckpointError(f"{where}: {key!r} is {_kind(v)}, expected {kind}")
        if kind == _PARAM and tuple(v.shape) != tuple(p.shape):
            got = "a 0-d tensor" if v.dim() == 0 else f"shape {tuple(v.shape)}"
            raise CheckpointError(f"{where}: {key!r} is {got}, expected {kind} {tuple(p.shape)}")
        if kind == _SCALAR and v.dim() != 0:
            raise CheckpointError(f"{where}: {key!r} has shape {tuple(v.shape)}, expected {kind}")
        if not _dtype_ok(v.dtype, dtype):
            raise CheckpointError(f"{where}: {key!r} has dtype {v.dtype}, expected {dtype}")
        return
    if torch.is_tensor(v):
        raise CheckpointError(f"{where}: {key!r} is {_kind(v)}, expected a {kind.__name__}")
    numeric = issubclass(kind, numbers.Real) and not issubclass(kind, bool)
    if not (isinstance(v, kind) or (numeric and isinstance(v, numbers.Real) and not isinstance(v, bool))):
        raise CheckpointError(f"{where}: {key!r} is {_kind(v)}, expected a {kind.__name__}")


def check_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict, names: list[str], where: str) -> None:
    """Raise ``CheckpointError`` unless ``optimizer.load_state_dict(sd)`` would give a
    state the next ``step()`` can use.  ``sd`` is ``{"state": {id: {key: value}},
    "param_groups": [...]}`` as torch writes it; ``names[i]`` names parameter ``i`` in
    the messages.

    Checked: the number of groups, each group's parameter ids (those of the optimizer,
    in order), each group's hyperparameter keys (exactly the optimizer's) and kinds (bool,
    finite number, sequence length ...), the class's own range checks, and for every
    parameter that has state: every key present and none unknown, tensors 0-d or of the
    parameter's shape as the class needs them, dtypes, and plain values' types."""
    current = optimizer.state_dict()["param_groups"]
    groups = sd["param_groups"]
    if len(groups) != len(current):
        raise CheckpointError(f"{where}: the optimizer has {len(current)} param groups, the checkpoint {len(groups)}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group_of: dict[int, int] = {}
    for g, (sg, cg) in enumerate(zip(groups, current, strict=True)):
        gw = f"{where}: optimizer param_groups[{g}]"
        if list(sg.get("params", ())) != list(cg["params"]):
            ids = sg.get("params")
            raise CheckpointError(
                f"{gw}.params is {ids if isinstance(ids, list) and len(ids) < 9 else _kind(ids)} "
                f"in the checkpoint, the optimizer's are {cg['params'][:8]}"
                f"{'...' if len(cg['params']) > 8 else ''} ({len(cg['params'])} parameters)"
            )
        for i in cg["params"]:
            group_of[i] = g
        missing = sorted(set(cg) - set(sg))
        unknown = sorted(set(sg) - set(cg))
        if missing or unknown:
            what = f"lacks {missing}" if missing else f"has unknown keys {unknown}"
            raise CheckpointError(f"{gw} {what} (the optimizer's keys: {sorted(k for k in cg if k != 'params')})")
        for k in cg:
            if k not in ("params", "param_names"):
                _check_hyper(sg[k], cg[k], f"{gw}.{k}")
    schemas: dict[tuple, dict | None] = {}
    for i in sorted(sd["state"]):
        state = sd["state"][i]
        if not isinstance(i, int) or i not in group_of:
            raise CheckpointError(
                f"{where}: optimizer state for parameter {i!r}, the optimizer has ids 0..{len(params) - 1}"
            )
        p, g = params[i], group_of[i]
        pw = f"{where}: optimizer state of parameter {i} ({names[i]})"
        key = (g, p.dim(), p.dtype, p.device)
        if key not in schemas:
            hyper = {k: v for k, v in groups[g].items() if k not in ("params", "param_names")}
            schemas[key] = _schema(optimizer, hyper, p, f"{where}: optimizer param_groups[{g}]")
        schema = schemas[key]
        if schema is None:
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                    raise CheckpointError(f"{pw}: {k!r} has shape {tuple(v.shape)}, the parameter {tuple(p.shape)}")
            continue
        missing = sorted(set(schema) - set(state))
        unknown = sorted(set(state) - set(schema))
        if missing:
            raise CheckpointError(f"{pw}: missing {missing} ({type(optimizer).__name__} keeps {sorted(schema)})")
        if unknown:
            raise CheckpointError(f"{pw}: unknown keys {unknown} ({type(optimizer).__name__} keeps {sorted(schema)})")
        for k, v in state.items():
            _check_entry(k, v, schema[k], p, pw)
