"""Head detectors: what each head attends to, as ``[layer, head]`` scores.

Every detector reads attention patterns ``p (B, H, Nq, Nk)`` of one layer (rows sum to 1
over visible keys; query row ``i`` sits at key position ``i + Nk − Nq``, the bottom-right
convention of :func:`attnlab.attention`) and returns ``(H,)`` — the mean, over batch and
the rows where the detector is defined, of the attention mass on the keys it names:

==================  ===========================================================  ============================
detector            keys counted for query position ``i``                        rows averaged
==================  ===========================================================  ============================
previous_token      ``i − 1``                                                    ``i ≥ 1``
duplicate_token     ``j < i`` with ``tokens[j] == tokens[i]``                    rows with such a ``j``
induction           ``j`` with ``tokens[j − 1] == tokens[i]``, ``j ≤ i``          rows with such a ``j``
                    (prefix matching: the token *after* an earlier copy of the
                    current token).  On ``[x₁..x_T, x₁..x_T]`` this is the
                    diagonal ``j = i − T + 1``.
sink                ``j < k`` (the first ``k`` tokens, e.g. [CLS] / BOS)         ``i ≥ k`` (not the sink itself)
positional          ``i − d`` for the best fixed offset ``|d| ≤ max_offset``      rows where key ``i − d`` exists
custom              ``template[i, j]`` (bool or weights in [0, 1])               all rows with a visible key
==================  ===========================================================  ============================

:func:`value_weighted` replaces ``p`` by ``p_ij‖v_j‖ / Σ_j p_ij‖v_j‖`` (Kobayashi et al.
2020): a head parking its mass on a key whose value is ~0 (a sink) writes little, and
raw mass overstates it.  :func:`detect` runs a model once (fast path, via
:func:`attnlab.interp.capture`) and scores every layer.

>>> import torch
>>> p = torch.zeros(1, 2, 4, 4)
>>> p[0, 0] = torch.eye(4).roll(-1, dims=1).tril().clamp(min=0)  # head 0: previous token
>>> p[0, 0, 0, 0] = 1.0
>>> p[0, 1, :, 0] = 1.0                                           # head 1: the first token
>>> previous_token(p).tolist(), sink(p).tolist()
([1.0, 0.3333333432674408], [0.3333333432674408, 1.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DETECTORS = ("previous_token", "duplicate_token", "induction", "sink", "positional")


@dataclass
class HeadScores:
    """A ``[layer, head]`` score table: ``scores (L, H)`` with the layer indices it covers."""

    name: str
    scores: torch.Tensor
    layers: list
    threshold: float | None = None

    def heads(self, threshold: float | None = None) -> list[tuple[int, int]]:
        """``[(layer, head)]`` scoring at least ``threshold`` (default the detector's), best first."""
        t = self.threshold if threshold is None else threshold
        if t is None:
            raise ValueError(f"{self.name}: no threshold given")
        idx = (self.scores >= t).nonzero().tolist()
        out = [(self.layers[i], h) for i, h in idx]
        return sorted(out, key=lambda lh: -float(self.scores[self.layers.index(lh[0]), lh[1]]))

    def top(self, n: int = 5) -> list[tuple[int, int, float]]:
        flat = self.scores.flatten()
        order = flat.argsort(descending=True)[:n].tolist()
        H = self.scores.shape[1]
        return [(self.layers[i // H], i % H, float(flat[i])) for i in order]

    def __repr__(self) -> str:
        rows = [f"{self.name} [layer, head]" + ("" if self.threshold is None else f" (threshold {self.threshold})")]
        rows.append("      " + " ".join(f"{h:>5d}" for h in range(self.scores.shape[1])))
        for i, l in enumerate(self.layers):
            rows.append(f"L{l:<4d} " + " ".join(f"{float(s):5.2f}" for s in self.scores[i]))
        return "\n".join(rows)


def _check_p(p, name="pattern"):
    if not isinstance(p, torch.Tensor) or p.dim() != 4 or not p.is_floating_point():
        raise ValueError(
            f"{name}: expected a float pattern (B, H, Nq, Nk), got "
            f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}"
        )
    if p.shape[2] > p.shape[3]:
        raise ValueError(f"{name}: Nq={p.shape[2]} > Nk={p.shape[3]}; queries are the last Nq of the Nk keys")
    return p


def _check_tokens(tokens, p):
    t = torch.as_tensor(tokens)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.dtype.is_floating_point or t.shape[1] != p.shape[3] or t.shape[0] not in (1, p.shape[0]):
        raise ValueError(
            f"tokens: expected integer ids (B={p.shape[0]}, Nk={p.shape[3]}) or (Nk,), got {tuple(t.shape)} {t.dtype}"
        )
    return t.to(p.device)


def _masked_mean(mass, rows):
    """mass (B, H, Nq), rows (B or 1, 1, Nq) bool -> (H,) mean over the chosen rows."""
    rows = rows.to(mass.dtype).expand_as(mass)
    n = rows.sum(dim=(0, 2))
    return torch.where(n > 0, (mass * rows).sum(dim=(0, 2)) / n.clamp(min=1), torch.zeros_like(n))


def _qpos(p):
    Nq, Nk = p.shape[2], p.shape[3]
    return torch.arange(Nk - Nq, Nk, device=p.device)


def keys_mass(p, keys, rows=None) -> torch.Tensor:
    """The mass on ``keys (B or 1, Nq, Nk)`` (bool or weights), averaged over ``rows
    (B or 1, Nq)`` (default: rows with a visible key) -> ``(H,)``; the base of every detector."""
    p = _check_p(p)
    keys = torch.as_tensor(keys, device=p.device)
    mass = (p * keys.to(p.dtype).unsqueeze(1)).sum(-1)
    if rows is None:
        rows = p.sum(-1).amax(1, keepdim=True) > 0
    else:
        rows = torch.as_tensor(rows, device=p.device).unsqueeze(1)
    return _masked_mean(mass, rows)


def offset_mass(p, d: int) -> torch.Tensor:
    """``(H,)``: mean mass on key ``i − d`` over the rows where that key exists
    (``d < 0`` looks ahead, for bidirectional encoders)."""
    p = _check_p(p)
    qp = _qpos(p)
    kp = torch.arange(p.shape[3], device=p.device)
    keys = (kp.view(1, -1) == (qp - d).view(-1, 1)).unsqueeze(0)
    return keys_mass(p, keys, ((qp - d >= 0) & (qp - d < p.shape[3])).view(1, -1))


def previous_token(p) -> torch.Tensor:
    """``(H,)``: mean mass on the previous token (rows ``i ≥ 1``)."""
    return offset_mass(p, 1)


def duplicate_token(p, tokens) -> torch.Tensor:
    """``(H,)``: mean mass on earlier copies of the current token (rows that have one)."""
    p = _check_p(p)
    t = _check_tokens(tokens, p)
    qp = _qpos(p)
    kp = torch.arange(p.shape[3], device=p.device)
    same = t[:, qp].unsqueeze(-1) == t.unsqueeze(1)  # (B, Nq, Nk)
    keys = same & (kp.view(1, 1, -1) < qp.view(1, -1, 1))
    return keys_mass(p, keys, keys.any(-1))


def induction(p, tokens) -> torch.Tensor:
    """``(H,)``: mean mass on the tokens that followed earlier copies of the current token
    (prefix matching), over rows that have such a key."""
    p = _check_p(p)
    t = _check_tokens(tokens, p)
    qp = _qpos(p)
    kp = torch.arange(p.shape[3], device=p.device)
    prev = torch.cat([torch.full_like(t[:, :1], -1), t[:, :-1]], dim=1)  # token before key j
    # earlier copy at j - 1 < i, so the attended key j <= i; a key j = i would need tokens[i-1] == tokens[i]
    keys = (
        (t[:, qp].unsqueeze(-1) == prev.unsqueeze(1))
        & (kp.view(1, 1, -1) <= qp.view(1, -1, 1))
        & (kp.view(1, 1, -1) >= 1)
    )
    keys &= ~(kp.view(1, 1, -1) == qp.view(1, -1, 1))  # the current position is not a copy of itself
    return keys_mass(p, keys, keys.any(-1))


def sink(p, k: int = 1) -> torch.Tensor:
    """``(H,)``: mean mass on the first ``k`` key positions, over rows ``i ≥ k``."""
    p = _check_p(p)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected a positive int (number of sink tokens), got {k!r}")
    qp = _qpos(p)
    keys = (torch.arange(p.shape[3], device=p.device) < k).view(1, 1, -1)
    return keys_mass(p, keys, (qp >= k).view(1, -1))


def positional(p, max_offset: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(score (H,), offset (H,))``: the largest mean mass at one fixed relative offset
    ``d ∈ [−max_offset, max_offset]`` (key ``i − d``; negative = a later key, which only a
    bidirectional model can see) and that offset: a head attending by position, not content."""
    offsets = list(range(-max_offset, max_offset + 1))
    masses = torch.stack([offset_mass(p, d) for d in offsets])  # (D, H)
    score, i = masses.max(0)
    return score, torch.tensor(offsets, device=score.device)[i]


def custom(p, template) -> torch.Tensor:
    """``(H,)``: mean mass on ``template`` — a bool/float ``(Nq, Nk)`` or ``(B, Nq, Nk)`` tensor,
    or a callable ``(q_pos (Nq, 1), kv_pos (1, Nk)) -> bool tensor`` in absolute positions."""
    p = _check_p(p)
    if callable(template):
        qp = _qpos(p).view(-1, 1)
        template = template(qp, torch.arange(p.shape[3], device=p.device).view(1, -1))
    t = torch.as_tensor(template, device=p.device)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or tuple(t.shape[1:]) != tuple(p.shape[2:]):
        raise ValueError(f"template: expected (Nq, Nk)={tuple(p.shape[2:])} or (B, Nq, Nk), got {tuple(t.shape)}")
    return keys_mass(p, t)


def value_weighted(p, v) -> torch.Tensor:
    """``p_ij ‖v_j‖ / Σ_j p_ij ‖v_j‖`` for ``p (B, H, Nq, Nk)`` and ``v (B, Hkv, Nk, d)``
    (query head ``h`` reads kv head ``h // (H // Hkv)``); rows with no mass stay 0."""
    p = _check_p(p)
    if (
        not isinstance(v, torch.Tensor)
        or v.dim() != 4
        or v.shape[0] != p.shape[0]
        or v.shape[2] != p.shape[3]
        or p.shape[1] % v.shape[1]
    ):
        raise ValueError(
            f"v: expected (B={p.shape[0]}, Hkv dividing H={p.shape[1]}, Nk={p.shape[3]}, d), got "
            f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
        )
    n = v.float().norm(dim=-1).repeat_interleave(p.shape[1] // v.shape[1], dim=1)  # (B, H, Nk)
    w = p * n.unsqueeze(2).to(p.dtype)
    s = w.sum(-1, keepdim=True)
    return torch.where(s > 0, w / s.clamp(min=torch.finfo(w.dtype).tiny), torch.zeros_like(w))


def detect(
    model,
    input_ids,
    *,
    detectors=DETECTORS,
    layers=None,
    value_weighted_too: bool = False,
    sink_tokens: int = 1,
    thresholds: dict | None = None,
    forward=None,
    **forward_kw,
) -> dict:
    """Run ``model`` once on ``input_ids (B, N)`` and score every head.

    Returns ``{name: HeadScores}`` for each detector in ``detectors`` (and ``"<name>_vw"``
    value-weighted variants when ``value_weighted_too``).  ``forward(model, ids)`` overrides
    how the model is called (default ``model(input_ids, **forward_kw)``).  Patterns are
    materialized one layer at a time (``B·H·N²`` floats); for long contexts use
    :meth:`attnlab.interp.Capture.stats`.  Default thresholds: 0.4 for every detector.
    """
    from attnlab.interp.capture import capture

    unknown = [d for d in detectors if d not in DETECTORS]
    if unknown:
        raise ValueError(f"detectors: unknown {unknown}; expected some of {DETECTORS}")
    thr = {d: 0.4 for d in DETECTORS}
    thr.update(thresholds or {})
    with torch.no_grad(), capture(model, layers=layers) as cap:
        (forward or (lambda m, x: m(x, **forward_kw)))(model, input_ids)
    out: dict[str, list] = {}
    for l in cap.layers:
        p = cap.pattern(l, heads=None)
        variants = [("", p)] + ([("_vw", value_weighted(p, cap[l].v))] if value_weighted_too else [])
        for suffix, pp in variants:
            for d in detectors:
                if d == "previous_token":
                    s = previous_token(pp)
                elif d == "duplicate_token":
                    s = duplicate_token(pp, input_ids)
                elif d == "induction":
                    s = induction(pp, input_ids)
                elif d == "sink":
                    s = sink(pp, sink_tokens)
                else:
                    s = positional(pp)[0]
                out.setdefault(d + suffix, []).append(s.float().cpu())
    return {
        name: HeadScores(name, torch.stack(v), list(cap.layers), thr[name.removesuffix("_vw")])
        for name, v in out.items()
    }
