"""Static SVG line and bar plots (no JavaScript needed).

Axes get ticks at round numbers (1, 2, 5 × 10ᵏ on a linear axis; decades on a log axis,
with 2 and 5 in between when the range is short), grid lines, axis labels and a legend
when there is more than one series.  Series colours are Okabe–Ito (colour-blind safe)
and, where markers are drawn (≤ 60 points), each series has its own marker shape.  Every
marker and bar carries an SVG ``<title>``: the browser shows its exact value on hover
without any script.  A line with more than 2,000 points is reduced to the minimum and
maximum of each of 1,000 buckets, which keeps its envelope (spikes stay visible).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import numpy as np

from attnlab.report._colors import series_color
from attnlab.report._html import esc
from attnlab.report._util import to_float_array

__all__ = ["linear_ticks", "log_ticks", "line_plot_svg", "bar_plot_svg"]

W, H = 760, 400
FONT = 12
_SUP = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _tw(s: str, size: float = FONT) -> float:
    """Rough rendered width of ``s`` in px (system sans-serif)."""
    return sum(0.35 if c in "il.,:;1|'!" else (1.0 if ord(c) > 0x2E80 else 0.6) for c in s) * size


def _fmt_lin(ticks: list[float], step: float) -> list[str]:
    m = max(abs(t) for t in ticks) if ticks else 0.0
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if m >= 10 * div:
            dec = max(0, -math.floor(math.log10(step / div) + 1e-9))
            return [f"{t / div:.{dec}f}{suf}" if t else "0" for t in ticks]
    if 0 < m < 1e-3:
        e = math.floor(math.log10(m))
        dec = max(0, e - math.floor(math.log10(step) + 1e-9))
        return [f"{t:.{dec}e}".replace("e-0", "e-") if t else "0" for t in ticks]
    dec = max(0, -math.floor(math.log10(step) + 1e-9))
    return [(f"{t:.{dec}f}" if abs(t) > step * 1e-6 else f"{0:.{dec}f}") for t in ticks]


def linear_ticks(lo: float, hi: float, n: int = 6) -> tuple[float, float, list[float], list[str]]:
    """Round-number ticks covering [lo, hi]: (domain_lo, domain_hi, ticks, labels).

    >>> linear_ticks(0.03, 0.97)[2:]
    ([0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0], ['0.0', '0.2', '0.4', '0.6', '0.8', '1.0'])
    >>> linear_ticks(0, 48213)[3]
    ['0', '10k', '20k', '30k', '40k', '50k']
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"axis range must be finite, got [{lo}, {hi}]")
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if raw <= m * mag * (1 + 1e-9))
    a = math.floor(lo / step + 1e-9) * step
    b = math.ceil(hi / step - 1e-9) * step
    k = round((b - a) / step)
    ticks = [a + i * step for i in range(k + 1)]
    return a, b, ticks, _fmt_lin(ticks, step)


def _pow10(e: int, mult: int = 1) -> str:
    if -3 <= e <= 3:
        v = mult * 10.0**e
        return f"{v:.{max(0, -e)}f}"
    return (f"{mult}×" if mult != 1 else "") + "10" + str(e).translate(_SUP)


def log_ticks(lo: float, hi: float) -> tuple[float, float, list[float], list[str], list[float]]:
    """Decade ticks for a log axis: (domain_lo, domain_hi, ticks, labels, minor_ticks).

    >>> log_ticks(0.003, 250.0)[3]
    ['0.001', '0.01', '0.1', '1', '10', '100', '1000']
    >>> log_ticks(2e-7, 3e-5)[3]
    ['10⁻⁷', '10⁻⁶', '10⁻⁵', '10⁻⁴']
    """
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"a log axis needs a positive finite range, got [{lo}, {hi}]")
    e0 = math.floor(math.log10(lo) + 1e-9)
    e1 = math.ceil(math.log10(hi) - 1e-9)
    if e1 == e0:
        e1 += 1
    span = e1 - e0
    stride = max(1, math.ceil(span / 8))
    ticks, labels = [], []
    for e in range(e0, e1 + 1):
        if (e - e0) % stride == 0:
            ticks.append(10.0**e)
            labels.append(_pow10(e))
        if span <= 2 and e < e1:
            for m in (2, 5):
                ticks.append(m * 10.0**e)
                labels.append(_pow10(e, m))
    minor = [m * 10.0**e for e in range(e0, e1) for m in range(2, 10)] if span <= 6 else []
    order = sorted(range(len(ticks)), key=ticks.__getitem__)
    return 10.0**e0, 10.0**e1, [ticks[i] for i in order], [labels[i] for i in order], minor


class _Axis:
    def __init__(self, lo, hi, log, a, b, include_zero=False):
        if log:
            self.d0, self.d1, self.ticks, self.labels, self.minor = log_ticks(lo, hi)
        else:
            if include_zero:
                lo, hi = min(lo, 0.0), max(hi, 0.0)
            self.d0, self.d1, self.ticks, self.labels = linear_ticks(lo, hi)
            self.minor = []
        self.log, self.a, self.b = log, a, b

    def __call__(self, v):
        if self.log:
            t = (math.log10(v) - math.log10(self.d0)) / (math.log10(self.d1) - math.log10(self.d0))
        else:
            t = (v - self.d0) / (self.d1 - self.d0)
        return self.a + t * (self.b - self.a)


def _n(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _marker(kind: int, x: float, y: float, color: str, tip: str) -> str:
    r = 3.5
    t = f"<title>{esc(tip)}</title>"
    kind %= 5
    if kind == 0:
        return f'<circle cx="{_n(x)}" cy="{_n(y)}" r="{r}" fill="{color}">{t}</circle>'
    if kind == 1:
        return f'<rect x="{_n(x - r)}" y="{_n(y - r)}" width="{2 * r}" height="{2 * r}" fill="{color}">{t}</rect>'
    if kind == 2:
        pts = f"{_n(x)},{_n(y - r * 1.2)} {_n(x - r * 1.1)},{_n(y + r * 0.8)} {_n(x + r * 1.1)},{_n(y + r * 0.8)}"
    elif kind == 3:
        pts = f"{_n(x)},{_n(y - r * 1.3)} {_n(x + r * 1.1)},{_n(y)} {_n(x)},{_n(y + r * 1.3)} {_n(x - r * 1.1)},{_n(y)}"
    else:
        return (
            f'<path d="M{_n(x - r)} {_n(y - r)}L{_n(x + r)} {_n(y + r)}M{_n(x - r)} {_n(y + r)}L{_n(x + r)} '
            f'{_n(y - r)}" stroke="{color}" stroke-width="2">{t}</path>'
        )
    return f'<polygon points="{pts}" fill="{color}">{t}</polygon>'


def _legend_swatch(kind: int, x: float, y: float, color: str, line: bool, marker: bool) -> str:
    if not line:
        return f'<rect x="{_n(x + 4)}" y="{_n(y - 6)}" width="14" height="12" fill="{color}"/>'
    out = f'<line x1="{_n(x)}" y1="{_n(y)}" x2="{_n(x + 22)}" y2="{_n(y)}" stroke="{color}" stroke-width="2.5"/>'
    return out + (_marker(kind, x + 11, y, color, "").replace("<title></title>", "") if marker else "")


def _frame(xa: _Axis, ya: _Axis, x_label, y_label, title, *, x_cat=None, vgrid=True, xlabel_y=None) -> list[str]:
    """Grid, axes, ticks and labels; ``x_cat`` = [(x, label)] for categorical x ticks."""
    L, R, T, B = xa.a, xa.b, ya.b, ya.a
    o = [f"<title>{esc(title)}</title>", '<g class="al-grid-lines">']
    for v in ya.minor:
        if ya.d0 < v < ya.d1:
            o.append(f'<line class="al-minor" x1="{_n(L)}" x2="{_n(R)}" y1="{_n(ya(v))}" y2="{_n(ya(v))}"/>')
    for v in ya.ticks:
        o.append(f'<line x1="{_n(L)}" x2="{_n(R)}" y1="{_n(ya(v))}" y2="{_n(ya(v))}"/>')
    if vgrid and x_cat is None:
        for v in xa.ticks:
            o.append(f'<line x1="{_n(xa(v))}" x2="{_n(xa(v))}" y1="{_n(T)}" y2="{_n(B)}"/>')
    o.append("</g>")
    o.append(f'<path class="al-axis" d="M{_n(L)} {_n(T)}V{_n(B)}H{_n(R)}"/>')
    for v, s in zip(ya.ticks, ya.labels, strict=True):
        y = ya(v)
        o.append(
            f'<line class="al-axis" x1="{_n(L - 5)}" x2="{_n(L)}" y1="{_n(y)}" y2="{_n(y)}"/>'
            f'<text x="{_n(L - 8)}" y="{_n(y + 4)}" text-anchor="end">{esc(s)}</text>'
        )
    if x_cat is None:
        for v, s in zip(xa.ticks, xa.labels, strict=True):
            x = xa(v)
            o.append(
                f'<line class="al-axis" x1="{_n(x)}" x2="{_n(x)}" y1="{_n(B)}" y2="{_n(B + 5)}"/>'
                f'<text x="{_n(x)}" y="{_n(B + 19)}" text-anchor="middle">{esc(s)}</text>'
            )
    ylw = max((_tw(s) for s in ya.labels), default=0)
    o.append(
        f'<text class="al-axis-label" x="{_n((L + R) / 2)}" y="{_n(xlabel_y or B + 40)}" '
        f'text-anchor="middle">{esc(x_label)}</text>'
    )
    yx = max(14.0, L - ylw - 22)
    o.append(
        f'<text class="al-axis-label" transform="translate({_n(yx)} {_n((T + B) / 2)}) rotate(-90)" '
        f'text-anchor="middle">{esc(y_label)}</text>'
    )
    return o


def _legend(names: list[str], x: float, y: float, line: bool, markers: bool) -> list[str]:
    o = ['<g class="al-legend">']
    for i, name in enumerate(names):
        yy = y + i * 20
        short = name if len(name) <= 28 else name[:27] + "…"
        sw = _legend_swatch(i, x, yy, series_color(i), line, markers)
        o.append(f'{sw}<text x="{_n(x + 28)}" y="{_n(yy + 4)}"><title>{esc(name)}</title>{esc(short)}</text>')
    o.append("</g>")
    return o


def _legend_width(names: list[str]) -> float:
    return 40 + max(_tw(n if len(n) <= 28 else n[:27] + "…") for n in names) if names else 0


def _series(series, x, log_y: bool, log_x: bool) -> list[tuple[str, np.ndarray, np.ndarray]]:
    if not isinstance(series, Mapping):
        series = {"": series}
    if not series:
        raise ValueError("series: expected at least one series, got an empty mapping")
    shared = None if x is None else to_float_array(x, "x", 1)
    out = []
    for name, s in series.items():
        what = f"series[{name!r}]"
        if isinstance(s, tuple) and len(s) == 2:
            xs, ys = to_float_array(s[0], what + " xs", 1), to_float_array(s[1], what + " ys", 1)
        else:
            ys = to_float_array(s, what, 1)
            xs = shared if shared is not None else np.arange(len(ys), dtype=np.float64)
        if len(xs) != len(ys):
            src = "x" if shared is not None and not isinstance(s, tuple) else what
            raise ValueError(f"{src}: {len(xs)} x values for {len(ys)} y values in {what}; they must match")
        if len(ys) == 0:
            raise ValueError(f"{what}: is empty")
        if np.isinf(ys).any() or np.isinf(xs).any() or np.isnan(xs).any():
            raise ValueError(f"{what}: contains infinities (or NaN x); NaN y values are allowed and leave a gap")
        ok = ~np.isnan(ys)
        if log_y and (ys[ok] <= 0).any():
            raise ValueError(
                f"{what}: log_y=True needs positive y values, got min {ys[ok].min():.4g}; "
                "drop or clip the non-positive values first"
            )
        if log_x and (xs <= 0).any():
            raise ValueError(f"{what}: log_x=True needs positive x values, got min {xs.min():.4g}")
        out.append((str(name), xs, ys))
    if all(np.isnan(ys).all() for _, _, ys in out):
        raise ValueError("series: every y value is NaN; nothing to plot")
    return out


def _decimate(xs: np.ndarray, ys: np.ndarray, buckets: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of each bucket (in x order), for very long lines."""
    n = len(xs)
    if n <= 2 * buckets or not (np.diff(xs) >= 0).all():
        return xs, ys
    keep = []
    edges = np.linspace(0, n, buckets + 1).astype(int)
    for a, b in itertools.pairwise(edges):
        seg = ys[a:b]
        if np.isnan(seg).all():
            keep.append(a)
            continue
        i, j = a + int(np.nanargmin(seg)), a + int(np.nanargmax(seg))
        if np.isnan(seg).any():
            keep.append(a + int(np.flatnonzero(np.isnan(seg))[0]))
        keep.extend(sorted({i, j}))
    idx = np.array(sorted(set(keep)))
    return xs[idx], ys[idx]


def _g(v: float) -> str:
    return f"{v:.6g}"


def line_plot_svg(series, *, title, x_label, y_label, log_y=False, x=None, log_x=False) -> str:
    """An SVG line plot; see :meth:`attnlab.report.Report.line_plot`."""
    data = _series(series, x, log_y, log_x)
    names = [n for n, _, _ in data]
    show_legend = len(data) > 1 or names[0] != ""
    allx = np.concatenate([xs for _, xs, _ in data])
    ally = np.concatenate([ys[~np.isnan(ys)] for _, _, ys in data])
    ya_probe = _Axis(float(ally.min()), float(ally.max()), log_y, 0, 1)
    left = 30 + max(_tw(s) for s in ya_probe.labels) + 16
    right = W - (_legend_width(names) + 18 if show_legend else 24)
    top, bottom = 14, H - 52
    xa = _Axis(float(allx.min()), float(allx.max()), log_x, left, right)
    ya = _Axis(float(ally.min()), float(ally.max()), log_y, bottom, top)
    height = max(H, top + 20 * len(names) + 10) if show_legend else H
    o = [f'<svg class="al-plot" viewBox="0 0 {W} {height}" role="img" aria-label="{esc(title)}">']
    o += _frame(xa, ya, x_label, y_label, title)
    few = max(len(xs) for _, xs, _ in data) <= 60
    for i, (name, xs, ys) in enumerate(data):
        color = series_color(i)
        dx, dy = _decimate(xs, ys)
        d, pen = [], False
        for xv, yv in zip(dx, dy, strict=True):
            if math.isnan(yv):
                pen = False
                continue
            d.append(("L" if pen else "M") + f"{_n(xa(xv))} {_n(ya(yv))}")
            pen = True
        label = esc(name or title)
        o.append(f'<path class="al-line" d="{"".join(d)}" stroke="{color}"><title>{label}</title></path>')
        if few:
            for xv, yv in zip(xs, ys, strict=True):
                if not math.isnan(yv):
                    tip = (f"{name}: " if name else "") + f"{x_label} = {_g(xv)}, {y_label} = {_g(yv)}"
                    o.append(_marker(i, xa(xv), ya(yv), color, tip))
    if show_legend:
        o += _legend(names, right + 18, top + 8, True, few)
    o.append("</svg>")
    return "".join(o)


def bar_plot_svg(values, *, title, labels=None, x_label, y_label, log_y=False) -> str:
    """An SVG bar plot (grouped when several series); see :meth:`attnlab.report.Report.bar_plot`."""
    if isinstance(values, Mapping):
        if not values:
            raise ValueError("values: expected at least one series, got an empty mapping")
        data = [(str(k), to_float_array(v, f"values[{k!r}]", 1)) for k, v in values.items()]
    else:
        data = [("", to_float_array(values, "values", 1))]
    n = len(data[0][1])
    for name, v in data:
        if len(v) != n:
            raise ValueError(f"values: series {name!r} has {len(v)} values, the first has {n}; they must match")
        if not np.isfinite(v).all():
            raise ValueError(f"values: series {name!r} has NaN or infinite values")
        if log_y and (v <= 0).any():
            raise ValueError(f"values: log_y=True needs positive values, series {name!r} has min {v.min():.4g}")
    if n == 0:
        raise ValueError("values: no values to plot")
    if labels is None:
        labels = [str(i) for i in range(n)]
    else:
        labels = [str(s) for s in labels]
        if len(labels) != n:
            raise ValueError(f"labels: got {len(labels)} labels for {n} bars per series")
    names = [k for k, _ in data]
    m = len(data)
    show_legend = m > 1 or names[0] != ""
    allv = np.concatenate([v for _, v in data])
    vlo, vhi = float(allv.min()), float(allv.max())
    if log_y:
        vlo /= 1.5  # a bar exactly at a decade would have no height on the bottom decade
    elif n * m <= 12:  # room for the value labels above (below) the bars
        pad = 0.1 * (max(vhi, 0.0) - min(vlo, 0.0))
        vlo, vhi = (vlo - pad if vlo < 0 else vlo), (vhi + pad if vhi > 0 else vhi)
    ya_probe = _Axis(vlo, vhi, log_y, 0, 1, include_zero=True)
    left = 30 + max(_tw(s) for s in ya_probe.labels) + 16
    right = W - (_legend_width(names) + 18 if show_legend else 24)
    band = (right - left) / n
    lw = max(_tw(s) for s in labels)
    every = max(1, math.ceil((lw + 8) / band)) if lw + 8 > band else 1
    rotate = every > 1 and lw > 24 and n <= 40
    if rotate:
        every = max(1, math.ceil(18 / band))
    extra = min(lw, 120) * 0.7 if rotate else 0
    top, bottom = 14, H - 52 - extra
    height = max(H, top + 20 * m + 10) if show_legend else H
    xa = _Axis(0.0, float(n), False, left, right)
    ya = _Axis(vlo, vhi, log_y, bottom, top, include_zero=True)
    o = [f'<svg class="al-plot" viewBox="0 0 {W} {height}" role="img" aria-label="{esc(title)}">']
    o += _frame(xa, ya, x_label, y_label, title, x_cat=True, xlabel_y=bottom + extra + 40)
    base = ya(ya.d0) if log_y else ya(min(max(0.0, ya.d0), ya.d1))
    gw = band * (0.8 if m > 1 else 0.7)
    bw = gw / m
    for i in range(n):
        x0 = left + i * band + (band - gw) / 2
        for j, (name, v) in enumerate(data):
            y = ya(float(v[i]))
            tip = (f"{name} · " if name else "") + f"{labels[i]}: {_g(float(v[i]))}"
            o.append(
                f'<rect x="{_n(x0 + j * bw)}" y="{_n(min(y, base))}" width="{_n(max(bw - (1 if bw > 4 else 0), 0.5))}" '
                f'height="{_n(max(abs(base - y), 0.5))}" fill="{series_color(j)}"><title>{esc(tip)}</title></rect>'
            )
        if i % every == 0:
            cx = left + (i + 0.5) * band
            o.append(f'<line class="al-axis" x1="{_n(cx)}" x2="{_n(cx)}" y1="{_n(bottom)}" y2="{_n(bottom + 4)}"/>')
            short = labels[i] if len(labels[i]) <= 18 else labels[i][:17] + "…"
            if rotate:
                o.append(
                    f'<text transform="translate({_n(cx + 4)} {_n(bottom + 14)}) rotate(-40)" text-anchor="end">'
                    f"{esc(short)}</text>"
                )
            else:
                o.append(f'<text x="{_n(cx)}" y="{_n(bottom + 19)}" text-anchor="middle">{esc(short)}</text>')
    if n * m <= 12 and bw >= 30:
        for i in range(n):
            for j, (_, v) in enumerate(data):
                cx = left + i * band + (band - gw) / 2 + (j + 0.5) * bw
                y = ya(float(v[i]))
                ty = min(y, base) - 5 if v[i] >= 0 or log_y else max(y, base) + 14
                o.append(
                    f'<text class="al-value" x="{_n(cx)}" y="{_n(ty)}" text-anchor="middle">{esc(_g(float(v[i])))}</text>'
                )
    if log_y is False and ya.d0 < 0 < ya.d1:
        o.append(f'<line class="al-zero" x1="{_n(left)}" x2="{_n(right)}" y1="{_n(ya(0.0))}" y2="{_n(ya(0.0))}"/>')
    if show_legend:
        o += _legend(names, right + 18, top + 8, False, False)
    o.append("</svg>")
    return "".join(o)
