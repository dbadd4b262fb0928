"""Claims about the alternatives to softmax attention: the modern Hopfield identity and its
capacity, linear attention as an approximation of softmax, additive attention's cost."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import attnlab
from attnlab.lab.claims._measure import gen, seeded
from attnlab.lab.claims.registry import SEED_002, Outcome, Verdict, claim


@claim(
    "hopfield-update-is-attention",
    title="softmax attention is one update step of a modern Hopfield network",
    seed=SEED_002,
    quote="Softmax-attention is exactly one update step of a continuous (“modern”) Hopfield network",
)
def _hopfield_identity() -> Outcome:
    from attnlab.ops.hopfield import hopfield_energy, hopfield_update

    g = gen(800)
    X = torch.randn(3, 50, 32, generator=g, dtype=torch.float64)
    xi = torch.randn(3, 7, 32, generator=g, dtype=torch.float64)
    ev = {}
    for beta in (0.1, 1.0, 4.0):
        a = hopfield_update(xi, X, beta)
        b = attnlab.attention(xi[:, None], X[:, None], X[:, None], scale=beta, backend="reference")[:, 0]
        ev[f"max |update − attention|, β={beta}"] = float((a - b).abs().max())
    s, rises = xi, 0
    e = hopfield_energy(s, X, 1.0)
    for _ in range(10):  # iterating never raises the energy
        s = hopfield_update(s, X, 1.0)
        e2 = hopfield_energy(s, X, 1.0)
        rises += int((e2 > e + 1e-12).sum())
        e = e2
    ev["energy increases over 10 steps"] = rises
    worst = max(v for k, v in ev.items() if k.startswith("max"))
    return Outcome.judge(
        worst < 1e-12 and rises == 0,
        evidence=ev,
        explanation="ξ ← X softmax(βXᵀξ) equals attnlab.attention with Q = ξ, K = V = X and scale β; "
        "iterating it never increases the Hopfield energy",
        key_figure=f"max diff {worst:.0e}; energy rises {rises}",
    )


@claim(
    "hopfield-exponential-capacity",
    title="a modern Hopfield net stores exponentially many patterns in the dimension",
    seed=SEED_002,
    quote="a modern Hopfield net stores exponentially many patterns in the embedding dimension",
)
def _hopfield_capacity() -> Outcome:
    from attnlab.lab import hopfield

    r = hopfield.run(dims=(16, 32, 64), n_probes=96)
    cap = {d: r["modern"]["capacity"][str(d)] for d in r["dims"]}
    cls = {d: r["classical"]["capacity"][str(d)] for d in r["dims"]}
    slope = r["growth"]["modern_log2_capacity_per_dim"]
    ev = {
        "modern capacity by d": {str(d): c for d, c in cap.items()},
        "classical capacity by d": {str(d): c for d, c in cls.items()},
        "log2(capacity) per dimension": slope,
        "criterion": r["criterion"],
    }
    grows = cap[64] >= 8 * cap[32] >= 8 * cap[16] and slope > 0.1
    if not grows:
        return Outcome(
            Verdict.DOES_NOT_HOLD,
            ev,
            "retrieval capacity does not grow exponentially with d here",
            key_figure=f"capacity {cap}",
        )
    return Outcome(
        Verdict.HOLDS_UNDER_CONDITIONS,
        ev,
        "one update step retrieves far more patterns than the classical Hebbian network, and log2 of the "
        "capacity grows linearly in d",
        conditions=f"random ±1 patterns, 25% of entries flipped, β = 1, one step; capacity doubles every "
        f"{1 / slope:.1f} dimensions (on a grid up to N = {r['ns'][-1]})",
        key_figure=f"capacity {cap[16]}/{cap[32]}/{cap[64]} at d 16/32/64 (classical {cls[16]}/{cls[32]}/{cls[64]})",
    )


def _rel(x, ref):
    return float((x - ref).norm() / ref.norm())


@claim(
    "linear-attention-approximates-softmax",
    title="linear attention (Performer / FAVOR+) approximates softmax attention",
    seed=SEED_002,
    quote="An approximation of softmax-as-kernel that sacrifices exact attention weights for linear sequence "
    "scaling, trading expressivity for asymptotic efficiency.",
)
def _favor() -> Outcome:
    from attnlab.ops.linear import FavorFeatures, linear_attention

    g = gen(810)
    B, H, N, D = 1, 2, 256, 32
    q0, k0, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    ev = {}
    for sigma in (0.5, 1.0):
        q, k = q0 * sigma, k0 * sigma
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for m in (16, 256, 2048):
            e = [
                _rel(linear_attention(q, k, v, feature_map=FavorFeatures(D, m, seed=s), causal=True), ref)
                for s in range(3)
            ]
            ev[f"FAVOR+ rel. error, σ={sigma}, m={m}"] = sum(e) / 3
        ev[f"elu+1 rel. error, σ={sigma}"] = _rel(linear_attention(q, k, v, causal=True), ref)
    small = [ev[f"FAVOR+ rel. error, σ=0.5, m={m}"] for m in (16, 256, 2048)]
    big = ev["FAVOR+ rel. error, σ=1.0, m=2048"]
    converges = small[-1] < 0.5 * small[0] and small[-1] < 0.15
    if not converges:
        return Outcome(
            Verdict.DOES_NOT_HOLD,
            ev,
            "FAVOR+'s error does not fall with the number of features",
            key_figure=f"error {small[0]:.2f} → {small[-1]:.2f}",
        )
    return Outcome(
        Verdict.HOLDS_UNDER_CONDITIONS,
        ev,
        "FAVOR+ is an unbiased estimator of the softmax kernel whose error falls with the number of "
        "random features; elu+1 is a different model, not an approximation",
        conditions=f"small logits or many features: at q, k ~ N(0, 0.5²) the error falls "
        f"{small[0]:.2f} → {small[-1]:.2f} (m 16 → 2048); at N(0, 1) it is still {big:.2f} with "
        "2048 features (the estimator's variance grows like exp(‖q‖²))",
        key_figure=f"σ 0.5: {small[0]:.2f} → {small[-1]:.2f}; σ 1: {big:.2f} at m=2048",
    )


@claim(
    "linear-attention-faster-at-long-sequences",
    title="linear attention's O(n) rewrite beats softmax attention in time past some length",
    seed=SEED_002,
    quote="admitting an $O(n)$ associative rewrite (e.g., Performer, FAVOR+)",
)
def _crossover() -> Outcome:
    import json

    from attnlab.lab import cache_dir

    path = cache_dir("crossover") / "crossover.json"
    if path.exists():
        r = json.loads(path.read_text())
        src = "the lab's cached `attnlab lab crossover` run"
    else:
        from attnlab.lab import crossover

        r = crossover.run(quick=True, progress=False)
        src = "a quick crossover run"
    c = r["crossover"]["fwdbwd"]["elu/sdpa"]
    ratios = r["ratios"]["fwdbwd"]["elu/sdpa"]
    ev = {
        "sequence lengths": r["ns"],
        "time ratio linear/SDPA (fwd+bwd)": ratios,
        "crossover N": c.get("interpolated") or c.get("n"),
        "source": src,
    }
    faster_at_end = ratios[-1] is not None and ratios[-1] < 1
    if not faster_at_end:
        return Outcome(
            Verdict.DOES_NOT_HOLD,
            ev,
            "linear attention is not faster at the longest length measured",
            key_figure=f"ratio {ratios[-1]}",
        )
    n_star = ev["crossover N"]
    return Outcome(
        Verdict.HOLDS_UNDER_CONDITIONS,
        ev,
        "causal elu+1 linear attention (chunked) against torch SDPA, forward and backward, on this CPU",
        conditions=f"past N ≈ {n_star:.0f} (d_head 64); below it softmax attention is faster",
        key_figure=f"crossover N ≈ {n_star:.0f}; ×{1 / ratios[-1]:.1f} faster at N={r['ns'][-1]}",
    )


@claim(
    "additive-attention-costlier",
    title="additive attention was superseded by the efficiency of the dot product (matrix multiplication)",
    seed=SEED_002,
    quote="An alternative computational path that predated dot-product attention, largely superseded by the "
    "computational efficiency and parallelization benefits of matrix multiplication",
)
def _additive() -> Outcome:
    import time

    from attnlab.ops.additive import additive_attention

    g = gen(820)
    B, H, N, D = 1, 4, 256, 64
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    with seeded(821):
        w_q, w_k = torch.randn(D, D) / 8, torch.randn(D, D) / 8
        v_a = torch.randn(D) / 8

    def best(fn, reps=5):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    with torch.no_grad():
        t_add = best(lambda: additive_attention(q, k, v, w_q, w_k, v_a))
        t_dot = best(lambda: attnlab.attention(q, k, v))
    # work: additive evaluates tanh over (N, N, d_attn) and a vector product; dot product one GEMM
    flops_add = B * H * N * N * D * 3
    flops_dot = B * H * N * N * D * 2
    ev = {
        "median time additive (s)": t_add,
        "median time dot product (s)": t_dot,
        "time ratio": t_add / t_dot,
        "elementwise tanh evaluations": B * H * N * N * D,
        "dot-product score FLOPs": flops_dot,
        "additive score FLOPs (+ tanh)": flops_add,
    }
    return Outcome.judge(
        t_add > 2 * t_dot,
        evidence=ev,
        explanation=f"additive scores need a tanh for every (query, key, feature) triple — "
        f"B·H·N²·d_attn = {B * H * N * N * D:,} here — where dot-product scores are "
        "one matrix multiplication",
        key_figure=f"×{t_add / t_dot:.0f} slower at N={N} (same machine, same run)",
    )


@claim(
    "ssm-weaker-content-recall",
    title="state-space models retrieve by content less well than softmax attention",
    seed=SEED_002,
    quote="possesses weaker explicit content-based retrieval capabilities compared to softmax attention",
)
def _ssm_recall() -> Outcome:
    from attnlab.lab import recall

    r = recall.run(config=recall.DEMO, progress=False)  # the demo's run (lab cache; under a minute the first time)
    ns = [str(n) for n in r["n_pairs"]]
    acc = {m: r["models"][m]["accuracy"] for m in r["models"]}
    ev: dict[str, Any] = {f"accuracy {m}": [round(acc[m][n], 4) for n in ns] for m in acc}
    ev.update(
        {
            "pairs": r["n_pairs"],
            "no-binding bar": [round(r["no_binding"][n], 4) for n in ns],
            "params": {m: r["models"][m]["params"] for m in acc},
        }
    )
    att, ssm = acc["attention"], acc["ssm"]
    last = ns[-1]
    weaker = all(ssm[n] <= att[n] for n in ns) and att[last] - ssm[last] > 0.02
    if not weaker:
        return Outcome(
            Verdict.DOES_NOT_HOLD,
            ev,
            "the SSM recalls as well as softmax attention on MQAR here",
            key_figure=f"n={last}: attention {att[last]:.2f}, SSM {ssm[last]:.2f}",
        )
    lin = acc.get("linear", {}).get(last)
    return Outcome(
        Verdict.HOLDS_UNDER_CONDITIONS,
        ev,
        f"multi-query associative recall with equal-size {r['config']['n_layers']}-layer models: the SSM "
        "recalls no better than softmax attention at any number of pairs, and worse at the most",
        conditions=f"MQAR, sequence length {r['config']['seq_len']}, up to {last} pairs, d_model "
        f"{r['config']['d_model']}, {r['config']['steps']} steps, one seed, learning rate chosen "
        f"per mixer; at {last} pairs the SSM scores {ssm[last]:.2f} against the no-binding bar's "
        f"{r['no_binding'][last]:.2f} ("
        + ("above it: it binds keys to values, less well" if ssm[last] > r["no_binding"][last] else "not above it")
        + ")",
        key_figure=f"n={last}: attention {att[last]:.2f}, SSM {ssm[last]:.2f}"
        + (f", linear {lin:.2f}" if lin is not None else ""),
    )
