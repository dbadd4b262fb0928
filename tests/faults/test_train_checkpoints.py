"""Fault injection for training checkpoints (attnlab.train.checkpoint / loop / run, `attnlab train`).

* A save really killed (SIGKILL) before each of its file-system steps, and at random
  instants, leaves the complete old or the complete new checkpoint under its name.
* A damaged or inconsistent checkpoint is refused with a CheckpointError naming the field,
  and the model and the optimizer are bit-identical to what they were before the attempt.
* Resume never hangs on a data position the data cannot give.
* `attnlab train` checks --out before it trains, and refuses --resume without --out.

This file is self-contained: run as a script (``python this_file.py --kill-harness DIR``)
it is the child process of the SIGKILL test.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from attnlab.models.checkpoint import CheckpointError
from attnlab.nn import Decoder, DecoderConfig
from attnlab.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from attnlab.train.data import TokenStream
from attnlab.train.loop import TrainConfig, configure_optimizer, train

pytest.importorskip("safetensors")

VOCAB, SEQ, BATCH = 8, 8, 2
# The trainer.json checksum's place in the format (attnlab.train.checkpoint's docstring):
# tests that write a *consistent but invalid* trainer.json record it there, as a writer would.
JSON_CRC_KEY = "attnlab.trainer_json_crc32"
TENSOR_CRC_KEY = "attnlab.crc32"
# Bounds of the SIGKILL test (the brief: <= 40 kills): the step sweep of one save plus these.
RANDOM_KILLS = 12
MAX_KILLS = 40
# Resume tests: the refusal is instant; old code loops forever.  Generous for a loaded machine.
RESUME_TIMEOUT_S = 10


def make_model(seed=0) -> Decoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Decoder(DecoderConfig(vocab_size=VOCAB, d_model=8, n_layers=1, n_heads=2, max_positions=SEQ))


def tcfg(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": 2, "batch_size": BATCH, "seq_len": SEQ, "lr": 1e-2, "warmup_steps": 0, **kw})


def data(seed=0):
    return TokenStream(torch.arange(64) % VOCAB).batches(BATCH, SEQ, seed=seed)


def stepped(seed):
    """A model and its AdamW after one step (so the optimizer has state)."""
    model = make_model(seed)
    opt = configure_optimizer(model, tcfg())
    x, y = next(data(seed))
    torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def snapshot(model, opt):
    sd = opt.state_dict()
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()},
        json.dumps(sd["param_groups"], default=str, sort_keys=True),
    )


def same(a, b) -> bool:
    (ma, sa, ga), (mb, sb, gb) = a, b
    if ga != gb or ma.keys() != mb.keys() or sa.keys() != sb.keys():
        return False
    if not all(torch.equal(ma[k], mb[k]) and ma[k].dtype == mb[k].dtype for k in ma):
        return False
    for i in sa:
        if sa[i].keys() != sb[i].keys():
            return False
        for k, v in sa[i].items():
            w = sb[i][k]
            if (
                torch.is_tensor(v) != torch.is_tensor(w)
                or (torch.is_tensor(v) and not (v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w)))
                or (not torch.is_tensor(v) and v != w)
            ):
                return False
    return True


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the root conftest's one-thread fixture


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TimeoutError in the main thread after ``seconds`` (the code under test is a
    Python loop, so the signal interrupts it)."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- the SIGKILL harness (runs in a child process) ---------------------------------------

# Every call that changes the file system (or makes it durable) is a step boundary.
OS_STEPS = ("mkdir", "replace", "rename", "rmdir", "unlink", "remove", "fsync", "write", "symlink")


def _kill_before_step(k: int) -> None:
    """From now on, SIGKILL this process right before its k-th file-system step (0-based)."""
    import safetensors.torch as st

    count = [0]

    def wrap(mod, name):
        orig = getattr(mod, name)

        def hooked(*a, **kw):
            if count[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return orig(*a, **kw)

        setattr(mod, name, hooked)

    for name in OS_STEPS:
        if hasattr(os, name):
            wrap(os, name)
    wrap(shutil, "rmtree")
    wrap(st, "save_file")


def _verify(root: Path, ck: Path, states: dict, loader_first: bool) -> str:
    """Which complete checkpoint the name holds ('A' / 'B'), or what is wrong."""
    model = make_model(99)
    opt = configure_optimizer(model, tcfg())
    try:
        if loader_first:
            info = load_checkpoint(ck, model, opt)
        latest = latest_checkpoint(root)
        if latest is None:
            return "latest_checkpoint() is None"
        if latest != ck:
            return f"latest_checkpoint() is {latest.name}"
        if not loader_first:
            info = load_checkpoint(ck, model, opt)
    except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
        return f"{type(e).__name__}: {e}"
    if not (ck / "trainer.json").is_file():
        return "the name holds no complete folder after recovery"
    which = {1: "A", 2: "B"}.get(info.step, f"step {info.step}")
    if which in states and not same(snapshot(model, opt), states[which]):
        return f"step {info.step} but not the weights/optimizer state of {which}"
    return which


def kill_harness(root: Path, seed: int) -> list[dict]:
    torch.set_num_threads(1)
    pair = {"A": stepped(1), "B": stepped(2)}
    steps = {"A": 1, "B": 2}
    states = {k: snapshot(*v) for k, v in pair.items()}
    ck = root / "ck"

    def save(which):
        save_checkpoint(ck, *pair[which], step=steps[which], extra={"which": which})

    save("A")
    current, results = "A", []
    # 1. the step sweep: a save of the other one killed before its k-th file-system step,
    #    k = 0, 1, ... until a save completes.
    for k in itertools.count():
        for p in root.iterdir():  # from a clean state, so every trial runs the same steps
            if p.name != "ck":  # (the library's own clean-up is checked at the end)
                shutil.rmtree(p)
        target = "B" if current == "A" else "A"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _kill_before_step(k)
                save(target)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        found = _verify(root, ck, states, loader_first=k % 2 == 1)
        results.append({"phase": "step", "k": k, "killed": killed, "old": current, "new": target, "found": found})
        if found in states:
            current = found
        if not killed or k >= MAX_KILLS:
            break
    # 2. random instants: a child saving A and B in turn forever, killed after a random delay.
    t0 = time.perf_counter()
    for _ in range(3):
        save(current)
    per_save = (time.perf_counter() - t0) / 3
    rnd = random.Random(seed)
    for r in range(RANDOM_KILLS):
        first = "B" if current == "A" else "A"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                for which in itertools.cycle([first, current]):
                    save(which)
            finally:
                os._exit(0)
        time.sleep(rnd.uniform(0.0, 3.0 * per_save))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        found = _verify(root, ck, states, loader_first=r % 2 == 1)
        results.append(
            {
                "phase": "random",
                "k": r,
                "killed": os.WIFSIGNALED(status),
                "old": current,
                "new": "either",
                "found": found,
            }
        )
        if found in states:
            current = found
    save(current)  # a clean save removes what the dead processes left
    results.append({"phase": "end", "left": sorted(os.listdir(root))})
    return results


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the harness forks a child per kill")
def test_sigkill_at_every_step_and_at_random_instants_leaves_old_or_new(tmp_path):
    src = Path(sys.modules["attnlab"].__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--kill-harness", str(tmp_path), "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    end = results.pop()
    sweep = [r for r in results if r["phase"] == "step"]
    bad = [
        r
        for r in results
        if r["found"] not in ("A", "B")
        or (r["phase"] == "step" and r["found"] not in ((r["old"], r["new"]) if r["killed"] else (r["new"],)))
    ]
    assert not bad, [f"{r['phase']} k={r['k']} old={r['old']} new={r['new']}: {r['found']}" for r in bad]
    kills = sum(r["killed"] for r in results)
    assert kills <= MAX_KILLS + RANDOM_KILLS and len(results) - RANDOM_KILLS <= MAX_KILLS + 1
    assert not sweep[-1]["killed"], "the sweep did not reach a completed save"
    assert len(sweep) >= 10  # the hook saw the save's file-system steps
    outcomes = {r["found"] == r["old"] for r in sweep if r["killed"]}
    assert outcomes == {True, False}  # kills before and after the switch
    assert end["left"] == ["ck"], end  # no temporary folder or backup left behind


def test_save_interrupted_between_backup_and_switch_keeps_the_old(tmp_path, monkeypatch):
    """An exception (KeyboardInterrupt) at the rename that switches the new folder in."""
    old_model, old_opt = stepped(1)
    ck = save_checkpoint(tmp_path / "ck", old_model, old_opt, step=1)
    new_model, new_opt = stepped(2)
    calls, real = [], os.replace

    def replace(a, b):
        calls.append((Path(a).name, Path(b).name))
        if Path(b).name == "ck" and ".tmp" in Path(a).name:
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ck, new_model, new_opt, step=2)
    monkeypatch.setattr(os, "replace", real)
    assert latest_checkpoint(tmp_path) == ck
    target, target_opt = stepped(5)
    assert load_checkpoint(ck, target, target_opt).step == 1
    assert same(snapshot(target, target_opt), snapshot(old_model, old_opt))


# -- damaged or inconsistent checkpoints ------------------------------------------------


def checkpoint(tmp_path) -> Path:
    model = make_model(1)
    res = train(model, data(1), tcfg(checkpoint_dir=str(tmp_path / "run")), progress=False)
    return res.checkpoints[-1]


def edit_json(path: Path, edit, record_crc=True) -> None:
    """Change trainer.json; with ``record_crc`` also record its new checksum, as a
    consistent (but wrong) writer would, so that the field checks are what is tested."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    meta = json.loads((path / "trainer.json").read_text())
    edit(meta)
    raw = json.dumps(meta, indent=1, sort_keys=True).encode()
    (path / "trainer.json").write_bytes(raw)
    if record_crc:
        f = path / "trainer.safetensors"
        with safe_open(str(f), "pt") as h:
            md, tensors = dict(h.metadata() or {}), {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - a safe_open handle is not iterable
        md[JSON_CRC_KEY] = str(zlib.crc32(raw))
        save_file(tensors, str(f), metadata=md)


def edit_tensors(file: Path, edit, metadata_edit=None) -> None:
    """Change the tensors of a safetensors file, keeping its per-tensor CRC-32s consistent."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), "pt") as h:
        md, tensors = dict(h.metadata() or {}), {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - a safe_open handle is not iterable
    edit(tensors)
    crcs = {
        k: zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0
        for k, t in tensors.items()
    }
    md[TENSOR_CRC_KEY] = json.dumps(crcs, sort_keys=True)
    if metadata_edit:
        metadata_edit(md)
    save_file(tensors, str(file), metadata=md)


def _groups(meta):
    return meta["optimizer"]["param_groups"]


def _set(d, key, value):
    d[key] = value


OPT, TRAINER = "optimizer.safetensors", "trainer.safetensors"
RNG = "rng.torch_cpu"

BAD = {
    # RNG state: size, content, presence
    "rng-wrong-size": (
        lambda p: edit_tensors(p / TRAINER, lambda t: _set(t, RNG, torch.zeros(100, dtype=torch.uint8))),
        r"rng.torch_cpu.*shape \(100,\)",
    ),
    "rng-invalid-state": (
        lambda p: edit_tensors(p / TRAINER, lambda t: _set(t, RNG, torch.zeros_like(t[RNG]))),
        r"rng.torch_cpu.*not a valid",
    ),
    "trainer-file-missing": (lambda p: (p / TRAINER).unlink(), r"trainer.safetensors"),
    # trainer.json: its checksum, then every field with a consistent checksum
    "json-edited": (
        lambda p: edit_json(p, lambda m: _set(m["extra"], "note", "edited"), record_crc=False),
        r"trainer.json.*CRC-32",
    ),
    "param-ids-replaced": (
        lambda p: edit_json(p, lambda m: [_set(g, "params", [i + 100 for i in g["params"]]) for g in _groups(m)]),
        r"param_groups\[0\]\.params",
    ),
    "param-ids-not-ints": (
        lambda p: edit_json(p, lambda m: _set(_groups(m)[1], "params", [str(i) for i in _groups(m)[1]["params"]])),
        r"param_groups\[1\]\.params",
    ),
    "lr-not-a-number": (lambda p: edit_json(p, lambda m: _set(_groups(m)[0], "lr", "fast")), r"param_groups\[0\]\.lr"),
    "lr-negative": (
        lambda p: edit_json(p, lambda m: _set(_groups(m)[0], "lr", -1.0)),
        r"param_groups\[0\].*learning rate",
    ),
    "betas-wrong-length": (
        lambda p: edit_json(p, lambda m: _set(_groups(m)[0], "betas", {"__tuple__": [0.9]})),
        r"param_groups\[0\]\.betas",
    ),
    "amsgrad-not-bool": (
        lambda p: edit_json(p, lambda m: _set(_groups(m)[1], "amsgrad", 1)),
        r"param_groups\[1\]\.amsgrad",
    ),
    "unknown-hyperparameter": (
        lambda p: edit_json(p, lambda m: _set(_groups(m)[0], "surprise", 1)),
        r"param_groups\[0\].*surprise",
    ),
    "param-names-not-a-list": (
        lambda p: edit_json(p, lambda m: _set(m["optimizer"], "param_names", 7)),
        r"optimizer.param_names",
    ),
    "extra-not-an-object": (lambda p: edit_json(p, lambda m: _set(m, "extra", [1])), r"'extra'"),
    "unknown-field": (lambda p: edit_json(p, lambda m: _set(m, "surprise", 1)), r"surprise"),
    "aliases-not-an-object": (lambda p: edit_json(p, lambda m: _set(m["model"], "aliases", [])), r"model.aliases"),
    "rng-field": (lambda p: edit_json(p, lambda m: _set(m, "rng", {"torch_cpu": "elsewhere"})), r"'rng'"),
    "alias-metadata-not-an-object": (
        lambda p: edit_tensors(p / "model.safetensors", lambda t: None, lambda md: _set(md, "attnlab.aliases", "[]")),
        r"attnlab.aliases",
    ),
    # per-parameter optimizer state
    "scalar-exp-avg": (
        lambda p: edit_tensors(p / OPT, lambda t: _set(t, "state.0.exp_avg", torch.tensor(0.0))),
        r"parameter 0 \(embed.weight\).*'exp_avg' is a 0-d tensor",
    ),
    "missing-exp-avg-sq": (
        lambda p: edit_tensors(p / OPT, lambda t: t.pop("state.1.exp_avg_sq")),
        r"parameter 1 \(pos_embed.weight\).*missing \['exp_avg_sq'\]",
    ),
    "step-not-scalar": (
        lambda p: edit_tensors(p / OPT, lambda t: _set(t, "state.0.step", torch.ones(8, 8))),
        r"parameter 0 .*'step' has shape \(8, 8\)",
    ),
    "step-not-a-number": (
        lambda p: (
            edit_tensors(p / OPT, lambda t: t.pop("state.0.step")),
            edit_json(p, lambda m: _set(m["optimizer"]["state"], "0", {"step": "abc"})),
        ),
        r"parameter 0 .*'step' is a str",
    ),
    "exp-avg-integer": (
        lambda p: edit_tensors(p / OPT, lambda t: _set(t, "state.2.exp_avg", t["state.2.exp_avg"].long())),
        r"parameter 2 .*'exp_avg' has dtype torch.int64",
    ),
    "unknown-state-entry": (
        lambda p: edit_tensors(p / OPT, lambda t: _set(t, "state.3.bogus", torch.zeros(()))),
        r"parameter 3 .*unknown keys \['bogus'\]",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_refused_before_anything_changes(tmp_path, case):
    path = checkpoint(tmp_path)
    damage, message = BAD[case]
    damage(path)
    model, opt = stepped(7)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, model, opt)
    assert same(snapshot(model, opt), before)


# -- resume ---------------------------------------------------------------------------

RESUME_BAD = {
    "batches-consumed-not-a-number": (
        lambda m: _set(m["extra"]["data"], "batches_consumed", "many"),
        r"extra.data.batches_consumed",
    ),
    "batches-consumed-beyond-the-data": (
        lambda m: _set(m["extra"]["data"], "batches_consumed", 10**12),
        r"extra.data.batches_consumed.*step 2",
    ),
    "train-config-not-an-object": (lambda m: _set(m["extra"], "train_config", "abc"), r"extra.train_config"),
}


@pytest.mark.parametrize("case", sorted(RESUME_BAD))
def test_resume_refuses_a_bad_data_position_quickly(tmp_path, case):
    path = checkpoint(tmp_path)
    edit, message = RESUME_BAD[case]
    edit_json(path, edit)
    model = make_model(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    endless = itertools.repeat(next(data()))
    with time_limit(RESUME_TIMEOUT_S), pytest.raises(CheckpointError, match=message):
        train(model, endless, tcfg(steps=4), resume=path, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resume_past_the_configured_steps_skips_nothing(tmp_path):
    """A checkpoint at step 10**12 (batches_consumed 10**12) resumed with steps=4: there is
    nothing left to train, so nothing is skipped; it returns at once."""
    path = checkpoint(tmp_path)
    edit_json(path, lambda m: (_set(m, "step", 10**12), _set(m["extra"]["data"], "batches_consumed", 10**12)))
    with time_limit(RESUME_TIMEOUT_S), pytest.warns(UserWarning, match="different steps"):
        res = train(make_model(7), itertools.repeat(next(data())), tcfg(steps=4), resume=path, progress=False)
    assert res.final_step == 10**12 and res.losses == []


# -- checkpoint folders checked before training --------------------------------------------


def test_train_checks_checkpoint_dir_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    steps = []
    for bad in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(ValueError, match=r"TrainConfig.checkpoint_dir"):
            train(
                make_model(),
                data(),
                tcfg(checkpoint_dir=str(bad)),
                progress=False,
                callback=lambda info: steps.append(info.step),
            )
    assert steps == []


TINY = [
    "train",
    "--task",
    "induction",
    "--steps",
    "2",
    "--layers",
    "1",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--seq-len",
    "8",
    "--batch",
    "2",
    "--vocab",
    "8",
]


@pytest.fixture
def no_training(monkeypatch):
    """Training must not start: the CLI refuses first."""
    from attnlab.train import run

    def refuse(*a, **kw):
        raise AssertionError("training started")

    monkeypatch.setattr(run, "train", refuse)


def test_cli_refuses_resume_without_out(no_training, capsys):
    from attnlab.cli import main

    assert main([*TINY, "--resume"]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_cli_checks_out_before_training(tmp_path, no_training, capsys, where):
    from attnlab.cli import main

    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" if where == "a-file" else tmp_path / "file" / "ck"
    assert main([*TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and str(out) in err


if __name__ == "__main__":
    if sys.argv[1:2] == ["--kill-harness"]:
        print(json.dumps(kill_harness(Path(sys.argv[2]), int(sys.argv[3]))))
