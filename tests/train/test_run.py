"""``attnlab train``: the command trains, checkpoints and resumes."""

import pytest

from attnlab.cli import main
from attnlab.train import run


def test_induction_task_learns_to_copy(tmp_path, capsys):
    s = run.main(task="induction", steps=150, layers=2, d_model=128, heads=4, seq_len=64, batch=16, lr=3e-3,
                 out=str(tmp_path / "ck"))
    # the first half of each sequence is unpredictable (ignored); the second is a copy:
    # an induction circuit takes the loss far below uniform
    assert s["loss_first10"] > 0.9 * s["uniform_loss"]
    assert s["loss_last10"] < 0.3 * s["uniform_loss"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == "step-0000150"
    assert "induction:" in capsys.readouterr().out


def test_resume_continues_from_the_checkpoint(tmp_path):
    a = run.main(task="recall", steps=20, layers=1, d_model=32, heads=2, seq_len=10, batch=8, vocab=32,
                 out=str(tmp_path / "ck"))
    b = run.main(task="recall", steps=30, layers=1, d_model=32, heads=2, seq_len=10, batch=8, vocab=32,
                 out=str(tmp_path / "ck"), resume=True)
    assert a["steps"] == 20 and b["steps"] == 30


def test_cli_reports_bad_arguments(capsys):
    assert main(["train", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err
    assert main(["train", "--task", "poetry"]) == 2  # argparse's usage error, as the exit status
