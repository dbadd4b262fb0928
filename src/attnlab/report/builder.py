"""``Report``: build a self-contained, offline HTML report step by step.

>>> import torch
>>> from attnlab.report.builder import Report
>>> r = Report("Induction heads", subtitle="GPT-2 small, 512 tokens")
>>> r = r.section("Scores", intro="Prefix-matching score per head.")
>>> r = r.head_grid(torch.rand(2, 3), title="prefix matching")
>>> r = r.table(["head", "score"], [["L1H2", 0.91234], ["L0H1", 0.0871]], highlight="score")
>>> "<table" in r.html() and "://" not in r.html()
True

Everything lands in one ``.html`` file: styles and scripts are inlined, heatmap data is
embedded compressed, and the page's Content-Security-Policy forbids any network access.
Tables, head grids and the SVG plots read with JavaScript off; heatmaps need it (they
fall back to a static image of the first head).  Text from a model or a user (titles,
tokens, cells, series names) is always escaped.
"""

from __future__ import annotations

import os
from pathlib import Path

from attnlab.report._css import CSS
from attnlab.report._heatmap_js import JS as HEATMAP_JS
from attnlab.report._html import esc, inline_markup, page, slug
from attnlab.report._token_view_js import JS as TOKEN_VIEW_JS
from attnlab.report.heatmap import heatmap_html
from attnlab.report.inputs import as_patterns, as_scores
from attnlab.report.plots import bar_plot_svg, line_plot_svg
from attnlab.report.tables import head_grid_html, table_html
from attnlab.report.token_view import token_view_html

__all__ = ["Report"]


def _title(value, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    return value


class Report:
    """A report under construction.  Every adder returns the report, so calls chain.

    Parameters
    ----------
    title:
        The page title (``<h1>`` and the browser tab).
    subtitle:
        Optional line under the title; accepts the same ``**bold**``/```code``` markup as
        :meth:`text`.
    """

    def __init__(self, title: str, *, subtitle: str | None = None):
        self.title = _title(title, "title")
        self.subtitle = subtitle
        self._root: list[str] = []
        self._sections: list[tuple[str, str, list[str]]] = []  # (id, title, blocks)
        self._ids: set[str] = set()
        self._has_heatmap = False
        self._has_token_view = False

    # -- structure ---------------------------------------------------------------------
    def _add(self, block: str) -> Report:
        (self._sections[-1][2] if self._sections else self._root).append(block)
        return self

    def _fig_id(self, title: str) -> str:
        return slug("fig-" + title, self._ids)

    def section(self, title: str, intro: str | None = None) -> Report:
        """Start a section (``<h2>``, listed in the contents bar) with an optional paragraph."""
        sid = slug(_title(title, "title"), self._ids)
        self._sections.append((sid, title, []))
        if intro:
            self.text(intro)
        return self

    def text(self, paragraph: str) -> Report:
        """A paragraph of escaped text; ``**bold**`` and ```code``` are the only markup.

        A blank line starts a new paragraph.
        """
        if not isinstance(paragraph, str):
            raise ValueError(f"paragraph: expected a string, got {type(paragraph).__name__}")
        for part in (p.strip() for p in paragraph.split("\n\n")):
            if part:
                self._add(f"<p>{inline_markup(part)}</p>")
        return self

    # -- tables ------------------------------------------------------------------------
    def table(self, columns, rows, *, caption: str | None = None, highlight=None, fmt=None) -> Report:
        """A table.

        ``columns``: names; ``rows``: a list of rows (sequences of str/number/None) or a
        2-D tensor/array.  Numbers are formatted per column (see :mod:`attnlab.report.tables`);
        ``fmt`` overrides with one format spec (``".3f"``) or a ``{column: spec}`` dict.
        ``highlight``: a column name or index (or a list of them) whose numeric cells get a
        colour scale (sequential; diverging around 0 when the column has both signs).
        """
        return self._add(table_html(columns, rows, caption=caption, highlight=highlight, fmt=fmt))

    def head_grid(
        self,
        scores,
        *,
        title: str,
        row_label: str = "layer",
        col_label: str = "head",
        fmt: str = ".2f",
        vmin: float | None = None,
        vmax: float | None = None,
    ) -> Report:
        """A ``[L, H]`` tensor/array (e.g. a detector's score per head) as a coloured grid.

        Also takes a :class:`~attnlab.interp.detectors.HeadScores` or a result with named axes
        (``.values``/``.axes``, e.g. head patching) as it comes (:func:`attnlab.report.inputs.as_scores`).

        The colour scale spans the data (or ``vmin``..``vmax``); signed data get a diverging
        scale centred on 0.  Each cell shows its value with ``fmt``; NaN cells are grey.
        """
        return self._add(
            head_grid_html(
                as_scores(scores),
                title=_title(title, "title"),
                row_label=row_label,
                col_label=col_label,
                fmt=fmt,
                vmin=vmin,
                vmax=vmax,
                fig_id=self._fig_id(title),
            )
        )

    # -- heatmaps ----------------------------------------------------------------------
    def heatmaps(
        self,
        patterns,
        tokens_q=None,
        tokens_k=None,
        *,
        title: str,
        labels=None,
        floor: float = 1e-5,
        color: str = "sqrt",
        pool: str = "max",
        batch: int | None = None,
    ) -> Report:
        """Attention patterns as an interactive canvas heatmap with a layer/head selector.

        ``patterns``: ``[L, H, Nq, Nk]`` (or ``[H, Nq, Nk]``, ``[Nq, Nk]``, or a list of
        per-layer ``[H, Nq, Nk]``), non-negative and finite; or straight from
        :mod:`attnlab.interp`: a ``Capture``, an activation cache, ``(L, B, H, Nq, Nk)`` or a
        list of per-layer ``(B, H, Nq, Nk)``, with ``batch`` choosing the sequence
        (:func:`attnlab.report.inputs.as_patterns`).  ``tokens_q``: ``Nq`` strings
        (``None``: positions); ``tokens_k``: ``Nk`` strings, defaults to ``tokens_q``.
        ``labels``: a ``{(layer, head): text}`` dict or ``[L][H]`` nested list naming heads.
        ``floor``: weights below ``floor × the head's max`` are stored as 0 (the log-scale
        quantization keeps ±2.3 % relative error above it).  ``color``: initial colour
        scale, ``"linear"``, ``"sqrt"`` or ``"log"``; ``pool``: ``"max"`` or ``"mean"``
        for views larger than the canvas.  All are switchable in the page.
        """
        self._has_heatmap = True
        return self._add(
            heatmap_html(
                as_patterns(patterns, batch),
                tokens_q,
                tokens_k,
                title=_title(title, "title"),
                labels=labels,
                floor=floor,
                color=color,
                pool=pool,
                fig_id=self._fig_id(title),
            )
        )

    def token_view(
        self,
        patterns,
        tokens_q,
        tokens_k=None,
        *,
        title: str,
        layer: int = 0,
        head=0,
        labels=None,
        batch: int | None = None,
    ) -> Report:
        """bertviz-style token-to-token view: queries left, keys right, a line per pair with
        opacity = weight, for the selected layer and head (selectors in the page, hover a
        token to isolate its lines and list its strongest partners).

        ``patterns`` and ``batch`` as in :meth:`heatmaps` (weights in [0, 1]); ``tokens_q``:
        ``Nq`` strings (``tok.to_str_tokens(ids)``), ``tokens_k`` when ``Nk ≠ Nq``.  ``head``:
        an int, or ``"all"`` to overlay every head of the layer in its own colour (the head
        view).  Up to :data:`attnlab.report.token_view.MAX_TOKENS` tokens.
        """
        self._has_token_view = True
        return self._add(
            token_view_html(
                as_patterns(patterns, batch),
                tokens_q,
                tokens_k,
                title=_title(title, "title"),
                fig_id=self._fig_id(title),
                layer=layer,
                head=head,
                labels=labels,
            )
        )

    def head_view(
        self, patterns, tokens_q, tokens_k=None, *, title: str, layer: int = 0, labels=None, batch: int | None = None
    ) -> Report:
        """bertviz's head view: :meth:`token_view` with every head of ``layer`` overlaid,
        one colour per head (pick one head in the page)."""
        return self.token_view(
            patterns, tokens_q, tokens_k, title=title, layer=layer, head="all", labels=labels, batch=batch
        )

    # -- plots -------------------------------------------------------------------------
    def line_plot(
        self, series, *, title: str, x_label: str, y_label: str, log_y: bool = False, x=None, log_x: bool = False
    ) -> Report:
        """An SVG line plot.

        ``series``: ``{name: ys}`` (x = ``x`` if given, else 0, 1, …) or ``{name: (xs, ys)}``;
        a bare 1-D sequence is one unnamed series.  NaN in ``ys`` leaves a gap.  ``log_y`` /
        ``log_x`` need positive values.
        """
        return self._add(
            self._figure(
                title,
                line_plot_svg(series, title=title, x_label=x_label, y_label=y_label, log_y=log_y, x=x, log_x=log_x),
            )
        )

    def bar_plot(self, values, *, title: str, x_label: str, y_label: str, labels=None, log_y: bool = False) -> Report:
        """An SVG bar plot: ``values`` is one 1-D sequence, or ``{series: values}`` for grouped bars.

        ``labels`` names the bars (default 0, 1, …), e.g. the singular values of a circuit
        per head: ``r.bar_plot({"L1H6": s1, "L5H1": s2}, labels=range(1, 9), ...)``.
        """
        return self._add(
            self._figure(
                title, bar_plot_svg(values, title=title, labels=labels, x_label=x_label, y_label=y_label, log_y=log_y)
            )
        )

    def _figure(self, title: str, svg: str) -> str:
        fid = self._fig_id(_title(title, "title"))
        return f'<figure class="al-fig al-plot-fig" id="{fid}"><figcaption>{esc(title)}</figcaption>{svg}</figure>'

    # -- output ------------------------------------------------------------------------
    def html(self) -> str:
        """The whole page as a string."""
        from attnlab import __version__

        body = (
            ['<section class="al-section al-intro">\n' + "\n".join(self._root) + "\n</section>"] if self._root else []
        )
        for sid, title, blocks in self._sections:
            body.append(
                f'<section class="al-section" id="{sid}"><h2>{esc(title)}</h2>\n' + "\n".join(blocks) + "\n</section>"
            )
        toc = ""
        if len(self._sections) >= 2:
            links = "".join(f'<li><a href="#{sid}">{esc(t)}</a></li>' for sid, t, _ in self._sections)
            toc = f'<nav class="al-toc" aria-label="Contents"><ol>{links}</ol></nav>\n'
        return page(
            title=self.title,
            subtitle=self.subtitle,
            toc=toc,
            body="\n".join(body),
            css=CSS,
            scripts=([HEATMAP_JS] if self._has_heatmap else []) + ([TOKEN_VIEW_JS] if self._has_token_view else []),
            generator=f"attnlab {__version__}",
        )

    def write(self, path: str | os.PathLike) -> Path:
        """Write the page to ``path`` (UTF-8; parent folders are created) and return the path."""
        p = Path(path)
        if p.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"path: expected a file name ending in .html, got {str(path)!r}")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.html(), encoding="utf-8")
        return p

    def _repr_html_(self) -> str:  # notebooks: show an iframe-free summary, not the full page
        n = sum(len(b) for _, _, b in self._sections) + len(self._root)
        return (
            f"<p>attnlab Report <strong>{esc(self.title)}</strong>: {len(self._sections)} sections, {n} blocks; "
            "call <code>.write('report.html')</code> and open the file.</p>"
        )
