"""The linear-attention crossover: from which sequence length is linear attention faster?

Causal attention at ``d_head = 64``, ``H = 4``, ``B = 1``, float32, on this machine's
CPU threads, for ``N = 256 … 16384`` (doubling):

* ``elu``   — :func:`attnlab.ops.linear.linear_attention` with ``elu(x)+1`` features,
  causal chunked (``chunk_size`` rows per chunk, running ``(F, Dv)`` state);
* ``favor`` — the same with FAVOR+ positive orthogonal random features, ``m = d_head``;
* ``flash`` — exact softmax attention, ``attnlab.attention(..., mask=causal(), backend="flash")``;
* ``sdpa``  — exact softmax attention, ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.

Times are medians over ``reps`` interleaved repetitions (each repetition runs every
method once, in a rotated order, after one warm-up each), for the forward pass under
``torch.no_grad()`` and for forward + backward (gradients of q, k, v).  The
**crossover** of a (linear, softmax) pair is the smallest ``N`` on the grid from which
the linear method is faster at every larger measured ``N``; ``interpolated`` places it
between the bracketing grid points by log-log interpolation of the time ratio.
Absolute times on a shared 2-core machine are noisy; the ratios within one run are the
measurement.

Approximation error, at each ``N``: ``‖out − out_softmax‖_F / ‖out_softmax‖_F`` against
exact causal softmax (torch SDPA, float32), with ``v ~ N(0, 1)`` and ``q, k`` entries
``N(0, σ²)`` for each ``σ`` in ``error_scales``.  ``σ = 1`` is the typical scale (the
scaled scores ``q·k/sqrt(d)`` are ~N(0, 1), as the ``1/sqrt(d)`` scale is designed for);
``σ = 0.5`` gives scores of std 0.25.  The timed runs use ``σ = 1``.  FAVOR+ is an
unbiased estimator of the softmax kernel, so its error is an approximation error and
falls as the number of random features grows (``favor_vs_features``) — but the
estimator's variance grows like ``exp(‖q‖²/sqrt(d) + ‖k‖²/sqrt(d))``, so at ``σ = 1``,
``d = 64`` (``‖q‖²/sqrt(d) ≈ 8``) it falls very slowly.  ``elu+1`` is a different model (another kernel), not an
approximation of softmax: its number is how far apart the two models' outputs are on
the same q/k/v, and no feature count makes it go away.

``attnlab lab crossover [--quick] [--json PATH]`` runs it and prints the
table; the result is also written under :func:`attnlab.lab.cache_dir` ``("crossover")``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from attnlab import masks
from attnlab.lab import cache_dir
from attnlab.ops.dispatch import attention
from attnlab.ops.linear import FavorFeatures, linear_attention
from attnlab.validate import positive_int

__all__ = ["run", "summary", "main", "METHODS", "LINEAR", "SOFTMAX"]

LINEAR = ("elu", "favor")
SOFTMAX = ("flash", "sdpa")
METHODS = LINEAR + SOFTMAX
MODES = ("fwd", "fwdbwd")
FULL_NS = tuple(256 * 2**i for i in range(7))  # 256 … 16384
QUICK_NS = (256, 512, 1024, 2048)


def run(
    quick=False,
    *,
    ns=None,
    d_head=64,
    heads=4,
    batch=1,
    reps=None,
    favor_features=None,
    error_scales=(1.0, 0.5),
    error_features=(16, 64, 256, 1024),
    error_n=None,
    error_seeds=3,
    chunk_size=64,
    max_call_s=60.0,
    seed=0,
    progress=True,
) -> dict:
    """Time the four methods over ``ns`` and measure the approximation errors; JSON-able dict.

    ``quick`` picks ``ns = 256 … 2048`` and 3 repetitions (else ``256 … 16384`` and 5);
    explicit ``ns``/``reps`` win.  ``favor_features`` is FAVOR+'s ``m`` in the timed runs
    (default ``d_head``).  ``error_features`` are the ``m`` of the error-vs-features
    sweep at ``N = error_n`` (default ``min(1024, max(ns))``), each averaged over
    ``error_seeds`` feature draws, for each q/k std in ``error_scales``.  A method whose single call took longer than
    ``max_call_s`` is not timed at larger ``N`` (``None``).

    Keys: ``config``, ``env``, ``ns``, ``times`` ``{mode: {method: [median s or None]}}``
    (``mode`` in ``fwd``, ``fwdbwd``), ``samples`` (every repetition), ``ratios``
    ``{mode: {"elu/flash": [...], ...}}``, ``crossover`` ``{mode: {"elu/flash": {"n",
    "interpolated", "below_grid"}}}``, ``errors`` ``{"favor": {str(σ): [rel. error per N]},
    "elu": {str(σ): [...]}, "flash_vs_sdpa": [...]}``, ``favor_vs_features`` ``{"n",
    "features", "rel_error": {str(σ): [per m]}}``, ``notes``, ``seconds``.
    """
    ns = tuple(ns) if ns is not None else (QUICK_NS if quick else FULL_NS)
    reps = reps if reps is not None else (3 if quick else 5)
    m_feat = d_head if favor_features is None else favor_features
    for name, x in (
        ("reps", reps),
        ("d_head", d_head),
        ("heads", heads),
        ("batch", batch),
        ("favor_features", m_feat),
        ("error_seeds", error_seeds),
        ("chunk_size", chunk_size),
    ):
        positive_int(x, name)
    if not ns:
        raise ValueError("ns: expected at least one sequence length")
    for n in ns:
        positive_int(n, "ns")
    error_features = tuple(error_features)
    for m in error_features:
        positive_int(m, "error_features")
    error_n = min(1024, max(ns)) if error_n is None else positive_int(error_n, "error_n")
    error_scales = tuple(float(x) for x in error_scales)
    if not error_scales or not all(0 < x < math.inf for x in error_scales):
        raise ValueError(f"error_scales: expected positive finite q/k stds, got {error_scales!r}")

    from tqdm import tqdm

    t_start = time.perf_counter()
    favor = FavorFeatures(d_head, m_feat, seed=seed)
    times: dict[str, dict[str, list[float | None]]] = {mode: {m: [] for m in METHODS} for mode in MODES}
    samples: dict[str, dict[str, list[list[float]]]] = {mode: {m: [] for m in METHODS} for mode in MODES}
    errors: dict[str, Any] = {
        "favor": {str(x): [] for x in error_scales},
        "elu": {str(x): [] for x in error_scales},
        "flash_vs_sdpa": [],
    }
    too_slow: dict[str, set[str]] = {mode: set() for mode in MODES}
    bar = tqdm(total=len(ns) * len(MODES) * reps, disable=not progress, file=sys.stderr, desc="crossover", unit="rep")
    for n in ns:
        g = torch.Generator().manual_seed(seed * 7919 + n)
        shape = (batch, heads, n, d_head)
        q, k, v, dout = (torch.randn(shape, generator=g) for _ in range(4))
        causal = masks.causal()
        fns = _methods(favor, causal, chunk_size)
        with torch.no_grad():
            errors["flash_vs_sdpa"].append(_rel(fns["flash"](q, k, v), fns["sdpa"](q, k, v)))
            for x in error_scales:
                qs, ks = q * x, k * x
                ref = fns["sdpa"](qs, ks, v)
                errors["favor"][str(x)].append(_rel(fns["favor"](qs, ks, v), ref))
                errors["elu"][str(x)].append(_rel(fns["elu"](qs, ks, v), ref))
            del ref, qs, ks
        for mode in MODES:
            bar.set_postfix_str(f"N={n} {mode}")
            active = [m for m in METHODS if m not in too_slow[mode]]
            calls = {m: _timed_call(fns[m], q, k, v, dout, backward=(mode == "fwdbwd")) for m in active}
            for m in active:  # warm-up (allocations, tile plans)
                w = calls[m]()
                if w > max_call_s:
                    too_slow[mode].add(m)
            active = [m for m in active if m not in too_slow[mode]]
            per: dict[str, list[float]] = {m: [] for m in METHODS}
            for r in range(reps):
                order = active[r % len(active) :] + active[: r % len(active)] if active else []
                for m in order:
                    per[m].append(calls[m]())
                bar.update(1)
            for m in METHODS:
                times[mode][m].append(statistics.median(per[m]) if per[m] else None)
                samples[mode][m].append(per[m])
    bar.close()

    ratios: dict[str, dict[str, list[float | None]]] = {}
    cross: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        ratios[mode], cross[mode] = {}, {}
        for lin in LINEAR:
            for soft in SOFTMAX:
                key = f"{lin}/{soft}"
                rs = [
                    None if a is None or b is None else a / b
                    for a, b in zip(times[mode][lin], times[mode][soft], strict=True)
                ]
                ratios[mode][key] = rs
                cross[mode][key] = _crossover(ns, rs)

    fvf = _favor_vs_features(error_n, d_head, heads, batch, error_features, error_seeds, chunk_size, seed, error_scales)
    return {
        "config": {
            "quick": bool(quick),
            "ns": list(ns),
            "d_head": d_head,
            "heads": heads,
            "batch": batch,
            "reps": reps,
            "favor_features": m_feat,
            "chunk_size": chunk_size,
            "dtype": "float32",
            "causal": True,
            "error_scales": list(error_scales),
            "error_features": list(error_features),
            "error_n": error_n,
            "error_seeds": error_seeds,
            "max_call_s": max_call_s,
            "seed": seed,
        },
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads()},
        "ns": list(ns),
        "times": times,
        "samples": samples,
        "ratios": ratios,
        "crossover": cross,
        "errors": errors,
        "favor_vs_features": fvf,
        "notes": [
            "ratios within one run are the measurement; absolute times on a shared machine are noisy",
            "elu+1 is a different model, not an approximation of softmax: its 'error' is the distance "
            "between two models' outputs",
            "FAVOR+ error is an estimator's error: it falls as the number of random features grows",
        ],
        "seconds": time.perf_counter() - t_start,
    }


def summary(result: dict) -> str:
    """Text tables: median times (ms) and ratios per mode, crossovers, errors."""
    c = result["config"]
    ns = result["ns"]
    lines = [
        f"Linear-attention crossover: causal, B={c['batch']} H={c['heads']} d_head={c['d_head']} "
        f"{c['dtype']}, FAVOR+ m={c['favor_features']}, chunk={c['chunk_size']}, "
        f"{c['reps']} interleaved reps (median), torch {result['env']['torch']}, "
        f"{result['env']['threads']} threads",
        "",
    ]
    keys = [f"{a}/{b}" for a in LINEAR for b in SOFTMAX]
    for mode in MODES:
        title = "forward (no_grad)" if mode == "fwd" else "forward + backward"
        lines.append(f"{title}: median ms, and time ratio linear/softmax (< 1: linear is faster)")
        lines.append(f"{'N':>6} " + "".join(f"{m:>10}" for m in METHODS) + "".join(f"{k:>12}" for k in keys))
        for i, n in enumerate(ns):
            row = f"{n:>6} " + "".join(_fmt_ms(result["times"][mode][m][i]) for m in METHODS)
            row += "".join(_fmt_ratio(result["ratios"][mode][k][i]) for k in keys)
            lines.append(row)
        for k in keys:
            cr = result["crossover"][mode][k]
            if cr["n"] is None:
                text = "linear is not faster by the largest N measured"
            elif cr["below_grid"]:
                text = f"linear is faster at every N measured (from N={cr['n']})"
            else:
                text = f"faster from N={cr['n']} (interpolated N*≈{cr['interpolated']:.0f})"
            lines.append(f"  crossover {k:<11} {text}")
        lines.append("")
    e = result["errors"]
    scales = list(e["favor"])
    lines.append(
        f"relative error vs exact causal softmax  ‖out − softmax‖ / ‖softmax‖  "
        f"(q, k entries N(0, σ²); FAVOR+ m={c['favor_features']})"
    )
    lines.append(
        f"{'N':>6} "
        + "".join(f"{'FAVOR+ σ=' + s:>14}" for s in scales)
        + "".join(f"{'elu+1(*) σ=' + s:>16}" for s in scales)
        + f"{'flash-sdpa':>12}"
    )
    for i, n in enumerate(ns):
        lines.append(
            f"{n:>6} "
            + "".join(f"{e['favor'][s][i]:>14.4f}" for s in scales)
            + "".join(f"{e['elu'][s][i]:>16.4f}" for s in scales)
            + f"{e['flash_vs_sdpa'][i]:>12.2e}"
        )
    f = result["favor_vs_features"]
    lines.append(f"FAVOR+ error vs features at N={f['n']} (mean of {result['config']['error_seeds']} draws):")
    for s, errs in f["rel_error"].items():
        lines.append(f"  σ={s}: " + ", ".join(f"m={m}: {x:.4f}" for m, x in zip(f["features"], errs, strict=True)))
    lines.append(
        "(*) elu+1 is a different model, not an approximation: its number is the distance between "
        "the two models' outputs"
    )
    return "\n".join(lines)


def main(
    *,
    quick: bool = False,
    reps: int | None = None,
    threads: int | None = None,
    progress: bool = True,
    json_path: str | None = None,
) -> int:
    """``attnlab lab crossover``: run (on ``threads`` torch threads when given), keep the result in
    the lab cache, write it to ``json_path``, print the summary."""
    if threads is not None:
        positive_int(threads, "threads (--threads)")
        torch.set_num_threads(threads)
    res = run(quick=quick, reps=reps, progress=progress)
    text = json.dumps(res, indent=1)
    cached = cache_dir("crossover") / ("crossover-quick.json" if quick else "crossover.json")
    cached.write_text(text)
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(text)
    print(summary(res))
    print(f"\n(result written to {cached}{' and ' + json_path if json_path else ''}; {res['seconds']:.0f} s)")
    return 0


# --------------------------------------------------------------------------------------


def _methods(favor, causal, chunk_size):
    return {
        "elu": lambda q, k, v: linear_attention(q, k, v, feature_map="elu", causal=True, chunk_size=chunk_size),
        "favor": lambda q, k, v: linear_attention(q, k, v, feature_map=favor, causal=True, chunk_size=chunk_size),
        "flash": lambda q, k, v: attention(q, k, v, mask=causal, backend="flash"),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def _timed_call(fn, q, k, v, dout, backward):
    """A closure that runs one forward (and backward) and returns its wall time in seconds."""
    if not backward:

        def call():
            with torch.no_grad():
                t0 = time.perf_counter()
                fn(q, k, v)
                return time.perf_counter() - t0

        return call
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def call_bwd():
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        fn(*leaves).backward(dout)
        return time.perf_counter() - t0

    return call_bwd


def _rel(x, ref):
    den = float(ref.double().norm())
    return float((x.double() - ref.double()).norm()) / den if den else 0.0


def _crossover(ns, ratios):
    """Smallest N from which every measured ratio is < 1; log-log interpolated against the previous point."""
    pts = [(n, r) for n, r in zip(ns, ratios, strict=True) if r is not None]
    if not pts or pts[-1][1] >= 1:
        return {"n": None, "interpolated": None, "below_grid": False}
    i = len(pts) - 1
    while i > 0 and pts[i - 1][1] < 1:
        i -= 1
    if i == 0:
        return {"n": pts[0][0], "interpolated": None, "below_grid": True}
    (n0, r0), (n1, r1) = pts[i - 1], pts[i]
    if r0 == r1:
        interp = float(n1)
    else:
        f = math.log(r0) / (math.log(r0) - math.log(r1))  # where log ratio crosses 0
        interp = math.exp(math.log(n0) + f * (math.log(n1) - math.log(n0)))
    return {"n": n1, "interpolated": interp, "below_grid": False}


def _favor_vs_features(n, d_head, heads, batch, features, n_seeds, chunk_size, seed, scales):
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    shape = (batch, heads, n, d_head)
    q0, k0, v = (torch.randn(shape, generator=g) for _ in range(3))
    out = {}
    with torch.no_grad():
        for x in scales:
            q, k = q0 * x, k0 * x
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            errs = []
            for m in features:
                e = [
                    _rel(
                        linear_attention(
                            q,
                            k,
                            v,
                            feature_map=FavorFeatures(d_head, m, seed=seed + 1000 * s),
                            causal=True,
                            chunk_size=chunk_size,
                        ),
                        ref,
                    )
                    for s in range(n_seeds)
                ]
                errs.append(sum(e) / len(e))
            out[str(x)] = errs
    return {"n": n, "features": list(features), "rel_error": out}


def _fmt_ms(t):
    return f"{'-':>10}" if t is None else f"{t * 1e3:>10.2f}"


def _fmt_ratio(r):
    return f"{'-':>12}" if r is None else f"{r:>12.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
