"""Input conversion shared by the report's parts: tensors, arrays and lists to numpy."""

from __future__ import annotations

import numbers

import numpy as np
import torch

__all__ = ["to_numpy", "to_float_array", "scalar"]


def to_numpy(x, name: str) -> np.ndarray:
    """A torch tensor (any device, any dtype), numpy array or (nested) list as numpy."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        return x.numpy()
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name}: could not read as an array ({e}); pass a tensor, an array or a rectangular list"
        ) from None


def to_float_array(x, name: str, ndim: int | tuple[int, ...]) -> np.ndarray:
    """``x`` as a float64 array with ``ndim`` dimensions, or a ValueError naming ``name``."""
    a = to_numpy(x, name)
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise ValueError(f"{name}: expected numbers, got an array of dtype {a.dtype}")
    if a.ndim not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name}: expected a {want} array, got shape {tuple(a.shape)}")
    return a.astype(np.float64)


def scalar(v):
    """Plain Python number for numpy/torch scalars; anything else unchanged."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"expected a scalar tensor in a table cell, got shape {tuple(v.shape)}")
        return v.item()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and v.ndim == 0:
        return v.item()
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    return v
