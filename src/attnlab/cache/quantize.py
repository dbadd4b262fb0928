"""The codecs of the quantized KV cache (:mod:`attnlab.cache.quantized`): asymmetric min/max
quantization to int8/int4/int2 codes and their bit packing.

A group of values ``x`` (reduced over one axis) is stored as codes ``c`` in ``[0, Q]``,
``Q = 2**bits - 1``, with a ``scale`` and a ``zero`` (the group's minimum) kept in
``scale_dtype``::

    zero  = round_down(min x)                 # to scale_dtype, toward -inf
    scale = round_up((max x - zero) / Q)      # to scale_dtype, toward +inf
    c     = clamp(round((x - zero) / scale), 0, Q)     # round half to even (torch.round)
    x̂     = c · scale + zero

The directed rounding of ``zero`` and ``scale`` keeps every ``(x - zero) / scale`` inside
``[0, Q]``, so no code is ever clamped and every element satisfies
``|x - x̂| <= scale / 2`` (up to the rounding of the arithmetic itself), even when the
scale is stored in float16 and the group sits far from zero.  A constant group has
``scale = 0`` and decodes exactly to ``zero`` (= its value when representable).

The arithmetic runs in float32 (float64 for float64 input).

Packing: ``bits = 4`` puts 2 codes in a byte, ``bits = 2`` puts 4, element ``i`` of a
byte in bits ``[bits·i, bits·(i+1))``; the last axis is padded with zero codes to a
whole byte and the padding is dropped on unpacking.  ``bits = 8`` stores the codes as
they are.

>>> import torch
>>> c = torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8)
>>> p = pack(c, 2); p.shape, bool(torch.equal(unpack(p, 2, 5), c))
(torch.Size([1, 2]), True)
"""

from __future__ import annotations

import torch

BITS = (8, 4, 2)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take along the packed axis."""
    per = 8 // bits
    return -(-n // per)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``(..., n)`` (each ``< 2**bits``) -> uint8 ``(..., ceil(n·bits/8))``."""
    if bits == 8:
        return codes
    per = 8 // bits
    n = codes.shape[-1]
    pad = -n % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    c = codes.reshape(*codes.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``(..., m)`` -> codes ``(..., n)``."""
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    c = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    c = c.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    return c[..., :n] if c.shape[-1] != n else c


def _round_directed(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` rounded to ``dtype`` toward +inf (``up``) or -inf."""
    y = x.to(dtype)
    back = y.to(x.dtype)
    wrong = back < x if up else back > x
    if bool(wrong.any()):
        target = torch.full_like(y, float("inf") if up else float("-inf"))
        y = torch.where(wrong, torch.nextafter(y, target), y)
    return y


def quantize(x: torch.Tensor, dim: int, bits: int, scale_dtype: torch.dtype):
    """Quantize ``x`` in groups reduced over ``dim``.

    Returns ``codes`` (uint8, the shape of ``x``, not packed), ``scale`` and ``zero``
    (``scale_dtype``, ``dim`` kept with size 1).  Raises ``ValueError`` when the scale or
    zero do not fit ``scale_dtype`` (float16 tops out at 65504).
    """
    cdt = compute_dtype(x.dtype)
    xc = x.to(cdt)
    Q = (1 << bits) - 1
    mn = xc.amin(dim, keepdim=True)
    mx = xc.amax(dim, keepdim=True)
    zero = _round_directed(mn, scale_dtype, up=False)
    scale = _round_directed((mx - zero.to(cdt)) / Q, scale_dtype, up=True)
    if not (bool(torch.isfinite(zero).all()) and bool(torch.isfinite(scale).all())):
        raise ValueError(
            f"QuantizedCache: a group's min/max ({float(mn.min())}, {float(mx.max())}) does not fit "
            f"scale_dtype={scale_dtype} (or the input is not finite); use scale_dtype=torch.float32"
        )
    s = scale.to(cdt)
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.round((xc - zero.to(cdt)) / s).clamp_(0, Q).to(torch.uint8)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes · scale + zero`` (broadcast), computed in float32 (float64) and cast to ``dtype``."""
    cdt = compute_dtype(dtype)
    return (codes.to(cdt) * scale.to(cdt) + zero.to(cdt)).to(dtype)
