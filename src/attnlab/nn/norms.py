"""Normalisation layers: LayerNorm (torch's) and RMSNorm.

``RMSNorm(x) = x / sqrt(mean(x²) + eps) · weight`` (Zhang & Sennrich, 2019), computed
in float32 and cast back, as Llama does.

>>> import torch
>>> from attnlab.nn import RMSNorm
>>> y = RMSNorm(4)(torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
>>> [round(v, 4) for v in y[0].tolist()]
[1.0, -1.0, 1.0, -1.0]
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.validate import choice, positive_float, positive_int

NORMS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = positive_float(eps, "eps")
        self.weight = nn.Parameter(torch.ones(positive_int(d_model, "d_model")))

    def forward(self, x):
        h = x if x.dtype == torch.float64 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, d_model: int, eps: float, bias: bool = True) -> nn.Module:
    """``"layernorm"`` (``bias`` toggles its shift) or ``"rmsnorm"``."""
    choice(kind, "norm", NORMS)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps)
    return nn.LayerNorm(d_model, eps=eps, bias=bias)
