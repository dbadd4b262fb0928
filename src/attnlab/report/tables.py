"""Tables and head grids as plain HTML (they read with JavaScript off).

Numbers are formatted per column so that a column reads evenly:

* integers (and floats that are all whole numbers) get thousands separators: ``12,345``;
* floats get the decimals that give the column's largest magnitude 4 significant digits
  (``0.9531``, ``12.50``); a column whose values span too many decades for that to keep
  2 significant digits of its smallest value falls back to ``%.4g`` per value, and
  magnitudes from 10⁶ up or under 10⁻³ use ``1.235e-05`` notation;
* NaN shows as ``NaN``, infinities as ``∞``/``-∞``, ``None`` as an empty cell.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from attnlab.report._colors import Scale, css_rgb, text_on
from attnlab.report._html import esc
from attnlab.report._util import scalar, to_float_array, to_numpy

__all__ = ["format_number", "column_formatter", "table_html", "head_grid_html"]


def _nonfinite(v: float) -> str:
    return "NaN" if math.isnan(v) else ("∞" if v > 0 else "-∞")


def _general(v: float) -> str:
    if not math.isfinite(v):
        return _nonfinite(v)
    a = abs(v)
    if a == 0:
        return "0"
    if 1e-3 <= a < 1e4:
        return f"{v:.4g}"
    if 1e4 <= a < 1e6:
        return f"{v:,.0f}"
    return f"{v:.3e}"


def format_number(v) -> str:
    """One number on its own (see the module docstring for columns).

    >>> [format_number(x) for x in (1234567, 0.5, 2/3, 1e-7, 123456.7, float("nan"), True)]
    ['1,234,567', '0.5', '0.6667', '1.000e-07', '123,457', 'NaN', 'True']
    """
    v = scalar(v)
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, numbers.Integral):
        return f"{int(v):,}"
    if isinstance(v, numbers.Real):
        return _general(float(v))
    return str(v)


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def column_formatter(values: Sequence, spec: str | Callable | None = None) -> Callable[[Any], str]:
    """A function that formats the numbers of one column consistently.

    ``spec`` is a format spec such as ``".3f"`` or a callable, and overrides the rule.

    >>> f = column_formatter([0.5, 0.25, 12.5])
    >>> [f(v) for v in (0.5, 0.25, 12.5)]
    ['0.50', '0.25', '12.50']
    >>> f = column_formatter([3.0, 1200.0]); f(1200.0)
    '1,200'
    """
    if callable(spec):
        return lambda v: str(spec(v))
    if spec is not None:
        return lambda v: format(v, spec) if _is_num(v) else format_number(v)
    nums = [scalar(v) for v in values]
    floats = [float(v) for v in nums if _is_num(v) and not isinstance(v, numbers.Integral)]
    finite = [v for v in floats if math.isfinite(v)]
    if not finite:
        return format_number
    if all(v == int(v) for v in finite) and max(abs(v) for v in finite) < 1e15:
        return lambda v: format_number(int(v)) if _is_num(v) and math.isfinite(float(v)) else format_number(v)
    big = max(abs(v) for v in finite)
    small = min((abs(v) for v in finite if v != 0), default=big)
    if big >= 1e6 or big < 1e-3:
        return lambda v: f"{float(v):.3e}" if _is_num(v) and math.isfinite(float(v)) else format_number(v)
    d = min(6, max(0, 3 - math.floor(math.log10(big))))
    if small < 10 ** (1 - d):  # fewer than 2 significant digits would survive
        return lambda v: _general(float(v)) if _is_num(v) else format_number(v)

    def fmt(v):
        v = scalar(v)
        if _is_num(v) and not isinstance(v, numbers.Integral):
            v = float(v)
            return f"{v:,.{d}f}" if math.isfinite(v) else _nonfinite(v)
        return format_number(v)

    return fmt


def _column_index(key, columns: list[str], name: str) -> int:
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        if not -len(columns) <= int(key) < len(columns):
            raise ValueError(f"{name}: column index {key} out of range for {len(columns)} columns")
        return int(key) % len(columns)
    if key in columns:
        return columns.index(key)
    raise ValueError(f"{name}: no column named {key!r}; columns are {columns}")


def _cell(v, fmt, scale) -> str:
    v = scalar(v)
    if v is None:
        return '<td class="al-empty"></td>'
    if _is_num(v):
        style = ""
        if scale is not None:
            rgb = scale(v)
            if rgb is not None:
                style = f' style="background:{css_rgb(rgb)};color:{text_on(rgb)}"'
        return f'<td class="al-num"{style}>{esc(fmt(v))}</td>'
    return f"<td>{esc(fmt(v) if isinstance(v, bool) else v)}</td>"


def table_html(columns, rows, *, caption=None, highlight=None, fmt=None) -> str:
    """An HTML table; see :meth:`attnlab.report.Report.table`."""
    if isinstance(columns, str) or not isinstance(columns, Sequence):
        raise ValueError(f"columns: expected a list of column names, got {type(columns).__name__}")
    columns = [str(c) for c in columns]
    if not columns:
        raise ValueError("columns: expected at least one column name, got an empty list")
    if not isinstance(rows, (list, tuple)):
        arr = to_numpy(rows, "rows")
        if arr.ndim != 2:
            raise ValueError(f"rows: expected a 2-D array or a list of rows, got shape {tuple(arr.shape)}")
        rows = arr.tolist()
    norm = []
    for i, r in enumerate(rows):
        if isinstance(r, (str, bytes, dict)) or not hasattr(r, "__len__"):
            raise ValueError(f"rows: row {i} is a {type(r).__name__}, expected a sequence of {len(columns)} cells")
        r = list(r)
        if len(r) != len(columns):
            raise ValueError(f"rows: row {i} has {len(r)} cells, expected {len(columns)} (one per column)")
        norm.append(r)
    rows = norm
    cols = [[r[j] for r in rows] for j in range(len(columns))]
    specs = fmt if isinstance(fmt, dict) else {}
    for key in specs:
        _column_index(key, columns, "fmt")
    formatters = []
    for j, name in enumerate(columns):
        spec = specs.get(name, specs.get(j)) if isinstance(fmt, dict) else fmt
        formatters.append(column_formatter(cols[j], spec))
    scales: dict[int, Scale] = {}
    if highlight is not None:
        keys = highlight if isinstance(highlight, (list, tuple)) else [highlight]
        for key in keys:
            j = _column_index(key, columns, "highlight")
            nums = [float(scalar(v)) for v in cols[j] if _is_num(scalar(v))]
            if not nums:
                raise ValueError(f"highlight: column {columns[j]!r} has no numbers to colour")
            scales[j] = Scale(nums)
    numeric = [bool(c) and all(_is_num(scalar(v)) or v is None for v in c) for c in cols]
    head = "".join(
        f'<th scope="col"{" class=al-num" if numeric[j] else ""}>{esc(c)}</th>' for j, c in enumerate(columns)
    )
    body = "\n".join(
        "<tr>" + "".join(_cell(v, formatters[j], scales.get(j)) for j, v in enumerate(r)) + "</tr>" for r in rows
    )
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    return (
        f'<div class="al-table-wrap"><table class="al-table">{cap}<thead><tr>{head}</tr></thead>'
        f"<tbody>\n{body}\n</tbody></table></div>"
    )


def head_grid_html(
    scores, *, title, row_label="layer", col_label="head", fmt=".2f", vmin=None, vmax=None, fig_id: str
) -> str:
    """A coloured [rows, cols] grid of numbers; see :meth:`attnlab.report.Report.head_grid`."""
    a = to_float_array(scores, "scores", 2)
    if a.size == 0:
        raise ValueError(f"scores: expected a non-empty [{row_label}, {col_label}] array, got shape {a.shape}")
    try:
        format(0.5, fmt)
    except (ValueError, TypeError):
        raise ValueError(f"fmt: {fmt!r} is not a format spec for floats; try '.2f' or '.3g'") from None
    scale = Scale(a.ravel().tolist(), vmin=vmin, vmax=vmax)
    L, H = a.shape
    head = "".join(f'<th scope="col">{esc(col_label)} {h}</th>' for h in range(H))
    rows = []
    for i in range(L):
        cells = []
        for h in range(H):
            v = float(a[i, h])
            tip = esc(f"{row_label} {i}, {col_label} {h}: {format(v, fmt) if math.isfinite(v) else _nonfinite(v)}")
            rgb = scale(v)
            if rgb is None:
                cells.append(f'<td class="al-nan" title="{tip}">{_nonfinite(v)}</td>')
            else:
                cells.append(
                    f'<td style="background:{css_rgb(rgb)};color:{text_on(rgb)}" title="{tip}">'
                    f"{esc(format(v, fmt))}</td>"
                )
        rows.append(f'<tr><th scope="row">{esc(row_label)} {i}</th>{"".join(cells)}</tr>')
    lo, hi = format(scale.vmin, fmt), format(scale.vmax, fmt)
    legend = (
        f'<div class="al-legend-bar"><span>{esc(lo)}</span><span class="al-bar" '
        f'style="background:{scale.gradient_css()}"></span><span>{esc(hi)}</span></div>'
    )
    return (
        f'<figure class="al-fig al-grid-fig" id="{fig_id}"><figcaption>{esc(title)}</figcaption>'
        f'<div class="al-table-wrap"><table class="al-grid"><thead><tr><th></th>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>{legend}</figure>"
    )
