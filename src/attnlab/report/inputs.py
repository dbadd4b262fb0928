"""What the report takes straight from :mod:`attnlab.interp`: captures, activation caches,
batched patterns, head scores and patching results, without reshaping by hand.

:func:`as_patterns` turns any of these into ``[L, H, Nq, Nk]`` (a list of per-layer
``[H, Nq, Nk]``) for one sequence of the batch:

===============================================  =====================================
input                                            layout
===============================================  =====================================
``Capture`` (``with capture(model) as cap``)     ``cap.patterns()``: ``(L, B, H, N, N)``
an activation cache (``run_with_cache``)         every ``blocks.{l}.attn.hook_pattern``
                                                 ``(B, H, Nq, Nk)`` it holds, by layer
a 5-D tensor / array                             ``(L, B, H, Nq, Nk)``
a list of 4-D tensors                            per layer ``(B, H, Nq, Nk)``
a 4-D / 3-D / 2-D tensor, a list of 3-D          ``[L, H, Nq, Nk]`` / ``[H, ...]`` / ``[Nq, Nk]``
                                                 / per layer ``[H, Nq, Nk]`` (as before)
===============================================  =====================================

``batch`` picks the sequence wherever there is a batch axis; with ``batch=None`` a batch
of one is taken and a larger batch is refused (naming ``batch=``) rather than silently
showing row 0.  A bare 4-D tensor is read as ``[L, H, Nq, Nk]``: pass one layer's
``(B, H, Nq, Nk)`` as ``[p]`` (a list) to have ``batch`` applied.

:func:`as_scores` reads a ``[layer, head]`` table from a tensor, a
:class:`~attnlab.interp.detectors.HeadScores` (``.scores``) or a result with named axes
(``.values`` and ``.axes``, e.g. patching results).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from attnlab.report._util import to_numpy

__all__ = ["as_patterns", "as_scores"]

_PATTERN = re.compile(r"^blocks\.(\d+)\.attn\.hook_pattern$")


def _pick(x, batch, what):
    """One sequence of a batched ``(B, ...)`` array."""
    B = x.shape[0]
    if batch is None:
        if B != 1:
            raise ValueError(
                f"batch: {what} holds a batch of {B} sequences; pass batch= (an int in [-{B}, {B})) "
                "to choose the one to show"
            )
        return x[0]
    if isinstance(batch, bool) or not isinstance(batch, int) or not -B <= batch < B:
        raise ValueError(f"batch: expected an int in [-{B}, {B}) for {what} with B={B}, got {batch!r}")
    return x[batch]


def _cache_patterns(cache):
    """Per-layer ``(B, H, Nq, Nk)`` from an activation cache, or None if it is not one."""
    keys = getattr(cache, "keys", None)
    if not callable(keys) or isinstance(cache, (torch.Tensor, np.ndarray, list, tuple)):
        return None
    found = sorted((int(m.group(1)), k) for k in keys() if isinstance(k, str) and (m := _PATTERN.match(k)))
    if not found:
        raise ValueError(
            "patterns: the activation cache holds no blocks.{l}.attn.hook_pattern; run "
            "run_with_cache with names_filter including the patterns"
        )
    return [cache[k] for _, k in found]


def as_patterns(patterns, batch: int | None = None):
    """``patterns`` in a form :func:`attnlab.report.heatmap.normalize_patterns` reads
    (``[L, H, Nq, Nk]`` or a list of per-layer ``[H, Nq, Nk]``); see the module docstring."""
    if hasattr(patterns, "patterns") and callable(patterns.patterns) and hasattr(patterns, "layers"):
        patterns = patterns.patterns()  # a Capture: (L, B, H, N, N)
    per_layer = _cache_patterns(patterns)
    if per_layer is not None:
        return [_pick(p, batch, "the cache's patterns") for p in per_layer]
    if (
        isinstance(patterns, (list, tuple))
        and patterns
        and hasattr(patterns[0], "shape")
        and len(patterns[0].shape) == 4
    ):
        return [_pick(p, batch, f"patterns[{i}]") for i, p in enumerate(patterns)]
    if hasattr(patterns, "shape") and len(patterns.shape) == 5:
        return _pick(
            patterns.transpose(0, 1) if isinstance(patterns, torch.Tensor) else np.swapaxes(np.asarray(patterns), 0, 1),
            batch,
            "patterns (L, B, H, Nq, Nk)",
        )
    if batch is not None:
        shape = tuple(getattr(patterns, "shape", ()))
        raise ValueError(
            f"batch: patterns of shape {shape} have no batch axis (a 4-D tensor is [L, H, Nq, Nk]); "
            "pass (L, B, H, Nq, Nk), a list of per-layer (B, H, Nq, Nk), a Capture or a cache"
        )
    return patterns


def as_scores(scores):
    """A ``[layer, head]`` array from a tensor/array, a ``HeadScores`` or a named-axes result."""
    if hasattr(scores, "values") and hasattr(scores, "axes") and not isinstance(scores, dict):
        axes = tuple(scores.axes)
        if len(axes) != 2:
            raise ValueError(
                f"scores: a result with axes {axes} is not a 2-D [layer, head] table; select one "
                "index of the other axes first"
            )
        return to_numpy(scores.values, "scores")
    if hasattr(scores, "scores") and hasattr(scores, "layers"):
        return to_numpy(scores.scores, "scores")
    return scores
