"""Induction heads form: a 2-layer attention-only transformer and a 1-layer control.

The data make induction the only way to predict (Olsson et al. 2022, synthetic form):
each row is a random segment of ``P`` tokens repeated, with ``P`` drawn per row from
``[p_min, p_max]``, so no fixed positional offset finds the earlier copy::

    inputs   r₁ r₂ … r_P  r₁ r₂ … r_P  r₁ …          targets scored from t = P on
    the token after the earlier copy of the current token is the next token.

A previous-token head in layer 0 writes "my previous token was x" into each position;
an induction head in layer 1 matches its query (current token) against those keys
(K-composition) and copies the value.  One layer cannot compose, so the control can
only learn the bag of tokens seen (loss ≈ log P instead of ≈ 0).

Logged during training (every ``eval_every`` steps, on fixed held-out data):
the loss; the best induction score in the last layer and the best previous-token score
in layer 0 (:mod:`attnlab.interp.detectors`, on ``[x₁..x_T, x₁..x_T]``: the induction
target of query ``i`` in the second half is key ``i − T + 1``); and the in-context
learning score: loss on the second copy minus loss on the first copy (negative = the
model uses its context).  The jump of these curves is the phase change.

>>> from attnlab.lab.induction import InductionConfig
>>> InductionConfig().steps > 0
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.interp import detectors as D
from attnlab.interp.capture import capture
from attnlab.lab import cache_dir
from attnlab.nn import Decoder, DecoderConfig

IGNORE = -100
VERSION = 2


@dataclass
class InductionConfig:
    """Sizes chosen by measurement on 2 CPU cores (docs/lab.md).

    ``steps`` is the schedule's length and the most a model trains; with ``target_loss``
    set, the 2-layer model stops at the first evaluation (every ``eval_every`` steps)
    whose held-out loss is at most ``target_loss`` (the task solved), and the 1-layer
    control trains exactly as many steps as the 2-layer model did (same schedule, same
    data), so the comparison stays like for like.  ``None``: every model trains ``steps``.
    """

    vocab: int = 32
    seq_len: int = 48
    p_min: int = 6
    p_max: int = 24
    d_model: int = 64
    n_heads: int = 4
    batch: int = 32
    steps: int = 2000
    lr: float = 1e-2
    eval_every: int = 50
    positions: str = "learned"
    seed: int = 0
    target_loss: float | None = 0.05

    def key(self, n_layers: int) -> str:
        s = json.dumps({**dataclasses.asdict(self), "n_layers": n_layers, "v": VERSION}, sort_keys=True)
        return hashlib.sha1(s.encode()).hexdigest()[:12]


def batches(cfg: InductionConfig, seed: int, batch: int | None = None):
    """Endless ``(inputs, targets)`` ``(batch, seq_len)``: a segment of random length P repeated."""
    g = torch.Generator().manual_seed(seed)
    B, N = batch or cfg.batch, cfg.seq_len
    t = torch.arange(N + 1)
    while True:
        P = torch.randint(cfg.p_min, cfg.p_max + 1, (B, 1), generator=g)
        r = torch.randint(0, cfg.vocab, (B, cfg.p_max), generator=g)
        s = torch.gather(r, 1, t.view(1, -1) % P)
        x, y = s[:, :-1], s[:, 1:].clone()
        y[t[:-1].view(1, -1) < P] = IGNORE  # the first copy is unpredictable
        yield x, y


def repeated_tokens(cfg: InductionConfig, T: int, B: int, seed: int) -> torch.Tensor:
    """``(B, 2T)``: T distinct random tokens, then the same T again (the detectors' input)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(cfg.vocab, generator=g)[:T] for _ in range(B)])
    return torch.cat([first, first], dim=1)


def build(cfg: InductionConfig, n_layers: int) -> Decoder:
    torch.manual_seed(cfg.seed)
    return Decoder(
        DecoderConfig(
            vocab_size=cfg.vocab,
            d_model=cfg.d_model,
            n_layers=n_layers,
            n_heads=cfg.n_heads,
            attn_only=True,
            positions=cfg.positions,
            max_positions=cfg.seq_len,
            bias=False,
            tie_embeddings=False,
        )
    )


def per_position_loss(model, x, y) -> torch.Tensor:
    """``(N,)`` mean cross-entropy at each position over the scored rows (NaN where none)."""
    logits = model(x).logits.float()
    l = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.clamp(min=0), reduction="none")
    m = (y != IGNORE).float()
    return (l * m).sum(0) / m.sum(0)


@torch.no_grad()
def measure(model, cfg: InductionConfig, ev) -> dict:
    """The logged quantities on the fixed evaluation data ``ev``."""
    was = model.training
    model.eval()
    x, y, rep = ev
    logits = model(x).logits.float()
    loss = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE))
    T = rep.shape[1] // 2
    lrep = torch.nn.functional.cross_entropy(
        model(rep[:, :-1]).logits.float().transpose(1, 2), rep[:, 1:], reduction="none"
    ).mean(0)
    icl = float(lrep[T:].mean() - lrep[: T - 1].mean())
    L = len(model.blocks)
    with capture(model, keep=("q", "k")) as cap:
        model(rep)
    ind = D.induction(cap.pattern(L - 1), rep)
    prev = D.previous_token(cap.pattern(0))
    model.train(was)
    return {
        "loss": loss,
        "icl": icl,
        "induction": ind.tolist(),
        "prev_token": prev.tolist(),
        "induction_max": float(ind.max()),
        "prev_token_max": float(prev.max()),
    }


def eval_data(cfg: InductionConfig):
    x, y = next(batches(cfg, seed=10_000 + cfg.seed, batch=64))
    rep = repeated_tokens(cfg, T=min(cfg.seq_len // 2, cfg.vocab), B=16, seed=20_000 + cfg.seed)
    return x, y, rep


def train_one(
    cfg: InductionConfig, n_layers: int, *, progress=True, max_steps: int | None = None
) -> tuple[Decoder, dict]:
    """Train one model; returns it and its log ``{"step": [...], "loss": [...], ...,
    "steps_trained": n}``.  It stops at ``max_steps`` when given, else (with
    ``cfg.target_loss``) at the first evaluation whose loss reaches the target; the
    learning-rate schedule is always the one of ``cfg.steps``."""
    from attnlab.train import TrainConfig, train

    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps: expected an int >= 1, got {max_steps!r}")

    model = build(cfg, n_layers)
    ev = eval_data(cfg)
    log: dict[str, Any] = {"step": [], "train_loss": []}

    def record(step):
        log["step"].append(step)
        for k, v in measure(model, cfg, ev).items():
            log.setdefault(k, []).append(v)

    record(0)

    def cb(info):
        log["train_loss"].append(info.loss)
        done = info.step + 1
        if done % cfg.eval_every == 0 or done == max_steps:
            record(done)
        if max_steps is not None:
            return done >= max_steps
        return done % cfg.eval_every == 0 and cfg.target_loss is not None and log["loss"][-1] <= cfg.target_loss

    t0 = time.perf_counter()
    tc = TrainConfig(
        steps=cfg.steps,
        batch_size=cfg.batch,
        seq_len=cfg.seq_len,
        lr=cfg.lr,
        warmup_steps=min(20, cfg.steps // 10),
        weight_decay=0.0,
        seed=cfg.seed,
        log_every=20,
    )
    bar = progress if progress is not True else True
    train(model, batches(cfg, seed=cfg.seed), tc, callback=cb, progress=bar)
    log["train_seconds"] = time.perf_counter() - t0
    log["steps_trained"] = len(log["train_loss"])
    model.eval()
    return model, log


def _paths(cfg, n_layers):
    d = cache_dir("induction")
    k = cfg.key(n_layers)
    return d / f"{n_layers}L-{k}.safetensors", d / f"{n_layers}L-{k}.json"


def load_or_train(cfg: InductionConfig, n_layers: int, *, force=False, progress=True) -> tuple[Decoder, dict]:
    """The trained model and its log, from the lab cache when present.  With
    ``cfg.target_loss`` set, a 1-layer model trains as many steps as the 2-layer one took
    (which is loaded, or trained first)."""
    from safetensors.torch import load_file, save_file

    wpath, lpath = _paths(cfg, n_layers)
    if not force and wpath.exists() and lpath.exists():
        model = build(cfg, n_layers)
        model.load_state_dict(load_file(str(wpath)), strict=False)
        return model.eval(), json.loads(lpath.read_text())
    budget = None
    if n_layers < 2 and cfg.target_loss is not None:
        budget = load_or_train(cfg, 2, progress=progress)[1]["steps_trained"]  # cached (or trained) first
    model, log = train_one(cfg, n_layers, progress=progress, max_steps=budget)
    tmp = wpath.with_suffix(f".tmp{os.getpid()}")  # atomic: concurrent runs never see half a file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    os.replace(tmp, wpath)
    tmp = lpath.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(log))
    os.replace(tmp, lpath)
    return model, log


def phase_change_step(log: dict, key: str = "induction_max") -> int | None:
    """The first logged step where ``key`` passes half-way from its start to its final value."""
    v = log[key]
    if len(v) < 2 or v[-1] - v[0] < 0.2:
        return None
    half = v[0] + 0.5 * (v[-1] - v[0])
    return next(s for s, x in zip(log["step"], v, strict=True) if x >= half)


def analyse(model, cfg: InductionConfig) -> dict:
    """Final detector scores, K-composition of the last layer with layer 0, ablation."""
    from attnlab.interp.ablation import ablation_effects

    rep = repeated_tokens(cfg, T=min(cfg.seq_len // 2, cfg.vocab), B=16, seed=30_000 + cfg.seed)
    scores = D.detect(model, rep, detectors=("previous_token", "induction", "duplicate_token", "sink"))
    out = {k: v.scores.tolist() for k, v in scores.items()}
    L = len(model.blocks)
    T = rep.shape[1] // 2

    def second_half_loss(m, ids):
        lg = m(ids[:, :-1]).logits.float()
        return torch.nn.functional.cross_entropy(lg[:, T:].flatten(0, 1), ids[:, T + 1 :].flatten())

    eff = ablation_effects(model, rep, loss_fn=second_half_loss, progress=False)
    out["ablation"] = eff.scores.tolist()
    with torch.no_grad():
        out["second_half_loss"] = float(second_half_loss(model, rep))
    if L >= 2:
        from attnlab.interp import circuits as C

        comp = C.composition_scores(model, "K").detach()  # [l_earlier, h_earlier, l_later, h_later]
        base = C.composition_baseline(cfg.d_model, cfg.d_model // cfg.n_heads, seed=cfg.seed)
        ind_h = int(torch.tensor(out["induction"][L - 1]).argmax())
        prev_h = int(torch.tensor(out["previous_token"][0]).argmax())
        out["k_composition"] = comp[0, :, L - 1, :].T.tolist()  # [last-layer head, layer-0 head]
        out["k_comp_induction_prev"] = float(comp[0, prev_h, L - 1, ind_h])
        out["k_comp_baseline"] = {"mean": float(base.mean), "std": float(base.std)}
        out["induction_head"] = [L - 1, ind_h]
        out["prev_token_head"] = [0, prev_h]
    return out


def run(quick: bool = False, force: bool = False, progress=True) -> dict:
    """Train (or load) both models, analyse them; JSON-able result."""
    cfg = InductionConfig(steps=600, eval_every=50) if quick else InductionConfig()
    res = {"config": dataclasses.asdict(cfg), "models": {}}
    for n_layers in (2, 1):
        model, log = load_or_train(cfg, n_layers, force=force, progress=progress)
        res["models"][f"{n_layers}L"] = {
            "log": log,
            "final": analyse(model, cfg),
            "phase_change_step": phase_change_step(log),
        }
    return res


def summary(res: dict) -> str:
    rows = [
        f"{'model':<6} {'loss¹':>6} {'2nd-copy loss³':>14} {'ICL²':>7} {'induction²':>10} {'prev-tok²':>9} "
        f"{'phase change':>12} {'K-comp (base)':>14}"
    ]
    for name, m in res["models"].items():
        log, fin = m["log"], m["final"]
        kc = (
            f"{fin['k_comp_induction_prev']:.2f} ({fin['k_comp_baseline']['mean']:.2f})"
            if "k_comp_induction_prev" in fin
            else "-"
        )
        pc = m["phase_change_step"]
        rows.append(
            f"{name:<6} {log['loss'][-1]:6.3f} {fin['second_half_loss']:14.3f} {log['icl'][-1]:7.3f} "
            f"{log['induction_max'][-1]:10.2f} {log['prev_token_max'][-1]:9.2f} "
            f"{('step ' + str(pc)) if pc is not None else 'none':>12} {kc:>14}"
        )
    rows += [
        "The columns are measured on different data, so the losses do not compare across columns:",
        "  ¹ held-out loss on fresh training-task sequences (the last training-log point)",
        "  ² on a fixed batch of repeated random segments [x₁..x_T, x₁..x_T] (the last training-log point; "
        "ICL = loss on the 2nd copy minus the 1st)",
        "  ³ loss on the 2nd copy of another batch of repeated segments, after training (the analysis batch)",
    ]
    return "\n".join(rows)
