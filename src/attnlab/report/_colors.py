"""Colour-blind-safe colours: Okabe–Ito for series, ColorBrewer ramps for values.

* Series (lines, bars): the Okabe–Ito palette (Okabe & Ito 2008), distinguishable under
  the common colour-vision deficiencies; plots also vary the marker shape per series.
* Sequential values (attention weights, detector scores): ColorBrewer YlGnBu starting
  at white, monotone in lightness, so it also reads in greyscale.
* Signed values: a PuOr-like blue–white–orange diverging ramp.
"""

from __future__ import annotations

import math

SERIES = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#F0E442"]

SEQUENTIAL = [
    (255, 255, 255),
    (237, 248, 177),
    (199, 233, 180),
    (127, 205, 187),
    (65, 182, 196),
    (29, 145, 192),
    (34, 94, 168),
    (37, 52, 148),
    (8, 29, 88),
]
DIVERGING = [
    (33, 102, 172),
    (103, 169, 207),
    (209, 229, 240),
    (247, 247, 247),
    (254, 224, 182),
    (241, 163, 64),
    (179, 88, 6),
]


def series_color(i: int) -> str:
    return SERIES[i % len(SERIES)]


def ramp(t: float, anchors=SEQUENTIAL) -> tuple[int, int, int]:
    """Linear interpolation along ``anchors`` for ``t`` in [0, 1] (clamped)."""
    if not math.isfinite(t):
        t = 0.0
    t = min(1.0, max(0.0, t)) * (len(anchors) - 1)
    i = min(int(t), len(anchors) - 2)
    f = t - i
    a, b = anchors[i], anchors[i + 1]
    return tuple(round(a[c] + (b[c] - a[c]) * f) for c in range(3))


def css_rgb(rgb) -> str:
    r, g, b = rgb
    return f"#{r:02x}{g:02x}{b:02x}"


def text_on(rgb) -> str:
    """Black or white text, whichever reads better on ``rgb`` (relative luminance)."""

    def lin(c):
        c = c / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    y = 0.2126 * lin(rgb[0]) + 0.7152 * lin(rgb[1]) + 0.0722 * lin(rgb[2])
    return "#000" if y > 0.22 else "#fff"


class Scale:
    """Maps numbers to colours.

    Non-negative data: sequential from 0 (or ``vmin``) to the max (or ``vmax``).  Data with
    negative values: diverging, symmetric around 0.
    """

    def __init__(self, values, vmin=None, vmax=None):
        finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        lo = min(finite) if finite else 0.0
        hi = max(finite) if finite else 1.0
        if vmin is None and lo > 0:
            lo = 0.0  # non-negative data (scores, weights) are read against 0, not their minimum
        lo = lo if vmin is None else float(vmin)
        hi = hi if vmax is None else float(vmax)
        self.diverging = (lo < 0 and vmin is None) or lo < 0 < hi
        if self.diverging:
            m = max(-lo, hi, 0.0) or 1.0
            lo, hi = -m, m
        if hi <= lo:
            hi = lo + 1.0
        self.vmin, self.vmax = lo, hi

    def __call__(self, v) -> tuple[int, int, int] | None:
        if v is None or not math.isfinite(float(v)):
            return None
        t = (float(v) - self.vmin) / (self.vmax - self.vmin)
        return ramp(t, DIVERGING if self.diverging else SEQUENTIAL)

    def gradient_css(self) -> str:
        anchors = DIVERGING if self.diverging else SEQUENTIAL
        stops = ", ".join(css_rgb(c) for c in anchors)
        return f"linear-gradient(to right, {stops})"
