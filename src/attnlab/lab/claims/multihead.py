"""Claims about multi-head attention: parameter and compute budget, the concatenation and W_O."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

import attnlab
from attnlab.lab.claims._measure import flops, gen, seeded
from attnlab.lab.claims.registry import SEED_000, SEED_002, Outcome, Verdict, claim
from attnlab.nn import MultiHeadAttention


def _mha(*args, seed=0, **kw) -> MultiHeadAttention:
    with seeded(seed):
        return MultiHeadAttention(*args, **kw).double()


def _heads(mha: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The per-head attention outputs ``z (B, H, N, d_head)`` of ``mha`` (no positions, no mask)."""
    q, k, v = mha.project(x)
    return attnlab.attention(q, k, v, scale=mha.scale)


def _torch_mha(mha: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    """``torch.nn.MultiheadAttention`` holding the same weights as an (MHA, bias-free) attnlab module."""
    t = torch.nn.MultiheadAttention(mha.d_model, mha.n_heads, bias=False, batch_first=True).double()
    with torch.no_grad():
        t.in_proj_weight.copy_(mha.qkv_weight)  # rows: Q heads, K heads, V heads (same layout)
        t.out_proj.weight.copy_(mha.out_weight)
    return t


@claim(
    "multihead-budget-equals-one-head",
    title="at d_k = d_v = d_model/h, h heads have the parameters and the FLOPs of one full-width head",
    seed=SEED_002,
    quote=(
        "While the $d_k = d_v = d{model}/h$ split makes multi-head parameter-equivalent to single-head",
        "This means multi-head attention allocates the same rank budget differently, rather than adding net "
        "parameter capacity.",
    ),
)
def _budget() -> Outcome:
    d, N = 64, 32
    x = torch.randn(2, N, d, generator=gen(200), dtype=torch.float64)
    params, fl = {}, {}
    for h in (1, 2, 4, 8, 16):
        m = _mha(d, h, backend="reference")
        params[h] = sum(p.numel() for p in m.parameters())
        with torch.no_grad():
            fl[h] = flops(lambda m=m: m(x))
    ok = len(set(params.values())) == 1 and len(set(fl.values())) == 1
    return Outcome.judge(
        ok,
        evidence={
            **{f"parameters, h={h}": p for h, p in params.items()},
            **{f"forward FLOPs, h={h}": f for h, f in fl.items()},
        },
        explanation="attnlab's MultiHeadAttention(d_model=64) has the same parameter count and "
        "matmul FLOPs (N=32) for h = 1..16 heads",
        key_figure=f"{params[1]} params, {fl[1] / 1e6:.2f} MFLOP for every h",
    )


@claim(
    "concat-scaled-by-inverse-sqrt-h",
    title="multi-head output scales the concatenated heads by 1/sqrt(h) before W_O",
    seed=SEED_002,
    quote="Typically, one sums the outputs scaled by $\\frac{1}{\\sqrt{h}}$: $$ \\text{Output}_{heads} = "
    "\\frac{1}{\\sqrt{h}} \\text{Concat}(\\text{Head}_1, \\dots, \\text{Head}_h) $$",
)
def _concat_scale() -> Outcome:
    d, h = 64, 8
    m = _mha(d, h, bias=False)
    x = torch.randn(2, 12, d, generator=gen(201), dtype=torch.float64)
    with torch.no_grad():
        ours = m(x)
        ref = _torch_mha(m)(x, x, x, need_weights=False)[0]
        z = _heads(m, x).transpose(1, 2).reshape(2, 12, h * m.d_head)
        plain = F.linear(z, m.out_weight)  # Concat(heads) W_O
        seed = F.linear(z / math.sqrt(h), m.out_weight)  # the seed's variant
    e_ours = float((ours - ref).abs().max())
    e_plain = float((plain - ref).abs().max())
    e_seed = float((seed - ref).norm() / ref.norm())
    ratio = float(seed.norm() / ref.norm())
    ok = e_seed < 1e-6  # the claim holds only if the 1/sqrt(h) variant is what the standard computes
    return Outcome.judge(
        ok,
        evidence={
            "max |attnlab − torch.nn.MultiheadAttention|": e_ours,
            "max |Concat(heads)·W_O − torch|": e_plain,
            "rel. error of the 1/sqrt(h) variant vs torch": e_seed,
            "‖1/sqrt(h) variant‖ / ‖torch‖": ratio,
        },
        explanation="torch.nn.MultiheadAttention and attnlab apply W_O to the plain concatenation; "
        f"the seed's 1/sqrt(h) would shrink every output by {ratio:.3f} (h={h})",
        key_figure=f"attnlab = torch (err {e_ours:.0e}); 1/√h variant off by ×{ratio:.3f}",
    )


@claim(
    "w-o-shape-dh-by-d",
    title="W_O has shape (D·h) × D",
    seed=SEED_002,
    quote="Where $W_O \\in \\mathbb{R}^{(D \\times h) \\times D}$ projects the aggregated head information back to "
    "the original model dimension $D$.",
)
def _wo_shape_seed() -> Outcome:
    d, h = 64, 8
    m = _mha(d, h, bias=False)
    t = _torch_mha(m)
    concat_width = m.n_heads * m.d_head
    ours = tuple(m.out_weight.T.shape)  # (in, out) = (h·d_head, d_model)
    torch_shape = tuple(t.out_proj.weight.T.shape)
    seed_shape = (d * h, d)
    z = torch.zeros(1, concat_width, dtype=torch.float64)
    try:
        z @ torch.zeros(seed_shape, dtype=torch.float64)
        seed_fits = True
    except RuntimeError:
        seed_fits = False
    ok = ours == seed_shape and torch_shape == seed_shape
    return Outcome.judge(
        ok,
        evidence={
            "attnlab W_O (in × out)": list(ours),
            "torch out_proj (in × out)": list(torch_shape),
            "seed's (D·h) × D": list(seed_shape),
            "concatenated width h·d_head": concat_width,
            "seed's W_O fits the concatenation": seed_fits,
        },
        explanation=f"W_O maps the {concat_width}-wide concatenation (h·d_head) to d_model; a "
        f"({d * h}×{d}) matrix does not even multiply it",
        key_figure=f"W_O {ours[0]}×{ours[1]} (h·d_k × d_model), not {seed_shape[0]}×{seed_shape[1]}",
    )


@claim(
    "w-o-square",
    title="in standard transformers W_O is a square d_model × d_model matrix",
    seed=SEED_000,
    quote="in standard transformers, W_O is a square d_model x d_model matrix that transforms features while "
    "preserving tensor shape.",
)
def _wo_square() -> Outcome:
    cases = {
        "d_model=64, h=8": dict(d_model=64, n_heads=8),
        "d_model=64, h=8, GQA 2 kv heads": dict(d_model=64, n_heads=8, n_kv_heads=2),
        "d_model=48, h=4, d_head=16 (h·d_head ≠ d_model)": dict(d_model=48, n_heads=4, d_head=16),
    }
    ev: dict[str, Any] = {}
    square: dict[str, bool] = {}
    for name, kw in cases.items():
        m = _mha(**kw)
        x = torch.randn(1, 5, kw["d_model"], generator=gen(202), dtype=torch.float64)
        with torch.no_grad():
            shape_kept = tuple(m(x).shape) == tuple(x.shape)
        s = tuple(m.out_weight.T.shape)
        square[name] = s[0] == s[1]
        ev[f"W_O (in × out), {name}"] = list(s)
        ev[f"output shape preserved, {name}"] = shape_kept
    all_kept = all(v for k, v in ev.items() if k.startswith("output shape"))
    if all(square.values()):
        return Outcome(Verdict.HOLDS, ev, "every configuration gives a square W_O", key_figure="square in every case")
    rect = next(ev[f"W_O (in × out), {n}"] for n, sq in square.items() if not sq)
    if any(square.values()) and all_kept:
        return Outcome(
            Verdict.HOLDS_UNDER_CONDITIONS,
            ev,
            "W_O is (h·d_head) × d_model: square exactly when h·d_head = d_model; the output keeps the "
            "input's shape either way",
            conditions="h·d_head = d_model (the usual d_head = d_model/h, GQA included); models that set "
            "d_head independently (e.g. Gemma-7B: 16 × 256 = 4096 vs d_model 3072) have a "
            "rectangular W_O",
            key_figure=f"square iff h·d_head = d_model; else e.g. {rect[0]}×{rect[1]}",
        )
    return Outcome(Verdict.DOES_NOT_HOLD, ev, "W_O is not square in the standard configuration")


@claim(
    "w-o-mixes-heads",
    title="W_O is block-partitioned by head (MHA = Σ_m head_m W_O^m) and mixes every head into every feature",
    seed=SEED_002,
    quote=(
        "$\\text{MHA}(X) = \\sum_m (\\text{head}_m) W^O_m$, where $W^O_m$ is head $m$‘s slice.",
        "Without $W_O$, heads would feed the residual stream as disjoint, non-interacting signals.",
    ),
)
def _wo_mixes() -> Outcome:
    d, h = 64, 8
    m = _mha(d, h)
    x = torch.randn(2, 10, d, generator=gen(203), dtype=torch.float64)
    with torch.no_grad():
        out = m(x)
        z = _heads(m, x)  # (B, H, N, d_head)
        parts = torch.einsum("bhnd,hdm->bhnm", z, m.W_O)  # head m's write through its slice W_O[m]
        block = float((parts.sum(1) + m.b_O - out).abs().max())
        touched = (parts.abs() > 1e-12).float().mean(dim=(0, 2)).mean(0)  # per output coordinate
        cover_wo = float((parts.abs().amax(dim=(0, 2)) > 1e-12).float().mean())
        eye = torch.eye(h * m.d_head, dtype=torch.float64).view(h, m.d_head, h * m.d_head)
        parts_id = torch.einsum("bhnd,hdm->bhnm", z, eye)  # no W_O: concatenation only
        cover_id = float((parts_id.abs().amax(dim=(0, 2)) > 1e-12).float().mean())
    ok = block < 1e-12 and cover_wo == 1.0 and abs(cover_id - 1 / h) < 1e-12
    return Outcome.judge(
        ok,
        evidence={
            "max |Σ_m head_m W_O^m + b_O − MHA(X)|": block,
            "output coordinates each head writes, with W_O": cover_wo,
            "output coordinates each head writes, without W_O": cover_id,
            "mean fraction of nonzero writes": float(touched.mean()),
        },
        explanation="attnlab's output is exactly the sum of per-head writes through W_O's slices; "
        f"each head reaches all {d} features through W_O but only {m.d_head} without it",
        key_figure=f"each head writes {cover_wo:.0%} of features (vs {cover_id:.1%} without W_O)",
    )
