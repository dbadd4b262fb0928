"""The cache interface: what a KV cache promises the attention module.

A cache holds, for each of ``n_layers`` layers, the keys and values of the tokens seen
so far.  The attention module of layer ``i`` calls::

    kv = cache.update(i, k_new, v_new)      # k_new (B, Hkv, n, D), v_new (B, Hkv, n, Dv)
    out = kv.attend(q, mask=..., score_mod=..., scale=..., backend=...)

``update`` stores the new keys/values (after RoPE, unless ``cache.rotates_keys``) and
returns a :class:`KV` *view*: dense caches hand back tensors (no copy), paged and
quantized caches hand back an object whose ``attend`` reads their blocks directly.
Positions are absolute, as everywhere in attnlab: the view's ``q_offset`` is the
position of the first new query and ``kv_offset`` that of its first key, in the
coordinates the masks see.

Model code indexes a cache per layer (``cache[i]``, a :class:`LayerCache` with
``seen`` and ``update(k, v)``), which is what :class:`attnlab.nn.MultiHeadAttention`
reads.

Lifecycle: ``length`` (tokens held per sequence), ``seen`` (absolute position of the
next token; differs from ``length`` once a cache evicts), ``reset()``, ``fork()`` (an
independent copy that shares what it can), ``free()``.
"""

from __future__ import annotations

import torch

from attnlab.ops.dispatch import attention, attention_probs
from attnlab.validate import ArgumentTypeError, int_in, integer

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def float_dtype(dtype, where: str) -> torch.dtype:
    """``dtype`` when it is a floating torch dtype a cache can hold."""
    if dtype not in _FLOATS:
        raise ArgumentTypeError(f"{where}: dtype must be one of {_FLOATS}, got {dtype!r}")
    return dtype


def check_write(where: str, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, device) -> None:
    """A write must not change what it stores: ``k``/``v`` have the cache's dtype and device.

    A cast on write could lose precision or range silently (float64 or float32 ``1e6``
    into float16 is ``inf``), so every cache refuses any dtype that differs from the
    one it holds (what :class:`PagedCache` always did) instead of casting; the caller
    casts, or builds the cache with the model's dtype."""
    if k.dtype != dtype or v.dtype != dtype:
        raise TypeError(
            f"{where}: layer {layer}: k/v dtypes {k.dtype}/{v.dtype} differ from the cache's {dtype}; a "
            "cast on write could lose precision or range (1e6 in float16 is inf), so none is made: "
            f"cast k and v to {dtype}, or build the cache with dtype={k.dtype}"
        )
    if device is not None and (k.device != torch.device(device) or v.device != torch.device(device)):
        raise ValueError(f"{where}: layer {layer}: k/v on {k.device}/{v.device}, the cache on {device}")


class KV:
    """One layer's keys and values as the attention reads them after an update."""

    q_offset: int | None = None  # absolute position of the first new query (None: the op's default)
    q_positions = None  # RoPE positions for the queries, when the cache rotates keys itself

    def attend(self, q, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False):
        raise NotImplementedError

    def dense(self) -> DenseKV:
        """The same keys and values as dense tensors (for patterns and checks)."""
        raise NotImplementedError


class DenseKV(KV):
    """Dense ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)``; key ``j`` at ``kv_offset + j``."""

    def __init__(self, k, v, kv_offset: int = 0, q_offset: int | None = None, q_positions=None):
        self.k, self.v, self.kv_offset, self.q_offset, self.q_positions = k, v, kv_offset, q_offset, q_positions

    def attend(self, q, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False):
        return attention(
            q,
            self.k,
            self.v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
            return_lse=return_lse,
            backend=backend,
        )

    def probs(self, q, *, mask=None, score_mod=None, scale=None):
        return attention_probs(
            q, self.k, mask=mask, score_mod=score_mod, scale=scale, q_offset=self.q_offset, kv_offset=self.kv_offset
        )

    def dense(self):
        return self


class Cache:
    """Base class: subclasses implement :meth:`update`, :attr:`length`, :meth:`seen_at`."""

    rotates_keys = False  # True: keys are stored before RoPE and rotated at read (StreamingCache)

    def __init__(self, n_layers: int):
        self.n_layers = integer(n_layers, "n_layers", lo=1)

    # -- the interface ------------------------------------------------------------
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        raise NotImplementedError

    def seen_at(self, layer: int):
        """Absolute position of the next token of ``layer`` (int, or ``(B,)`` for ragged caches)."""
        raise NotImplementedError

    @property
    def seen(self):
        return self.seen_at(0)

    @property
    def length(self) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def fork(self) -> Cache:
        raise NotImplementedError

    def free(self) -> None:
        self.reset()

    # -- per-layer access for model code -----------------------------------------------
    def __len__(self) -> int:
        return self.n_layers

    def __getitem__(self, layer: int) -> LayerCache:
        if not -self.n_layers <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range for a cache of {self.n_layers} layers")
        return LayerCache(self, layer % self.n_layers)

    def _check_layer(self, layer, k, v):
        int_in(layer, "layer", 0, self.n_layers)
        if (
            not isinstance(k, torch.Tensor)
            or not isinstance(v, torch.Tensor)
            or k.dim() != 4
            or v.dim() != 4
            or k.shape[:3] != v.shape[:3]
        ):
            raise ValueError(
                f"update: expected k (B, Hkv, n, D) and v (B, Hkv, n, Dv), got "
                f"{tuple(getattr(k, 'shape', ()))}, {tuple(getattr(v, 'shape', ()))}"
            )

    def _check_continues(self, layer, k, v, K):
        """Caches that concatenate: a later write keeps the first write's dtype and device
        (``torch.cat`` would promote the whole cache instead)."""
        if K is not None:
            check_write(type(self).__name__ + ".update", layer, k, v, K.dtype, K.device)


class LayerCache:
    """``cache[i]``: the view of one layer that :class:`~attnlab.nn.MultiHeadAttention` uses."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache: Cache, layer: int):
        self.cache, self.layer = cache, layer

    @property
    def seen(self):
        return self.cache.seen_at(self.layer)

    @property
    def rotates_keys(self) -> bool:
        return self.cache.rotates_keys

    def update(self, k, v) -> KV:
        return self.cache.update(self.layer, k, v)
