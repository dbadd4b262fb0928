"""Hopfield capacity: how many patterns can one attention read retrieve?

The seed's claim (the Hopfield lens on attention): softmax attention is one update of a
modern Hopfield network (:mod:`attnlab.ops.hopfield`), and a modern Hopfield network
stores exponentially many patterns in the dimension ``d``, where the classical binary
Hopfield network with Hebbian weights stores about ``0.14 d``.  This experiment
measures both on the same probes.

Setup, for each dimension ``d`` and number of stored patterns ``N``:

* patterns: ``kind="binary"`` draws entries ±1 (norm ``√d``); ``kind="gaussian"`` draws
  Gaussian vectors normalised to norm ``√d`` (same scale, so one ``beta`` means the same).
* probes: a stored pattern corrupted in ``round(frac·d)`` random entries,
  ``corruption="flip"`` (sign flipped) or ``"mask"`` (set to 0).
* modern retrieval: :func:`~attnlab.ops.hopfield.hopfield_retrieve` with inverse
  temperature ``beta`` on the raw dot products (the attention scale), ``steps`` updates
  at most (``steps=1`` is exactly one attention read), stopping at a fixed point.
* classical retrieval (binary patterns only): Hebbian weights ``W = XᵀX / d`` with zero
  diagonal, asynchronous sign updates in random order until no unit changes (at most
  ``classical_sweeps`` sweeps).

**Retrieved** means ``cos(state, stored pattern) > 0.99``.  For ±1 patterns with
``d < 200`` that is exact recovery (one wrong sign already gives ``cos ≤ 1 − 2/d``).
**Accuracy** is the fraction of probes retrieved (at least ``n_probes`` probes per
cell: small ``N`` repeats the draw over independent pattern sets).  **Capacity** at a
dimension is the largest ``N`` on the grid before accuracy first falls below
``threshold``; it is *censored* (a lower bound) when even the largest ``N`` passes.

References printed beside the measurements: the classical ``0.138 d`` (Amit, Gutfreund &
Sompolinsky 1985; stable storage with ~1.5 % wrong bits, so exact recall from corrupted
probes stays below it) and a separation heuristic for the modern network at large β:
retrieval fails once the largest overlap of the probe with one of the ``N`` other random
patterns (≈ ``sqrt(2 ln N)`` standard deviations) reaches its overlap with the target,
i.e. ``ln N ≈ d (1 − 2f)² / 2`` for flips, ``d (1 − f) / 2`` for masking — exponential
in ``d``.  ``growth`` fits ``log2(capacity)`` against ``d`` (uncensored dims) for the
modern network and ``capacity / d`` for the classical one.

>>> r = run(dims=(8, 16), ns=(2, 4, 8), n_probes=16, classical=False)
>>> sorted(r["modern"]) == ["accuracy", "capacity", "censored", "mean_steps"]
True
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from attnlab.ops.hopfield import hopfield_retrieve
from attnlab.validate import int_sequence, positive_int, real

__all__ = ["run", "summary", "DEFAULT_NS"]

DEFAULT_NS = tuple(2**i for i in range(1, 13))  # 2 … 4096
COS_THRESHOLD = 0.99


def run(
    dims=(16, 32, 64),
    ns=DEFAULT_NS,
    beta=1.0,
    *,
    kind="binary",
    corruption="flip",
    frac=0.25,
    steps=1,
    n_probes=128,
    threshold=0.9,
    classical=True,
    classical_sweeps=20,
    seed=0,
) -> dict:
    """Measure retrieval accuracy over ``dims × ns``; returns a JSON-able dict.

    Keys: ``config`` (the arguments), ``dims``, ``ns``, ``criterion`` (text),
    ``modern`` and ``classical`` (``None`` when not run) each with ``accuracy``
    ``{str(d): [acc per N]}``, ``capacity`` ``{str(d): N}`` (0 if the smallest N fails),
    ``censored`` ``{str(d): bool}``, and for modern ``mean_steps`` ``{str(d): [...]}``;
    ``reference`` (``classical_0.138d`` and ``modern_separation_heuristic`` per d),
    ``growth`` (``modern_log2_capacity_per_dim``, ``classical_capacity_per_dim``; None
    where fewer than two uncensored dims) and ``seconds``.
    """
    dims = int_sequence(dims, "dims")
    ns = int_sequence(ns, "ns")
    real(beta, "beta", gt=0.0)
    if kind not in ("binary", "gaussian"):
        raise ValueError(f"kind: expected 'binary' or 'gaussian', got {kind!r}")
    if corruption not in ("flip", "mask"):
        raise ValueError(f"corruption: expected 'flip' or 'mask', got {corruption!r}")
    real(frac, "frac", ge=0.0, lt=1.0)
    steps = positive_int(steps, "steps")
    n_probes = positive_int(n_probes, "n_probes")
    classical_sweeps = positive_int(classical_sweeps, "classical_sweeps")
    real(threshold, "threshold", gt=0.0, le=1.0)
    if not isinstance(classical, bool):
        raise TypeError(f"classical: expected a bool, got {type(classical).__name__}")
    do_classical = classical and kind == "binary"

    t0 = time.perf_counter()
    modern: dict[str, dict[str, Any]] = {"accuracy": {}, "capacity": {}, "censored": {}, "mean_steps": {}}
    clas: dict[str, dict[str, Any]] | None = {"accuracy": {}, "capacity": {}, "censored": {}} if do_classical else None
    for d in dims:
        accs, msteps, caccs = [], [], []
        for N in ns:
            g = torch.Generator().manual_seed(_cell_seed(seed, d, N))
            X, target, probe = _draw(d, N, n_probes, kind, corruption, frac, g)
            state, n = hopfield_retrieve(probe, X, float(beta), steps=steps, tol=1e-6)
            accs.append(_retrieved(state, target))
            msteps.append(n)
            if do_classical:
                caccs.append(_retrieved(_classical(X, probe, classical_sweeps, g), target))
        modern["accuracy"][str(d)] = accs
        modern["mean_steps"][str(d)] = msteps
        modern["capacity"][str(d)], modern["censored"][str(d)] = _capacity(ns, accs, threshold)
        if clas is not None:
            clas["accuracy"][str(d)] = caccs
            clas["capacity"][str(d)], clas["censored"][str(d)] = _capacity(ns, caccs, threshold)

    ref = {
        "classical_0.138d": {str(d): 0.138 * d for d in dims},
        "modern_separation_heuristic": {str(d): _heuristic(d, corruption, frac) for d in dims},
    }
    growth = {
        "modern_log2_capacity_per_dim": _log2_slope(dims, modern),
        "classical_capacity_per_dim": _linear_ratio(dims, clas) if clas else None,
    }
    return {
        "config": {
            "dims": list(dims),
            "ns": list(ns),
            "beta": float(beta),
            "kind": kind,
            "corruption": corruption,
            "frac": float(frac),
            "steps": steps,
            "n_probes": n_probes,
            "threshold": float(threshold),
            "classical": classical,
            "classical_sweeps": classical_sweeps,
            "seed": int(seed),
        },
        "dims": list(dims),
        "ns": list(ns),
        "criterion": (
            f"retrieved = cos(final state, stored pattern) > {COS_THRESHOLD}; accuracy = fraction of "
            f"probes retrieved; capacity = largest N before accuracy first drops below {threshold}"
        ),
        "modern": modern,
        "classical": clas,
        "reference": ref,
        "growth": growth,
        "seconds": time.perf_counter() - t0,
    }


def summary(result: dict) -> str:
    """A text table: accuracy per (d, N) for both networks, capacities and references."""
    c = result["config"]
    ns = result["ns"]
    lines = [
        f"Hopfield capacity: {c['kind']} patterns, {c['corruption']} {c['frac']:.0%} of entries, "
        f"beta={c['beta']:g}, modern steps<={c['steps']}, >= {c['n_probes']} probes per cell",
        result["criterion"],
        "",
    ]
    w = max(5, len(str(max(ns))) + 1)
    head = "      N: " + "".join(f"{n:>{w}}" for n in ns)
    for name in ("modern", "classical"):
        part = result.get(name)
        if not part:
            continue
        lines.append(f"{name} accuracy")
        lines.append(head)
        for d in result["dims"]:
            accs = part["accuracy"][str(d)]
            lines.append(f"  d={d:<4} " + "".join(f"{a:>{w}.2f}" for a in accs))
        lines.append("")
    lines.append(f"{'d':>5} {'modern cap':>11} {'classical cap':>14} {'0.138 d':>8} {'sep. heuristic':>15}")
    for d in result["dims"]:
        m = result["modern"]
        mc = f"{m['capacity'][str(d)]}{'+' if m['censored'][str(d)] else ''}"
        cl = result.get("classical")
        cc = "-" if not cl else f"{cl['capacity'][str(d)]}{'+' if cl['censored'][str(d)] else ''}"
        ref = result["reference"]
        lines.append(
            f"{d:>5} {mc:>11} {cc:>14} {ref['classical_0.138d'][str(d)]:>8.1f} "
            f"{ref['modern_separation_heuristic'][str(d)]:>15.3g}"
        )
    gr = result["growth"]
    if gr["modern_log2_capacity_per_dim"] is not None:
        s = gr["modern_log2_capacity_per_dim"]
        lines.append(
            f"modern: log2(capacity) grows {s:.3f} per dimension (x2 every {1 / s:.1f} dims)"
            if s > 0
            else f"modern: log2(capacity) slope {s:.3f} per dimension"
        )
    if gr.get("classical_capacity_per_dim") is not None:
        lines.append(f"classical: capacity / d = {gr['classical_capacity_per_dim']:.3f} (mean over dims)")
    lines.append("('+' = censored: every N on the grid passed, the capacity is at least that)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------


def _cell_seed(seed, d, N):
    return (int(seed) * 1_000_003 + d * 10_007 + N) % (2**63)


def _draw(d, N, n_probes, kind, corruption, frac, g):
    """T independent pattern sets ``X (T, N, d)``, targets and corrupted probes ``(T, P, d)``."""
    P = min(N, n_probes)
    T = -(-n_probes // P)
    if kind == "binary":
        X = torch.randint(0, 2, (T, N, d), generator=g).float() * 2 - 1
    else:
        X = torch.randn(T, N, d, generator=g)
        X = X / X.norm(dim=-1, keepdim=True).clamp_min(1e-12) * math.sqrt(d)
    idx = torch.rand(T, N, generator=g).argsort(-1)[:, :P]  # P distinct patterns per set
    target = X.gather(1, idx[..., None].expand(T, P, d))
    nf = round(frac * d)
    where = torch.rand(T, P, d, generator=g).argsort(-1)[..., :nf]
    probe = target.clone()
    if nf:
        vals = -probe.gather(-1, where) if corruption == "flip" else torch.zeros(T, P, nf)
        probe.scatter_(-1, where, vals)
    return X, target, probe


def _retrieved(state, target):
    cos = torch.nn.functional.cosine_similarity(state.float(), target.float(), dim=-1)
    return float((cos > COS_THRESHOLD).float().mean())


def _classical(X, probe, sweeps, g):
    """Asynchronous sign dynamics with Hebbian weights ``W = XᵀX / d`` (zero diagonal)."""
    _T, _N, d = X.shape
    W = X.transpose(1, 2) @ X / d
    W.diagonal(dim1=1, dim2=2).zero_()
    s = probe.clone()
    s = torch.where(s == 0, torch.ones_like(s), s)  # masked entries start at +1
    for _ in range(sweeps):
        changed = False
        for i in torch.randperm(d, generator=g).tolist():
            h = s @ W[:, :, i : i + 1]  # (T, P, 1) local field
            new = torch.where(h > 0, 1.0, torch.where(h < 0, -1.0, s[..., i : i + 1]))
            if not changed and bool((new != s[..., i : i + 1]).any()):
                changed = True
            s[..., i : i + 1] = new
        if not changed:
            break
    return s


def _capacity(ns, accs, threshold):
    cap = 0
    for n, a in zip(ns, accs, strict=True):
        if a < threshold:
            return cap, False
        cap = n
    return cap, True


def _heuristic(d, corruption, frac):
    expo = d * (1 - 2 * frac) ** 2 / 2 if corruption == "flip" else d * (1 - frac) / 2
    return math.exp(expo)


def _log2_slope(dims, part):
    pts = [
        (d, math.log2(part["capacity"][str(d)]))
        for d in dims
        if part["capacity"][str(d)] > 0 and not part["censored"][str(d)]
    ]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def _linear_ratio(dims, part):
    r = [part["capacity"][str(d)] / d for d in dims if not part["censored"][str(d)]]
    return sum(r) / len(r) if r else None
