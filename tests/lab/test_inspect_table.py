"""What ``attnlab inspect`` prints and the lab's induction table, on hand-made scores (no
model is loaded): columns explained, no zero-scoring "top heads", truncation said."""

import torch

from attnlab.interp.detectors import HeadScores
from attnlab.lab import demo, induction


def _scores():
    sink = torch.zeros(2, 3)
    sink[1, 2] = 0.8
    return {
        "sink": HeadScores("sink", sink, [0, 1]),
        "induction": HeadScores("induction", torch.zeros(2, 3), [0, 1]),
        "sink_vw": HeadScores("sink_vw", sink * 0.5, [0, 1]),
        "positional": HeadScores("positional", torch.full((2, 3), 0.004), [0, 1]),
    }


def test_zero_scores_are_not_top_heads_and_the_columns_are_explained():
    text = "\n".join(demo.format_inspect(["a", "b"], _scores(), n_layers=2, n_heads=3))
    rows = {}
    for line in text.splitlines():  # the table's row of each detector (the legend below repeats the names)
        if line.split():
            rows.setdefault(line.split()[0], line)
    assert "L1H2 0.80" in rows["sink"] and "L0H0" not in rows["sink"]  # only the head that scores
    assert "0.00" not in rows["induction"] and "none" in rows["induction"]
    assert "0.00" not in rows["positional"] and "none" in rows["positional"]  # 0.004 rounds to 0.00
    assert "L1H2 0.40" in rows["sink_vw"]
    for word in ("sink", "positional", "induction", "_vw", "value-weighted", "first token", "offset"):
        assert word in text


def test_truncation_is_said():
    toks = [f"t{i}" for i in range(demo.SHOW_TOKENS + 5)]
    text = "\n".join(demo.format_inspect(toks, _scores(), n_layers=2, n_heads=3, cut_to=512))
    assert f"the first {demo.SHOW_TOKENS} of {len(toks)} tokens" in text
    assert f"t{demo.SHOW_TOKENS - 1}'" in text and f"t{demo.SHOW_TOKENS}'" not in text
    assert "only its first 512 tokens are read" in text
    short = "\n".join(demo.format_inspect(["a"], _scores(), n_layers=2, n_heads=3))
    assert "tokens shown" not in short and "limit" not in short


def test_the_induction_table_says_which_data_each_loss_is_on():
    log = {"loss": [0.5], "icl": [-1.0], "induction_max": [0.9], "prev_token_max": [0.8]}
    res = {"models": {"2L": {"log": log, "final": {"second_half_loss": 0.1}, "phase_change_step": 400}}}
    table = induction.summary(res)
    head, row = table.splitlines()[:2]
    assert "loss¹" in head and "2nd-copy loss³" in head and "ICL²" in head
    assert "0.500" in row and "0.100" in row
    assert "measured on different data" in table
    for mark in ("¹ held-out loss", "² on a fixed batch of repeated", "³ loss on the 2nd copy"):
        assert mark in table
