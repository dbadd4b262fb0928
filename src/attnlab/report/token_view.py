"""Token-to-token and head views in the manner of bertviz, offline.

Two columns of tokens, queries on the left and keys on the right; a line joins query
``i`` to key ``j`` with opacity proportional to the weight ``A[i, j]`` of the selected
layer and head.  The *head view* overlays every head of a layer, one colour per head
(bertviz's ``head_view``); the *token view* shows one head.  Hovering a token keeps only
its lines and lists its strongest partners with their weights; a layer and a head
selector switch the view (the head selector has "all heads").

Data: each head's ``[Nq, Nk]`` weights as one byte per cell, linear (``round(255·w)``;
weights are probabilities, so the resolution is 1/255 ≈ 0.004, below a visible line's
opacity step), base64 in a non-executable data block.  Token text reaches the page as
JSON in a data block and is drawn with ``fillText`` / set with ``textContent`` only.
Lines scale as ``Nq·Nk``: views are for sequences up to :data:`MAX_TOKENS`; longer ones
belong in :meth:`~attnlab.report.Report.heatmaps`.
"""

from __future__ import annotations

import base64

import numpy as np

from attnlab.report._colors import SEQUENTIAL
from attnlab.report._html import esc, json_for_script
from attnlab.report.heatmap import head_labels, normalize_patterns, token_strings

__all__ = ["token_view_html", "MAX_TOKENS", "HEAD_COLORS"]

MAX_TOKENS = 512
#: one colour per head in the head view (cycled), bertviz-like categorical palette
HEAD_COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#393b79",
    "#ad494a",
]


def token_view_html(
    patterns, tokens_q, tokens_k=None, *, title: str, fig_id: str, layer: int = 0, head="all", labels=None
) -> str:
    """The figure for :meth:`attnlab.report.Report.token_view` / :meth:`~attnlab.report.Report.head_view`."""
    layers = normalize_patterns(patterns)
    nq, nk = (int(s) for s in layers[0].shape[-2:])
    if max(nq, nk) > MAX_TOKENS:
        raise ValueError(
            f"patterns: Nq={nq}, Nk={nk}; the token view draws Nq·Nk lines and takes up to "
            f"{MAX_TOKENS} tokens; use Report.heatmaps for longer sequences (or slice the patterns)"
        )
    tq = token_strings(tokens_q, nq, "tokens_q", "Nq")
    if tokens_k is None and nk != nq:
        raise ValueError(f"tokens_k: the patterns have Nk = {nk} ≠ Nq = {nq}, so pass the key tokens too")
    tk = tq if tokens_k is None else token_strings(tokens_k, nk, "tokens_k", "Nk")
    shape = [int(p.shape[0]) for p in layers]
    L = len(layers)
    if isinstance(layer, bool) or not isinstance(layer, int) or not -L <= layer < L:
        raise ValueError(f"layer: expected an int in [-{L}, {L}), got {layer!r}")
    layer %= L
    H = shape[layer]
    if head != "all" and (isinstance(head, bool) or not isinstance(head, int) or not -H <= head < H):
        raise ValueError(f"head: expected 'all' or an int in [-{H}, {H}) for layer {layer}, got {head!r}")
    if head != "all":
        head %= H
    for i, p in enumerate(layers):
        m = float(p.max())
        if m > 1 + 1e-3:
            raise ValueError(
                f"patterns: layer {i} has weights up to {m:.4g}; the token view shows attention probabilities in [0, 1]"
            )
    names = head_labels(labels, shape)
    heads: list[dict] = []
    blocks: list[str] = []
    for li, p in enumerate(layers):
        for hi in range(p.shape[0]):
            codes = np.rint(np.clip(np.asarray(p[hi], dtype=np.float32), 0, 1) * 255).astype(np.uint8)
            heads.append({"l": li, "h": hi, "label": names[li][hi]})
            b64 = base64.b64encode(np.ascontiguousarray(codes).tobytes()).decode("ascii")
            blocks.append(
                f'<script type="application/octet-stream" class="al-tv-b64" data-i="{len(blocks)}">{b64}</script>'
            )
    cfg = {
        "nq": nq,
        "nk": nk,
        "layers": shape,
        "heads": heads,
        "tq": tq,
        "tk": tk,
        "layer": layer,
        "head": head,
        "colors": HEAD_COLORS,
        "anchors": SEQUENTIAL,
    }
    return (
        f'<figure class="al-fig al-tv" id="{fig_id}" data-ready="0"><figcaption>{esc(title)}</figcaption>'
        f'<div class="al-tv-app"></div>'
        f'<noscript><p class="al-note">The token view needs JavaScript.</p></noscript>'
        f'<script type="application/json" class="al-tv-config">{json_for_script(cfg)}</script>'
        + "".join(blocks)
        + "</figure>"
    )
