"""StreamingLLM's cache (Xiao et al., 2023): attention sinks plus a recent window.

The cache keeps the first ``sinks`` tokens and the last ``window`` tokens, so memory
is bounded, ``(sinks + window)`` slots per layer, however long the stream; a new
token attends the sinks, the window and itself.

**Positions are positions in the cache**, as the paper does ("if the cache holds
tokens [0, 1, 2, 3, 6, 7, 8] and decodes the 9th, the positions are 0..7"): RoPE
rotates by slot indices, never by the (unbounded) position in the stream — the
model never meets a distance longer than it was trained on.  To make that possible
the cache **stores keys before RoPE and rotates them at read** (``rotates_keys =
True``): after an eviction every window key moves one slot, and rotating at read
costs one elementwise pass over ``sinks + window`` keys per step — the same as
re-rotating on eviction (``R(p−1) = R(−1)·R(p)``) — but it is exact, whereas
re-rotating a stored key again and again accumulates rounding.  ALiBi models get
the same slot positions through ``q_offset``/``kv_offset``.

A chunk of ``n > 1`` new tokens (a prompt) is attended over the stored tokens plus the
chunk; each token sees exactly what it would see if fed one at a time, at the same
positions, as long as the chunk fits (``length + n <= sinks + window + 1``: then the
StreamingLLM pattern ``masks.sink_window(sinks, window + 1)`` in slot coordinates is
plain causal attention).  A longer chunk would need positions that differ per query,
so it is refused (``generate`` feeds long prompts a token at a time past that point).
Eviction happens after the chunk.

>>> import torch
>>> from attnlab.cache import StreamingCache
>>> c = StreamingCache(n_layers=1, sinks=2, window=4)
>>> for t in range(10):
...     _ = c.update(0, torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2))
>>> c.k[0][0, 0, :, 0].tolist(), c.seen, c.length      # tokens 0, 1 (sinks) and 6..9
([0.0, 1.0, 6.0, 7.0, 8.0, 9.0], 10, 6)
>>> c.update(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
Traceback (most recent call last):
...
ValueError: StreamingCache: 2 new tokens after 6 cached exceed sinks + window + 1 = 7 (a chunk must fit, or token i of it would need other positions); feed at most 1 now and the rest one at a time
"""

from __future__ import annotations

import torch

from attnlab.cache.base import Cache, DenseKV
from attnlab.validate import integer


class StreamingCache(Cache):
    """``sinks`` first tokens + ``window`` newest, per layer; keys stored unrotated.

    ``rope``: the model's :class:`attnlab.positions.RoPE` (``None`` for ALiBi or no
    positions).  ``for_model`` picks it from a :class:`attnlab.nn.Decoder`.
    """

    rotates_keys = True

    def __init__(self, n_layers: int, sinks: int, window: int, *, rope=None):
        super().__init__(n_layers)
        sinks = integer(sinks, "StreamingCache: sinks", lo=0)
        window = integer(window, "StreamingCache: window", lo=1)
        if rope is not None and not hasattr(rope, "cos_sin"):
            raise TypeError(f"StreamingCache: rope must be a positions.RoPE or None, got {type(rope).__name__}")
        self.sinks, self.window, self.rope = sinks, window, rope
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.total = [0] * n_layers  # tokens seen (the stream position)

    @classmethod
    def for_model(cls, model, sinks: int = 4, window: int = 256) -> StreamingCache:
        cfg = model.cfg
        if cfg.positions in ("learned", "sinusoidal"):
            raise ValueError(
                f"StreamingCache: a model with absolute {cfg.positions!r} positions cannot stream past "
                "its table; StreamingLLM needs relative positions (rope, alibi or none)"
            )
        rope = model.blocks[0].attn.positions if cfg.positions == "rope" else None
        return cls(cfg.n_layers, sinks, window, rope=rope)

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    def seen_at(self, layer):
        return self.total[layer]

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def update(self, layer, k, v):
        self._check_layer(layer, k, v)
        K, V = self.k[layer], self.v[layer]
        if K is not None and (k.shape[:2] != K.shape[:2] or k.shape[3] != K.shape[3] or v.shape[3] != V.shape[3]):
            raise ValueError(
                f"update: new k {tuple(k.shape)} / v {tuple(v.shape)} do not continue the cached "
                f"k {tuple(K.shape)} / v {tuple(V.shape)}"
            )
        self._check_continues(layer, k, v, K)
        L = 0 if K is None else K.shape[2]
        n = k.shape[2]
        if n > 1 and L + n > self.capacity + 1:
            raise ValueError(
                f"StreamingCache: {n} new tokens after {L} cached exceed sinks + window + 1 = "
                f"{self.capacity + 1} (a chunk must fit, or token i of it would need other "
                f"positions); feed at most {max(1, self.capacity + 1 - L)} now and the rest one at a time"
            )
        Kc = k if K is None else torch.cat([K, k], 2)
        Vc = v if V is None else torch.cat([V, v], 2)
        n_all = Kc.shape[2]
        Kr = Kc if self.rope is None else self.rope(Kc, 0)  # slot positions 0 .. n_all-1
        # Every query of a chunk that fits sees all the slots (the stored sinks and window
        # and the chunk before it): sink_window(sinks, window + 1) in slot coordinates
        # reduces to the caller's causal mask, so no extra mask is needed.
        view = DenseKV(Kr, Vc, kv_offset=0, q_offset=L, q_positions=torch.arange(L, n_all, device=Kc.device))
        if n_all > self.capacity:  # evict the middle: keep the sinks and the newest `window`
            keep = torch.cat([torch.arange(self.sinks), torch.arange(n_all - self.window, n_all)]).to(Kc.device)
            Kc, Vc = Kc.index_select(2, keep), Vc.index_select(2, keep)
        self.k[layer], self.v[layer] = Kc, Vc
        self.total[layer] += k.shape[2]
        return view

    def reset(self):
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.total = [0] * self.n_layers

    def fork(self):
        c = StreamingCache(self.n_layers, self.sinks, self.window, rope=self.rope)
        c.k, c.v, c.total = list(self.k), list(self.v), list(self.total)
        return c

    def __repr__(self):
        return f"StreamingCache(sinks={self.sinks}, window={self.window}, length={self.length}, seen={self.seen})"
