"""Attention sinks in a real model: which heads of the pretrained MiniLM park their mass
on [CLS] or [SEP], and how much of it they actually *write* (value-weighted).

For each head and each real (non-padding) query token, the raw sink mass is
``Σ_{j ∈ sink} p_ij``; the value-weighted mass uses ``p_ij‖v_j‖ / Σ_j p_ij‖v_j‖``
(Kobayashi et al. 2020) — a head that parks its attention on a token whose value vector
is small writes almost nothing there, so raw mass overstates the sink.  Averages are
over the real query tokens of a batch of varied sentences.  The model runs on attnlab's
fast path; patterns are recomputed per layer from the captured q and k
(:mod:`attnlab.interp.capture`).

>>> SENTENCES[0]
'The cat sat on the mat because it was tired.'
"""

from __future__ import annotations

from typing import Any

import torch

from attnlab.interp import detectors as D
from attnlab.interp.capture import capture

SENTENCES = [
    "The cat sat on the mat because it was tired.",
    "Attention is all you need, or so the title says.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "She sells sea shells by the sea shore.",
    "The quick brown fox jumps over the lazy dog.",
    "A transformer layer mixes tokens with attention and then transforms each token with an MLP.",
    "Keys and values are cached during decoding so that each new token attends to the past cheaply.",
    "If it rains tomorrow, the picnic will move indoors.",
    "The stock market fell sharply after the announcement.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "He played the violin beautifully at the concert last night.",
    "Machine translation systems once relied on recurrent networks with additive attention.",
    "Why do birds suddenly appear every time you are near?",
    "The committee postponed its decision until next week.",
    "Photosynthesis converts light energy into chemical energy.",
    "Good morning!",
]


def tokens_of(tokenizer, ids) -> list[str]:
    """Token strings for ``ids`` (for tables and the report)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is not None and hasattr(tok, "id_to_token"):
        return [tok.id_to_token(int(i)) or f"<{int(i)}>" for i in ids]
    return [str(int(i)) for i in ids]


@torch.no_grad()
def analyse(model, tokenizer, sentences=SENTENCES) -> dict:
    """Per-head sink masses of an encoder on ``sentences``: ``[layer, head]`` lists for raw
    and value-weighted mass on [CLS] (position 0) and on [SEP] (each row's last real token)."""
    b = tokenizer(list(sentences))
    ids, keep = b["input_ids"], b["attention_mask"].bool()
    B, N = ids.shape
    with capture(model, keep=("q", "k", "v")) as cap:
        model(ids, attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"])
    last = keep.long().sum(1) - 1  # [SEP] position per row
    kpos = torch.arange(N)
    cls_keys = (kpos == 0).view(1, 1, N).expand(B, N, N)
    sep_keys = (kpos.view(1, N) == last.view(B, 1)).view(B, 1, N).expand(B, N, N)
    rows = keep  # real query tokens only
    res: dict[str, Any] = {k: [] for k in ("cls", "cls_vw", "sep", "sep_vw", "entropy")}
    for l in cap.layers:
        p = cap.pattern(l)
        vw = D.value_weighted(p, cap[l].v)
        res["cls"].append(D.keys_mass(p, cls_keys, rows).tolist())
        res["sep"].append(D.keys_mass(p, sep_keys, rows).tolist())
        res["cls_vw"].append(D.keys_mass(vw, cls_keys, rows).tolist())
        res["sep_vw"].append(D.keys_mass(vw, sep_keys, rows).tolist())
        ent = -(p * p.clamp(min=1e-30).log()).sum(-1)  # (B, H, N)
        res["entropy"].append(D._masked_mean(ent, rows.unsqueeze(1)).tolist())
    t = {k: torch.tensor(v) for k, v in res.items()}
    sink = t["cls"] + t["sep"]
    sink_vw = t["cls_vw"] + t["sep_vw"]
    top = sink.flatten().argsort(descending=True)[:8].tolist()
    H = sink.shape[1]
    res["top_heads"] = [
        {"layer": i // H, "head": i % H, "raw": float(sink.flatten()[i]), "value_weighted": float(sink_vw.flatten()[i])}
        for i in top
    ]
    res["mean_raw"], res["mean_vw"] = float(sink.mean()), float(sink_vw.mean())
    res["heads_over_half_raw"] = int((sink > 0.5).sum())
    res["heads_over_half_vw"] = int((sink_vw > 0.5).sum())
    res["n_sentences"], res["n_heads"] = B, int(sink.numel())
    example = 2
    n = int(keep[example].sum())
    res["example"] = {"tokens": tokens_of(tokenizer, ids[example, :n]), "row": example, "length": n}
    return res


def run(sentences=SENTENCES) -> dict:
    """Load the pretrained MiniLM (``attnlab.models.load("minilm")``) and analyse it."""
    from attnlab.models import load

    model, tok = load("minilm")
    return analyse(model.eval(), tok, sentences)


def summary(res: dict) -> str:
    rows = [
        f"MiniLM sinks over {res['n_sentences']} sentences, {res['n_heads']} heads: mean mass on [CLS]+[SEP] "
        f"raw {res['mean_raw']:.2f}, value-weighted {res['mean_vw']:.2f}; heads with > half their mass there: "
        f"raw {res['heads_over_half_raw']}, value-weighted {res['heads_over_half_vw']}",
        f"{'head':>6} {'raw':>6} {'value-weighted':>15}",
    ]
    for h in res["top_heads"]:
        rows.append(f"L{h['layer']}H{h['head']:<3d} {h['raw']:6.2f} {h['value_weighted']:15.2f}")
    return "\n".join(rows)
