"""The tensors requiring grad that a score mod reads, so the tiled backwards can return their gradients.

The flash backward differentiates the score mod tile by tile inside an
``autograd.Function``; a tensor the mod reads reaches autograd only if it is one of the
Function's inputs.  A mod declares its learnable tensors with ``parameters()``
(:mod:`attnlab.scores`), but a plain callable captures them: a closure cell, a bound
method's ``self``, an ``nn.Module``'s parameters and buffers, a ``functools.partial``'s
arguments, a default argument, a module-level global.  :func:`score_mod_params` finds
them all and keeps those the mod's output really depends on:

1. *discover*: walk the mod (recursively, a few levels deep) through those routes and
   collect every tensor with ``requires_grad``;
2. *probe* (only when the walk found candidates): call the mod once on a 1×1 score
   under autograd and keep the candidates its output depends on (declared ones always);
   a leaf tensor the walk missed (it appears in the probe's graph) is added;
3. *check*: the flash forward runs the mod on its first tile under autograd and refuses,
   with a ``ValueError`` that says to pass ``scores.custom(fn, params=[...])``, a mod
   whose graph reaches a tensor requiring grad that is not routed (a non-leaf computed
   outside the mod that the walk did not find, or a leaf it missed).

Only run when gradients are wanted (``torch.is_grad_enabled()``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch

_DEPTH = 4  # containers/closures followed this many levels deep


def _discover(mod) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(t):
        if t.requires_grad and not any(t is x for x in found):
            found.append(t)

    def visit(o, d):
        if d < 0 or id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool, types.ModuleType)):
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            add(o)
            return
        if isinstance(o, torch.nn.Module):
            for t in o.parameters():
                add(t)
            for b in o.buffers():
                add(b)
        if isinstance(o, (list, tuple, set, frozenset)):
            for x in o:
                visit(x, d - 1)
            return
        if isinstance(o, dict):
            for x in o.values():
                visit(x, d - 1)
            return
        if isinstance(o, functools.partial):
            visit(o.func, d - 1)
            visit(o.args, d - 1)
            visit(o.keywords, d - 1)
            return
        if inspect.ismethod(o):
            visit(o.__self__, d - 1)
            visit(o.__func__, d - 1)
            return
        if isinstance(o, types.FunctionType):
            for cell in o.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(cell.cell_contents, d - 1)
            visit(o.__defaults__, d - 1)
            visit(o.__kwdefaults__, d - 1)
            g = o.__globals__
            for name in _global_names(o.__code__):
                if name in g:
                    visit(g[name], d - 1)
            return
        if callable(getattr(o, "parameters", None)) and not isinstance(o, torch.nn.Module):
            with contextlib.suppress(TypeError):
                visit(list(o.parameters()), d - 1)  # an attnlab ScoreMod
        if hasattr(o, "__dict__") and not isinstance(o, type):
            visit(vars(o), d - 1)

    visit(mod, _DEPTH)
    return found


def _declared(mod) -> list[torch.Tensor]:
    """What the mod lists itself (``parameters()`` of an attnlab ScoreMod or an nn.Module):
    kept whatever the probe shows, as before discovery existed."""
    f = getattr(mod, "parameters", None)
    if not callable(f):
        return []
    try:
        return [t for t in f() if isinstance(t, torch.Tensor) and t.requires_grad]
    except TypeError:
        return []


def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def _seq(node) -> int | None:
    f = getattr(node, "_sequence_nr", None)
    return f() if callable(f) else None


def _marker(device) -> int | None:
    """The autograd sequence number now: nodes with a smaller one existed before."""
    return _seq((torch.zeros((), device=device, requires_grad=True) * 1).grad_fn)


def _walk(out, known: list[torch.Tensor], input_leaf, before):
    """The leaves requiring grad that ``out`` depends on beyond ``known``/``input_leaf``,
    and whether its graph reaches a pre-existing non-leaf that is not in ``known``."""
    stops = {id(t.grad_fn) for t in known if t.grad_fn is not None}
    leaves = {id(t) for t in known if t.grad_fn is None} | {id(input_leaf)}
    new, foreign = [], False
    todo, visited = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in visited or id(node) in stops:
            continue
        visited.add(id(node))
        var = getattr(node, "variable", None)
        if var is not None:  # AccumulateGrad: a leaf tensor
            if id(var) not in leaves:
                new.append(var)
                leaves.add(id(var))
            continue
        s = _seq(node)
        if before is not None and s is not None and s < before:
            foreign = True
            continue
        todo.extend(n for n, _ in node.next_functions)
    return new, foreign


def _refusal(score_mod) -> ValueError:
    return ValueError(
        f"score_mod {score_mod!r}: it reads a tensor that requires grad which attnlab cannot route to the tiled "
        "backward (computed outside the mod and not reachable from it); pass it explicitly with "
        "scores.custom(fn, params=[tensor, ...])"
    )


def score_mod_params(score_mod, *, dtype, device, q_offset: int = 0, kv_offset: int = 0) -> list[torch.Tensor]:
    """The tensors requiring grad that ``score_mod`` reads (each once), declared or captured.

    ``dtype``/``device``: those of the score tiles the mod will see.  When the walk finds
    candidates, one probe call on a 1×1 score keeps those the output depends on (and adds
    leaves it reaches); a mod with none is not called.  Raises ``ValueError`` when the
    mod reads a tensor requiring grad that cannot be routed (see module doc)."""
    cands = _discover(score_mod)
    if not cands:
        return []
    declared = _declared(score_mod)
    x = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device, requires_grad=True)
    z = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    before = _marker(device)
    try:
        with torch.enable_grad():
            out = score_mod(x.clone(), z, z, z + q_offset, z + kv_offset)
    except Exception:  # noqa: BLE001 - a user's mod may raise anything; the kernels will report it
        return cands
    if not isinstance(out, torch.Tensor) or not out.requires_grad or out.grad_fn is None:
        return cands
    used = torch.autograd.grad(out.sum(), cands, allow_unused=True, retain_graph=True)
    keep = [t for t, g in zip(cands, used, strict=True) if g is not None or any(t is d for d in declared)]
    new, foreign = _walk(out, keep, x, before)
    if foreign:
        raise _refusal(score_mod)
    return keep + new


def check_tile_graph(score_mod, mod_out, leaf, params, before) -> None:
    """Raise ``ValueError`` when a score mod's output on a tile depends on a tensor requiring
    grad that is not among ``params`` (its gradient would be lost).  ``before``:
    :func:`_marker` taken just before the mod ran."""
    if mod_out.grad_fn is None:
        return
    new, foreign = _walk(mod_out, list(params), leaf, before)
    if new or foreign:
        raise _refusal(score_mod)


marker = _marker
