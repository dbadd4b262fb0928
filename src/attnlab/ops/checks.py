"""Argument checks shared by the functional ops beside ``attention()`` (linear, additive)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUT = {"q": "(B, H, Nq, D)", "k": "(B, Hkv, Nk, D)", "v": "(B, Hkv, Nk, Dv)"}


def check_qkv(q, k, v, layout: dict | None = None) -> None:
    """q, k, v are 4-D float tensors of one dtype on one device; errors name the argument."""
    layout = layout or LAYOUT
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims {layout[name]}, got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a float tensor (float16, bfloat16, float32 or float64), got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got q {q.device}, k {k.device}, v {v.device}")
