"""The simplest KV cache: keys and values appended as they come (grows without bound).

It implements the per-layer protocol :class:`attnlab.nn.MultiHeadAttention` reads::

    cache.seen           absolute position of the next new token
    cache.update(k, v)   -> (k_all, v_all, kv_offset)

>>> import torch
>>> from attnlab.cache import DynamicCache
>>> layers = DynamicCache.for_model(n_layers=2)
>>> k_all, v_all, off = layers[0].update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
>>> k_all.shape, off, layers[0].seen
(torch.Size([1, 2, 3, 8]), 0, 3)
"""

from __future__ import annotations

import torch


class DynamicCache:
    """One layer's keys ``(B, Hkv, seen, D)`` and values ``(B, Hkv, seen, Dv)``."""

    def __init__(self):
        self.k = self.v = None
        self.seen = 0

    @classmethod
    def for_model(cls, n_layers: int) -> list["DynamicCache"]:
        return [cls() for _ in range(n_layers)]

    def update(self, k: torch.Tensor, v: torch.Tensor):
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"update: expected k (B, Hkv, n, D) and v (B, Hkv, n, Dv), got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if self.k is None:
            self.k, self.v = k, v
        else:
            if k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3] or v.shape[3] != self.v.shape[3]:
                raise ValueError(f"update: new k {tuple(k.shape)} / v {tuple(v.shape)} do not continue the cached "
                                 f"k {tuple(self.k.shape)} / v {tuple(self.v.shape)}")
            self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        self.seen += k.shape[2]
        return self.k, self.v, 0

    def __repr__(self):
        return f"DynamicCache(seen={self.seen})"
