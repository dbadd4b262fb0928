"""Claims about the alternatives (Hopfield, linear, additive attention): verdicts as measured, and a
broken implementation flips the ones it should (quotes: test_claims.py checks every claim's)."""

import pytest
import torch

import attnlab.lab.claims as C
from attnlab.lab.claims import Verdict

EXPECTED = {"hopfield-update-is-attention": Verdict.HOLDS,
            "hopfield-exponential-capacity": Verdict.HOLDS_UNDER_CONDITIONS,
            "linear-attention-approximates-softmax": Verdict.HOLDS_UNDER_CONDITIONS}
TIMED = ("linear-attention-faster-at-long-sequences", "additive-attention-costlier")  # wall-time evidence




@pytest.mark.parametrize("claim_id", sorted(EXPECTED))
def test_verdict(claim_id):
    (r,) = C.run_claims([claim_id], progress=False)
    assert r.ok, r.error
    assert r.verdict is EXPECTED[claim_id], (r.key_figure, r.evidence)


@pytest.mark.parametrize("claim_id", TIMED)
def test_timed_claims_run(claim_id, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))  # the crossover claim falls back to a quick run
    (r,) = C.run_claims([claim_id], progress=False)
    assert r.ok, r.error
    assert isinstance(r.verdict, Verdict) and r.key_figure and r.evidence


def test_a_hopfield_update_with_the_wrong_temperature_flips_the_identity(monkeypatch):
    import attnlab.ops.hopfield as H
    real = H.hopfield_update
    monkeypatch.setattr(H, "hopfield_update", lambda xi, X, beta: real(xi, X, beta ** 0.5))
    (r,) = C.run_claims(["hopfield-update-is-attention"], progress=False)
    assert r.verdict is Verdict.DOES_NOT_HOLD


def test_favor_features_without_the_exponential_flip_the_approximation(monkeypatch):
    import attnlab.ops.linear as L

    class Broken(L.FavorFeatures):  # positive random features without the exponential: not the softmax kernel
        def query(self, x):
            return torch.relu(self.logits(x)) + 1e-3

        key = query

    monkeypatch.setattr(L, "FavorFeatures", Broken)
    (r,) = C.run_claims(["linear-attention-approximates-softmax"], progress=False)
    assert r.verdict is Verdict.DOES_NOT_HOLD


@pytest.mark.slow
def test_ssm_recall_claim():
    (r,) = C.run_claims(["ssm-weaker-content-recall"], progress=False)   # the lab's recall run (cached)
    assert r.ok, r.error
    assert r.verdict is Verdict.HOLDS_UNDER_CONDITIONS, (r.key_figure, r.evidence)


def test_an_ssm_that_recalls_like_attention_flips_the_recall_claim(monkeypatch):
    from attnlab.lab import recall
    acc = {"2": 1.0, "4": 1.0, "8": 0.99}
    fake = {"n_pairs": [2, 4, 8], "no_binding": {"2": 0.75, "4": 0.52, "8": 0.34},
            "config": {"seq_len": 32, "d_model": 64, "steps": 10},
            "models": {m: {"accuracy": dict(acc), "params": 1} for m in ("attention", "ssm")}}
    monkeypatch.setattr(recall, "run", lambda **kw: fake)
    (r,) = C.run_claims(["ssm-weaker-content-recall"], progress=False)
    assert r.verdict is Verdict.DOES_NOT_HOLD
