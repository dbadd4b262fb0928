"""``attnlab bench distributed`` end to end on a tiny configuration (one round)."""

from __future__ import annotations

import pytest

from attnlab.bench import distributed as bench
from attnlab.cli import main


def test_tiny_run_reports_every_figure():
    res = bench.run([bench.Config(N=256, P=2, reps=1)], progress=False, timeout=120)
    (case,) = res["cases"]
    assert set(case["single"]) == {"auto", "flash"}
    names = [x["variant"] for x in case["variants"]]
    assert names == ["ring contiguous", "ring zigzag", "ring striped", "ulysses contiguous"]
    for x in case["variants"]:
        assert x["fwd"] > 0 and x["fwdbwd"] >= x["fwd"] and x["speed_vs_flash"] > 0
        assert len(x["exposed_wait_s"]) == len(x["comm_only_s"]) == len(x["hidden"]) == 2
        assert all(0.0 <= h <= 1.0 for h in x["hidden"])
        assert sum(x["bytes_sent_per_rank"]) > 0
    by = {x["variant"]: x for x in case["variants"]}
    assert by["ring contiguous"]["work_balance"] == pytest.approx(3.0, rel=0.02)  # 2P-1 for causal
    assert by["ring zigzag"]["work_balance"] == 1.0
    text = bench.format_table(res)
    assert "ring zigzag" in text and "N=256 P=2" in text


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="divisible"):
        bench.run([bench.Config(N=100, P=4)], progress=False)
    with pytest.raises(ValueError, match="--seq"):
        bench.parse_ints("16k", "--seq")
    assert main(["bench", "distributed", "--reps", "0"]) == 2
    assert main(["bench", "distributed", "--ranks", "x"]) == 2
