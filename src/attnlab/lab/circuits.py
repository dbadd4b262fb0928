"""Patching on real models: where the induction circuit lives, and what MiniLM routes.

**Induction** (the lab's trained 2-layer attention-only model, :mod:`attnlab.lab.induction`).
Clean rows are ``[x₁ … x_T, x₁ … x_{T−1}]``: at the last position (token ``x_{T−1}``) the
model predicts ``x_T`` by induction.  The corrupted rows change one token, ``x_{T−1}`` at
position ``T−2`` (the earlier copy of the current token), to a token not in the row: the
previous-token head can no longer mark position ``T−1`` as "preceded by ``x_{T−1}``", so the
induction head finds no match.  Metric: the logit difference ``x_T`` − the corrupting token
at the last position.  Patching the residual stream restores it at position ``T−2`` before
layer 0 and at ``T−1`` before layer 1 (the previous-token head moved the information one
step), head patching puts it in the previous-token head of layer 0 and the induction heads
of layer 1, and path patching shows the previous-token head acting through the induction
heads' *keys* (K-composition).

**MiniLM** (``models.load("minilm")``): "the cat sat on the mat …" against "the dog …";
metric: the cosine similarity of the mean-pooled sentence embedding to the clean one.

:func:`run` computes both and :func:`add_to_report` draws them (``attnlab.report``).
"""

from __future__ import annotations

from typing import Any

import torch

from attnlab.interp import activation_patching, agreement, attribution_patching, detect, path_patching

__all__ = ["induction_pair", "induction_patching", "minilm_patching", "run", "add_to_report"]


def induction_pair(cfg, T: int, B: int, seed: int = 0):
    """``(clean, corrupted, answer, wrong)``: ``(B, 2T−1)`` rows as in the module docstring."""
    if not 3 <= T < cfg.vocab:
        raise ValueError(f"T: expected 3 <= T < vocab={cfg.vocab}, got {T}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(cfg.vocab, generator=g) for _ in range(B)])
    first, other = perm[:, :T], perm[:, T]
    clean = torch.cat([first, first[:, :-1]], 1)
    corrupted = clean.clone()
    corrupted[:, T - 2] = other
    return clean, corrupted, first[:, T - 1], other


def induction_patching(model=None, cfg=None, *, T: int = 12, B: int = 8, seed: int = 5, progress=False) -> dict:
    """Residual × position, head, attribution and path patching on the trained induction model."""
    from attnlab.lab import induction as I

    cfg = cfg or I.InductionConfig()
    if model is None:
        model, _ = I.load_or_train(cfg, 2, progress=progress)
    clean, corrupted, answer, wrong = induction_pair(cfg, T, B, seed)
    kw = dict(answer=answer, wrong=wrong)
    scores = detect(model, I.repeated_tokens(cfg, 16, 8, seed=1), detectors=("previous_token", "induction"))
    resid = activation_patching(model, clean, corrupted, site="resid_pre", progress=progress, **kw)
    heads = activation_patching(model, clean, corrupted, site="z", by="head", progress=progress, **kw)
    a_resid = attribution_patching(model, clean, corrupted, site="resid_pre", **kw)
    a_heads = attribution_patching(model, clean, corrupted, site="z", by="head", **kw)
    last = len(model.blocks) - 1
    receivers = [lh for lh in scores["induction"].heads() if lh[0] == last]
    path_k = path_patching(model, clean, corrupted, receivers=receivers, receiver_input="k", progress=progress, **kw)
    path_q = path_patching(model, clean, corrupted, receivers=receivers, receiver_input="q", progress=progress, **kw)
    return {
        "T": T,
        "clean": clean,
        "corrupted": corrupted,
        "scores": scores,
        "resid": resid,
        "heads": heads,
        "resid_attribution": a_resid,
        "heads_attribution": a_heads,
        "path_k": path_k,
        "path_q": path_q,
        "receivers": receivers,
        "agreement_heads": agreement(heads, a_heads),
        "agreement_resid": agreement(resid, a_resid),
    }


def minilm_patching(*, progress=False) -> dict:
    """Head and residual patching on MiniLM for one clean/corrupted sentence pair."""
    from attnlab.models import load

    model, tok = load("minilm")
    a, b = "the cat sat on the mat because it was tired", "the dog sat on the mat because it was tired"
    clean, corrupted = tok([a])["input_ids"], tok([b])["input_ids"]
    if clean.shape != corrupted.shape:
        raise RuntimeError("minilm_patching: the two sentences tokenize to different lengths")
    with torch.no_grad():
        e0 = model(clean).last_hidden_state.mean(1)

    def similarity(h):
        return torch.nn.functional.cosine_similarity(h.mean(1), e0).mean()

    resid = activation_patching(model, clean, corrupted, site="resid_pre", progress=progress, metric=similarity)
    heads = activation_patching(model, clean, corrupted, site="z", by="head", progress=progress, metric=similarity)
    a_heads = attribution_patching(model, clean, corrupted, site="z", by="head", metric=similarity)
    changed = int((clean != corrupted).nonzero()[0, 1])
    return {
        "tokens": tok.to_str_tokens(clean[0]),
        "changed_position": changed,
        "resid": resid,
        "heads": heads,
        "heads_attribution": a_heads,
        "agreement_heads": agreement(heads, a_heads),
    }


def run(progress=False, minilm: bool = True) -> dict:
    out: dict[str, Any] = {"induction": induction_patching(progress=progress)}
    if minilm:
        try:
            out["minilm"] = minilm_patching(progress=progress)
        except ImportError:
            out["minilm"] = None
    return out


def add_to_report(r, res: dict):
    """Sections with the patching figures (head grids) and the agreement figures."""
    ind = res["induction"]
    T = ind["T"]
    hs = ind["heads"]
    r.section(
        "Patching the induction circuit",
        intro=f"Clean rows repeat {T} random tokens; the corrupted rows change the earlier copy of the last "
        f"token (position {T - 2}). Values: the fraction of the logit difference restored "
        "(0 = corrupted, 1 = clean) when one activation is patched from the clean run.",
    )
    r.head_grid(ind["resid"], title="Residual stream (resid_pre) by layer × position", col_label="pos")
    r.head_grid(hs, title="Per-head output (z) by layer × head")
    r.head_grid(ind["heads_attribution"], title="Attribution patching (gradient estimate), layer × head")
    r.head_grid(ind["path_k"], title="Path patching: sender head → induction heads' keys")
    top = ", ".join(f"L{l}H{h} {v:.2f}" for (l, h), v in hs.top(5))
    r.text(
        f"Top heads by patching effect: {top}. Attribution agrees with patching: Pearson r = "
        f"{ind['agreement_heads']:.3f} over heads, {ind['agreement_resid']:.3f} over layer × position."
    )
    m = res.get("minilm")
    if m:
        r.section(
            "Patching MiniLM",
            intro='"the cat sat on the mat …" against "the dog …"; metric: cosine '
            "similarity of the mean-pooled embedding to the clean one, restored "
            "fraction.",
        )
        r.head_grid(m["resid"], title="MiniLM resid_pre by layer × position", col_label="pos")
        r.head_grid(m["heads"], title="MiniLM per-head output (z) by layer × head")
        top = ", ".join(f"L{l}H{h} {v:.2f}" for (l, h), v in m["heads"].top(3))
        r.text(f"Top heads: {top}; attribution agreement r = {m['agreement_heads']:.3f}.")
    return r
