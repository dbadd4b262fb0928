"""The claims registry: every claim runs, quotes its seed verbatim, gives the verdict we
expect of the current implementation — and a deliberately broken attnlab flips it."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.cli import main
from attnlab.lab import claims as C
from attnlab.lab.claims import Outcome, Verdict
from attnlab.lab.claims.registry import Registry, normalize

H, N, U = Verdict.HOLDS, Verdict.DOES_NOT_HOLD, Verdict.HOLDS_UNDER_CONDITIONS

# What the current implementation must give (measured at call time, never hard-coded in the claims).
EXPECTED = {
    "dot-product-cosine": H,
    "score-variance-grows-with-dk": H,
    "scaling-restores-unit-variance": U,
    "unit-vectors-variance": H,
    "max-subtraction-prevents-overflow": H,
    "scaling-prevents-overflow": U,
    "softmax-rows-on-simplex": H,
    "softmax-strictly-positive": U,
    "budget-example-is-softmax": N,
    "output-in-convex-hull": H,
    "softmax-jacobian": H,
    "jacobian-vanishes-when-saturated": H,
    "softmax-gradients-never-vanish": N,
    "temperature-limits": H,
    "multihead-budget-equals-one-head": H,
    "concat-scaled-by-inverse-sqrt-h": N,
    "w-o-shape-dh-by-d": N,
    "w-o-square": U,
    "w-o-mixes-heads": H,
    "qk-asymmetry": U,
    "tied-qk-collapses-to-mean": N,
    "qk-rank-bounded-by-dk": H,
    "qk-gauge-freedom": U,
    "head-factors-into-qk-and-ov": H,
    "attention-only-moves-between-positions": H,
    "permutation-equivariance": H,
    "rope-relative-offset": H,
    "positions-only-change-qkv-input": U,
    "causal-mask-keeps-past-fixed": H,
    "mask-large-negative-constant": U,
    "kv-cache-equals-recomputation": H,
    "kv-cache-step-cost-linear": H,
    "kv-cache-bytes-formula": U,
    "gqa-shrinks-kv-cache": H,
    "flash-exact-with-linear-memory": U,
    "attention-cost-quadratic": H,
    "linear-attention-reassociation": H,
}
OURS = {
    f"attnlab.lab.claims.{m}"
    for m in ("scores", "softmax", "multihead", "circuits", "positions", "masking", "inference")
}


@pytest.fixture(scope="module")
def results():
    return {r.id: r for r in C.run_claims(list(EXPECTED), progress=False)}


def _verdict(claim_id: str) -> Verdict:
    (r,) = C.run_claims([claim_id], progress=False)
    assert r.ok, r.error
    return r.verdict


# ----------------------------------------------------------------------------- the registry
def test_registry_lists_our_claims():
    mine = [c for c in C.all_claims() if c.module in OURS]
    assert sorted(c.id for c in mine) == sorted(EXPECTED)
    assert 25 <= len(mine) <= 40
    assert all(c.seed in (C.SEED_000, C.SEED_002) for c in mine)
    assert {c.seed for c in mine} == {C.SEED_000, C.SEED_002}


@pytest.mark.parametrize("claim_id", sorted(EXPECTED))
def test_claim_runs_and_gives_a_valid_verdict(results, claim_id):
    r = results[claim_id]
    assert r.ok, r.error
    assert isinstance(r.verdict, Verdict)
    assert isinstance(r.evidence, dict) and r.evidence
    assert r.explanation and "\n" not in r.explanation
    assert bool(r.conditions) == (r.verdict is U)
    assert r.key_figure
    json.dumps(r.as_dict())  # evidence is JSON


@pytest.mark.parametrize("claim_id", sorted(c.id for c in C.all_claims()))  # every registered claim
def test_claim_quotes_occur_verbatim_in_its_seed(claim_id):
    (c,) = [c for c in C.all_claims() if c.id == claim_id]
    path = C.seed_path(c.seed)
    if path is None:
        pytest.skip(f"seed {c.seed} not found (looked in ../shared/seeds and $ATTNLAB_SEEDS)")
    text = normalize(path.read_text(encoding="utf-8"))
    for q in c.quotes:
        assert normalize(q) in text, f"{claim_id}: not in {c.seed}: {q!r}"
    assert C.quote_found(c) == [True] * len(c.quotes)


@pytest.mark.parametrize("claim_id", sorted(EXPECTED))
def test_current_implementation_gives_the_expected_verdict(results, claim_id):
    r = results[claim_id]
    assert r.verdict is EXPECTED[claim_id], f"{claim_id}: {r.verdict} ({r.key_figure}); evidence {r.evidence}"


def test_outcome_validation():
    with pytest.raises(ValueError, match="conditions"):
        Outcome(U, {"x": 1.0}, "measured")
    with pytest.raises(ValueError, match="conditions"):
        Outcome(H, {"x": 1.0}, "measured", conditions="only on Tuesdays")
    with pytest.raises(ValueError, match="evidence"):
        Outcome(H, {}, "measured")
    with pytest.raises(ValueError, match="one-line"):
        Outcome(H, {"x": 1}, "two\nlines")
    assert Outcome.judge(True, evidence={"x": 1}, explanation="e").verdict is H
    assert Outcome.judge(True, evidence={"x": 1}, explanation="e", conditions="c").verdict is U
    o = Outcome.judge(False, evidence={"x": float("nan")}, explanation="e", conditions="c")
    assert o.verdict is N and o.conditions is None and o.evidence == {"x": "nan"}
    assert Verdict("holds") is H and H == "holds"


def test_registry_is_open_and_reports_errors():
    reg = Registry()

    @reg.claim("fine", title="t", seed="s.txt", quote="q")
    def _():
        return Outcome.judge(True, evidence={"a": 1}, explanation="ok")

    @reg.claim("broken-experiment", title="t", seed="s.txt", quote=("q1", "q2"))
    def _():
        raise RuntimeError("boom")

    with pytest.raises(ValueError, match="already registered"):
        reg.claim("fine", title="t", seed="s.txt", quote="q")(lambda: None)
    with pytest.raises(ValueError, match="no claim matches"):
        reg.select(["nothing-like-this"])
    assert [c.id for c in reg.select(["broken"])] == ["broken-experiment"]
    res = reg.run(progress=False)
    assert [r.ok for r in res] == [True, False]
    assert res[1].verdict is None and "boom" in res[1].error
    table = C.format_table(res)
    assert "ERROR" in table and "fine" in table and "1 holds, 1 error" in table
    doc = json.loads(C.to_json(res))
    assert doc["claims"][1]["error"].startswith("RuntimeError")


def test_main(tmp_path, capsys, monkeypatch):
    assert main(["claims", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(i in listed for i in EXPECTED)
    out = tmp_path / "claims.json"
    assert main(["claims", "budget-example", "w-o-shape", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "does not hold" in text and "budget-example-is-softmax" in text
    doc = json.loads(out.read_text())
    assert [c["id"] for c in doc["claims"]] == ["budget-example-is-softmax", "w-o-shape-dh-by-d"]
    assert all(c["verdict"] == "does not hold" for c in doc["claims"])
    assert main(["claims", "no-such-claim"]) == 2

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setitem(C.REGISTRY._claims, "zz-raises", C.Claim("zz-raises", "t", C.SEED_000, ("q",), boom, "tests"))
    assert main(["claims", "zz-raises", "--no-progress"]) == 1


def test_claims_on_worker_processes_give_what_one_process_gives(tmp_path, capsys):
    ids = ["budget-example-is-softmax", "w-o-shape-dh-by-d", "softmax-rows-on-simplex"]
    docs = []
    for workers in ("1", "2"):
        out = tmp_path / f"claims-{workers}.json"
        assert main(["claims", *ids, "--workers", workers, "--json", str(out), "--no-progress"]) == 0
        capsys.readouterr()
        docs.append([{k: v for k, v in c.items() if k != "seconds"} for c in json.loads(out.read_text())["claims"]])
    assert [c["id"] for c in docs[1]] == ids  # registration order, whichever worker finished first
    assert docs[1] == docs[0]
    with pytest.raises(ValueError, match="workers: expected a positive int"):
        C.run_claims(ids, progress=False, workers=0)


def test_run_claims_restores_threads():
    before = torch.get_num_threads()
    C.run_claims(["budget-example"], progress=False, threads=1)
    assert torch.get_num_threads() == before


# ----------------------------------------------------------------------------- broken implementations
def test_scale_of_one_flips_the_variance_claims(monkeypatch):
    from attnlab.ops import args

    monkeypatch.setattr(args, "scale_arg", lambda scale, D: 1.0 if scale is None else float(scale))
    assert _verdict("scaling-restores-unit-variance") is N
    assert _verdict("score-variance-grows-with-dk") is N
    assert _verdict("dot-product-cosine") is H  # an explicit scale is untouched


def test_leaky_causal_mask_flips_the_past_fixed_claim(monkeypatch):
    from attnlab import masks
    from attnlab.masks import cache as mask_cache
    from attnlab.nn import decoder

    causal = type(masks.causal())
    mask_cache.clear()  # tiles classified before the leak would hide it; tiles classified with it must not stay
    monkeypatch.setattr(causal, "predicate", lambda self, b, h, q, kv: kv <= q + 1)  # peeks one ahead
    monkeypatch.setattr(causal, "classify", lambda self, *a: None)
    monkeypatch.setattr(causal, "lower", lambda self: None)  # no kernel takes it for causal()
    monkeypatch.setattr(decoder, "_CAUSAL", masks.causal())
    try:
        assert _verdict("causal-mask-keeps-past-fixed") is N
    finally:
        mask_cache.clear()


def test_stale_kv_cache_flips_the_cache_claim(monkeypatch):
    from attnlab.cache.base import DenseKV

    attend = DenseKV.attend

    def forgets_newest(self, q, **kw):  # a cache that does not show the newest key/value
        if self.k.shape[2] < 2:
            return attend(self, q, **kw)
        return attend(
            DenseKV(self.k[:, :, :-1], self.v[:, :, :-1], self.kv_offset, self.q_offset, self.q_positions), q, **kw
        )

    monkeypatch.setattr(DenseKV, "attend", forgets_newest)
    assert _verdict("kv-cache-equals-recomputation") is N


def test_absolute_angle_rope_flips_the_relative_offset_claim(monkeypatch):
    from attnlab.positions import RoPE

    cos_sin = RoPE.cos_sin
    monkeypatch.setattr(
        RoPE,
        "cos_sin",
        lambda self, positions, dtype=torch.float32: cos_sin(self, positions * positions.abs() // 3, dtype=dtype),
    )  # angle ∝ position²
    assert _verdict("rope-relative-offset") is N


def test_identity_rope_flips_the_permutation_claim(monkeypatch):
    from attnlab.positions import RoPE

    monkeypatch.setattr(RoPE, "forward", lambda self, x, positions: x)  # RoPE that rotates nothing
    assert _verdict("permutation-equivariance") is N


def test_scaled_concatenation_flips_the_budget_of_heads_not_the_torch_parity(monkeypatch):
    """If attnlab scaled the concatenation by 1/sqrt(h) as the seed says, it would part from torch."""
    from attnlab.nn import attention as nn_attention

    out = nn_attention.MultiHeadAttention._out

    def scaled(self, z, B, N_):
        return out(self, z / self.n_heads**0.5, B, N_)

    monkeypatch.setattr(nn_attention.MultiHeadAttention, "_out", scaled)
    (r,) = C.run_claims(["concat-scaled-by-inverse-sqrt-h"], progress=False)
    assert r.evidence["max |attnlab − torch.nn.MultiheadAttention|"] > 0.1
    assert _verdict("w-o-mixes-heads") is N  # MHA ≠ Σ_m head_m W_O^m any more


def test_materializing_flash_flips_the_memory_claim(monkeypatch):
    from attnlab.ops import flash
    from attnlab.ops.reference import reference_attention

    class Materializing:  # a "flash" kernel that builds the n×n matrix (and autograd saves it)
        @staticmethod
        def apply(pb, q, k, v, *params):
            return reference_attention(
                q, k, v, score_mod=pb.score_mod, scale=pb.scale, q_offset=pb.q_offset, kv_offset=pb.kv_offset
            )

    monkeypatch.setattr(flash, "_FlashFn", Materializing)
    assert _verdict("flash-exact-with-linear-memory") is N
