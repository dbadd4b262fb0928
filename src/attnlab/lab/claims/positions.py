"""Claims about order: permutation equivariance, RoPE's relative-offset identity, and
where position information enters."""

from __future__ import annotations

import math
from typing import Any

import torch

import attnlab
from attnlab.lab.claims._measure import gen, seeded
from attnlab.lab.claims.registry import SEED_002, Outcome, Verdict, claim
from attnlab.nn import MultiHeadAttention
from attnlab.positions import ALiBi, LearnedEmbedding, RoPE, sinusoidal


def _mha(*args, seed=0, **kw) -> MultiHeadAttention:
    with seeded(seed):
        return MultiHeadAttention(*args, **kw).double()


@claim(
    "permutation-equivariance",
    title="attention without positions is permutation-equivariant; positions (RoPE, sinusoidal) break it",
    seed=SEED_002,
    quote=(
        "Raw attention is permutation-equivariant: permute the input rows and the output permutes identically — "
        "$QK^\\top$ depends only on content, not order.",
        "Pure attention literally cannot tell “dog bites man” from “man bites dog.” Position must be injected:",
    ),
)
def _perm() -> Outcome:
    g = gen(400)
    N, d = 16, 32
    x = torch.randn(2, N, d, generator=g, dtype=torch.float64)
    perm = torch.randperm(N, generator=g)
    pe = sinusoidal(N, d, dtype=torch.float64)

    def err(m, table=None):
        """rel. |f(x)[π] − f(x[π])| with f(z) = m(z + table) (positions stay in place)."""
        with torch.no_grad():
            f = (lambda z: m(z + table)) if table is not None else m
            a, b = f(x)[:, perm], f(x[:, perm])
        return float((a - b).abs().max() / a.abs().max())

    plain = err(_mha(d, 4))
    rope = err(_mha(d, 4, positions=RoPE(d // 4)))
    sin = err(_mha(d, 4), pe)
    with seeded(401):
        table = LearnedEmbedding(N, d).double()
        torch.nn.init.normal_(table.weight)  # a trained-scale table, not the 0.02 init
    with torch.no_grad():
        learned = err(_mha(d, 4), table(torch.arange(N)))
    ok = plain < 1e-12 and min(rope, sin, learned) > 1e-2
    return Outcome.judge(
        ok,
        evidence={
            "rel. |MHA(x)[π] − MHA(x[π])|, no positions": plain,
            "same, RoPE": rope,
            "same, sinusoidal added to x": sin,
            "same, learned embedding added to x": learned,
        },
        explanation="permuting the tokens permutes attnlab's output exactly without positions; with "
        "RoPE, sinusoidal or learned embeddings the output depends on the order",
        key_figure=f"no pos. {plain:.0e}; RoPE {rope:.2f}; sinusoidal {sin:.2f}; learned {learned:.2f}",
    )


def _rope_scores(rope: RoPE, q: torch.Tensor, k: torch.Tensor, i, j) -> torch.Tensor:
    """``⟨R_i q, R_j k⟩`` for vectors ``q, k (P, D)`` at positions ``i, j`` (LongTensors ``(P,)``)."""
    rq = rope(q[:, None, None, :], i[:, None])[:, 0, 0]  # each pair is its own batch row, at its own position
    rk = rope(k[:, None, None, :], j[:, None])[:, 0, 0]
    return (rq * rk).sum(-1)


@claim(
    "rope-relative-offset",
    title="with RoPE, ⟨R_i q, R_j k⟩ = ⟨q, R_{j−i} k⟩: scores depend on the offset j − i only",
    seed=SEED_002,
    quote=(
        "$$\\langle R(i\\theta)q_i,; R(j\\theta)k_j\\rangle = \\langle q_i,; R((j-i)\\theta)k_j\\rangle$$",
        "The score depends only on the relative offset $j-i$, not absolute positions",
        "Different dimension pairs use geometrically spaced $\\theta_c$ (a la $10000^{-2c/d}$)",
    ),
)
def _rope_relative() -> Outcome:
    g = gen(401)
    D, P = 16, 64
    q = torch.randn(P, D, generator=g, dtype=torch.float64)
    k = torch.randn(P, D, generator=g, dtype=torch.float64)
    i = torch.randint(0, 2000, (P,), generator=g)
    j = torch.randint(0, 2000, (P,), generator=g)
    ev: dict[str, Any] = {}
    worst = 0.0
    for inter in (False, True):
        rope = RoPE(D, interleaved=inter).double()
        base = _rope_scores(rope, q, k, i, j)
        scale = float(base.abs().max())
        ident = float((base - _rope_scores(rope, q, k, torch.zeros_like(i), j - i)).abs().max()) / scale
        shift = max(float((_rope_scores(rope, q, k, i + s, j + s) - base).abs().max()) for s in (1, 37, 5000)) / scale
        name = "interleaved" if inter else "half-split"
        ev[f"identity error, {name}"] = ident
        ev[f"shift-invariance error, {name}"] = shift
        worst = max(worst, ident, shift)
    # through the attention op: rotating a whole sequence at offset 0 or 777 gives the same outputs
    rope = RoPE(D).double()
    qs = torch.randn(1, 2, 24, D, generator=g, dtype=torch.float64)
    ks = torch.randn(1, 2, 24, D, generator=g, dtype=torch.float64)
    vs = torch.randn(1, 2, 24, D, generator=g, dtype=torch.float64)
    o0 = attnlab.attention(rope(qs, 0), rope(ks, 0), vs)
    o1 = attnlab.attention(rope(qs, 777), rope(ks, 777), vs)
    ev["attention output change under a global shift of 777"] = op = float((o0 - o1).abs().max())
    f = rope.inv_freq.double()
    ratios = f[1:] / f[:-1]
    geo = float((ratios - 10000 ** (-2 / D)).abs().max())
    ev["max |θ_{c+1}/θ_c − 10000^(−2/d)|"] = geo
    ev["wavelengths 2π/θ (shortest, longest)"] = [2 * math.pi / float(f[0]), 2 * math.pi / float(f[-1])]
    ok = worst < 1e-9 and op < 1e-9 and geo < 1e-6
    return Outcome.judge(
        ok,
        evidence=ev,
        explanation="attnlab's RoPE (both pairings) satisfies the identity and is invariant to "
        "shifting both positions, through the attention op too; θ_c are geometric",
        key_figure=f"identity/shift error {max(worst, op):.0e}",
    )


@claim(
    "positions-only-change-qkv-input",
    title="swapping position schemes (RoPE, ALiBi, absolute) only changes the input to the QKV projections",
    seed=SEED_002,
    quote="Swapping them only changes the input to the QKV projections, leaving the core attention mechanism intact.",
)
def _surface() -> Outcome:
    """Test with a uniform pattern (W_Q = W_K = 0): the output is then the mean of the values, so
    it moves with positions exactly when position reaches the *values* or the *scores*."""
    g = gen(402)
    N, d, h = 12, 32, 4
    x = torch.randn(1, N, d, generator=g, dtype=torch.float64)
    shuffled = torch.randperm(N, generator=g) + 5

    def silence_qk(m):
        with torch.no_grad():
            m.W_Q.zero_()
            m.W_K.zero_()
            m.b_Q.zero_()
            m.b_K.zero_()
        return m

    with torch.no_grad():
        m = silence_qk(_mha(d, h, positions=RoPE(d // h)))
        rope_delta = float((m(x, pos=0) - m(x, pos=shuffled)).abs().max())
        m = silence_qk(_mha(d, h))
        pe = sinusoidal(64, d, dtype=torch.float64)
        abs_delta = float((m(x + pe[:N]) - m(x + pe[shuffled])).abs().max())
        # ALiBi never touches x or q, k, v: it biases the scores inside the op
        m = silence_qk(_mha(d, h, positions=ALiBi(h)))
        plain = silence_qk(_mha(d, h))
        alibi_delta = float((m(x) - plain(x)).abs().max())
    ev = {
        "output change from positions, RoPE (uniform pattern)": rope_delta,
        "output change from positions, absolute sinusoidal": abs_delta,
        "output change, ALiBi vs none (same q, k, v)": alibi_delta,
    }
    if rope_delta > 1e-9 and alibi_delta < 1e-9:
        return Outcome(Verdict.HOLDS, ev, "every scheme acts through the projections' input")
    if abs_delta > 1e-6:
        return Outcome(
            Verdict.HOLDS_UNDER_CONDITIONS,
            ev,
            "an absolute embedding moves the values (it enters X), RoPE leaves them untouched and ALiBi "
            "changes the pattern with the same q, k, v: both act inside attention",
            conditions="absolute (sinusoidal or learned) embeddings added to X only; RoPE rotates q and k "
            "after the projections and ALiBi adds a bias to the scores",
            key_figure=f"Δ with uniform pattern: abs {abs_delta:.2f}, RoPE {rope_delta:.0e}; ALiBi {alibi_delta:.2f}",
        )
    return Outcome(Verdict.DOES_NOT_HOLD, ev, "no scheme acts through the projections' input")
