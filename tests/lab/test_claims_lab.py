"""The claims measured by the lab's experiments (induction heads, sinks): verdicts as measured, and
breaking what they rest on flips them (their quotes are checked with every claim's in test_claims.py)."""

import pytest

import attnlab.lab.claims as C
from attnlab.lab.claims import Verdict

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LAB = {
    "induction-heads-need-two-layers": Verdict.HOLDS,
    "attention-sinks-in-trained-models": Verdict.HOLDS_UNDER_CONDITIONS,
    "evicting-the-sink-collapses-quality": Verdict.DOES_NOT_HOLD,
}


#: the trained models each claim reads (root conftest fixtures: trained once per run, shared by the workers)
NEEDS = {"induction-heads-need-two-layers": "induction_models", "evicting-the-sink-collapses-quality": "text_models"}


@pytest.mark.parametrize("claim_id", sorted(LAB))
def test_verdict(claim_id, request):
    if claim_id in NEEDS:
        request.getfixturevalue(NEEDS[claim_id])
    (r,) = C.run_claims([claim_id], progress=False)
    assert r.ok, r.error
    assert r.verdict is LAB[claim_id], (r.key_figure, r.evidence)
    assert r.key_figure and r.evidence


def test_a_blind_induction_detector_flips_the_induction_claim(monkeypatch, induction_models):
    import torch

    from attnlab.interp import detectors

    # the induction score is recomputed from the (cached) models: a detector that sees nothing flips the verdict
    monkeypatch.setattr(detectors, "induction", lambda p, tokens: torch.zeros(p.shape[1]))
    (r,) = C.run_claims(["induction-heads-need-two-layers"], progress=False)
    assert r.verdict is Verdict.DOES_NOT_HOLD


def test_sinks_vanish_when_attention_ignores_the_special_tokens(monkeypatch):
    import torch

    from attnlab.lab import sinks

    real = sinks.D.keys_mass

    def no_sinks(p, keys, rows=None):  # attention that never lands on [CLS]/[SEP]
        return torch.zeros(p.shape[1])

    monkeypatch.setattr(sinks.D, "keys_mass", no_sinks)
    (r,) = C.run_claims(["attention-sinks-in-trained-models"], progress=False)
    assert r.verdict is Verdict.DOES_NOT_HOLD
    monkeypatch.setattr(sinks.D, "keys_mass", real)


def test_a_window_that_loses_quality_flips_the_streaming_claim(monkeypatch, text_models):
    import attnlab.lab.streaming as inf

    real = inf.streaming_table

    def collapsed(tm, **kw):  # as if the window-only cache had lost the model's sink
        rows = real(tm, n_tokens=64)
        for r in rows:
            if r["method"] == "window only":
                r["ppl"] *= 3
        return rows

    monkeypatch.setattr(inf, "streaming_table", collapsed)
    (r,) = C.run_claims(["evicting-the-sink-collapses-quality"], progress=False)
    assert r.verdict is Verdict.HOLDS
