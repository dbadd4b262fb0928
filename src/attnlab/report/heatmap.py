"""Attention heatmaps that stay usable at 4,096 × 4,096 and beyond.

How the data travels
--------------------
Each head's ``[Nq, Nk]`` pattern is quantized to one byte per cell on a **log scale**
relative to the head's largest weight ``top``::

    code 0          weight < floor · top                      (shown as "< floor·top")
    code 1 … 255    weight ≈ top · floor ** (1 − (code − 1) / 254)

so every weight from ``top`` down to ``floor · top`` (default ``floor = 1e-5``: five decades)
keeps a relative error under ±2.3 %, which a linear byte could not do for the tiny weights
of long rows.  The bytes are zlib-compressed (causal zeros and flat tails shrink a lot),
base64-encoded, and stored per head in a non-executable ``<script type="application/
octet-stream">`` block; the browser inflates them with the built-in ``DecompressionStream``
(no library).  Measured sizes of the whole page (``tests/report/test_report.py``):

    6 × 12 × 512 × 512     ~11 MB synthetic causal; ~19.5 MB real MiniLM-L6 (bidirectional)
    1 × 4 × 4096 × 4096    ~37 MB synthetic causal with noisy tails; ~7.5 MB with floor=1e-3

(raw uint8 would be 18.9 MB and 67 MB; JSON floats, as bertviz/circuitsvis embed, ~20×
more).  Raising ``floor`` is the knob for smaller files: the noise in long rows' tails is
what costs bytes, and it is invisible on the linear and √ colour scales.

How it is drawn
---------------
The page draws on ``<canvas>``.  A view larger than the canvas is **max-pooled** into tiles
of ``tq × tk`` cells (one tile per device pixel or more; "mean" is a choice in the page),
and the status line states the pooling and the tile size.  Zoom (drag a box, or click the
plot and use the wheel, ``+``/``-``, arrow keys to pan, double-click or ``Esc`` to reset)
down to single cells, where the axes show the token text and large cells print their weight.
Hovering shows the query token, the key token and the weight (for a tile: the tile's
range and the cell holding its maximum).  All token text reaches the page as JSON inside
a data block and is only ever put into the DOM with ``textContent`` or drawn with
``fillText``: it is never parsed as HTML.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from attnlab.report._colors import SEQUENTIAL, ramp
from attnlab.report._html import esc, json_for_script
from attnlab.report._util import to_numpy

__all__ = ["quantize_log", "dequantize_log", "encode_head", "heatmap_html", "COLOR_MODES", "POOL_MODES"]

COLOR_MODES = ("linear", "sqrt", "log")
POOL_MODES = ("max", "mean")
LEVELS = 254  # codes 1..255


def quantize_log(x, floor: float) -> tuple[np.ndarray, float]:
    """Log-quantize one non-negative 2-D pattern to uint8 codes; returns (codes, top).

    >>> codes, top = quantize_log(np.array([[0.5, 0.25], [1e-7, 0.0]]), 1e-5)
    >>> codes.tolist(), top
    ([[255, 240], [0, 0]], 0.5)
    """
    x = np.asarray(x, dtype=np.float32)
    top = float(x.max()) if x.size else 0.0
    if top <= 0.0:
        return np.zeros(x.shape, dtype=np.uint8), 0.0
    lo = np.float32(top * floor)
    u = np.log(np.maximum(x, lo * np.float32(0.5)) / np.float32(top))  # float32 throughout
    u *= np.float32(LEVELS / math.log(1.0 / floor))
    u += np.float32(LEVELS + 1)
    np.rint(u, out=u)
    np.clip(u, 1, 255, out=u)
    codes = u.astype(np.uint8)
    codes[x < lo] = 0
    return codes, top


def dequantize_log(codes: np.ndarray, top: float, floor: float) -> np.ndarray:
    """Inverse of :func:`quantize_log` (float64); code 0 decodes to 0."""
    c = codes.astype(np.float64)
    v = top * floor ** (1.0 - (c - 1.0) / LEVELS)
    return np.where(codes == 0, 0.0, v)


def encode_head(codes: np.ndarray, level: int = 6) -> str:
    """zlib-compress and base64-encode one head's codes (row-major)."""
    return base64.b64encode(zlib.compress(np.ascontiguousarray(codes).tobytes(), level)).decode("ascii")


def code_to_t(mode: str, floor: float) -> list[float]:
    """Colour position in [0, 1] for each code 0..255 under a colour mode (mirrors the JS)."""
    out = [0.0]
    for c in range(1, 256):
        r = floor ** (1.0 - (c - 1) / LEVELS)
        out.append(r if mode == "linear" else math.sqrt(r) if mode == "sqrt" else 0.06 + 0.94 * (c - 1) / LEVELS)
    return out


def _png_palette(idx: np.ndarray, palette: list[tuple[int, int, int]]) -> bytes:
    """A minimal 8-bit palette PNG (for the no-JavaScript fallback image)."""
    h, w = idx.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + row.tobytes() for row in np.ascontiguousarray(idx, dtype=np.uint8))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0))
        + chunk(b"PLTE", bytes(c for rgb in palette for c in rgb))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def _as_array(x, name: str) -> np.ndarray:
    """Numbers as a numpy array without copying where possible (bf16/fp16 become float32)."""
    if isinstance(x, torch.Tensor):
        if x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{name}: expected real attention weights, got dtype {x.dtype}")
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        return x.numpy()
    a = to_numpy(x, name)
    if (
        a.dtype == object
        or a.dtype == bool
        or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating))
    ):
        raise ValueError(f"{name}: expected real numbers, got an array of dtype {a.dtype}")
    return a


def normalize_patterns(patterns) -> list[np.ndarray]:
    """A list of per-layer ``[H, Nq, Nk]`` arrays from any accepted input form."""
    if isinstance(patterns, (list, tuple)) and patterns and not isinstance(patterns[0], (int, float)):
        first = _as_array(patterns[0], "patterns[0]")
        if first.ndim <= 1:  # a nested list of numbers: one 2-D pattern
            layers = [_as_array(patterns, "patterns")]
        else:
            layers = [first] + [_as_array(p, f"patterns[{i}]") for i, p in enumerate(patterns[1:], 1)]
            for i, p in enumerate(layers):
                if p.ndim != 3:
                    hint = " (a batch dimension? pass p[0] for one sequence)" if p.ndim == 4 else ""
                    raise ValueError(
                        f"patterns[{i}]: expected a [H, Nq, Nk] tensor per layer, got shape {tuple(p.shape)}{hint}"
                    )
            return _check(layers)
    else:
        layers = [_as_array(patterns, "patterns")]
    t = layers[0]
    if t.ndim == 4:
        return _check(list(t))
    if t.ndim == 3:
        return _check([t])
    if t.ndim == 2:
        return _check([t[None]])
    raise ValueError(
        f"patterns: expected [L, H, Nq, Nk] (or [H, Nq, Nk], [Nq, Nk], or a list of [H, Nq, Nk]), "
        f"got shape {tuple(t.shape)}"
    )


def _check(layers: list[np.ndarray]) -> list[np.ndarray]:
    nq, nk = layers[0].shape[-2:]
    for i, p in enumerate(layers):
        if tuple(p.shape[-2:]) != (nq, nk):
            raise ValueError(
                f"patterns: layer {i} has Nq×Nk = {tuple(p.shape[-2:])}, layer 0 has {(nq, nk)}; "
                "all layers must share one sequence"
            )
        if p.shape[0] == 0 or nq == 0 or nk == 0:
            raise ValueError(f"patterns: layer {i} has an empty dimension, shape {tuple(p.shape)}")
        for h, x in enumerate(p):  # per head: no layer-sized temporaries
            if np.issubdtype(x.dtype, np.floating):
                bad = int(np.count_nonzero(~np.isfinite(x)))
                if bad:
                    raise ValueError(f"patterns: layer {i} head {h} has {bad} NaN/infinite weights")
            lo = x.min()
            if lo < 0:
                raise ValueError(
                    f"patterns: layer {i} head {h} has {int(np.count_nonzero(x < 0))} negative weights "
                    f"(min {float(lo):.4g}); attention heatmaps show non-negative weights"
                )
    return layers


def token_strings(tokens, n: int, name: str, dim: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(f"{name}: expected a list of {n} token strings, got {type(tokens).__name__}")
    if len(tokens) != n:
        raise ValueError(f"{name}: got {len(tokens)} tokens but the patterns have {dim} = {n}")
    return [t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t) for t in tokens]


def head_labels(labels, shape: list[int]) -> list[list[str]]:
    out = [[""] * h for h in shape]
    if labels is None:
        return out
    if isinstance(labels, Mapping):
        for key, text in labels.items():
            if not (
                isinstance(key, tuple) and len(key) == 2 and 0 <= key[0] < len(shape) and 0 <= key[1] < shape[key[0]]
            ):
                raise ValueError(
                    f"labels: key {key!r} is not a (layer, head) pair inside {len(shape)} layers × {shape} heads"
                )
            out[key[0]][key[1]] = str(text)
        return out
    if len(labels) != len(shape) or any(len(row) != h for row, h in zip(labels, shape, strict=True)):
        raise ValueError(
            f"labels: expected {len(shape)} rows of {shape} head labels (or a {{(layer, head): text}} dict)"
        )
    return [[str(s) for s in row] for row in labels]


def heatmap_html(
    patterns,
    tokens_q=None,
    tokens_k=None,
    *,
    title: str,
    labels=None,
    floor: float = 1e-5,
    color: str = "sqrt",
    pool: str = "max",
    fig_id: str,
    level: int = 6,
) -> str:
    """The figure for :meth:`attnlab.report.Report.heatmaps`."""
    if not (isinstance(floor, (int, float)) and 0 < floor < 1):
        raise ValueError(f"floor: expected a number in (0, 1), got {floor!r}")
    if color not in COLOR_MODES:
        raise ValueError(f"color: expected one of {COLOR_MODES}, got {color!r}")
    if pool not in POOL_MODES:
        raise ValueError(f"pool: expected one of {POOL_MODES}, got {pool!r}")
    layers = normalize_patterns(patterns)
    nq, nk = (int(s) for s in layers[0].shape[-2:])
    tq = token_strings(tokens_q, nq, "tokens_q", "Nq")
    if tokens_k is None and nk != nq:
        raise ValueError(f"tokens_k: the patterns have Nk = {nk} ≠ Nq = {nq}, so pass the key tokens too")
    tk = tq if tokens_k is None else token_strings(tokens_k, nk, "tokens_k", "Nk")
    shape = [int(p.shape[0]) for p in layers]
    names = head_labels(labels, shape)
    heads: list[dict] = []
    blocks: list[str] = []
    fallback = ""
    for li, p in enumerate(layers):
        for hi in range(p.shape[0]):
            codes, top = quantize_log(p[hi], floor)
            b64 = encode_head(codes, level)
            heads.append({"l": li, "h": hi, "top": top, "label": names[li][hi], "n": len(b64)})
            blocks.append(
                f'<script type="application/octet-stream" class="al-b64" data-i="{len(blocks)}">{b64}</script>'
            )
            if not fallback:
                fallback = _fallback_img(codes, color, floor, title)
    cfg = {
        "nq": nq,
        "nk": nk,
        "floor": floor,
        "color": color,
        "pool": pool,
        "anchors": SEQUENTIAL,
        "layers": shape,
        "heads": heads,
        "tq": tq,
        "tk": tk,
    }
    return (
        f'<figure class="al-fig al-heat" id="{fig_id}" data-ready="0"><figcaption>{esc(title)}</figcaption>'
        f'<div class="al-heat-app"></div>'
        f'<noscript><p class="al-note">The interactive view needs JavaScript; below: layer 0, head 0, '
        f"max-pooled, no tokens.</p>{fallback}</noscript>"
        f'<script type="application/json" class="al-config">{json_for_script(cfg)}</script>'
        + "".join(blocks)
        + "</figure>"
    )


def _fallback_img(codes: np.ndarray, color: str, floor: float, title: str, side: int = 256) -> str:
    nq, nk = codes.shape
    kq, kk = max(1, math.ceil(nq / side)), max(1, math.ceil(nk / side))
    pad = np.zeros((math.ceil(nq / kq) * kq, math.ceil(nk / kk) * kk), dtype=np.uint8)
    pad[:nq, :nk] = codes
    pooled = pad.reshape(pad.shape[0] // kq, kq, pad.shape[1] // kk, kk).max(axis=(1, 3))
    palette = [ramp(v) for v in code_to_t(color, floor)]
    b64 = base64.b64encode(_png_palette(pooled, palette)).decode("ascii")
    return f'<img class="al-fallback" alt="{esc(title)}" src="data:image/png;base64,{b64}">'
