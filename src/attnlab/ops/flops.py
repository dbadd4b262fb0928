"""FLOP formulas of the flash custom ops (``attnlab::flash_fwd`` / ``flash_bwd``) for
``torch.utils.flop_counter``.

torch.utils.flop_counter.FlopCounterMode sees each operator as one call: without a
formula it counts 0.  The formulas are torch's own SDPA ones (forward: 2·B·H·Nq·Nk·(D+Dv);
backward, which recomputes the scores: 2·B·H·Nq·Nk·(3D+2Dv)) scaled by the fraction of the
Nq·Nk score elements the kernel computes: the area of the tiles it visits (partial tiles
count whole; every (batch, head) row of a visited tile is computed), from the same tile plan
the kernel runs.  On fake/meta tensors (no values to classify a mask) the count is the
dense one, as torch counts varlen on fake offsets.

torch.utils.flop_counter imports triton (seconds), so attnlab does not import it: the
formulas are registered when it is imported (now, if it already is; else by a one-shot
import hook), before any FlopCounterMode can copy the registry.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import torch

__all__ = ["install", "visited_fraction"]


def visited_fraction(q, k, mask_spec, mask_tensors, ints, scale, q_offset, kv_offset, block) -> float:
    """The fraction of the ``Nq·Nk`` score elements the flash kernel computes for this call
    (1.0 without a mask, or on fake tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    Nq, Nk = q.shape[2], k.shape[2]
    if not mask_spec or Nq == 0 or Nk == 0 or any(is_fake(t) or t.device.type == "meta" for t in (q, k, *mask_tensors)):
        return 1.0
    from attnlab.ops.library import op_problem  # imported here: library imports this module

    pb = op_problem(q, k, mask_spec, mask_tensors, ints, None, scale, q_offset, kv_offset, block, [])
    area = sum(
        (min(Nq, (i + 1) * pb.bq) - i * pb.bq) * (min(Nk, (j + 1) * pb.bk) - j * pb.bk)
        for i, row in enumerate(pb.plan)
        for j, _ in row
    )
    return area / (Nq * Nk)


def _register_flop_formulas(fc) -> None:
    """Register the formulas with the module ``torch.utils.flop_counter`` (``fc``)."""

    @fc.register_flop_formula(torch.ops.attnlab.flash_fwd, get_raw=True)
    def _flash_fwd_flops(
        q,
        k,
        v,
        mask_spec,
        mask_tensors,
        mod_spec,
        mod_tensors,
        ints,
        scale,
        q_offset,
        kv_offset,
        block,
        *rest,
        out_val=None,
        **kw,
    ) -> int:
        frac = visited_fraction(q, k, mask_spec, mask_tensors, ints, scale, q_offset, kv_offset, block)
        return round(fc.sdpa_flop_count(tuple(q.shape), tuple(k.shape), tuple(v.shape)) * frac)

    @fc.register_flop_formula(torch.ops.attnlab.flash_bwd, get_raw=True)
    def _flash_bwd_flops(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        mask_spec,
        mask_tensors,
        mod_spec,
        mod_tensors,
        ints,
        scale,
        q_offset,
        kv_offset,
        block,
        *rest,
        out_val=None,
        **kw,
    ) -> int:
        frac = visited_fraction(q, k, mask_spec, mask_tensors, ints, scale, q_offset, kv_offset, block)
        dense = fc.sdpa_backward_flop_count(tuple(dout.shape), tuple(q.shape), tuple(k.shape), tuple(v.shape))
        return round(dense * frac)


class _OnFlopCounterImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: once ``torch.utils.flop_counter`` has executed, register the
    formulas (then the hook removes itself)."""

    NAME = "torch.utils.flop_counter"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register_flop_formulas(module)

        setattr(spec.loader, "exec_module", exec_module)  # noqa: B010 - mypy refuses a method assignment
        return spec


def install() -> None:
    """Register the formulas now if ``torch.utils.flop_counter`` is imported, else when it is
    (one-shot import hook).  Called once, by :mod:`attnlab.ops.library` after it has
    registered the ops."""
    if _OnFlopCounterImport.NAME in sys.modules:
        _register_flop_formulas(sys.modules[_OnFlopCounterImport.NAME])
    else:
        sys.meta_path.insert(0, _OnFlopCounterImport())
