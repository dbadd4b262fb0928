"""A preallocated KV cache: one ``(B, Hkv, capacity, D)`` buffer per layer, written in place.

Writing past ``capacity`` raises (nothing is written), unless the cache was built with
``evict="window"``: then the oldest tokens are dropped and attention becomes a sliding
window of ``capacity`` keys (positions stay absolute: ``kv_offset`` moves).

>>> import torch
>>> from attnlab.cache import StaticCache
>>> cache = StaticCache(n_layers=1, batch_size=1, n_kv_heads=2, d_head=4, capacity=4)
>>> kv = cache.update(0, torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
>>> kv.k.shape, cache.seen
(torch.Size([1, 2, 3, 4]), 3)
>>> cache.update(0, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
Traceback (most recent call last):
...
ValueError: StaticCache: layer 0 holds 3 of 4 slots and 2 more were written; build it with a larger capacity or evict='window'
"""

from __future__ import annotations

import torch

from attnlab.cache.base import Cache, DenseKV, check_write, float_dtype
from attnlab.validate import integer

EVICT = (None, "window")


class StaticCache(Cache):
    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        d_head: int,
        capacity: int,
        *,
        d_v: int | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        evict: str | None = None,
    ):
        super().__init__(n_layers)
        for name, x in (
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("d_head", d_head),
            ("capacity", capacity),
        ):
            integer(x, f"StaticCache: {name}", lo=1)
        if evict not in EVICT:
            raise ValueError(f"StaticCache: evict must be one of {EVICT}, got {evict!r}")
        d_v = d_head if d_v is None else integer(d_v, "StaticCache: d_v", lo=1)
        float_dtype(dtype, "StaticCache")
        self.capacity, self.evict = capacity, evict
        shape = (batch_size, n_kv_heads, capacity)
        self.k = [torch.zeros(*shape, d_head, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(*shape, d_v, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = [0] * n_layers
        self.offsets = [0] * n_layers  # absolute position of slot 0

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int, *, dtype=None, evict=None) -> StaticCache:
        """A cache shaped for an :class:`attnlab.nn.Decoder`."""
        c = model.cfg
        p = next(model.parameters())
        return cls(
            c.n_layers,
            batch_size,
            c.n_kv_heads,
            c.d_head,
            capacity,
            dtype=dtype or p.dtype,
            device=p.device,
            evict=evict,
        )

    def seen_at(self, layer):
        return self.offsets[layer] + self.lengths[layer]

    @property
    def length(self) -> int:
        return self.lengths[0]

    def nbytes(self) -> int:
        """Bytes held by the buffers (allocated up front, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def update(self, layer, k, v):
        self._check_layer(layer, k, v)
        K, V = self.k[layer], self.v[layer]
        if k.shape[0] != K.shape[0] or k.shape[1] != K.shape[1] or k.shape[3] != K.shape[3] or v.shape[3] != V.shape[3]:
            raise ValueError(
                f"StaticCache.update: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit buffers of "
                f"(B, Hkv, capacity, D) = {tuple(K.shape)} / {tuple(V.shape)}"
            )
        check_write("StaticCache.update", layer, k, v, K.dtype, K.device)
        L, n = self.lengths[layer], k.shape[2]
        start = self.seen_at(layer)
        if L + n > self.capacity:
            if self.evict is None or n > self.capacity:
                raise ValueError(
                    f"StaticCache: layer {layer} holds {L} of {self.capacity} slots and {n} more were "
                    "written; build it with a larger capacity" + (" or evict='window'" if self.evict is None else "")
                )
            drop = L + n - self.capacity
            K[:, :, : L - drop] = K[:, :, drop:L].clone()
            V[:, :, : L - drop] = V[:, :, drop:L].clone()
            self.offsets[layer] += drop
            L -= drop
        K[:, :, L : L + n] = k
        V[:, :, L : L + n] = v
        self.lengths[layer] = L + n
        return DenseKV(K[:, :, : L + n], V[:, :, : L + n], kv_offset=self.offsets[layer], q_offset=start)

    def reset(self):
        self.lengths = [0] * self.n_layers
        self.offsets = [0] * self.n_layers

    def fork(self):
        c = StaticCache.__new__(StaticCache)
        Cache.__init__(c, self.n_layers)
        c.capacity, c.evict = self.capacity, self.evict
        c.k = [t.clone() for t in self.k]
        c.v = [t.clone() for t in self.v]
        c.lengths, c.offsets = list(self.lengths), list(self.offsets)
        return c

    def free(self):
        self.k = self.v = []
        self.lengths = self.offsets = [0] * self.n_layers

    def __repr__(self):
        return f"StaticCache(layers={self.n_layers}, length={self.length}/{self.capacity}, evict={self.evict!r})"
