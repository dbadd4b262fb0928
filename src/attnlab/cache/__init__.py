"""KV caches (the per-layer protocol is in :mod:`attnlab.nn.attention`)."""

from attnlab.cache.dynamic import DynamicCache

__all__ = ["DynamicCache"]
