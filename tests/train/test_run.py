"""``attnlab train``: the command trains, checkpoints and resumes."""

import shutil

import pytest
import torch

from attnlab.cli import main
from attnlab.train import run

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # bitwise comparisons need a fixed thread count


def test_induction_task_learns_to_copy(tmp_path, capsys):
    s = run.main(
        task="induction",
        steps=150,
        layers=2,
        d_model=128,
        heads=4,
        seq_len=64,
        batch=16,
        lr=3e-3,
        out=str(tmp_path / "ck"),
    )
    # the first half of each sequence is unpredictable (ignored); the second is a copy:
    # an induction circuit takes the loss far below uniform
    assert s["loss_first10"] > 0.9 * s["uniform_loss"]
    assert s["loss_last10"] < 0.3 * s["uniform_loss"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == "step-0000150"
    assert "induction:" in capsys.readouterr().out


def test_resume_continues_from_the_checkpoint(tmp_path):
    kw = dict(task="recall", layers=1, d_model=32, heads=2, seq_len=10, batch=8, vocab=32)
    a = run.main(steps=20, **kw, out=str(tmp_path / "ck"))
    b = run.main(steps=30, **kw, out=str(tmp_path / "ck"), resume=True)
    assert a["steps"] == 20 and b["steps"] == 30


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Interrupted after step 18 (only its checkpoints exist), resumed to step 30: the same losses,
    evaluation and weights as the run that was never stopped."""
    from safetensors.torch import load_file

    kw = dict(task="recall", steps=30, layers=1, d_model=32, heads=2, seq_len=10, batch=8, vocab=32)
    straight = run.main(**kw, out=str(tmp_path / "a"))
    names = sorted(p.name for p in (tmp_path / "a").iterdir() if p.name.startswith("step-"))
    assert names == ["step-0000006", "step-0000012", "step-0000018", "step-0000024", "step-0000030"]
    (tmp_path / "b").mkdir()
    for name in names[:3]:
        shutil.copytree(tmp_path / "a" / name, tmp_path / "b" / name)
    resumed = run.main(**kw, out=str(tmp_path / "b"), resume=True)
    assert resumed["steps"] == straight["steps"] == 30
    assert resumed["loss_last10"] == straight["loss_last10"]  # steps 21-30, all after the resume
    assert resumed["eval"] == straight["eval"]
    want, got = (_weights(tmp_path / d / "step-0000030", load_file) for d in ("a", "b"))
    assert want.keys() == got.keys() and want
    assert all(torch.equal(want[k], got[k]) for k in want)
    # the comparison has power: a run with another seed ends elsewhere
    other = run.main(**{**kw, "seed": 1}, out=str(tmp_path / "c"))
    assert other["loss_last10"] != straight["loss_last10"]


def _weights(folder, load_file):
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


def test_cli_reports_bad_arguments(capsys):
    assert main(["train", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err
    assert main(["train", "--task", "poetry"]) == 2  # argparse's usage error, as the exit status
