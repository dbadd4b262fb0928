"""Claims about masking: the causal mask keeps the past fixed; a large finite constant
in place of −∞."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks
from attnlab.lab.claims._measure import gen, seeded
from attnlab.lab.claims.registry import SEED_002, Outcome, Verdict, claim
from attnlab.nn import Decoder, DecoderConfig


@claim(
    "causal-mask-keeps-past-fixed",
    title="with a causal mask, outputs (and keys/values) of past tokens never change when later tokens change",
    seed=SEED_002,
    quote=(
        "this is what makes the $n^2$ structure a strict prefix-causal computation and what enables KV-caching "
        "at inference (keys/values for past tokens never change, so they’re computed once)",
        "so the surviving weights still sum to 1 over the visible prefix",
    ),
)
def _causal() -> Outcome:
    g = gen(500)
    B, H, N, D, t = 2, 4, 200, 32, 77
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):  # rewrite every token from t on
        x[:, :, t:] = torch.randn(B, H, N - t, D, generator=g) * 5
    ev = {}
    for be in ("reference", "flash", "auto"):
        a = attnlab.attention(q, k, v, mask=masks.causal(), backend=be)
        b = attnlab.attention(q2, k2, v2, mask=masks.causal(), backend=be)
        ev[f"max change of outputs before t, {be}"] = float((a[:, :, :t] - b[:, :, :t]).abs().max())
    p = attnlab.attention_probs(q, k, mask=masks.causal())
    ev["max weight on a future key"] = float(p.triu(1).abs().max())
    ev["max |visible row sum − 1|"] = float((p.sum(-1) - 1).abs().max())
    cfg = DecoderConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, positions="rope")
    with seeded(501):
        model = Decoder(cfg).eval()
    ids = torch.randint(0, 64, (2, 24), generator=g)
    ids2 = ids.clone()
    ids2[:, 12:] = torch.randint(0, 64, (2, 12), generator=g)
    with torch.no_grad():
        ev["max change of Decoder logits before t"] = float(
            (model(ids).logits[:, :12] - model(ids2).logits[:, :12]).abs().max()
        )
    worst = max(v for k_, v in ev.items() if k_.startswith("max change"))
    ok = worst <= 1e-6 and ev["max weight on a future key"] == 0.0 and ev["max |visible row sum − 1|"] < 1e-5
    return Outcome.judge(
        ok,
        evidence=ev,
        explanation="rewriting every token from position t on leaves attnlab's outputs before t "
        "unchanged (reference, flash, SDPA, a 2-layer Decoder)",
        key_figure=f"past outputs change by {worst:.1g}",
    )


@claim(
    "mask-large-negative-constant",
    title="in practice −∞ is a large negative constant such as −1e9",
    seed=SEED_002,
    quote="In practice $-\\infty$ is a large negative constant (e.g. $-10^9$).",
)
def _large_negative() -> Outcome:
    g = gen(502)
    Nq, Nk, D = 6, 10, 16
    q = torch.randn(1, 1, Nq, D, generator=g)
    k = torch.randn(1, 1, Nk, D, generator=g)
    v = torch.randn(1, 1, Nk, D, generator=g)
    qpos = torch.arange(Nq).view(-1, 1)
    kpos = torch.arange(Nk).view(1, -1)
    allowed = (kpos <= qpos + 2) & (qpos > 0)  # row 0 sees nothing
    mask = masks.custom(lambda b, h, qp, kp: (kp <= qp + 2) & (qp > 0))
    ours = attnlab.attention(q, k, v, mask=mask, q_offset=0)
    s = (q @ k.transpose(-1, -2)) / D**0.5
    big = (s + torch.where(allowed, 0.0, -1e9)).softmax(-1) @ v
    inf = (s + torch.where(allowed, 0.0, float("-inf"))).softmax(-1) @ v
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    vis = float((big[..., 1:, :] - ours[..., 1:, :]).abs().max())
    full_big = float((big[..., 0, :] - v.mean(2)).abs().max())
    ev = {
        "max |−1e9 − attnlab|, rows with a visible key": vis,
        "fully masked row, −1e9: distance to the mean of all values": full_big,
        "fully masked row, attnlab: max |out|": float(ours[..., 0, :].abs().max()),
        "fully masked row, additive −inf + softmax: NaN": bool(torch.isnan(inf[..., 0, :]).any()),
        "fully masked row, torch SDPA: max |out|": float(sdpa[..., 0, :].abs().max()),
    }
    if vis < 1e-6 and full_big < 1e-6:
        return Outcome(
            Verdict.HOLDS_UNDER_CONDITIONS,
            ev,
            "−1e9 gives attnlab's weights whenever a row sees a key; a row that sees none silently "
            "averages every hidden value, where attnlab's −inf returns 0 and plain −inf gives NaN",
            conditions="every row has at least one visible key (padding, document or window masks can "
            "empty a row; there −1e9 attends uniformly to the masked keys)",
            key_figure=f"visible rows equal ({vis:.0e}); empty row = mean of hidden V",
        )
    return Outcome.judge(
        vis < 1e-6, evidence=ev, explanation="−1e9 and −∞ agree on every row", key_figure=f"visible rows {vis:.0e}"
    )
