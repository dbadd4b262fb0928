"""Measuring instruments the claims share: seeded RNG, FLOP counts, tensor memory.

Work is measured, never wall time: FLOPs with :class:`torch.utils.flop_counter.FlopCounterMode`
(exact integer counts of the matmuls; torch's CPU SDPA kernel is not counted, so
experiments that count FLOPs pick the ``reference`` or ``flash`` backend), and memory
as the peak bytes of live tensor storage allocated inside a block
(:class:`PeakTensorMemory`) or the bytes autograd saves for the backward
(:func:`saved_bytes`).  Both are deterministic, unlike the process's resident set.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode


@contextlib.contextmanager
def seeded(seed: int = 0):
    """Run a block with ``torch.manual_seed(seed)`` without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def flops(fn) -> int:
    """Matmul FLOPs of ``fn()`` (counted by torch's FlopCounterMode)."""
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storage created inside the block and alive at once.

    Every tensor an aten op returns is tracked by its storage; the storage counts until
    the last tracked tensor on it dies.  Inputs created before the block are not
    counted, so ``peak`` is the *extra* memory the block needed (outputs included
    while they live).  Deterministic; blind only to scratch memory a single kernel
    allocates and frees internally.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key):
        ent = self.live.get(key)
        if ent is not None:
            ent[1] -= 1
            if ent[1] == 0:
                del self.live[key]
                self.current -= ent[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                n = st.nbytes()
                if n == 0:
                    continue
                key = st.data_ptr()
                ent = self.live.get(key)
                if ent is None:
                    self.live[key] = ent = [n, 0]
                    self.current += n
                    self.peak = max(self.peak, self.current)
                ent[1] += 1
                weakref.finalize(t, self._release, key)
        return out


def peak_bytes(fn) -> int:
    """Peak extra tensor bytes of ``fn()`` under :class:`PeakTensorMemory` (no grad)."""
    with torch.no_grad(), PeakTensorMemory() as m:
        out = fn()
        del out
    return m.peak


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward during ``fn()``."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def growth_exponent(ns, ys) -> float:
    """Slope of log y against log n between the last two points (the asymptotic order)."""
    return math.log(ys[-1] / ys[-2]) / math.log(ns[-1] / ns[-2])


def second_difference(ys) -> list:
    """``y[i+2] - 2 y[i+1] + y[i]`` for equally spaced samples: 0 for an affine law."""
    return [ys[i + 2] - 2 * ys[i + 1] + ys[i] for i in range(len(ys) - 2)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())
