"""Position information.  So far: the ALiBi slopes (the rest of the position
encodings arrive with the modules issue).

>>> from attnlab.positions import alibi_slopes
>>> alibi_slopes(4).tolist()
[0.25, 0.0625, 0.015625, 0.00390625]
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al., 2022), float32 ``(n_heads,)``.

    For ``n`` a power of two: the geometric sequence ``2^(-8/n), 2^(-16/n), ..., 2^(-8)``.
    Otherwise, as in the paper's reference code: the slopes of the largest power of two
    ``p < n``, then every other slope of ``2p`` for the remaining ``n - p`` heads.
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"alibi_slopes(n_heads): expected an int >= 1, got {n_heads!r}")

    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        s = pow2(n_heads)
    else:
        p = 2 ** math.floor(math.log2(n_heads))
        s = pow2(p) + pow2(2 * p)[0::2][: n_heads - p]
    return torch.tensor(s, dtype=torch.float32)
