"""The MQAR experiment: the task's layout, a tiny run, and its cache."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.lab import recall
from attnlab.lab.recall import RecallConfig, mqar_batch, mqar_batches, run, summary

TINY = RecallConfig(
    vocab_size=17,
    seq_len=16,
    n_pairs=(2, 4),
    d_model=16,
    n_layers=1,
    n_heads=2,
    d_state=4,
    steps=3,
    batch_size=4,
    warmup_steps=0,
    eval_sequences=8,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the root conftest's one-thread fixture


@pytest.fixture
def lab_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    return tmp_path


def test_mqar_layout():
    g = torch.Generator().manual_seed(0)
    x, y = mqar_batch(vocab_size=33, batch_size=16, seq_len=40, n_pairs=5, generator=g)
    assert x.shape == y.shape == (16, 40) and x.dtype == y.dtype == torch.int64
    K = 16
    for row in range(16):
        keys, values = x[row, 0:10:2], x[row, 1:10:2]
        assert len(set(keys.tolist())) == 5 and ((keys >= 1) & (keys <= K)).all()
        assert ((values > K) & (values < 33)).all() and len(set(values.tolist())) == 5
        scored = (y[row] != -100).nonzero().flatten()
        assert sorted(x[row, scored].tolist()) == sorted(keys.tolist())  # every key queried once
        for p in scored.tolist():
            assert p >= 10 and y[row, p] == values[keys == x[row, p]].item()  # target = its value
            assert p + 1 >= 40 or x[row, p + 1] == y[row, p]  # and the value follows
        rest = torch.ones(40, dtype=torch.bool)
        rest[:10] = False
        rest[scored] = False
        rest[(scored + 1).clamp_max(39)] = False
        assert (x[row, rest] == 0).all()  # filler elsewhere


def test_mqar_mixture_and_errors():
    x, y = next(mqar_batches(17, 6, 16, (2, 4), seed=1))
    assert ((y != -100).sum(1).tolist()) == [2, 2, 2, 4, 4, 4]
    x2, _ = next(mqar_batches(17, 6, 16, (2, 4), seed=1))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="n_pairs=9 distinct keys need vocab_size >= 19"):
        mqar_batches(17, 4, 64, 9, seed=0)
    with pytest.raises(ValueError, match="n_pairs=4 needs seq_len >= 15"):
        mqar_batches(64, 4, 12, 4, seed=0)
    with pytest.raises(ValueError, match="batch_size: 5 must split evenly"):
        mqar_batches(17, 5, 16, (2, 4), seed=0)
    with pytest.raises(ValueError, match=r"RecallConfig.mixers"):
        RecallConfig(mixers=("attention", "rnn"))


def test_tiny_run_and_cache(lab_cache, monkeypatch):
    result = run(config=TINY, progress=False, workers=1)
    assert set(result) == {
        "experiment",
        "key",
        "config",
        "n_pairs",
        "chance",
        "no_binding",
        "models",
        "elapsed_s",
        "torch",
    }
    assert result["n_pairs"] == [2, 4] and result["chance"] == pytest.approx(1 / 8)
    assert result["no_binding"] == pytest.approx({"2": 3 / 4, "4": 25 / 48})
    assert set(result["models"]) == {"attention", "linear", "ssm"}
    for m in result["models"].values():
        assert set(m["accuracy"]) == {"2", "4"} and all(0 <= a <= 1 for a in m["accuracy"].values())
        assert m["params"] > m["mixer_params"] > 0 and m["final_loss"] > 0
        assert [r["lr"] for r in m["runs"]] == list(TINY.lrs)  # every learning rate ran
        best = min(m["runs"], key=lambda r: r["final_loss"])  # chosen by training loss
        assert m["lr"] == best["lr"] and m["accuracy"] == best["accuracy"]
    p = result["models"]
    assert p["linear"]["mixer_params"] == p["attention"]["mixer_params"]
    assert (lab_cache / "recall" / f"mqar-{TINY.key()}.json").exists()

    def no_training(*a, **k):
        raise AssertionError("the cached result should be returned without training")

    monkeypatch.setattr(recall, "train", no_training)
    assert run(config=TINY, progress=False, workers=1) == result
    monkeypatch.undo()
    monkeypatch.setenv("ATTNLAB_CACHE", str(lab_cache))
    again = run(config=TINY, force=True, progress=False, workers=2)  # retrains in 2 processes: same numbers
    for mixer, m in again["models"].items():
        assert m["accuracy"] == result["models"][mixer]["accuracy"]
        assert m["final_loss"] == pytest.approx(result["models"][mixer]["final_loss"], rel=1e-6)
    table = summary(result)
    assert "n=2" in table and "n=4" in table and all(mx in table for mx in ("attention", "linear", "ssm"))


def test_main_writes_json_and_prints_table(lab_cache, monkeypatch, capsys, tmp_path):
    from attnlab.cli import main

    small = RecallConfig(**{**TINY.to_dict(), "mixers": ("ssm",), "n_pairs": (2,), "batch_size": 2, "lrs": (1e-3,)})
    monkeypatch.setattr(recall, "QUICK", small)
    path = tmp_path / "recall.json"
    assert main(["lab", "recall", "--quick", "--json", str(path), "--workers", "1"]) == 0
    out = json.loads(path.read_text())
    assert out["key"] == small.key() and list(out["models"]) == ["ssm"]
    assert "ssm" in capsys.readouterr().out
    assert main(["lab", "recall", "--quick", "--workers", "1"]) == 0
    assert "ssm" in capsys.readouterr().out
    assert RecallConfig(steps=4, warmup_steps=0).key() != RecallConfig(steps=5, warmup_steps=0).key()


def test_no_binding_baseline_is_what_elimination_scores():
    """Guessing each queried value among the values not yet queried scores H_n / n."""
    g = torch.Generator().manual_seed(0)
    n, trials = 4, 20000
    hits = 0
    for order in torch.rand(trials, n, generator=g).argsort(1).tolist():
        left = list(range(n))
        for q in order:
            guess = left[int(torch.randint(len(left), (1,), generator=g))]
            hits += guess == q
            left.remove(q)
    assert abs(hits / (trials * n) - recall.no_binding_accuracy(n)) < 0.01
