"""The token-to-token and head views in a real headless Chromium (as tests/report/test_browser.py):
no errors or requests, lines drawn per weight, hover isolates one token's lines and names its
partners (hostile token text shown literally), the selectors switch layer and head, and a
heatmap in the same page still works (the two viewers share ``window.attnlab``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium); CI installs it", allow_module_level=True)

from playwright.sync_api import sync_playwright  # noqa: E402

from attnlab.report.builder import Report  # noqa: E402

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
pytestmark = pytest.mark.slow
N = 10


@pytest.fixture(scope="module")
def built(tmp_path_factory, synth, evil_tokens):
    p = synth(2, 3, N, seed=4)
    toks = (evil_tokens + [f"t{i}" for i in range(N)])[:N]
    r = Report("token views")
    r.section("Views")
    r.heatmaps(p, toks, title="Heatmap next to the views")
    r.head_view(p, toks, title="Head view", layer=1)
    r.token_view(p, toks, title="Token view", layer=0, head=2, labels={(0, 2): "<i>prev</i>"})
    return r.write(tmp_path_factory.mktemp("tv") / "tv.html"), p, toks


@pytest.fixture(scope="module")
def page(built):
    path, _, _ = built
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = b.new_context(viewport={"width": 1280, "height": 900}).new_page()
        pg.events = {"console": [], "errors": [], "requests": []}
        pg.on("console", lambda m: pg.events["console"].append((m.type, m.text)))
        pg.on("pageerror", lambda e: pg.events["errors"].append(str(e)))
        pg.on("request", lambda r: pg.events["requests"].append(r.url))
        pg.goto(path.as_uri())
        pg.wait_for_function(
            "() => [...document.querySelectorAll('figure.al-tv, figure.al-heat')].every(f => f.dataset.ready === '1')",
            timeout=20_000,
        )
        yield pg
        b.close()


def ids(page):
    return page.eval_on_selector_all("figure.al-tv", "fs => fs.map(f => f.id)")


def state(page, fid):
    return page.evaluate(f"() => attnlab.views['{fid}'].state()")


def visible_lines(w):
    return int((np.rint(np.clip(w, 0, 1) * 255) / 255 >= 0.01).sum())


def test_loads_clean_offline_and_beside_a_heatmap(page, built):
    assert page.events["errors"] == [] and [m for m in page.events["console"] if m[0] in ("error", "warning")] == []
    assert page.events["requests"] == [built[0].as_uri()]
    assert page.evaluate("() => Object.keys(attnlab.figures).length") == 1  # the heatmap API survived


def test_lines_follow_the_weights(page, built):
    _, p, _ = built
    hv, tv = ids(page)
    assert state(page, hv)["lines"] == sum(visible_lines(p[1, h]) for h in range(3))  # all heads of layer 1
    assert state(page, tv)["lines"] == visible_lines(p[0, 2])
    colours = page.evaluate(f"""() => {{
        const c = document.querySelector('#{hv} canvas'); const d = c.getContext('2d').getImageData(0, 0, c.width,
        c.height).data; const s = new Set(); for (let i = 0; i < d.length; i += 4 * 5) if (d[i + 3] > 0)
        s.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]); return s.size; }}""")
    assert colours > 20


def test_hover_isolates_a_token_and_names_its_partners(page, built):
    _, p, toks = built
    tv = ids(page)[1]
    page.eval_on_selector(f"#{tv} canvas", "c => c.scrollIntoView({block: 'center'})")
    for side, i in (("q", 0), ("q", 7), ("k", 3)):
        c = page.evaluate(f"() => attnlab.views['{tv}'].tokenCenter('{side}', {i})")
        page.mouse.move(c["x"], c["y"])
        s = state(page, tv)
        assert s["focus"] == {"side": side, "i": i}
        w = p[0, 2, i] if side == "q" else p[0, 2, :, i]
        assert s["lines"] == visible_lines(w)
        best = int(np.argmax(w))
        other = toks[best].replace("\n", "\u23ce")
        assert other in s["tip"] and toks[i].replace("\n", "\u23ce") in s["tip"]
        assert f"{float(w[best]):.3f}"[:4] in s["tip"]
    assert page.evaluate("() => window.__pwned === undefined") and page.events["errors"] == []


def test_selectors_switch_layer_and_head(page, built):
    _, p, _ = built
    tv = ids(page)[1]
    assert "<i>prev</i>" in page.inner_text(f"#{tv} select.al-tv-head")  # the label, as text
    page.select_option(f"#{tv} select.al-tv-layer", "1")
    assert state(page, tv)["head"] == "all"
    page.select_option(f"#{tv} select.al-tv-head", "1")
    s = state(page, tv)
    assert (s["layer"], s["head"]) == (1, 1) and s["lines"] == visible_lines(p[1, 1])
