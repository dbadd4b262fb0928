"""Attention dropout with a counter-based RNG: the keep-mask is a pure function of
``(seed, b, h, q_pos, kv_pos)``.

``attention(..., dropout_p=p)`` drops attention *probabilities* after the softmax and
rescales the survivors by ``1/(1 − p)`` (inverted dropout, as ``torch.nn.Dropout``,
SDPA and flash-attn do)::

    P   = softmax(scale·QKᵀ + score_mod, masked)        (the LSE is of these, undropped)
    Z   = keep(seed, b, h, q_pos, kv_pos)                bool, P(keep) = 1 − p
    out = (P ∘ Z / (1 − p)) V

No random state is stored and nothing is drawn per element: each element's bit comes
from hashing its counter, so every tile of every kernel (any tile size, forward or
backward) regenerates exactly the same mask, and the reference, the flash path and
the Triton kernels agree bit for bit on ``Z``.

The hash (32-bit words held in int64 tensors so that it runs as plain tensor ops on any
device; murmur3's ``fmix32`` finalizer as the mixing step)::

    absorb(s, v) = fmix32(((s ^ (v mod 2^32)) + 0x9E3779B9) mod 2^32)
    key_r = absorb(absorb(0x243F6A88, seed mod 2^32), seed >> 32 mod 2^32)
    key_c = absorb(key_r, 0x85A308D3)
    row   = absorb(absorb(absorb(key_r, b), h), q_pos)        (B, H, n, 1): cheap
    col   = absorb(key_c, kv_pos)                             (1, 1, 1, m): cheap
    u     = fmix32((fmix32(row ^ col) + col) mod 2^32)         two rounds per element
    keep  = u >= round(p · 2^32)

``q_pos``/``kv_pos`` are the absolute positions the masks see (``q_offset + i``,
``kv_offset + j``), so a shard of the keys (a ring step, a KV-cache chunk) gets the
same bits as the whole problem.  ``b`` and ``h`` are the batch and *query*-head indices.

Where the seed comes from: ``dropout_seed=`` (an int, or a ``torch.Generator`` to draw
it from); by default one int64 is drawn from torch's default CPU generator
(:func:`draw_seed`), so ``torch.manual_seed(s)`` makes a run reproducible, and each call
draws a fresh seed (as ``F.dropout`` would advance the generator).

>>> import torch, attnlab
>>> from attnlab.ops import dropout_mask
>>> q = k = v = torch.randn(1, 2, 5, 8, dtype=torch.float64)
>>> out = attnlab.attention(q, k, v, dropout_p=0.5, dropout_seed=7, backend="flash")
>>> z = dropout_mask(1, 2, 5, 5, p=0.5, seed=7)                  # the mask that call used
>>> p = attnlab.attention_probs(q, k)
>>> bool(torch.allclose(out, (p * z / 0.5) @ v))
True
"""

from __future__ import annotations

import numbers

import torch

from attnlab.validate import probability, rng_seed

M32 = 0xFFFFFFFF
_GOLD = 0x9E3779B9
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32
_ROW0, _COL0 = 0x243F6A88, 0x85A308D3  # digits of pi: distinct starting states


def fmix32(x):
    """murmur3's 32-bit finalizer on ints in ``[0, 2^32)`` (a Python int or an int64 tensor):
    a bijection with full avalanche.  The int64 products wrap; their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * _C1) & M32
    x = x ^ (x >> 13)
    x = (x * _C2) & M32
    return x ^ (x >> 16)


def absorb(s, v):
    """Mix the 32-bit word ``v`` (taken mod 2^32, so negative positions are fine) into state ``s``."""
    return fmix32(((s ^ (v & M32)) + _GOLD) & M32)


class Dropout:
    """A dropout draw: probability ``p`` and ``seed``; the keep-mask of any tile on demand.

    Kernels hold one of these (``None`` when ``p == 0``) and call :meth:`scale_tile` for
    each tile they visit, forward and backward."""

    def __init__(self, p: float, seed):
        self.p = float(p)
        # an int, or (under torch.compile, drawn in the graph) a 0-d int64 tensor: the same
        # 64 bits in two's complement, so ``s & M32`` and ``(s >> 32) & M32`` agree
        self.seed = seed if isinstance(seed, torch.Tensor) else int(seed)
        self.threshold = min(M32, round(self.p * 2.0**32))
        self.inv_keep = 1.0 / (1.0 - self.p)
        s = self.seed if isinstance(seed, torch.Tensor) else self.seed & ((1 << 64) - 1)
        self.key_r = absorb(absorb(_ROW0, s & M32), (s >> 32) & M32)
        self.key_c = absorb(self.key_r, _COL0)

    def keep(self, b, h, q_pos, kv_pos) -> torch.Tensor:
        """The bool keep-mask at broadcastable int64 grids ``(b, h, q_pos, kv_pos)``."""
        row = absorb(absorb(absorb(self.key_r, b), h), q_pos)
        col = absorb(self.key_c, kv_pos)
        u = fmix32((fmix32(row ^ col) + col) & M32)
        return u >= self.threshold

    def scale_tile(self, B, H, q_pos, kv_pos, dtype) -> torch.Tensor:
        """``Z / (1 − p)`` for one tile as ``(B, H, n, m)`` in ``dtype``: ``q_pos (n,)`` and
        ``kv_pos (m,)`` are the tile's absolute positions (int64)."""
        dev = q_pos.device
        b = torch.arange(B, device=dev).view(B, 1, 1, 1)
        h = torch.arange(H, device=dev).view(1, H, 1, 1)
        z = self.keep(b, h, q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))
        return z.to(dtype).mul_(self.inv_keep)

    def __repr__(self):
        return f"Dropout(p={self.p}, seed={self.seed})"


def draw_seed(generator=None) -> int:
    """One int64 seed drawn from ``generator`` (default: torch's default CPU generator, so
    ``torch.manual_seed`` makes it reproducible).  CPU: no device synchronisation."""
    return int(draw_seed_tensor(generator))


def draw_seed_tensor(generator=None) -> torch.Tensor:
    """The draw of :func:`draw_seed` as a 0-d int64 tensor: what compiled code uses (a
    traced op, where ``int()`` of it would graph-break).  Under ``backend="aot_eager"`` it is
    the same value as the eager draw; inductor draws with its own RNG (seeded from torch's
    generator, so ``torch.manual_seed`` still makes runs reproducible, with other values)."""
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, generator=generator)


def check_dropout(dropout_p, dropout_seed):
    """Validate ``dropout_p``/``dropout_seed`` at the public boundary; returns ``(p, seed_arg)``."""
    p = probability(dropout_p, "dropout_p", hint="p = 1 would drop everything and divide by 0")
    if dropout_seed is not None and not isinstance(dropout_seed, torch.Generator):
        if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, numbers.Integral):
            raise TypeError(
                f"dropout_seed: expected None, an int or a torch.Generator, got {type(dropout_seed).__name__}"
            )
        rng_seed(dropout_seed, "dropout_seed")
    return p, dropout_seed


def make_dropout(p: float, seed_arg) -> Dropout | None:
    """The draw for one call: ``None`` when ``p == 0`` (the no-dropout path, exactly)."""
    if p == 0.0:
        return None
    if seed_arg is None and torch.compiler.is_compiling():
        return Dropout(p, draw_seed_tensor())  # no graph break: the seed stays a tensor
    if seed_arg is None or isinstance(seed_arg, torch.Generator):
        seed_arg = draw_seed(seed_arg)
    return Dropout(p, seed_arg)


def dropout_mask(B, H, Nq, Nk, *, p, seed, q_offset=None, kv_offset=0, device=None) -> torch.Tensor:
    """The bool keep-mask ``(B, H, Nq, Nk)`` (True = kept) that :func:`attnlab.attention`
    applies with ``dropout_p=p, dropout_seed=seed`` and the same positions
    (``q_offset`` defaults to ``kv_offset + Nk − Nq``, as in ``attention``)."""
    p, _ = check_dropout(p, seed)
    if seed is None or isinstance(seed, torch.Generator):
        raise TypeError("dropout_mask: seed must be an int (the one given to attention's dropout_seed=)")
    q_offset = kv_offset + Nk - Nq if q_offset is None else q_offset
    d = Dropout(p, seed)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    qp = (torch.arange(Nq, device=device) + q_offset).view(1, 1, Nq, 1)
    kp = (torch.arange(Nk, device=device) + kv_offset).view(1, 1, 1, Nk)
    return torch.broadcast_to(d.keep(b, h, qp, kp), (B, H, Nq, Nk))


__all__ = ["Dropout", "check_dropout", "draw_seed", "draw_seed_tensor", "dropout_mask", "fmix32", "make_dropout"]
