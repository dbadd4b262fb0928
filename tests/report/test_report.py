"""Unit tests of attnlab.report: escaping, offline-ness, payloads, formatting, errors.

File sizes (measured by ``test_size_*`` below, floor=1e-5, zlib level 6, base64):

* 6 × 12 × 512 × 512 (72 heads; synthetic causal patterns with logit noise): ~11 MB;
  the real bidirectional MiniLM-L6 (6 × 12) on 512 tokens of text: ~19.5 MB.
* 1 × 4 × 4096 × 4096 (synthetic causal, noisy tails kept): ~37 MB; with ``floor=1e-3``
  (weights under 0.1 % of the head's max dropped): ~7.5 MB.

For scale: the same data as JSON floats (what bertviz/circuitsvis embed) is ~20 bytes per
cell: ~380 MB and ~1.3 GB.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from attnlab.report.builder import Report
from attnlab.report.heatmap import dequantize_log, quantize_log
from attnlab.report.plots import linear_ticks, log_ticks
from attnlab.report.tables import column_formatter, format_number


class Doc(HTMLParser):
    """Every tag (with attributes and the text inside it) of a page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[tuple[dict, str]] = []
        self.text: list[str] = []
        self._in: list = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag in ("script", "style"):
            self._in.append((tag, a, []))

    def handle_endtag(self, tag):
        if self._in and self._in[-1][0] == tag:
            t, a, buf = self._in.pop()
            if t == "script":
                self.scripts.append((a, "".join(buf)))

    def handle_data(self, data):
        if self._in:
            self._in[-1][2].append(data)
        else:
            self.text.append(data)


def parse(html: str) -> Doc:
    d = Doc()
    d.feed(html)
    d.close()
    return d


def evil_report(evil_tokens, synth) -> Report:
    ev = evil_tokens
    n = len(ev)
    r = Report(ev[0] + " title", subtitle=ev[1] + " **b** `c` " + ev[10])
    r.section(ev[0], intro=ev[10] + " & more")
    r.text("para " + ev[0] + " **bold " + ev[2] + "** and `" + ev[0] + "`")
    r.table([ev[0], "v"], [[ev[10], 1.5], [ev[3], 2]], caption=ev[0], highlight="v")
    r.head_grid(np.arange(6.0).reshape(2, 3), title=ev[0], row_label=ev[0], col_label=ev[4])
    r.heatmaps(synth(1, 2, n), ev, title=ev[0] + "heat", labels={(0, 1): ev[0]})
    r.line_plot({ev[0]: [1, 2, 3], ev[10]: [3, 2, 1]}, title=ev[0], x_label=ev[2], y_label=ev[3])
    r.bar_plot({ev[0]: [1, 2], ev[5]: [2, 1]}, labels=[ev[0], ev[6]], title=ev[10], x_label=ev[0], y_label=ev[1])
    return r


# -- escaping --------------------------------------------------------------------------------
def test_no_markup_from_user_text(evil_tokens, synth):
    html = evil_report(evil_tokens, synth).html()
    doc = parse(html)
    # Only our own tags: no img with onerror, no extra script from any token.
    for tag, attrs in doc.tags:
        assert not any(k.startswith("on") for k in attrs), (tag, attrs)
    kinds = [a.get("type") for a, _ in doc.scripts]
    assert kinds.count(None) == 1  # the viewer
    assert set(kinds) <= {None, "application/json", "application/octet-stream"}
    assert kinds.count("application/octet-stream") == 2  # one per head
    for a, body in doc.scripts:
        if a.get("type") is None:
            assert "alert" not in body
        if a.get("type") == "application/octet-stream":
            assert re.fullmatch(r"[A-Za-z0-9+/=]+", body)
    imgs = [a for t, a in doc.tags if t == "img"]
    assert imgs and all(a["src"].startswith("data:image/png;base64,") for a in imgs)
    assert "<script>alert" not in html and "<img src=x" not in html
    # ... and the text still reads as written
    text = "".join(doc.text)
    assert "<script>alert(1)</script> title" in text
    assert "<img src=x onerror=alert(2)>" in text
    assert "**" not in text.split("para")[1].split("\n")[0]


def test_tokens_round_trip_through_json(evil_tokens, synth):
    doc = parse(evil_report(evil_tokens, synth).html())
    cfg = next(json.loads(body) for a, body in doc.scripts if a.get("type") == "application/json")
    assert cfg["tq"] == evil_tokens and cfg["tk"] == evil_tokens
    assert cfg["heads"][1]["label"] == evil_tokens[0]


def test_inline_markup_only_bold_and_code():
    doc = parse(Report("t").text("a **b** `c<d>` **<i>x</i>** <b>no</b>").html())
    tags = [t for t, _ in doc.tags]
    assert tags.count("strong") == 2 and tags.count("code") == 1
    assert "i" not in tags and "b" not in tags
    assert "<b>no</b>" in "".join(doc.text)


def test_lone_surrogates_and_controls_do_not_break_the_file(tmp_path, synth):
    bad = ["\udc80x", "a\x00b", "ok"]
    r = Report("s\udc80").table(["c"], [[bad[0]], [bad[1]]])
    r.heatmaps(synth(1, 1, 3), bad, title="t")
    p = r.write(tmp_path / "s.html")
    p.read_text(encoding="utf-8")  # valid UTF-8


# -- offline ---------------------------------------------------------------------------------
def test_no_external_references(evil_tokens, synth, tmp_path):
    p = evil_report(evil_tokens, synth).write(tmp_path / "r.html")
    html = p.read_text(encoding="utf-8")
    assert "://" not in html
    assert "@import" not in html
    assert all(m.startswith("data:") for m in re.findall(r"url\(\s*['\"]?([^)'\"]*)", html))
    doc = parse(html)
    for tag, attrs in doc.tags:
        for key in ("src", "href", "xlink:href", "action", "formaction", "poster", "data", "srcset", "background"):
            if key in attrs:
                v = attrs[key].strip()
                assert v.startswith(("#", "data:")), (tag, key, v)
        assert tag not in ("iframe", "object", "embed", "base", "form")
    metas = [a for t, a in doc.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    csp = metas[0]["content"]
    assert "default-src 'none'" in csp and "connect-src" not in csp
    viewer = next(body for a, body in doc.scripts if a.get("type") is None)
    digest = base64.b64encode(hashlib.sha256(viewer.encode()).digest()).decode()
    assert f"'sha256-{digest}'" in csp  # only this exact script may run


def test_report_without_heatmaps_has_no_script():
    r = Report("plain").section("s").table(["a"], [[1]]).line_plot([1, 2], title="t", x_label="x", y_label="y")
    doc = parse(r.html())
    assert doc.scripts == []
    csp = next(a["content"] for t, a in doc.tags if t == "meta" and a.get("http-equiv"))
    assert "script-src 'none'" in csp


# -- heatmap payload -------------------------------------------------------------------------
def _payloads(html):
    doc = parse(html)
    cfg = next(json.loads(b) for a, b in doc.scripts if a.get("type") == "application/json")
    blobs = [base64.b64decode(b) for a, b in doc.scripts if a.get("type") == "application/octet-stream"]
    return cfg, blobs


def test_quantized_payload_size_and_accuracy(synth):
    x = synth(2, 3, 97)[:, :, :, :80]  # Nq != Nk
    html = (
        Report("q")
        .heatmaps(torch.from_numpy(x), [f"q{i}" for i in range(97)], [f"k{i}" for i in range(80)], title="h")
        .html()
    )
    cfg, blobs = _payloads(html)
    assert (cfg["nq"], cfg["nk"], cfg["layers"]) == (97, 80, [3, 3])
    assert len(blobs) == 6
    floor = cfg["floor"]
    for i, blob in enumerate(blobs):
        raw = zlib.decompress(blob)
        assert len(raw) == 97 * 80  # one byte per cell
        assert len(blob) < len(raw)  # compression pays even on a small noisy head
        codes = np.frombuffer(raw, dtype=np.uint8).reshape(97, 80)
        hd = cfg["heads"][i]
        ref = x[hd["l"], hd["h"]].astype(np.float64)
        assert hd["top"] == pytest.approx(ref.max(), rel=1e-6)
        got = dequantize_log(codes, hd["top"], floor)
        kept = ref >= hd["top"] * floor
        rel = np.abs(got[kept] - ref[kept]) / ref[kept]
        assert rel.max() < 0.024  # (1e5 ** (1/254) - 1) / 2 = 2.3 %
        assert (codes[~kept] == 0).all()


def test_quantize_edge_cases():
    codes, top = quantize_log(np.zeros((3, 4)), 1e-5)
    assert top == 0.0 and not codes.any()
    codes, top = quantize_log(np.array([[1.0, 1e-5, 0.99e-5, 0.0]]), 1e-5)
    assert codes.tolist() == [[255, 1, 0, 0]]


def test_heatmap_input_forms_agree(synth):
    x = synth(2, 2, 9)
    as_list = Report("a").heatmaps([torch.from_numpy(x[0]), x[1]], title="h").html()
    as_4d = Report("a").heatmaps(x.tolist(), title="h").html()
    assert _payloads(as_list)[1] == _payloads(as_4d)[1]
    cfg, blobs = _payloads(Report("b").heatmaps(torch.from_numpy(x[0, 0]).bfloat16(), title="h").html())
    assert cfg["layers"] == [1] and len(blobs) == 1 and cfg["tq"] == [str(i) for i in range(9)]


def _size_mb(x, **kw) -> float:
    html = Report("size").heatmaps(x, title="h", **kw).html()
    return len(html.encode()) / 1e6


def test_size_6x12x512(synth):
    mb = _size_mb(synth(6, 12, 512))
    print(f"\n6x12x512x512: {mb:.2f} MB")
    assert mb < 14  # raw uint8 would be 18.9 MB, base64 of it 25 MB


@pytest.mark.slow
def test_size_1x4x4096(synth):
    x = synth(1, 4, 4096)
    mb = _size_mb(x)
    mb_floor = _size_mb(x, floor=1e-3)
    print(f"\n1x4x4096x4096: {mb:.1f} MB (floor 1e-5), {mb_floor:.1f} MB (floor 1e-3)")
    assert mb < 45 and mb_floor < 10  # raw uint8: 67 MB; base64 of it: 89 MB


# -- tables ----------------------------------------------------------------------------------
def test_format_number():
    assert format_number(1234567) == "1,234,567"
    assert format_number(np.int64(-42)) == "-42"
    assert format_number(torch.tensor(0.5)) == "0.5"
    assert format_number(2 / 3) == "0.6667"
    assert format_number(1e-7) == "1.000e-07"
    assert format_number(3.2e9) == "3.200e+09"
    assert format_number(float("inf")) == "∞" and format_number(float("-inf")) == "-∞"
    assert format_number(float("nan")) == "NaN"
    assert format_number(0.0) == "0"


def test_column_formatting():
    f = column_formatter([0.9531, 0.0123, 0.5])
    assert [f(v) for v in (0.9531, 0.0123, 0.5)] == ["0.9531", "0.0123", "0.5000"]
    f = column_formatter([12.5, 3.75, 100.0])
    assert [f(v) for v in (12.5, 3.75, 100.0)] == ["12.5", "3.8", "100.0"]  # 4 digits for the largest
    f = column_formatter([3.0, 1200.0, float("nan")])
    assert [f(v) for v in (3.0, 1200.0, float("nan"))] == ["3", "1,200", "NaN"]
    f = column_formatter([1e-7, 2e-6])
    assert f(1e-7) == "1.000e-07"
    f = column_formatter([0.9, 1e-6])  # too many decades for one number of decimals
    assert (f(0.9), f(1e-6)) == ("0.9", "1.000e-06")
    f = column_formatter([1.0, 2.0], ".3f")
    assert f(1.0) == "1.000"


def test_table_html_cells_and_highlight():
    r = Report("t").table(
        ["name", "score", "n"],
        [["a", 0.25, 10], ["b", -0.5, 2000], ["c", None, 3]],
        caption="cap",
        highlight=["score", 2],
        fmt={"n": ",d"},
    )
    doc = parse(r.html())
    tds = [a for t, a in doc.tags if t == "td"]
    assert len(tds) == 9
    styled = [a for a in tds if "style" in a]
    assert len(styled) == 5  # 2 score cells (None is empty) + 3 n cells
    text = "".join(doc.text)
    assert "0.250" in text and "-0.500" in text and "2,000" in text and "cap" in text
    r2 = Report("t").table(["x", "y"], torch.arange(6).reshape(3, 2))
    assert '<td class="al-num">4</td>' in r2.html()


def test_head_grid():
    s = np.array([[0.1, float("nan")], [0.9, 0.5]])
    doc = parse(Report("g").head_grid(torch.tensor(s), title="scores", fmt=".1f").html())
    tds = [a for t, a in doc.tags if t == "td"]
    assert len(tds) == 4 and tds[1].get("class") == "al-nan"
    assert "layer 1, head 0: 0.9" in tds[2]["title"]
    text = "".join(doc.text)
    assert "head 1" in text and "layer 1" in text and "0.9" in text


# -- plots -----------------------------------------------------------------------------------
def test_ticks_are_round():
    lo, hi, ticks, labels = linear_ticks(0.13, 7.9)
    assert (lo, hi) == (0, 8) and labels == ["0", "2", "4", "6", "8"]
    assert linear_ticks(-3.3e-5, 1.1e-5)[3] == ["-4e-5", "-3e-5", "-2e-5", "-1e-5", "0", "1e-5", "2e-5"]
    lo, hi, ticks, _ = linear_ticks(5, 5)  # a constant gets a small range around it
    assert lo < 5 < hi and len(ticks) >= 3
    lo, hi, ticks, labels, _minor = log_ticks(3e-9, 2e3)
    assert lo == pytest.approx(1e-9) and hi == pytest.approx(1e4)
    assert all(math.log10(t) == round(math.log10(t)) for t in ticks) and len(ticks) <= 9
    assert log_ticks(2.0, 30.0)[3] == ["1", "2", "5", "10", "20", "50", "100"]


def test_line_plot_svg():
    ys = np.exp(-np.arange(50) / 10.0)
    svg = (
        Report("p")
        .line_plot(
            {"decay": ys, "half": (np.arange(50), ys / 2)}, title="T", x_label="step", y_label="value", log_y=True
        )
        .html()
    )
    doc = parse(svg)
    text = "".join(doc.text)
    assert "step" in text and "value" in text and "decay" in text and "half" in text
    assert "10⁻³" in text or "0.001" in text
    assert sum(1 for t, _ in doc.tags if t == "circle") == 50 + 1  # markers on the first series + legend
    long = Report("p").line_plot(np.sin(np.arange(100_000) / 50.0), title="T", x_label="x", y_label="y").html()
    assert len(long) < 200_000  # min/max decimation keeps the envelope, not 100k points
    gap = Report("p").line_plot([1.0, float("nan"), 3.0, 4.0], title="T", x_label="x", y_label="y").html()
    d = re.search(r'class="al-line" d="([^"]+)"', gap).group(1)
    assert d.count("M") == 2


def test_bar_plot_svg():
    html = (
        Report("b")
        .bar_plot(
            {"L1H6": [5, 1, 0.1], "L5H1": [3, 2, 0.01]},
            labels=["σ1", "σ2", "σ3"],
            title="sv",
            x_label="index",
            y_label="σ",
            log_y=True,
        )
        .html()
    )
    doc = parse(html)
    rects = [a for t, a in doc.tags if t == "rect" and "fill" in a and a.get("height")]
    assert len(rects) >= 6
    heights = [float(a["height"]) for a in rects[:6]]
    assert min(heights) > 5  # the smallest bar is still visible on a log axis
    assert "σ3" in "".join(doc.text)


# -- errors name the argument -----------------------------------------------------------------
@pytest.mark.parametrize(
    "call, name",
    [
        (lambda r: r.heatmaps(np.ones((1, 2, 1, 2, 2)), title="t"), "batch"),  # (L, B, H, N, N), B > 1: say which
        (lambda r: r.heatmaps([np.ones((2, 1, 2, 2))], title="t"), "batch"),
        (lambda r: r.heatmaps(np.ones((1, 2, 1, 2, 2)), title="t", batch=2), "batch"),
        (lambda r: r.heatmaps(np.ones((1, 1, 1, 1, 2, 2)), title="t"), "patterns"),
        (lambda r: r.heatmaps(-np.ones((2, 2)), title="t"), "patterns"),
        (lambda r: r.heatmaps(np.full((2, 2), np.nan), title="t"), "patterns"),
        (lambda r: r.heatmaps([np.ones((1, 2, 2)), np.ones((1, 3, 3))], title="t"), "patterns"),
        (lambda r: r.heatmaps(np.ones((2, 2)), ["a"], title="t"), "tokens_q"),
        (lambda r: r.heatmaps(np.ones((2, 3)), ["a", "b"], title="t"), "tokens_k"),
        (lambda r: r.heatmaps(np.ones((2, 3)), ["a", "b"], ["x"], title="t"), "tokens_k"),
        (lambda r: r.heatmaps(np.ones((2, 2)), title="t", labels={(0, 5): "x"}), "labels"),
        (lambda r: r.heatmaps(np.ones((2, 2)), title="t", floor=0), "floor"),
        (lambda r: r.heatmaps(np.ones((2, 2)), title="t", color="jet"), "color"),
        (lambda r: r.heatmaps(np.ones((2, 2)), title=""), "title"),
        (lambda r: r.head_grid(np.ones(3), title="t"), "scores"),
        (lambda r: r.head_grid(np.ones((2, 2)), title="t", fmt="%d"), "fmt"),
        (lambda r: r.table(["a", "b"], [[1, 2], [3]]), "rows"),
        (lambda r: r.table(["a"], [[1]], highlight="b"), "highlight"),
        (lambda r: r.table("ab", [[1]]), "columns"),
        (lambda r: r.line_plot({"s": [1, 0]}, title="t", x_label="x", y_label="y", log_y=True), "series['s']"),
        (lambda r: r.line_plot({"s": [1, 2]}, x=[1, 2, 3], title="t", x_label="x", y_label="y"), "x"),
        (lambda r: r.line_plot({"s": [[1, 2]]}, title="t", x_label="x", y_label="y"), "series['s']"),
        (lambda r: r.bar_plot([1, 2], labels=["a"], title="t", x_label="x", y_label="y"), "labels"),
        (lambda r: r.bar_plot({"a": [1, 2], "b": [1]}, title="t", x_label="x", y_label="y"), "values"),
        (lambda r: r.write("report.txt"), "path"),
    ],
)
def test_errors_name_the_argument(call, name):
    with pytest.raises(ValueError) as e:
        call(Report("r"))
    assert str(e.value).startswith(name + ":"), str(e.value)


def test_write_creates_parent(tmp_path):
    p = Report("w").text("hi").write(tmp_path / "a" / "b.html")
    assert p.exists() and p.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
