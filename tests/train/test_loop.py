"""The training loop and its checkpoints (attnlab.train.loop, attnlab.train.checkpoint)."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import math
import struct

import pytest
import torch

from attnlab.nn import Decoder, DecoderConfig
from attnlab.train.checkpoint import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_JSON,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from attnlab.train.data import TokenStream
from attnlab.train.loop import TrainConfig, configure_optimizer, evaluate, lr_at, train
from tests.helpers import F32_PRODUCT

# Checkpoints need the safetensors package (the training loop itself does not).
needs_safetensors = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason="safetensors is not installed"
)

VOCAB, SEQ, BATCH = 16, 32, 8


pytestmark = pytest.mark.usefixtures(
    "one_torch_thread"
)  # the root conftest's one-thread fixture; bitwise reproducibility needs a fixed thread count


def make_model(seed=0, **kw) -> Decoder:
    cfg = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_positions=SEQ)
    cfg.update(kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Decoder(DecoderConfig(**cfg))


def corpus() -> TokenStream:
    """A random period-24 sequence repeated: learnable from a couple of tokens of context."""
    g = torch.Generator().manual_seed(0)
    return TokenStream(torch.randint(0, VOCAB, (24,), generator=g).repeat(20))


def data(seed=0):
    return corpus().batches(BATCH, SEQ, seed=seed)


def tcfg(**kw) -> TrainConfig:
    base = dict(steps=20, batch_size=BATCH, seq_len=SEQ, lr=1e-2)
    base.update(kw)
    base.setdefault("warmup_steps", min(3, base["steps"]))
    return TrainConfig(**base)


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- config and schedule -------------------------------------------------------------


def test_lr_schedule_exact_values():
    cfg = TrainConfig(steps=110, batch_size=1, seq_len=1, lr=2.0, min_lr_ratio=0.25, warmup_steps=10)
    assert lr_at(0, cfg) == 0.0  # warmup starts from 0
    assert lr_at(5, cfg) == 1.0  # linear
    assert lr_at(10, cfg) == 2.0  # peak at the end of warmup
    assert lr_at(60, cfg) == pytest.approx(1.25, abs=1e-12)  # cosine midpoint: (lr + min_lr) / 2
    assert lr_at(110, cfg) == 0.5 == cfg.min_lr  # min_lr at `steps`
    assert lr_at(500, cfg) == 0.5
    decay = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(x >= y for x, y in itertools.pairwise(decay))
    no_warmup = cfg.replace(warmup_steps=0)
    assert lr_at(0, no_warmup) == 2.0
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, cfg)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("steps", 0, "TrainConfig.steps"),
        ("steps", True, "TrainConfig.steps"),
        ("batch_size", 2.0, "TrainConfig.batch_size"),
        ("seq_len", -1, "TrainConfig.seq_len"),
        ("lr", 0.0, "TrainConfig.lr"),
        ("lr", float("nan"), "TrainConfig.lr"),
        ("min_lr_ratio", 1.5, "TrainConfig.min_lr_ratio"),
        ("warmup_steps", 21, "TrainConfig.warmup_steps"),
        ("weight_decay", -0.1, "TrainConfig.weight_decay"),
        ("betas", (0.9,), "TrainConfig.betas"),
        ("betas", (0.9, 1.0), r"TrainConfig.betas\[1\]"),
        ("eps", 0, "TrainConfig.eps"),
        ("grad_clip", 0.0, "TrainConfig.grad_clip"),
        ("seed", "0", "TrainConfig.seed"),
        ("log_every", 0, "TrainConfig.log_every"),
        ("eval_every", 0, "TrainConfig.eval_every"),
        ("checkpoint_every", 5, "TrainConfig.checkpoint_dir"),  # needs a folder
        ("dtype", "float16", "TrainConfig.dtype"),
    ],
)
def test_train_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        tcfg(**{field: value})


def test_train_config_normalises_and_round_trips(tmp_path):
    cfg = tcfg(dtype=torch.bfloat16, checkpoint_dir=tmp_path, grad_clip=None, betas=[0.8, 0.9])
    assert cfg.dtype == "bfloat16" and cfg.checkpoint_dir == str(tmp_path) and cfg.betas == (0.8, 0.9)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# -- optimizer -------------------------------------------------------------------------


def test_weight_decay_only_on_matrices_and_tied_weight_once():
    model = make_model()
    opt = configure_optimizer(model, tcfg(weight_decay=0.5))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.5 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    listed = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(listed) == len(set(listed)) == len(list(model.parameters()))
    assert sum(p is model.embed.weight for p in decay["params"]) == 1  # = lm_head.weight, once
    # Behaviour: with zero gradients Adam's update is 0, so only decoupled decay moves weights.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.1
    opt.step()
    for n, p in model.named_parameters():
        if p.dim() >= 2:
            torch.testing.assert_close(p.detach(), before[n] * (1 - 0.1 * 0.5), **F32_PRODUCT)
        else:
            assert torch.equal(p.detach(), before[n]), n


# -- training --------------------------------------------------------------------------


def test_loss_falls_on_a_fixed_corpus():
    res = train(make_model(), data(), tcfg(steps=40, warmup_steps=4), progress=False)
    assert len(res.losses) == len(res.lrs) == len(res.grad_norms) == len(res.tokens_per_s) == 40
    assert (res.start_step, res.final_step, res.stopped_early) == (0, 40, False)
    assert sum(res.losses[-5:]) / 5 < 0.7 * sum(res.losses[:5]) / 5
    assert res.losses[0] == pytest.approx(math.log(VOCAB), abs=0.3)  # an untrained model is ~uniform
    assert res.tokens_per_second > 0 and all(t > 0 for t in res.tokens_per_s)


def test_grad_clipping_bounds_the_global_norm():
    seen = []

    def after(info):
        grads = [p.grad for p in info.model.parameters() if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    res = train(make_model(), data(), tcfg(steps=8, grad_clip=0.05), callback=after, progress=False)
    assert all(n > 0.05 for n in res.grad_norms)  # every step needed clipping...
    assert all(s <= 0.05 * (1 + 1e-5) for s in seen)  # ...and got it
    seen.clear()
    res = train(make_model(), data(), tcfg(steps=4, grad_clip=None), callback=after, progress=False)
    assert seen == pytest.approx(res.grad_norms, rel=1e-5)  # no clipping: reported norm is the real one


def test_same_config_and_data_give_the_same_curve_bitwise():
    kw = dict(dropout=0.1)  # dropout draws from the seeded RNG
    rng_before = torch.get_rng_state()
    a_model, b_model = make_model(**kw), make_model(**kw)
    a = train(a_model, data(), tcfg(), progress=False)
    b = train(b_model, data(), tcfg(), progress=False)
    assert a.losses == b.losses and a.grad_norms == b.grad_norms and a.lrs == b.lrs
    assert same_state(a_model, b_model)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is untouched
    c = train(make_model(**kw), data(), tcfg(seed=1), progress=False)
    assert c.losses != a.losses  # the seed matters (dropout masks)


@needs_safetensors
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    kw = dict(dropout=0.1)
    straight_model = make_model(**kw)
    straight = train(straight_model, data(), tcfg(checkpoint_every=10, checkpoint_dir=tmp_path / "a"), progress=False)
    assert [p.name for p in straight.checkpoints] == ["step-0000010", "step-0000020"]

    # Interrupted: the same 20-step config, stopped by the callback after 10 steps.
    first = train(
        make_model(**kw),
        data(),
        tcfg(checkpoint_dir=tmp_path / "b"),
        callback=lambda info: info.step == 9,
        progress=False,
    )
    assert (first.final_step, first.stopped_early) == (10, True)
    assert [p.name for p in first.checkpoints] == ["step-0000010"]
    assert first.losses == straight.losses[:10]

    # Resume in a fresh model (different init) with a freshly built data iterator.
    resumed_model = make_model(seed=123, **kw)
    second = train(resumed_model, data(), tcfg(checkpoint_dir=tmp_path / "b"), resume=tmp_path / "b", progress=False)
    assert (second.start_step, second.final_step) == (10, 20)
    assert second.losses == straight.losses[10:]
    assert second.lrs == straight.lrs[10:]
    assert same_state(resumed_model, straight_model)
    # A checkpoint written by the straight run resumes the same way.
    third = train(make_model(seed=7, **kw), data(), tcfg(), resume=straight.checkpoints[0], progress=False)
    assert third.losses == straight.losses[10:]
    assert latest_checkpoint(tmp_path / "b").name == "step-0000020"


def test_progress_bar_shows_loss_tokens_per_second_and_lr():
    buf = io.StringIO()
    train(make_model(), data(), tcfg(steps=5, log_every=1), progress=buf)
    out = buf.getvalue()
    assert "5/5" in out and "loss=" in out and "tok/s=" in out and "lr=" in out
    buf = io.StringIO()
    train(make_model(), data(), tcfg(steps=2), progress=False)
    assert buf.getvalue() == ""
    with pytest.raises(TypeError, match="progress"):
        train(make_model(), data(), tcfg(steps=2), progress="yes")


def test_eval_losses_on_schedule():
    val = corpus()
    res = train(
        make_model(),
        data(),
        tcfg(steps=10, eval_every=4),
        eval_batches=lambda: val.eval_batches(BATCH, SEQ),
        progress=False,
    )
    assert [s for s, _ in res.eval_losses] == [4, 8, 10]
    assert res.eval_losses[-1][1] < res.eval_losses[0][1]
    batches = list(val.eval_batches(BATCH, SEQ))
    res2 = train(make_model(), data(), tcfg(steps=10), eval_batches=batches, progress=False)
    assert [s for s, _ in res2.eval_losses] == [10]
    with pytest.raises(TypeError, match="eval_batches"):
        train(make_model(), data(), tcfg(steps=2), eval_batches=iter(batches), progress=False)


def test_bfloat16_autocast_trains():
    m = make_model()
    res = train(m, data(), tcfg(steps=6, dtype="bfloat16"), progress=False)
    assert all(math.isfinite(x) for x in res.losses) and m.embed.weight.dtype == torch.float32
    assert math.isfinite(evaluate(m, [next(data())], dtype="bfloat16"))


def test_bad_batches_are_reported():
    bad = iter([(torch.zeros(BATCH, SEQ + 1, dtype=torch.long),) * 2])
    with pytest.raises(ValueError, match=r"step 0.*seq_len"):
        train(make_model(), bad, tcfg(steps=2), progress=False)
    ignored = torch.full((BATCH, SEQ), -100)
    with pytest.raises(ValueError, match="nothing to score"):
        train(make_model(), iter([(torch.zeros(BATCH, SEQ, dtype=torch.long), ignored)]), tcfg(steps=2), progress=False)
    short = [next(data())] * 3
    with pytest.warns(UserWarning, match="ran out after 3"):
        res = train(make_model(), short, tcfg(steps=5), progress=False)
    assert (res.final_step, res.stopped_early) == (3, True)


# -- checkpoints -----------------------------------------------------------------------


def trained_pair(tmp_path, steps=3):
    model = make_model()
    res = train(model, data(), tcfg(steps=steps, checkpoint_dir=tmp_path / "ck"), progress=False)
    return model, res.checkpoints[-1]


@needs_safetensors
def test_checkpoint_round_trip_keeps_tied_weights(tmp_path):
    model = make_model()
    opt = configure_optimizer(model, tcfg())
    x, y = next(data())
    torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).backward()
    opt.step()
    path = save_checkpoint(tmp_path / "ck", model, opt, step=1, extra={"note": [1, 2]})
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [MODEL_FILE, OPTIMIZER_FILE, "trainer.safetensors", TRAINER_JSON]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp folders left behind
    from safetensors import safe_open

    with safe_open(str(path / MODEL_FILE), "pt") as f:
        assert "embed.weight" in f.keys() and "lm_head.weight" not in f.keys()  # noqa: SIM118 - a safe_open handle is not iterable; stored once
    with safe_open(str(path / OPTIMIZER_FILE), "pt") as f:
        assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"} <= set(f.keys())
    meta = json.loads((path / TRAINER_JSON).read_text())
    assert meta["step"] == 1 and meta["model"]["aliases"] == {"lm_head.weight": "embed.weight"}
    assert meta["optimizer"]["param_names"][0] == "embed.weight"

    other = make_model(seed=5)
    other_opt = configure_optimizer(other, tcfg())
    info = load_checkpoint(path, other, other_opt)
    assert info.step == 1 and info.extra == {"note": [1, 2]} and info.rng_state.dtype == torch.uint8
    assert other.lm_head.weight is other.embed.weight
    assert same_state(model, other)
    sa, sb = opt.state_dict(), other_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    save_checkpoint(path, other, None, step=2)  # replacing a checkpoint is fine
    assert load_checkpoint(path, model).step == 2
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a checkpoint"):
        save_checkpoint(tmp_path / "notes", model, None, step=0)


@needs_safetensors
def test_mismatched_model_names_the_tensor(tmp_path):
    _, path = trained_pair(tmp_path)
    wide = make_model(d_model=64)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(ValueError, match=r"'embed.weight' has shape \(16, 32\).*expected \(16, 64\)"):
        load_checkpoint(path, wide)
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())  # nothing copied
    with pytest.raises(ValueError, match=r"missing tensor 'blocks.2"):
        load_checkpoint(path, make_model(n_layers=3))
    with pytest.raises(ValueError, match=r"unexpected tensor 'blocks.1"):
        load_checkpoint(path, make_model(n_layers=1))


@needs_safetensors
def test_corrupted_checkpoint_names_the_tensor(tmp_path):
    _model, path = trained_pair(tmp_path)
    f = path / MODEL_FILE
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name, entry = max(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][1]
    )  # the tensor stored last
    raw[8 + n + entry["data_offsets"][1] - 1] ^= 0xFF
    f.write_bytes(bytes(raw))
    target = make_model(seed=9)
    before = target.embed.weight.detach().clone()
    with pytest.raises(ValueError, match=f"tensor '{name}' fails its CRC-32"):
        load_checkpoint(path, target)
    assert torch.equal(target.embed.weight, before)  # checked before copying
    f.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(ValueError, match=r"model.safetensors.*not a readable safetensors file"):
        load_checkpoint(path, target)


@needs_safetensors
def test_mismatched_optimizer_state_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    model, path = trained_pair(tmp_path)
    tensors = load_file(str(path / OPTIMIZER_FILE))
    tensors["state.2.exp_avg"] = torch.zeros(3, 3)
    save_file(tensors, str(path / OPTIMIZER_FILE))  # written without checksums
    other = make_model()
    opt = configure_optimizer(other, tcfg())
    with pytest.raises(ValueError, match=r"'state.2.exp_avg' \(blocks.0.attn.qkv_weight\) has shape \(3, 3\)"):
        load_checkpoint(path, other, opt)
    assert not opt.state  # nothing loaded
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(save_checkpoint(tmp_path / "bare", model, None, step=0), other, opt)
    with pytest.raises(ValueError, match=r"not a checkpoint folder|holds none"):
        train(other, data(), tcfg(steps=2), resume=tmp_path / "nothing-here", progress=False)
