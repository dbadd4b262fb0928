"""Capture and cache outputs go into the report as they come; the token / head view's data and
its refusals (no browser needed; tests/report/test_token_view_browser.py draws it)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from attnlab.interp import capture, detect, run_with_cache
from attnlab.nn import Decoder, DecoderConfig
from attnlab.report import Report
from attnlab.report.inputs import as_patterns


@pytest.fixture(scope="module")
def model_ids():
    torch.manual_seed(0)
    m = Decoder(DecoderConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2)).eval()
    return m, torch.randint(0, 40, (3, 6))


def _config(html, cls="al-config"):
    return [json.loads(s) for s in re.findall(rf'<script type="application/json" class="{cls}">(.*?)</script>', html)]


def _heat_bytes(r):
    return re.findall(r'class="al-b64" data-i="\d+">(.*?)</script>', r.html())


def test_capture_cache_and_batched_tensors_give_the_same_heatmap(model_ids):
    model, ids = model_ids
    with torch.no_grad(), capture(model) as cap:
        model(ids)
    _, cache = run_with_cache(model, ids)
    want = torch.stack([cap.pattern(l)[1] for l in range(2)])  # [L, H, N, N] of row 1, by hand
    ref = _heat_bytes(Report("r").heatmaps(want, title="t"))
    for src in (cap, cache, cap.patterns(), [cap.pattern(l) for l in range(2)], cap.patterns().numpy()):
        got = _heat_bytes(Report("r").heatmaps(src, title="t", batch=1))
        assert got == ref, type(src).__name__
    assert _heat_bytes(Report("r").heatmaps(cap, title="t", batch=-2)) == ref


def test_batch_must_be_chosen_for_a_batch_and_is_refused_without_one(model_ids):
    model, ids = model_ids
    with torch.no_grad(), capture(model) as cap:
        model(ids)
    with pytest.raises(ValueError, match=r"batch: .*batch of 3 sequences; pass batch="):
        Report("r").heatmaps(cap, title="t")
    with pytest.raises(ValueError, match=r"batch: expected an int in \[-3, 3\)"):
        Report("r").heatmaps(cap, title="t", batch=3)
    with pytest.raises(ValueError, match=r"batch: patterns of shape .* have no batch axis"):
        Report("r").heatmaps(cap.pattern(0)[0], title="t", batch=0)
    with torch.no_grad(), capture(model) as one:
        model(ids[:1])
    assert as_patterns(one).shape == (2, 2, 6, 6)  # a batch of one needs no batch=
    _, cache = run_with_cache(model, ids, names_filter=lambda n: n.endswith("resid_pre"))
    with pytest.raises(ValueError, match=r"holds no blocks.*hook_pattern"):
        Report("r").heatmaps(cache, title="t", batch=0)


def test_head_scores_go_into_head_grids(model_ids):
    model, ids = model_ids
    s = detect(model, ids, detectors=("previous_token",))["previous_token"]
    a = Report("r").head_grid(s, title="g").html()
    b = Report("r").head_grid(s.scores, title="g").html()
    assert a == b and a.count("<td ") == 4


def test_token_view_config_and_data(model_ids, evil_tokens):
    model, ids = model_ids
    with torch.no_grad(), capture(model) as cap:
        model(ids)
    toks = evil_tokens[:6]
    html = Report("r").head_view(cap, toks, title="hv", layer=-1, batch=2, labels={(1, 0): "<b>x</b>"}).html()
    (cfg,) = _config(html, "al-tv-config")
    assert cfg["layer"] == 1 and cfg["head"] == "all" and cfg["tq"] == toks and cfg["layers"] == [2, 2]
    blobs = re.findall(r'class="al-tv-b64" data-i="\d+">(.*?)</script>', html)
    import base64

    got = np.frombuffer(base64.b64decode(blobs[3]), dtype=np.uint8).reshape(6, 6)
    want = np.rint(cap.pattern(1)[2, 1].numpy() * 255)
    assert np.array_equal(got, want)
    for t in ("<script>alert(1)</script>", "</textarea>", "<img src=x onerror=alert(2)>"):
        assert t in toks or t not in evil_tokens[:6]
        assert t not in html  # markup never lands in the page unescaped
    assert "<b>x</b>" not in html
    csp = re.search(r'Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert csp.count("sha256-") == 1 and "default-src &#x27;none&#x27;" in csp


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda r, p: r.token_view(p, ["a"] * 5, title="t"), "tokens_q"),
        (lambda r, p: r.token_view(p, ["a"] * 6, title="t", layer=2), "layer"),
        (lambda r, p: r.token_view(p, ["a"] * 6, title="t", head=2), "head"),
        (lambda r, p: r.token_view(p * 10, ["a"] * 6, title="t"), "patterns"),
        (lambda r, p: r.token_view(np.ones((1, 1, 600, 600)) / 600, None, title="t"), "patterns"),
        (lambda r, p: r.token_view(p[:, :, :, :4], ["a"] * 6, title="t"), "tokens_k"),
    ],
)
def test_token_view_errors_name_the_argument(call, name):
    p = np.full((2, 2, 6, 6), 1 / 6)
    with pytest.raises(ValueError) as e:
        call(Report("r"), p)
    assert str(e.value).startswith(name + ":"), str(e.value)
