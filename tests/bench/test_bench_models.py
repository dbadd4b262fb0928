"""``attnlab bench models`` end to end on its quick shapes (one timed round)."""

import pytest

pytest.importorskip("transformers")

from attnlab.bench import models as bench


def test_quick_run_compares_the_same_weights_and_reports_ratios():
    res = bench.run(reps=1, quick=True, progress=False)
    by = {c["case"]: c for c in res["cases"]}
    assert set(by) == {"gpt2 forward f32", "gpt2 forward bf16", "gpt2 train step f32", "minilm encode f32"}
    # the two contenders run the same weights: their outputs agree
    assert by["gpt2 forward f32"]["max_abs_logit_diff"] < 1e-4
    assert by["gpt2 forward bf16"]["max_abs_logit_diff"] < 0.1
    assert by["minilm encode f32"]["max_abs_diff"] < 1e-5
    for c in res["cases"]:
        assert c["attnlab"] > 0 and c["transformers"] > 0
        assert c["ratio"] == pytest.approx(c["attnlab"] / c["transformers"])
        assert 1e-2 < c["ratio"] < 1e2, c  # the same weights and shapes: within two orders of magnitude
    table = bench.format_table(res)
    assert "gpt2 train step f32" in table and "x" in table
