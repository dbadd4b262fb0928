"""KV caches.  The interface is in :mod:`attnlab.cache.base`: ``update(layer, k, v) -> KV``
(a view the attention reads), ``seen``, ``length``, ``reset``, ``fork``, ``free``."""

from attnlab.cache.base import KV, Cache, DenseKV, LayerCache
from attnlab.cache.dynamic import DynamicCache
from attnlab.cache.h2o import H2OCache
from attnlab.cache.paged import CacheFullError, PagedCache, PagedKV, StaleViewError
from attnlab.cache.quantized import QuantizedCache, QuantizedKV
from attnlab.cache.static import StaticCache
from attnlab.cache.streaming import StreamingCache

__all__ = [
    "KV",
    "DenseKV",
    "Cache",
    "LayerCache",
    "DynamicCache",
    "StaticCache",
    "StreamingCache",
    "H2OCache",
    "QuantizedCache",
    "QuantizedKV",
    "PagedCache",
    "PagedKV",
    "CacheFullError",
    "StaleViewError",
]
