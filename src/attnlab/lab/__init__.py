"""Experiments a learner can run: induction heads forming, attention sinks, associative
recall, Hopfield capacity, the linear-attention crossover, and the seeds' claims.

Expensive runs are cached under :func:`cache_dir` so the claims and the report reuse them.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """Folder for cached lab runs: ``$ATTNLAB_CACHE`` or ``./out/lab-cache`` (created)."""
    root = Path(os.environ.get("ATTNLAB_CACHE") or Path("out") / "lab-cache")
    d = root.joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    return d
