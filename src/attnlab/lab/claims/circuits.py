"""Claims about the QK and OV circuits: asymmetry, tied projections, rank, gauge freedom,
the factorization of a head, and attention as the only mover between positions."""

from __future__ import annotations

import math

import torch

from attnlab.lab.claims._measure import gen, seeded
from attnlab.lab.claims.registry import SEED_002, Outcome, Verdict, claim
from attnlab.nn import Decoder, DecoderConfig, MultiHeadAttention
from attnlab.positions import RoPE


def _mha(*args, seed=0, **kw) -> MultiHeadAttention:
    with seeded(seed):
        return MultiHeadAttention(*args, **kw).double()


def _scores(m: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Unscaled per-head scores ``q kᵀ (B, H, N, N)`` from the module's own projections."""
    q, k, _ = m.project(x)
    return q @ k.transpose(-1, -2)


def _asym(s: torch.Tensor) -> float:
    return float((s - s.transpose(-1, -2)).norm() / s.norm())


def _gaussian_weights(m: MultiHeadAttention, g: torch.Generator) -> None:
    """Weights N(0, 1/d_model): unit-variance q, k, v for unit-variance inputs."""
    with torch.no_grad():
        m.qkv_weight.copy_(
            torch.randn(m.qkv_weight.shape, generator=g, dtype=m.qkv_weight.dtype) / math.sqrt(m.d_model)
        )


@claim(
    "qk-asymmetry",
    title="q_i·k_j ≠ q_j·k_i in general because W_Q ≠ W_K: attention is directed",
    seed=SEED_002,
    quote="Note the asymmetry: $q_i \\cdot k_j \\neq q_j \\cdot k_i$ in general, because $W^Q \\neq W^K$.",
)
def _asymmetry() -> Outcome:
    g = gen(300)
    x = torch.randn(2, 24, 32, generator=g, dtype=torch.float64)
    m = _mha(32, 4, bias=False)
    with torch.no_grad():
        untied = _asym(_scores(m, x))
        pattern_untied = _asym(m(x, need_weights=True)[1])
        m.W_K.copy_(m.W_Q)  # W_Q = W_K
        tied = _asym(_scores(m, x))
        pattern_tied = _asym(m(x, need_weights=True)[1])
        S = torch.randn(m.d_head, m.d_head, generator=g, dtype=torch.float64)
        m.W_K.copy_(m.W_Q @ (S + S.T))  # W_K ≠ W_Q, yet W_Q W_Kᵀ symmetric
        sym_m = _asym(_scores(m, x))
    ev = {
        "score asymmetry ‖S−Sᵀ‖/‖S‖, random W_Q ≠ W_K": untied,
        "score asymmetry, W_K = W_Q": tied,
        "score asymmetry, W_K = W_Q·M with M symmetric (W_Q ≠ W_K)": sym_m,
        "pattern asymmetry ‖A−Aᵀ‖/‖A‖, W_Q ≠ W_K": pattern_untied,
        "pattern asymmetry, W_K = W_Q": pattern_tied,
    }
    if untied > 0.1 and tied < 1e-12:
        if sym_m < 1e-12:
            return Outcome(
                Verdict.HOLDS_UNDER_CONDITIONS,
                ev,
                "generic W_Q ≠ W_K gives directed scores; tying them makes the scores symmetric",
                conditions="W_Q W_Kᵀ not symmetric — W_Q ≠ W_K is not enough (W_K = W_Q·M with M symmetric "
                "keeps q_i·k_j = q_j·k_i); the softmax pattern A is asymmetric even with "
                f"W_Q = W_K (row normalization: {pattern_tied:.2f})",
                key_figure=f"asym {untied:.2f} (W_Q≠W_K) vs {tied:.0e} (tied), {sym_m:.0e} (sym. M)",
            )
        return Outcome(
            Verdict.HOLDS, ev, "W_Q ≠ W_K gives asymmetric scores", key_figure=f"asym {untied:.2f} vs {tied:.0e} tied"
        )
    return Outcome(
        Verdict.DOES_NOT_HOLD,
        ev,
        "the scores' asymmetry does not follow W_Q ≠ W_K",
        key_figure=f"asym {untied:.2f} vs {tied:.2f} tied",
    )


@claim(
    "tied-qk-collapses-to-mean",
    title="tying W_Q = W_K collapses attention to a naive mean",
    seed=SEED_002,
    quote=(
        "Claim: “Decoupling $W_Q = W_K$ collapses attention to a naive mean.” Resolution: Supported.",
        "If $W_Q = W_K$, the attention score becomes a quadratic form",
    ),
)
def _tied() -> Outcome:
    g = gen(301)
    N = 32
    x = torch.randn(4, N, 64, generator=g, dtype=torch.float64)
    m = _mha(64, 4, bias=False)
    _gaussian_weights(m, g)

    def stats():
        p = m(x, need_weights=True)[1]
        ent = float(-(p * p.clamp_min(1e-300).log()).sum(-1).mean() / math.log(N))
        self_w = float(torch.diagonal(p, dim1=-2, dim2=-1).mean())
        self_top = float((p.argmax(-1) == torch.arange(N)).double().mean())
        return ent, self_w, self_top

    with torch.no_grad():
        ent_u, self_u, _top_u = stats()
        m.W_K.copy_(m.W_Q)
        ent_t, self_t, top_t = stats()
        s = _scores(m, x)
        sym = _asym(s)
        min_eig = float(torch.linalg.eigvalsh((s + s.transpose(-1, -2)) / 2).min() / s.abs().max())
    ev = {
        "entropy/log N, tied": ent_t,
        "entropy/log N, untied": ent_u,
        "mean self weight, tied": self_t,
        "mean self weight, untied": self_u,
        "uniform weight 1/N": 1 / N,
        "rows whose argmax is self, tied": top_t,
        "score asymmetry, tied": sym,
        "min eigenvalue / max |score|, tied": min_eig,
    }
    mean_like = ent_t > 0.95
    return Outcome.judge(
        mean_like,
        evidence=ev,
        explanation="tied projections (weights N(0, 1/d_model)) give a symmetric PSD Gram score "
        f"x W Wᵀ xᵀ whose diagonal dominates: tokens attend to themselves ({self_t:.2f} vs 1/N={1 / N:.3f}), the "
        "opposite of a uniform mean",
        key_figure=f"tied: entropy {ent_t:.2f}·log N, self weight {self_t:.2f} (uniform {1 / N:.3f})",
    )


@claim(
    "qk-rank-bounded-by-dk",
    title="rank(W_Q W_Kᵀ) ≤ d_k: d_k is the rank budget of a head's bilinear form",
    seed=SEED_002,
    quote="rank(W_Q W_K^T) ≤ min(rank W_Q, rank W_K) ≤ d_k.",
)
def _rank() -> Outcome:
    m = _mha(64, 8, bias=False)
    x = torch.randn(1, 40, 64, generator=gen(302), dtype=torch.float64)
    with torch.no_grad():
        wqk = m.W_Q @ m.W_K.transpose(-1, -2)  # (H, d_model, d_model)
        ranks = [int(torch.linalg.matrix_rank(w)) for w in wqk]
        score_ranks = [int(torch.linalg.matrix_rank(s)) for s in _scores(m, x)[0]]
    ok = max(ranks) <= m.d_head and max(score_ranks) <= m.d_head
    return Outcome.judge(
        ok,
        evidence={
            "d_model": 64,
            "d_k": m.d_head,
            "rank W_QK per head": ranks,
            "rank of the 40×40 score matrix per head": score_ranks,
        },
        explanation=f"every head's 64×64 W_QK (and its 40×40 score matrix) has rank {max(ranks)} = d_k",
        key_figure=f"rank {max(ranks)} of 64×64 (d_k = {m.d_head})",
    )


@claim(
    "qk-gauge-freedom",
    title="W_Q M, W_K M⁻ᵀ leaves every score unchanged: only W_QK is meaningful",
    seed=SEED_002,
    quote="Only W_QK = W_Q W_K^T is invariant; the individual factors are gauge-arbitrary (insert any invertible M "
    "and M^{-1} between them with no change to the product).",
)
def _gauge() -> Outcome:
    g = gen(303)
    x = torch.randn(2, 16, 32, generator=g, dtype=torch.float64)
    dh = 8
    M = torch.randn(dh, dh, generator=g, dtype=torch.float64) + 2 * torch.eye(dh, dtype=torch.float64)
    Minv_T = torch.linalg.inv(M).T
    res = {}
    for name, pos in (("no positions", None), ("RoPE", RoPE(dh))):
        m = _mha(32, 4, bias=True, positions=pos)
        with torch.no_grad():
            before = m(x)
            wq_change = float((m.W_Q @ M - m.W_Q).norm() / m.W_Q.norm())
            m.W_Q.copy_(m.W_Q @ M)
            m.W_K.copy_(m.W_K @ Minv_T)
            m.b_Q.copy_(m.b_Q @ M)
            m.b_K.copy_(m.b_K @ Minv_T)
            res[name] = float((m(x) - before).abs().max() / before.abs().max())
    # with RoPE, an M that commutes with the rotations (c·I) still works
    m = _mha(32, 4, bias=True, positions=RoPE(dh))
    with torch.no_grad():
        before = m(x)
        m.W_Q.mul_(2.5)
        m.W_K.div_(2.5)
        m.b_Q.mul_(2.5)
        m.b_K.div_(2.5)
        commuting = float((m(x) - before).abs().max() / before.abs().max())
    ev = {
        "rel. change of W_Q": wq_change,
        "rel. change of output, no positions": res["no positions"],
        "rel. change of output, RoPE, general M": res["RoPE"],
        "rel. change of output, RoPE, M = 2.5·I": commuting,
    }
    if res["no positions"] < 1e-10 and commuting < 1e-10:
        if res["RoPE"] > 1e-3:
            return Outcome(
                Verdict.HOLDS_UNDER_CONDITIONS,
                ev,
                "the gauge change moves W_Q by ~100% yet leaves attnlab's output unchanged; RoPE, sitting "
                "between the projections and the dot product, restricts the freedom",
                conditions="no rotary positions between projection and dot product (with RoPE only M that "
                "commute with the rotations, such as c·I, leave the scores unchanged); biases "
                "transform with the weights",
                key_figure=f"Δout {res['no positions']:.0e} (no pos.), {res['RoPE']:.2f} (RoPE, general M)",
            )
        return Outcome(Verdict.HOLDS, ev, "any invertible M leaves the output unchanged")
    return Outcome(
        Verdict.DOES_NOT_HOLD, ev, "the gauge change altered the output", key_figure=f"Δout {res['no positions']:.1e}"
    )


@claim(
    "head-factors-into-qk-and-ov",
    title="a head is softmax(x W_QK xᵀ) times x W_OV: two collapsed matrices",
    seed=SEED_002,
    quote=(
        "scoreᵢⱼ = (xᵢW^Q)(xⱼW^K)^T = xᵢ(W^Q W^K^T)xⱼ^T = xᵢ·M·xⱼ^T.",
        "What a head writes is governed by a second collapsed matrix W_OV = W^V W^O acting on the residual stream",
    ),
)
def _factor() -> Outcome:
    m = _mha(32, 4, bias=False)
    x = torch.randn(2, 12, 32, generator=gen(304), dtype=torch.float64)
    with torch.no_grad():
        out = m(x)
        wqk = m.W_Q @ m.W_K.transpose(-1, -2)  # (H, d, d)
        wov = m.W_V @ m.W_O  # (H, d, d)
        s = torch.einsum("bid,hde,bje->bhij", x, wqk, x) * m.scale
        y = torch.einsum("bhij,bjd,hde->bie", s.softmax(-1), x, wov)
    err = float((y - out).abs().max() / out.abs().max())
    return Outcome.judge(
        err < 1e-12,
        evidence={"rel. max |Σ_h softmax(x W_QK xᵀ) x W_OV − MHA(x)|": err, "W_QK, W_OV shape": list(wqk.shape[1:])},
        explanation="attnlab's MultiHeadAttention output is rebuilt from each head's W_QK and W_OV alone",
        key_figure=f"rel err {err:.0e}",
    )


@claim(
    "attention-only-moves-between-positions",
    title="attention is the only operation that moves information between token positions",
    seed=SEED_002,
    quote=(
        "it is the only operation that moves information between token positions. MLPs, LayerNorm, and the "
        "nonlinearities all act strictly position-wise."
    ),
)
def _mover() -> Outcome:
    cfg = DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, positions="learned", max_positions=64)
    with seeded(305):
        model = Decoder(cfg).double().eval()
    g = gen(305)
    ids = torch.randint(0, 50, (1, 12), generator=g)
    other = ids.clone()
    other[0, 3] = (ids[0, 3] + 7) % 50  # change token 3 only

    def spread():
        with torch.no_grad():
            d = (model(ids).logits - model(other).logits).abs().amax(-1)[0]
        return float(d[4:].max()), float(d[3])

    later_with, _own_with = spread()
    with torch.no_grad():
        for b in model.blocks:  # silence every attention layer
            attn = b.attn
            if not isinstance(attn, MultiHeadAttention):
                raise TypeError(f"expected attention with an out_weight, got {type(attn).__name__}")
            attn.out_weight.zero_()
            if attn.out_bias is not None:
                attn.out_bias.zero_()
    later_without, own_without = spread()
    ok = later_with > 1e-3 and later_without <= 1e-12 and own_without > 1e-3
    return Outcome.judge(
        ok,
        evidence={
            "max logit change at later positions, with attention": later_with,
            "max logit change at later positions, attention zeroed": later_without,
            "logit change at the changed position, attention zeroed": own_without,
        },
        explanation="in a 2-layer attnlab Decoder (embeddings, LayerNorm, GELU MLPs) a changed token "
        "reaches later positions only through attention",
        key_figure=f"later-position change {later_with:.2g} → {later_without:.0f} without attention",
    )
