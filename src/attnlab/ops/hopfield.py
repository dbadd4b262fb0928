"""The modern (continuous) Hopfield network: attention as associative-memory retrieval.

Ramsauer et al. (2020), "Hopfield Networks is All You Need": with stored patterns
``X = (x_1 … x_N)`` and a state (probe) ``ξ``, the energy

    E(ξ) = −β⁻¹ log Σ_i exp(β x_iᵀ ξ) + ½ ξᵀξ + β⁻¹ log N + ½ M²,   M = max_i ‖x_i‖

is decreased by the update

    ξ_new = X softmax(β Xᵀ ξ).

The update is softmax attention: the probe is the query, the stored patterns are both
the keys and the values, and β is the softmax scale —

    hopfield_update(xi, X, beta) == attnlab.attention(xi[:, None], X[:, None], X[:, None],
                                                     scale=beta)[:, 0]

so one attention read is one step of energy-minimising retrieval towards the nearest
stored pattern.  The energy is ``−lse + ½|ξ|²`` (convex minus convex) and the update is
its concave-convex procedure step (``∇ ½|ξ_new|² = ∇ lse(ξ)``), so ``E`` never
increases along updates; the constants make ``E ≥ ½(‖ξ‖ − M)² ≥ 0``.

Shapes (rows are vectors; ``d`` is the pattern dimension)::

    patterns X (B, N, d)      N stored patterns per batch element
    xi         (B, M, d)      M states / probes updated independently
    result     (B, M, d)      dtype of xi; arithmetic in float32 (float64 for float64)
    energy     (B, M)

Both may also be 2-D, ``X (N, d)`` and ``xi (M, d)`` (no batch dim); mixing 2-D and 3-D
is an error, not a broadcast.
"""

from __future__ import annotations

import math

import torch

from attnlab import validate

__all__ = ["hopfield_update", "hopfield_retrieve", "hopfield_energy"]


def hopfield_update(xi, patterns, beta):
    """One update ``ξ_new = X softmax(β Xᵀ ξ)`` of every state row.

    ``xi (B, M, d)``, ``patterns (B, N, d)`` (or both 2-D) → ``(B, M, d)``; ``beta > 0``
    is the inverse temperature (the softmax scale of the equivalent attention).

    >>> import torch, attnlab
    >>> X = torch.randn(2, 10, 16); xi = torch.randn(2, 3, 16)
    >>> out = hopfield_update(xi, X, beta=0.5)
    >>> att = attnlab.attention(xi[:, None], X[:, None], X[:, None], scale=0.5)[:, 0]
    >>> out.shape, torch.allclose(out, att, atol=1e-5)
    (torch.Size([2, 3, 16]), True)
    """
    beta = _check(xi, patterns, beta)
    return _update(xi, patterns, beta)


def hopfield_energy(xi, patterns, beta):
    """The energy ``E(ξ) = −β⁻¹ lse(β Xᵀξ) + ½ ξᵀξ + β⁻¹ log N + ½ M²`` of each state row.

    ``xi (B, M, d)``, ``patterns (B, N, d)`` → ``(B, M)`` (or ``(M,)`` for 2-D inputs), in
    float32 (float64 for float64).  ``M = max_i ‖x_i‖`` per batch element; with these
    constants ``E ≥ 0``.  A state's energy does not increase under :func:`hopfield_update`.

    >>> import torch
    >>> X = torch.eye(4, dtype=torch.float64)          # 4 orthonormal patterns
    >>> xi = torch.tensor([[0.9, 0.1, 0.0, 0.0]], dtype=torch.float64)
    >>> e0 = hopfield_energy(xi, X, beta=4.0)
    >>> e1 = hopfield_energy(hopfield_update(xi, X, beta=4.0), X, beta=4.0)
    >>> bool(e1 <= e0), bool(e1 >= 0)
    (True, True)
    """
    beta = _check(xi, patterns, beta)
    acc = _acc_dtype(xi.dtype)
    x, X = xi.to(acc), patterns.to(acc)
    N = X.shape[-2]
    if N == 0:
        raise ValueError(f"patterns: the energy needs at least one stored pattern, got {tuple(patterns.shape)}")
    lse = torch.logsumexp(beta * (x @ X.transpose(-1, -2)), dim=-1)
    Msq = (X * X).sum(-1).amax(-1, keepdim=True)  # (B, 1) or (1,)
    return -lse / beta + 0.5 * (x * x).sum(-1) + math.log(N) / beta + 0.5 * Msq


def hopfield_retrieve(xi, patterns, beta, *, steps=100, tol=1e-6):
    """Iterate :func:`hopfield_update` towards a fixed point: returns ``(state, n_steps)``.

    Stops after the first step whose largest change ``max |ξ_new − ξ|`` (over every
    row and batch element) is ``≤ tol``, or after ``steps`` updates; ``n_steps`` is the
    number of updates applied (``1 ≤ n_steps ≤ steps``).  With well-separated patterns
    and large β one step already lands on a stored pattern (a fixed point up to
    ``exp(−β·gap)``); small β gives metastable mixtures of patterns.

    >>> import torch
    >>> X = torch.tensor([[1.0, 1, 1, 1, -1, -1, -1, -1], [1, -1, 1, -1, 1, -1, 1, -1]])
    >>> probe = X[:1].clone(); probe[0, 0] = -1.0     # pattern 0 with one entry flipped
    >>> state, n = hopfield_retrieve(probe, X, beta=2.0)
    >>> torch.allclose(state, X[:1], atol=1e-5), n <= 3
    (True, True)
    """
    beta = _check(xi, patterns, beta)
    steps = validate.integer(steps, "steps", lo=1)
    validate.real(tol, "tol", ge=0.0)
    state = xi
    for n in range(1, int(steps) + 1):  # noqa: B007 - n, the steps taken, is returned after the loop
        new = _update(state, patterns, beta)
        change = (new - state).abs().amax().item() if new.numel() else 0.0
        state = new
        if change <= float(tol):
            break
    return state, n


# --------------------------------------------------------------------------------------


def _update(xi, patterns, beta):
    acc = _acc_dtype(xi.dtype)
    x, X = xi.to(acc), patterns.to(acc)
    if X.shape[-2] == 0:  # no stored pattern: like a fully masked attention row, 0 (not NaN)
        return torch.zeros_like(xi)
    p = torch.softmax(beta * (x @ X.transpose(-1, -2)), dim=-1)  # (B, M, N)
    return (p @ X).to(xi.dtype)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(xi, patterns, beta):
    for name, t in (("xi", xi), ("patterns", patterns)):
        validate.tensor(t, name)
        validate.float_dtype(t, name)
    if xi.dim() not in (2, 3) or patterns.dim() != xi.dim():
        raise ValueError(
            f"xi, patterns: expected xi (B, M, d) with patterns (B, N, d), or xi (M, d) with "
            f"patterns (N, d); got xi {tuple(xi.shape)}, patterns {tuple(patterns.shape)}"
        )
    if xi.dim() == 3 and xi.shape[0] != patterns.shape[0]:
        raise ValueError(f"xi, patterns: batch sizes differ: xi {tuple(xi.shape)}, patterns {tuple(patterns.shape)}")
    if xi.shape[-1] != patterns.shape[-1]:
        raise ValueError(
            f"xi, patterns: pattern dimension d differs: xi {tuple(xi.shape)}, patterns {tuple(patterns.shape)}"
        )
    validate.same_dtype(xi=xi, patterns=patterns)
    validate.same_device(xi=xi, patterns=patterns)
    return validate.positive_float(beta, "beta")
