"""The induction experiment: its data, and (slow) the trained result — the 2-layer model
forms an induction head fed by a previous-token head, the 1-layer control does not."""

import dataclasses

import pytest
import torch

from attnlab.lab import induction as I


def test_batches_make_induction_the_only_predictor():
    cfg = I.InductionConfig()
    x, y = next(I.batches(cfg, seed=3, batch=64))
    assert x.shape == y.shape == (64, cfg.seq_len)
    periods = set()
    for b in range(64):
        scored = (y[b] != I.IGNORE).nonzero().flatten()
        P = int(scored[0])  # the first copy is never scored
        periods.add(P)
        assert cfg.p_min <= P <= cfg.p_max and scored.tolist() == list(range(P, cfg.seq_len))
        t = scored
        assert torch.equal(y[b, t], x[b, t + 1 - P])  # next token = the one after the earlier copy
    assert len(periods) > 5  # no fixed offset finds the copy


def test_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    cfg = I.InductionConfig(steps=4, eval_every=2, batch=4)
    m, log = I.load_or_train(cfg, 1, progress=False)
    assert log["step"] == [0, 2, 4] and len(log["train_loss"]) == 4
    m2, log2 = I.load_or_train(cfg, 1, progress=False)  # from the cache: same weights, same log
    assert log2 == log
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_early_stop_on_the_target_loss_and_a_control_trained_as_long(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    cfg = I.InductionConfig(steps=40, eval_every=4, batch=4, target_loss=1e9)  # reached at the first evaluation
    _, log2 = I.load_or_train(cfg, 2, progress=False)
    assert log2["steps_trained"] == 4 and log2["step"] == [0, 4] and len(log2["train_loss"]) == 4
    # the 1-layer control trains exactly as many steps as the cached 2-layer model took (here: as if 6)
    lpath = I._paths(cfg, 2)[1]
    lpath.write_text(json.dumps({**log2, "steps_trained": 6}))
    _, log1 = I.load_or_train(cfg, 1, progress=False)
    assert log1["steps_trained"] == 6 and log1["step"] == [0, 4, 6]
    _, full = I.train_one(dataclasses.replace(cfg, target_loss=None), 1, progress=False)  # no target: every step
    assert full["steps_trained"] == 40 and full["step"][-1] == 40
    with pytest.raises(ValueError, match="max_steps"):
        I.train_one(cfg, 1, progress=False, max_steps=0)


def test_phase_change_step():
    log = {"step": [0, 10, 20, 30, 40], "induction_max": [0.02, 0.03, 0.05, 0.6, 0.9]}
    assert I.phase_change_step(log) == 30
    assert I.phase_change_step({"step": [0, 10], "induction_max": [0.02, 0.05]}) is None


@pytest.mark.slow
def test_two_layers_form_an_induction_head_one_layer_does_not(induction_models):
    res = I.run(progress=False)  # the models trained once per run (induction_models)
    two, one = res["models"]["2L"], res["models"]["1L"]
    f2, f1 = two["final"], one["final"]
    assert max(map(max, f2["induction"][1:])) > 0.5  # an induction head in layer 1
    assert max(f2["previous_token"][0]) > 0.4  # fed by a previous-token head in layer 0
    assert max(f1["induction"][0]) < 0.25  # the control has none
    b = f2["k_comp_baseline"]
    assert f2["k_comp_induction_prev"] > b["mean"] + 4 * b["std"]
    assert two["phase_change_step"] is not None and one["phase_change_step"] is None
    assert f2["second_half_loss"] < 0.5 * f1["second_half_loss"]
    pl, ph = f2["prev_token_head"]
    assert f2["ablation"][pl][ph] > 1.0  # removing the previous-token head breaks it
    assert two["log"]["icl"][-1] < one["log"]["icl"][-1]
    assert one["log"]["steps_trained"] == two["log"]["steps_trained"] <= I.InductionConfig().steps  # trained as long
