"""The simplest KV cache: keys and values appended as they come (grows without bound).

>>> import torch
>>> from attnlab.cache import DynamicCache
>>> cache = DynamicCache(n_layers=2)
>>> kv = cache.update(0, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
>>> kv.k.shape, kv.kv_offset, cache.seen_at(0), cache.seen_at(1)
(torch.Size([1, 2, 3, 8]), 0, 3, 0)
"""

from __future__ import annotations

import torch

from attnlab.cache.base import Cache, DenseKV


class DynamicCache(Cache):
    """Per layer, keys ``(B, Hkv, seen, D)`` and values ``(B, Hkv, seen, Dv)``, concatenated
    on every update (a copy per step: :class:`StaticCache` avoids it)."""

    def __init__(self, n_layers: int):
        super().__init__(n_layers)
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    @classmethod
    def for_model(cls, n_layers: int) -> DynamicCache:
        return cls(n_layers)

    def seen_at(self, layer):
        return 0 if self.k[layer] is None else self.k[layer].shape[2]

    @property
    def length(self) -> int:
        return self.seen_at(0)

    def update(self, layer, k, v):
        self._check_layer(layer, k, v)
        K, V = self.k[layer], self.v[layer]
        self._check_continues(layer, k, v, K)
        if K is None:
            K, V = k, v
        else:
            if k.shape[:2] != K.shape[:2] or k.shape[3] != K.shape[3] or v.shape[3] != V.shape[3]:
                raise ValueError(
                    f"update: new k {tuple(k.shape)} / v {tuple(v.shape)} do not continue the cached "
                    f"k {tuple(K.shape)} / v {tuple(V.shape)}"
                )
            K, V = torch.cat([K, k], 2), torch.cat([V, v], 2)
        self.k[layer], self.v[layer] = K, V
        return DenseKV(K, V, kv_offset=0, q_offset=K.shape[2] - k.shape[2])

    def retain(self, index: torch.Tensor) -> None:
        """Keep only the cached tokens at ``index`` (a 1-D LongTensor of slots, in order):
        how speculative decoding keeps the accepted branch of a verified token tree."""
        index = torch.as_tensor(index, dtype=torch.long)
        for i in range(self.n_layers):
            k, v = self.k[i], self.v[i]
            if k is not None and v is not None:
                self.k[i] = k.index_select(2, index.to(k.device))
                self.v[i] = v.index_select(2, index.to(v.device))

    def reset(self):
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers

    def fork(self):
        c = DynamicCache(self.n_layers)
        c.k, c.v = list(self.k), list(self.v)  # tensors are never written in place: sharing is safe
        return c

    def __repr__(self):
        return f"DynamicCache(layers={self.n_layers}, seen={self.seen})"
