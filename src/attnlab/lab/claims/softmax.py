"""Claims about the softmax: the simplex, convexity, its Jacobian, saturation, temperature.

Softmax of an arbitrary logit vector ``s (N,)`` is read off attnlab with the identity
trick: one query ``q = s`` against the keys ``k = I_N`` at ``scale=1`` scores exactly
``s``, so ``attnlab.attention_probs`` returns ``softmax(s)`` as attnlab computes it
(and autograd through it gives attnlab's Jacobian).
"""

from __future__ import annotations

import itertools
import math

import torch

import attnlab
from attnlab import masks
from attnlab.lab.claims._measure import gen, seeded
from attnlab.lab.claims.registry import SEED_000, SEED_002, Outcome, Verdict, claim


def softmax_via_attnlab(s: torch.Tensor) -> torch.Tensor:
    """``softmax(s)`` over the last dim of ``s (..., N)`` computed by ``attnlab.attention_probs``."""
    N = s.shape[-1]
    q = s.reshape(1, 1, -1, N)
    k = torch.eye(N, dtype=s.dtype).view(1, 1, N, N)
    return attnlab.attention_probs(q, k, scale=1.0, q_offset=0).reshape(s.shape)


def _jacobian(s: torch.Tensor) -> torch.Tensor:
    return torch.autograd.functional.jacobian(softmax_via_attnlab, s)


@claim(
    "softmax-rows-on-simplex",
    title="every attention row is a probability distribution: nonnegative, sums to 1",
    seed=SEED_002,
    quote="Each row $\\alpha_{i\\cdot}$ is a probability distribution over all $n$ positions: nonnegative, sums to 1.",
)
def _simplex() -> Outcome:
    g = gen(100)
    q = torch.randn(2, 4, 97, 40, generator=g) * 3
    k = torch.randn(2, 2, 131, 40, generator=g) * 3
    worst_sum, worst_neg = 0.0, 0.0
    for m in (None, masks.causal(), masks.sliding_window(16)):
        p = attnlab.attention_probs(q, k, mask=m)
        worst_sum = max(worst_sum, float((p.sum(-1) - 1).abs().max()))
        worst_neg = min(worst_neg, float(p.min()))
    ok = worst_sum < 1e-5 and worst_neg >= 0
    return Outcome.judge(
        ok,
        evidence={"max |row sum - 1|": worst_sum, "min weight": worst_neg},
        explanation="attnlab's float32 patterns (no mask, causal, sliding window, GQA) are row-stochastic to rounding",
        key_figure=f"max |Σ-1| = {worst_sum:.1e}, min weight {worst_neg:.1g}",
    )


@claim(
    "softmax-strictly-positive",
    title="softmax weights are strictly positive for finite scores",
    seed=SEED_000,
    quote="Strict positivity: aᵢ > 0 for all finite sᵢ because e^(sᵢ) > 0.",
)
def _strictly_positive() -> Outcome:
    def first_zero_gap(dtype):
        lo, hi = 0.0, 4096.0

        def probe(gap):
            return float(softmax_via_attnlab(torch.tensor([0.0, -gap], dtype=dtype))[1])

        if probe(hi) > 0:
            return None
        for _ in range(40):  # bisect the logit gap at which the smaller weight becomes exactly 0
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if probe(mid) > 0 else (lo, mid)
        return hi

    g32, g64 = first_zero_gap(torch.float32), first_zero_gap(torch.float64)
    ev = {
        "float32: weight is exactly 0 beyond a logit gap of": g32 if g32 is not None else "none up to 4096",
        "float64: weight is exactly 0 beyond a logit gap of": g64 if g64 is not None else "none up to 4096",
    }
    if g32 is None and g64 is None:
        return Outcome(Verdict.HOLDS, ev, "no finite logit gap up to 4096 made a weight exactly zero")
    return Outcome(
        Verdict.HOLDS_UNDER_CONDITIONS,
        ev,
        "positive in exact arithmetic, but attnlab's floating-point softmax underflows to exactly 0",
        conditions=f"in exact arithmetic; in floating point a weight is exactly 0 once its logit trails "
        f"the row maximum by more than {g32:.1f} (float32) or {g64:.1f} (float64)",
        key_figure=f"0 beyond gap {g32:.1f} (fp32), {g64:.1f} (fp64)",
    )


@claim(
    "budget-example-is-softmax",
    title="the seed's 2/3/5 budget example (20%/30%/50%) illustrates softmax",
    seed=SEED_000,
    quote="To distribute the money fairly without negative payouts, you convert each score into a positive slice "
    "and divide by the total: 2/10 = 20%, 3/10 = 30%, and 5/10 = 50%.",
)
def _budget() -> Outcome:
    s = torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64)
    soft = softmax_via_attnlab(s) * 100
    prop = s / s.sum() * 100
    diff = float((soft - prop).abs().max())
    ev = {
        "softmax %": [round(float(x), 1) for x in soft],
        "score/total %": [round(float(x), 1) for x in prop],
        "max difference (points)": diff,
    }
    return Outcome.judge(
        diff < 1.0,
        evidence=ev,
        explanation="softmax exponentiates before dividing: scores 2, 3, 5 get "
        f"{soft[0]:.1f}%, {soft[1]:.1f}%, {soft[2]:.1f}%, not 20/30/50",
        key_figure="softmax " + "/".join(f"{float(x):.1f}" for x in soft) + " % vs 20/30/50",
    )


@claim(
    "output-in-convex-hull",
    title="each output is a convex combination of the values: inside their convex hull",
    seed=SEED_002,
    quote=(
        "The convexity matters: the output for token $i$ is a convex combination of value vectors, so it lives "
        "in the convex hull of ${v_j}$.",
        "Attention can interpolate among values but cannot extrapolate beyond them",
    ),
)
def _convex_hull() -> Outcome:
    g = gen(101)
    q = torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) * 2
    k = torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) * 2
    v = torch.randn(1, 2, 64, 8, generator=g, dtype=torch.float64)
    worst_excess, worst_pv = -float("inf"), 0.0
    w = torch.randn(500, 8, generator=g, dtype=torch.float64)  # random support directions
    for m in (None, masks.causal()):
        out = attnlab.attention(q, k, v, mask=m, backend="flash")
        p = attnlab.attention_probs(q, k, mask=m)
        worst_pv = max(worst_pv, float((out - p @ v).abs().max()))
        proj_out = out @ w.T  # (1, 2, 64, 2000)
        proj_v = v @ w.T  # (1, 2, 64 keys, 2000)
        if m is None:
            support = proj_v.amax(2, keepdim=True)
        else:  # row i sees keys 0..i: running maximum over keys
            support = torch.cummax(proj_v, dim=2).values
        worst_excess = max(worst_excess, float((proj_out - support).max()))
    ok = worst_excess <= 1e-12 and worst_pv < 1e-12
    return Outcome.judge(
        ok,
        evidence={"max over 500 directions of w·out − max_j w·v_j": worst_excess, "max |out − P·V|": worst_pv},
        explanation="no output row of attnlab's flash kernel sticks out of its visible values' hull "
        "in any of 500 random directions (negative = strictly inside)",
        key_figure=f"max support excess {worst_excess:.2g}",
    )


@claim(
    "softmax-jacobian",
    title="the softmax Jacobian is diag(a) − a aᵀ (rows sum to 0: zero-sum coupling)",
    seed=SEED_002,
    quote="In matrix form $J = \\text{diag}(\\alpha) - \\alpha\\alpha^\\top$.",
)
def _jacobian_form() -> Outcome:
    s = torch.randn(12, generator=gen(102), dtype=torch.float64)
    J = _jacobian(s)
    a = softmax_via_attnlab(s)
    err = float((J - (torch.diag(a) - torch.outer(a, a))).abs().max())
    row = float(J.sum(0).abs().max())
    off = J - torch.diag(torch.diag(J))
    ok = err < 1e-12 and row < 1e-12 and float(off.max()) <= 0
    return Outcome.judge(
        ok,
        evidence={
            "max |J_autograd − (diag(a) − aaᵀ)|": err,
            "max |column sum|": row,
            "max off-diagonal": float(off.max()),
        },
        explanation="autograd through attnlab's softmax gives diag(a) − aaᵀ; raising one score "
        "drains every other weight (off-diagonals ≤ 0, sums 0)",
        key_figure=f"err {err:.1e}",
    )


def _saturation():
    s = torch.randn(16, generator=gen(103), dtype=torch.float64)
    out = {}
    for c in (1, 4, 16, 64):
        J = _jacobian(s * c)
        out[c] = (float(torch.linalg.matrix_norm(J, 2)), float(softmax_via_attnlab(s * c).max()))
    return out


@claim(
    "jacobian-vanishes-when-saturated",
    title="as one weight → 1, the whole softmax Jacobian → 0",
    seed=SEED_002,
    quote="When one $\\alpha_i \\to 1$ (saturated/confident attention), the whole Jacobian $\\to 0$ — the head stops "
    "learning where to look.",
)
def _jacobian_saturation() -> Outcome:
    sat = _saturation()
    norms = [n for n, _ in sat.values()]
    mono = all(b < a for a, b in itertools.pairwise(norms))
    ok = mono and norms[-1] < 1e-3 * norms[0] and list(sat.values())[-1][1] > 0.999
    ev = {f"‖J‖₂ at logit scale {c} (max weight {m:.4f})": n for c, (n, m) in sat.items()}
    return Outcome.judge(
        ok,
        evidence=ev,
        explanation="multiplying the logits makes the top weight → 1 and the spectral norm of "
        "attnlab's softmax Jacobian collapses",
        key_figure=f"‖J‖ {norms[0]:.2f} → {norms[-1]:.1e} (logits ×64)",
    )


@claim(
    "softmax-gradients-never-vanish",
    title="because softmax is differentiable and bounded, gradients do not vanish during backprop",
    seed=SEED_002,
    quote="Softmax Stability: Because Softmax is differentiable and bounded, gradients do not vanish during backprop.",
)
def _gradients_never_vanish() -> Outcome:
    g = gen(104)
    q0, k, v, w = (torch.randn(1, 2, 32, 16, generator=g, dtype=torch.float64) for _ in range(4))
    base, median, vanished = None, {}, {}
    for c in (1.0, 8.0, 64.0, 512.0):  # logits scaled by c
        q = (q0 * c).requires_grad_()
        (attnlab.attention(q, k, v) * w).sum().backward()
        grad = q.grad
        if grad is None:
            raise RuntimeError("attention gave q no gradient")
        rows = grad.norm(dim=-1).flatten()  # ‖∂L/∂q_i‖ per query row
        base = rows if base is None else base
        median[c] = float((rows / base).median())
        vanished[c] = float((rows / base < 1e-6).double().mean())
    ok = median[512.0] > 1e-3  # "do not vanish"
    return Outcome.judge(
        ok,
        evidence={
            **{f"median ‖∂L/∂q_i‖ relative to scale 1, logits ×{int(c)}": m for c, m in median.items()},
            **{f"rows with gradient < 1e-6 of scale 1, logits ×{int(c)}": f for c, f in vanished.items()},
        },
        explanation="through attnlab's attention backward, saturating the logits makes the "
        "gradient reaching the queries vanish row by row: bounded is not non-vanishing",
        key_figure=f"median row gradient ×{median[64.0]:.0e} (logits ×64), {vanished[512.0]:.0%} rows < 1e-6 (×512)",
    )


@claim(
    "temperature-limits",
    title="temperature interpolates softmax between argmax (hot scores) and the uniform mean (flat scores)",
    seed=SEED_002,
    quote=(
        "As the top score pulls ahead, its exponential dominates the normalizer and that weight collapses toward "
        "1 (retrieve the single best match); as scores flatten, the exponentials equalize and weights approach "
        "uniform (average over everything).",
        "so a head can set its own effective temperature by growing or shrinking W_QK.",
    ),
)
def _temperature() -> Outcome:
    g = gen(105)
    q = torch.randn(1, 1, 32, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 48, 16, generator=g, dtype=torch.float64)
    raw = q @ k.transpose(-1, -2)
    taus = (0.01, 0.1, 1.0, 10.0, 1000.0)
    ent, top, tv = [], [], []
    for t in taus:  # attnlab's scale= is the inverse temperature
        p = attnlab.attention_probs(q, k, scale=1.0 / t)
        ent.append(float(-(p * p.clamp_min(1e-300).log()).sum(-1).mean() / math.log(48)))
        top.append(float(p.amax(-1).mean()))
        tv.append(float((p - 1 / 48).abs().sum(-1).mean() / 2))
    cold = attnlab.attention_probs(q, k, scale=1.0 / taus[0])
    argmax_ok = bool((cold.argmax(-1) == raw.argmax(-1)).all())
    # W_QK absorbs the temperature: scaling W_Q by c equals scale × c
    with seeded(106):
        from attnlab.nn import MultiHeadAttention

        mha = MultiHeadAttention(32, 4, bias=False).double()
        hot = MultiHeadAttention(32, 4, bias=False, scale=3.0 / math.sqrt(8)).double()
    hot.load_state_dict(mha.state_dict())
    x = torch.randn(2, 10, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        mha.W_Q.mul_(3.0)
        gauge = float((mha(x) - hot(x)).abs().max())
    mono = all(b > a for a, b in itertools.pairwise(ent))
    ok = mono and top[0] > 0.99 and argmax_ok and tv[-1] < 1e-2 and gauge < 1e-12
    ev = {
        **{f"entropy/log N at τ={t:g}": e for t, e in zip(taus, ent, strict=True)},
        "top weight at τ=0.01": top[0],
        "argmax preserved at τ=0.01": argmax_ok,
        "TV distance to uniform at τ=1000": tv[-1],
        "max |MHA(3·W_Q) − MHA(scale×3)|": gauge,
    }
    return Outcome.judge(
        ok,
        evidence=ev,
        explanation="with attnlab's scale as 1/τ the entropy rises monotonically from one-hot at the "
        "argmax to uniform; scaling W_Q is the same dial",
        key_figure=f"top weight {top[0]:.3f} (τ=0.01) → TV {tv[-1]:.1e} to uniform (τ=1000)",
    )
