"""Whether the Triton backend can serve a request, and why not (no triton import at module load).

The kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter: set
``TRITON_INTERPRET=1`` in the environment before attnlab's kernel modules are first
imported (``triton.jit`` reads it when a kernel is defined).  The interpreter is slow;
it is how CI tests the kernels.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from attnlab.ops.triton.config import MAX_HEAD_DIM
from attnlab.ops.triton.masking import POS_LIMIT
from attnlab.ops.triton.scoremods import lower_score_mod

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_AVAILABLE = None


def available() -> bool:
    """True when the ``triton`` package is installed (a regular package with ``triton.jit``).

    A directory named ``triton`` without ``__init__.py`` on ``sys.path`` (pytest puts
    ``tests/ops`` there) is a namespace package, not Triton; it is not imported."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            spec = importlib.util.find_spec("triton")
        except (ImportError, ValueError):
            spec = None
        ok = spec is not None and spec.origin not in (None, "namespace")
        if ok:
            try:
                import triton

                ok = hasattr(triton, "jit")
            except Exception:  # noqa: BLE001 - a broken install (any error) is "not available", with the reason below
                ok = False
        _AVAILABLE = ok
    return _AVAILABLE


def interpreting() -> bool:
    """True when attnlab's kernels were defined under ``TRITON_INTERPRET=1`` (they run on CPU).

    Imports the kernel modules (and so triton) on first call."""
    from attnlab.ops.triton import forward

    return type(forward.attn_fwd).__name__ == "InterpretedFunction"


def unsupported(q, k, v, mask, score_mod, q_offset, kv_offset, dropout=None) -> str | None:
    """``None`` if the Triton kernels can run this (already validated) request, else why not.

    (``dropout``, an :class:`attnlab.ops.dropout.Dropout`, runs on every request that does.)"""
    if not available():
        return "the triton package is not installed (pip install 'attnlab[triton]')"
    dev = q.device.type
    if dev == "cpu":
        if "attnlab.ops.triton.forward" not in sys.modules and not _env_interpret():
            return (
                "q is on the CPU: the Triton kernels need CUDA tensors, or the Triton interpreter "
                "(TRITON_INTERPRET=1 set before attnlab's triton kernels are first imported; slow, for tests)"
            )
        if not interpreting():
            return (
                "q is on the CPU but attnlab's triton kernels were compiled for the GPU "
                "(TRITON_INTERPRET was not set when they were first imported)"
            )
    elif dev != "cuda":
        return f"device {q.device} is not supported (CUDA, or CPU under TRITON_INTERPRET=1)"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16 or float32; backend='flash' runs float64)"
    D, Dv = q.shape[-1], v.shape[-1]
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} are supported, got D={D}, Dv={Dv}"
    Nq, Nk = q.shape[2], k.shape[2]
    if not (
        -POS_LIMIT <= q_offset
        and q_offset + Nq <= POS_LIMIT
        and -POS_LIMIT <= kv_offset
        and kv_offset + Nk <= POS_LIMIT
    ):
        return f"absolute positions must stay within ±2^30 (q_offset={q_offset}, kv_offset={kv_offset})"
    mod = lower_score_mod(score_mod)
    if isinstance(mod, str):
        return mod
    return None


def _env_interpret() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
