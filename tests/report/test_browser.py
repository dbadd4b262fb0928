"""The report in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

Opens the written file from a file:// URL, as a user would, and checks: no console or
page errors and no request leaves the file; the heatmap canvas is drawn; hovering a cell
names the right query/key tokens (with hostile token text shown literally and never run);
zooming (wheel, box drag, keys) changes the view; pooling is stated for long sequences;
the page reads with JavaScript off; a full-page screenshot is not blank.  The screenshot
is kept at /tmp/report-shot.png for a person to look at.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium); CI installs it", allow_module_level=True)

from playwright.sync_api import sync_playwright  # noqa: E402  (after the skip: only needed with a browser)

from attnlab.report.builder import Report  # noqa: E402

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOT = "/tmp/report-shot.png"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory, synth, evil_tokens):
    synth_patterns = synth
    toks = evil_tokens + [f"t{i}" for i in range(40 - len(evil_tokens))]
    rng = np.random.default_rng(1)
    r = Report(
        "attnlab report: <induction> & sinks", subtitle="GPT-2-like toy model · **40** tokens and **1,200** tokens"
    )
    r.section(
        "Detector scores", intro="Scores from the `induction` and `previous-token` detectors; higher is stronger."
    )
    r.head_grid(rng.random((4, 12)), title="Induction score per head")
    r.table(
        ["head", "induction", "prev-token", "tokens"],
        [[f"L{i}H{j}", rng.random(), rng.random() - 0.5, 10 ** (i + 2)] for i, j in ((1, 6), (2, 3), (3, 9))],
        caption="Top heads",
        highlight=["induction", "prev-token"],
    )
    r.section("Attention patterns")
    r.heatmaps(synth_patterns(2, 3, 40), toks, title="Short sequence (hostile tokens)", labels={(1, 2): "induction"})
    r.heatmaps(synth_patterns(1, 2, 1200, seed=3), None, title="Long sequence (1,200 tokens)", color="log")
    r.section("Training and circuits")
    steps = np.arange(1, 201)
    r.line_plot(
        {"train": 3 * steps**-0.3, "val": 3.2 * steps**-0.28},
        x=steps,
        title="Loss",
        x_label="step",
        y_label="loss",
        log_y=True,
    )
    r.bar_plot(
        {"L1H6": np.geomspace(8, 0.05, 8), "L2H3": np.geomspace(5, 0.2, 8)},
        labels=[f"σ{i}" for i in range(1, 9)],
        title="OV circuit singular values",
        x_label="singular value",
        y_label="σ",
        log_y=True,
    )
    path = r.write(tmp_path_factory.mktemp("report") / "report.html")
    return path, toks


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, report):
    path, _ = report
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.events = {"console": [], "errors": [], "requests": [], "dialogs": []}
    pg.on("console", lambda m: pg.events["console"].append((m.type, m.text)))
    pg.on("pageerror", lambda e: pg.events["errors"].append(str(e)))
    pg.on("request", lambda r: pg.events["requests"].append(r.url))
    pg.on("dialog", lambda d: (pg.events["dialogs"].append(d.message), d.dismiss()))
    pg.goto(path.as_uri())
    pg.wait_for_function(
        "() => [...document.querySelectorAll('figure.al-heat')].every(f => f.dataset.ready !== '0')", timeout=20_000
    )
    yield pg
    ctx.close()


def fig_ids(page):
    return page.eval_on_selector_all("figure.al-heat", "fs => fs.map(f => f.id)")


def hover(page, fid, q, k):
    page.eval_on_selector(f"#{fid} canvas.al-canvas", "c => c.scrollIntoView({block: 'center'})")
    c = page.evaluate(f"() => attnlab.figures['{fid}'].cellCenter({q}, {k})")
    page.mouse.move(c["x"], c["y"])
    return page.inner_text(f"#{fid} .al-tip")


def test_loads_clean_and_offline(page, report):
    states = page.eval_on_selector_all("figure.al-heat", "fs => fs.map(f => f.dataset.ready)")
    assert states == ["1", "1"]
    hover(page, fig_ids(page)[0], 3, 1)
    assert page.events["errors"] == []
    assert [m for m in page.events["console"] if m[0] in ("error", "warning")] == []
    assert page.events["requests"] == [report[0].as_uri()]  # the file itself and nothing else
    assert page.events["dialogs"] == []


def test_canvas_has_pixels(page):
    for fid in fig_ids(page):
        colours = page.evaluate(f"""() => {{
            const c = document.querySelector('#{fid} canvas.al-canvas');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const seen = new Set();
            for (let i = 0; i < d.length; i += 4 * 7) seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
            return seen.size; }}""")
        assert colours > 20, (fid, colours)


def test_hover_names_the_token_pair(page, report):
    _, toks = report
    fid = fig_ids(page)[0]
    for q, k in ((12, 0), (0, 0), (13, 4), (9, 5), (20, 10)):
        tip = hover(page, fid, q, k)
        shown = lambda s: s.replace("\n", "\u23ce")  # noqa: E731  (the viewer marks newlines)
        assert f"query {q}" in tip and shown(toks[q]) in tip, tip
        assert f"key {k}" in tip and shown(toks[k]) in tip, tip
        assert "weight" in tip
    tip = hover(page, fid, 0, 5)  # above the diagonal of a causal pattern
    assert "weight < " in tip or "weight 0" in tip
    assert page.events["dialogs"] == []  # '<script>alert(1)</script>' stayed text
    assert page.evaluate("() => document.querySelectorAll('.al-tip script, .al-tip img').length") == 0


def _pixels(page, fid):
    return page.evaluate(f"""() => {{ const c = document.querySelector('#{fid} canvas.al-canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let h = 0; for (let i = 0; i < d.length; i += 97) h = (h * 31 + d[i]) | 0; return h; }}""")


def test_zoom_changes_the_view(page):
    fid = fig_ids(page)[1]  # the long one: starts pooled
    view = lambda: page.evaluate(f"() => attnlab.figures['{fid}'].view()")  # noqa: E731
    status = page.inner_text(f"#{fid} .al-status")
    assert "max-pooled tiles of 2 × 2 cells" in status
    assert "tile: query" in hover(page, fid, 600, 300)
    full, before = view(), _pixels(page, fid)
    assert full == [0, 1200, 0, 1200]
    c = page.evaluate(f"() => attnlab.figures['{fid}'].cellCenter(600, 300)")
    page.mouse.click(c["x"], c["y"])  # focus; a click alone does not zoom
    assert view() == full
    for _ in range(6):
        page.mouse.wheel(0, -240)
    page.wait_for_timeout(50)
    v = view()
    assert v[1] - v[0] < 600 and v[0] <= 600 < v[1] and v[2] <= 300 < v[3], v
    assert _pixels(page, fid) != before
    page.keyboard.press("Escape")
    assert view() == full
    # drag a box over queries ~100..140, keys ~90..130: zooms to single cells with token labels
    a = page.evaluate(f"() => attnlab.figures['{fid}'].cellCenter(100, 90)")
    b = page.evaluate(f"() => attnlab.figures['{fid}'].cellCenter(140, 130)")
    page.mouse.move(a["x"], a["y"])
    page.mouse.down()
    page.mouse.move(b["x"], b["y"], steps=4)
    page.mouse.up()
    q0, q1, k0, k1 = view()
    assert abs(q0 - 100) <= 2 and abs(q1 - 141) <= 2 and abs(k0 - 90) <= 2 and abs(k1 - 131) <= 2, view()
    assert "1 cell = " in page.inner_text(f"#{fid} .al-status")
    tip = hover(page, fid, 120, 110)
    assert "query 120" in tip and "key 110" in tip and "tile" not in tip
    page.keyboard.press("ArrowRight")
    assert view()[2] > k0


def test_head_selection(page):
    fid = fig_ids(page)[0]
    page.select_option(f"#{fid} select.al-layer", "1")
    page.select_option(f"#{fid} select.al-head", "2")
    assert page.evaluate(f"() => attnlab.figures['{fid}'].current()") == 5
    assert "(induction)" in page.inner_text(f"#{fid} .al-status")
    page.click(f"#{fid} .al-thumb >> nth=1")
    assert page.evaluate(f"() => attnlab.figures['{fid}'].current()") == 1
    assert page.events["errors"] == []


def test_readable_without_javascript(browser, report):
    ctx = browser.new_context(java_script_enabled=False, viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    pg.goto(report[0].as_uri())
    assert pg.locator("svg.al-plot").count() == 2
    box = pg.locator("svg.al-plot >> nth=0").bounding_box()
    assert box["width"] > 500 and box["height"] > 250
    assert pg.locator("table.al-grid td").count() == 48
    assert "Top heads" in pg.inner_text("table.al-table")
    widths = pg.eval_on_selector_all("img.al-fallback", "is => is.map(i => i.naturalWidth)")
    assert len(widths) == 2 and min(widths) > 0  # the static first-head image decoded
    ctx.close()


def test_full_page_screenshot_is_not_blank(page):
    png = page.screenshot(full_page=True, path=SHOT)
    # decode the PNG with the browser itself and count colours on a coarse grid
    stats = page.evaluate(
        """async (b64) => {
        const img = new Image(); img.src = 'data:image/png;base64,' + b64; await img.decode();
        const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
        const x = c.getContext('2d'); x.drawImage(img, 0, 0);
        const d = x.getImageData(0, 0, c.width, c.height).data, seen = new Set();
        for (let i = 0; i < d.length; i += 4 * 101) seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
        return [img.width, img.height, seen.size]; }""",
        base64.b64encode(png).decode(),
    )
    w, h, colours = stats
    assert w >= 1200 and h > 2000
    assert colours > 50
