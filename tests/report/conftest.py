"""Shared pieces of the report tests: synthetic attention patterns and awkward tokens."""

from __future__ import annotations

import numpy as np
import pytest

# Tokens that must come out as text: markup, entities, quotes, emoji, CJK, whitespace.
EVIL = [
    "<script>alert(1)</script>",
    "&amp;",
    "&",
    '"dq"',
    "'sq'",
    "😀",
    "漢字",
    " the",
    "\n",
    "</textarea>",
    "<img src=x onerror=alert(2)>",
    "]]>",
    "<!--",
    "\u2028",
]


def synth_patterns(L: int, H: int, N: int, seed: int = 0, causal: bool = True) -> np.ndarray:
    """Softmax attention with realistic structure: a sink at key 0, previous-token,
    self or strided heads, and Gaussian noise on the logits (the hard part to compress)."""
    rng = np.random.default_rng(seed)
    out = np.empty((L, H, N, N), dtype=np.float32)
    i = np.arange(N)
    for l in range(L):
        for h in range(H):
            x = rng.standard_normal((N, N), dtype=np.float32)
            x[:, 0] += 4
            kind = (l * H + h) % 3
            if kind == 0:
                x[i[1:], i[:-1]] += 6
            elif kind == 1:
                x[i, i] += 3
            else:
                x[:, ::7] += 2
            if causal:
                x[i[None, :] > i[:, None]] = -np.inf
            x -= x.max(axis=1, keepdims=True)
            np.exp(x, out=x)
            x /= x.sum(axis=1, keepdims=True)
            out[l, h] = x
    return out


@pytest.fixture(scope="session")
def synth():
    return synth_patterns


@pytest.fixture(scope="session")
def evil_tokens():
    return list(EVIL)
