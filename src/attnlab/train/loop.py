"""A small CPU training loop for language models (:class:`attnlab.nn.Decoder`).

One step::

    inputs, targets = next(batches)                        # (B, N) int64 each; -100 = not scored
    logits = model(inputs).logits                          # (B, N, vocab)
    loss = cross_entropy(logits, targets, ignore_index=-100)   # mean over scored targets
    loss.backward(); clip the global grad norm; AdamW step at lr_at(step)

* Schedule (:func:`lr_at`): linear warmup from 0 over ``warmup_steps``, then a cosine
  from ``lr`` down to ``min_lr = min_lr_ratio * lr`` at ``steps``.
* Optimizer (:func:`configure_optimizer`): AdamW, nanoGPT's split — weight decay on
  parameters with ``dim >= 2`` (matmul weights and embeddings), none on biases and norm
  weights; a tied weight is one parameter, listed once.
* Determinism: inside :func:`train` torch's global RNG is seeded with ``cfg.seed``
  (dropout draws from it) within ``torch.random.fork_rng``, so the caller's RNG state is
  the same after the call.  The data iterator must own its RNG (the generators of
  :mod:`attnlab.train.data` do).  Same model init, config and data → the same loss
  curve, bitwise in float32 on CPU for a fixed thread count.
* Checkpoints (:mod:`attnlab.train.checkpoint`) every ``checkpoint_every`` steps and at
  the end, in ``checkpoint_dir/step-0000010`` (10 = completed steps).  They hold the
  model, the optimizer, the RNG state and the number of batches consumed; ``train(...,
  resume=folder)`` with a *fresh* iterator built with the same arguments skips that many
  batches and continues exactly where the run stopped.  The checkpoint is checked whole
  before anything changes (:func:`attnlab.train.checkpoint.prepare_load`), and its data
  position too: ``batches_consumed`` must equal the step (one batch per step), and only a
  run with steps left skips, so resuming takes at most ``cfg.steps`` batches, never forever.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.train.data import TokenStream
>>> _ = torch.manual_seed(0)
>>> model = Decoder(DecoderConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=2, max_positions=16))
>>> cfg = TrainConfig(steps=30, batch_size=8, seq_len=16, lr=1e-2, warmup_steps=3)
>>> data = TokenStream(torch.arange(400) % 8).batches(8, 16, seed=0)   # 0 1 2 ... 7 0 1 ...
>>> result = train(model, data, cfg, progress=False)
>>> result.final_step, len(result.losses), result.lrs[0], result.lrs[3]
(30, 30, 0.0, 0.01)
>>> result.losses[-1] < 0.2 * result.losses[0]
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from attnlab.train.atomic import check_writable_folder
from attnlab.train.checkpoint import CheckpointError, latest_checkpoint, prepare_load, save_checkpoint
from attnlab.validate import int_in, nonneg_int, positive_int, real, rng_seed

__all__ = [
    "IGNORE_INDEX",
    "TrainConfig",
    "TrainResult",
    "StepInfo",
    "lr_at",
    "configure_optimizer",
    "train",
    "evaluate",
    "lm_loss",
]

IGNORE_INDEX = -100
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Fields that change only logging / saving, not the trajectory (not compared on resume).
_BOOKKEEPING = ("log_every", "eval_every", "checkpoint_every", "checkpoint_dir")


@dataclass
class TrainConfig:
    """Hyperparameters of :func:`train`, checked on construction (``ValueError`` naming the field).

    Attributes:
        steps: optimizer steps in the whole run (the schedule ends here).
        batch_size, seq_len: the shape ``(B, N)`` every training batch must have.
        lr: peak learning rate (reached at the end of warmup).
        min_lr_ratio: the cosine ends at ``min_lr = min_lr_ratio * lr`` (in [0, 1]).
        warmup_steps: linear warmup from 0 (``0 <= warmup_steps <= steps``).
        weight_decay: AdamW decoupled decay for ``dim >= 2`` parameters.
        betas, eps: AdamW's.
        grad_clip: max global L2 norm of the gradients; ``None`` = no clipping.
        seed: seeds torch's RNG for the run (dropout).
        log_every: the progress bar's postfix is refreshed every this many steps.
        eval_every: evaluate on ``eval_batches`` every this many steps (and at the end);
            ``None``: at the end only.
        checkpoint_every: save every this many steps (needs ``checkpoint_dir``); with a
            ``checkpoint_dir`` the final state is always saved.
        checkpoint_dir: folder of the checkpoints (``step-0000010`` ...).
        dtype: ``"float32"``, or ``"bfloat16"`` (forward under CPU autocast; the loss, the
            weights and the optimizer stay float32).

    >>> TrainConfig(steps=10, batch_size=4, seq_len=32, warmup_steps=20)
    Traceback (most recent call last):
    ...
    ValueError: TrainConfig.warmup_steps: expected an int in [0, steps=10], got 20
    """

    steps: int
    batch_size: int
    seq_len: int
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int | None = None
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    dtype: str = "float32"

    def __post_init__(self):
        self.steps = positive_int(self.steps, "TrainConfig.steps")
        self.batch_size = positive_int(self.batch_size, "TrainConfig.batch_size")
        self.seq_len = positive_int(self.seq_len, "TrainConfig.seq_len")
        self.lr = real(self.lr, "TrainConfig.lr", gt=0.0)
        self.min_lr_ratio = real(self.min_lr_ratio, "TrainConfig.min_lr_ratio", ge=0.0, le=1.0)
        self.warmup_steps = int_in(
            self.warmup_steps,
            "TrainConfig.warmup_steps",
            0,
            self.steps,
            closed=True,
            interval=f"[0, steps={self.steps}]",
        )
        self.weight_decay = real(self.weight_decay, "TrainConfig.weight_decay", ge=0.0)
        try:
            b1, b2 = self.betas
        except (TypeError, ValueError):
            raise ValueError(f"TrainConfig.betas: expected two numbers in [0, 1), got {self.betas!r}") from None
        self.betas = (
            real(b1, "TrainConfig.betas[0]", ge=0.0, lt=1.0),
            real(b2, "TrainConfig.betas[1]", ge=0.0, lt=1.0),
        )
        self.eps = real(self.eps, "TrainConfig.eps", gt=0.0)
        if self.grad_clip is not None:
            self.grad_clip = real(self.grad_clip, "TrainConfig.grad_clip", gt=0.0)
        self.seed = rng_seed(self.seed, "TrainConfig.seed")
        self.log_every = positive_int(self.log_every, "TrainConfig.log_every")
        if self.eval_every is not None:
            self.eval_every = positive_int(self.eval_every, "TrainConfig.eval_every")
        if self.checkpoint_every is not None:
            self.checkpoint_every = positive_int(self.checkpoint_every, "TrainConfig.checkpoint_every")
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)) or not str(self.checkpoint_dir):
                raise ValueError(f"TrainConfig.checkpoint_dir: expected None or a path, got {self.checkpoint_dir!r}")
            self.checkpoint_dir = os.fspath(self.checkpoint_dir)
        elif self.checkpoint_every is not None:
            raise ValueError(
                f"TrainConfig.checkpoint_dir: checkpoint_every={self.checkpoint_every} needs a "
                "checkpoint_dir to write to"
            )
        names = {v: k for k, v in DTYPES.items()}
        if isinstance(self.dtype, torch.dtype) and self.dtype in names:
            self.dtype = names[self.dtype]
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype: expected one of {tuple(DTYPES)}, got {self.dtype!r}")

    @property
    def min_lr(self) -> float:
        return self.min_lr_ratio * self.lr

    def replace(self, **changes) -> TrainConfig:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"TrainConfig: unknown fields {sorted(unknown)}")
        d = dict(d)
        if "betas" in d and isinstance(d["betas"], list):
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of (0-based) step ``step``.

    ``lr · step / warmup_steps`` for ``step < warmup_steps`` (so step 0 runs at 0: it only
    fills Adam's moments), then ``min_lr + ½ (lr − min_lr)(1 + cos(π t))`` with
    ``t = (step − warmup_steps) / (steps − warmup_steps)``; ``min_lr`` from ``steps`` on.

    >>> cfg = TrainConfig(steps=110, batch_size=1, seq_len=1, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    >>> [round(lr_at(s, cfg), 6) for s in (0, 5, 10, 60, 110)]
    [0.0, 0.5, 1.0, 0.55, 0.1]
    """
    step = nonneg_int(step, "step")
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if step >= cfg.steps:
        return cfg.min_lr
    t = (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps)
    return cfg.lr - 0.5 * (cfg.lr - cfg.min_lr) * (1.0 - math.cos(math.pi * t))  # exactly lr at t = 0


def configure_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two groups: ``[0]`` decays (parameters with ``dim >= 2``), ``[1]`` does
    not (biases, norm weights, other 1-D / 0-D parameters).  Each parameter appears once
    (a tied weight such as ``lm_head.weight is embed.weight`` is one parameter); frozen
    parameters (``requires_grad=False``) are left out."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():  # remove_duplicate=True: tied weights once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("model: has no trainable parameters")
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of ``logits (B, N, V)`` against ``targets (B, N)`` in float32,
    skipping targets equal to ``-100``."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


@dataclass
class StepInfo:
    """What ``callback`` receives after each optimizer step.  ``step`` is the 0-based index
    of the step just taken (``step + 1`` steps are done); ``eval_loss`` is set on steps that
    evaluated.  At this point ``p.grad`` holds the gradients the step used (after clipping).
    Return ``True`` from the callback to stop after this step (a checkpoint is written
    first if ``checkpoint_dir`` is set)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    eval_loss: float | None
    model: nn.Module = field(repr=False)
    optimizer: torch.optim.Optimizer = field(repr=False)


@dataclass
class TrainResult:
    """Per-step records of the steps run by this call (``start_step .. final_step - 1``).

    ``grad_norms`` are global L2 norms *before* clipping; ``tokens_per_s`` counts input
    tokens (``B·N``) over each step's wall time, data fetch included; ``eval_losses`` are
    ``(completed_steps, loss)`` pairs; ``checkpoints`` the folders written."""

    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    start_step: int = 0
    final_step: int = 0
    stopped_early: bool = False
    elapsed_s: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Mean throughput of the whole call (tokens / total step time)."""
        t = sum(1.0 / r for r in self.tokens_per_s if r > 0)
        return len(self.tokens_per_s) / t if t else 0.0


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _autocast(dtype: str, device: torch.device):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _check_batch(batch, step: int, cfg: TrainConfig | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"batch at step {step}" if cfg is not None else f"eval batch {step}"
    try:
        inputs, targets = batch
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a pair (inputs, targets), got {type(batch).__name__}") from None
    for name, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool:
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be an integer tensor (B, N), got {got}")
    if inputs.shape != targets.shape:
        raise ValueError(f"{where}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape")
    if cfg is not None and tuple(inputs.shape) != (cfg.batch_size, cfg.seq_len):
        raise ValueError(
            f"{where}: shape {tuple(inputs.shape)}, but TrainConfig says (batch_size={cfg.batch_size}, "
            f"seq_len={cfg.seq_len})"
        )
    return inputs.to(device, torch.long), targets.to(device, torch.long)


def _check_targets(targets: torch.Tensor, vocab: int, where: str) -> int:
    scored = targets != IGNORE_INDEX
    n = int(scored.sum())
    if n == 0:
        raise ValueError(f"{where}: every target is {IGNORE_INDEX}; nothing to score")
    bad = scored & ((targets < 0) | (targets >= vocab))
    if bad.any():
        raise ValueError(f"{where}: targets must be {IGNORE_INDEX} or in [0, {vocab}), got {int(targets[bad][0])}")
    return n


def _eval_source(eval_batches) -> Callable[[], Iterable] | None:
    if eval_batches is None:
        return None
    if callable(eval_batches):
        return eval_batches
    try:
        it = iter(eval_batches)
    except TypeError:
        raise TypeError(
            f"eval_batches: expected a list of batches or a callable returning an iterator, "
            f"got {type(eval_batches).__name__}"
        ) from None
    if it is eval_batches:
        raise TypeError(
            "eval_batches: a one-shot iterator can be evaluated only once; pass a list of batches or "
            "a zero-argument callable that returns a fresh iterator (e.g. lambda: val.eval_batches(8, 64))"
        )
    return lambda: eval_batches


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable, *, dtype: str = "float32") -> float:
    """Mean cross entropy over every scored target of ``batches`` (token-weighted), in eval
    mode (no dropout); the model's mode is restored afterwards.

    >>> import torch
    >>> from attnlab.nn import Decoder, DecoderConfig
    >>> m = Decoder(DecoderConfig(vocab_size=5, d_model=16, n_layers=1, n_heads=2))
    >>> x = torch.randint(0, 5, (2, 4), generator=torch.Generator().manual_seed(0))
    >>> abs(evaluate(m, [(x, x.roll(-1, 1))]) - math.log(5)) < 0.1      # untrained: about ln(vocab)
    True
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {dtype!r}")
    device = _model_device(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i, batch in enumerate(batches):
            inputs, targets = _check_batch(batch, i, None, device)
            with _autocast(dtype, device):
                logits = _logits(model(inputs))
            count += _check_targets(targets, logits.shape[-1], f"eval batch {i}")
            total += float(lm_loss(logits, targets, reduction="sum"))
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("batches: no evaluation batches")
    return total / count


def _progress(progress, total: int, initial: int):
    if progress is False or progress is None:
        return tqdm(total=total, initial=initial, disable=True)
    if progress is True:
        return tqdm(total=total, initial=initial, file=sys.stderr, unit="step", dynamic_ncols=True)
    if hasattr(progress, "write"):
        return tqdm(total=total, initial=initial, file=progress, unit="step", mininterval=0)
    raise TypeError(f"progress: expected True, False or a writable file object, got {type(progress).__name__}")


def _resume_path(resume) -> Path:
    p = latest_checkpoint(resume)
    if p is None:
        raise ValueError(f"resume: {resume} is not a checkpoint folder and holds none")
    return p


def _resume_fields(info, path: Path) -> tuple[dict | None, int]:
    """``(train_config, batches_consumed)`` of a checkpoint's ``extra``, checked: the
    loop takes one batch per step, so ``batches_consumed`` must equal ``step``."""
    extra = info.extra
    where = f"{path}: trainer.json field"
    saved_cfg = extra.get("train_config")
    if saved_cfg is not None and not isinstance(saved_cfg, dict):
        raise CheckpointError(f"{where} 'extra.train_config' is a {type(saved_cfg).__name__}, expected an object")
    data = extra.get("data", {})
    if not isinstance(data, dict):
        raise CheckpointError(f"{where} 'extra.data' is a {type(data).__name__}, expected an object")
    consumed = data.get("batches_consumed", info.step)
    if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
        raise CheckpointError(f"{where} 'extra.data.batches_consumed' is {consumed!r}, expected an int >= 0")
    if consumed != info.step:
        raise CheckpointError(
            f"{where} 'extra.data.batches_consumed' is {consumed}, but the checkpoint is at step "
            f"{info.step} and the loop consumes one batch per step"
        )
    return saved_cfg, consumed


def _compare_configs(saved: dict | None, cfg: TrainConfig, where: Path) -> None:
    if not saved:
        return
    now = cfg.to_dict()
    diff = [k for k in now if k not in _BOOKKEEPING and k in saved and saved[k] != now[k]]
    if diff:
        warnings.warn(
            f"resume: {where} was trained with different {', '.join(diff)} "
            f"({', '.join(f'{k}={saved[k]!r}' for k in diff)}); the resumed run will not match "
            "an uninterrupted one",
            stacklevel=3,
        )


def train(
    model: nn.Module,
    batches: Iterable,
    cfg: TrainConfig,
    *,
    eval_batches=None,
    callback: Callable[[StepInfo], Any] | None = None,
    resume=None,
    progress=True,
) -> TrainResult:
    """Train ``model`` for ``cfg.steps`` steps on ``batches``; return a :class:`TrainResult`.

    Args:
        model: maps ``inputs (B, N)`` to an object with ``.logits (B, N, V)`` (or to the
            logits tensor itself).  Trained in place; left in the mode it had.
        batches: iterable of ``(inputs, targets)`` int64 ``(batch_size, seq_len)`` tensors,
            targets ``-100`` where not scored (one batch per step).  If it runs out
            early, training stops with a warning.
        cfg: a :class:`TrainConfig`.
        eval_batches: ``None``, a list of batches, or a zero-argument callable returning an
            iterable of batches; evaluated (:func:`evaluate`) every ``cfg.eval_every``
            steps and at the end.
        callback: called with a :class:`StepInfo` after every step; returning ``True``
            stops the run.
        resume: a checkpoint folder, or a ``checkpoint_dir`` (its latest checkpoint):
            restores model, optimizer, RNG state and step, and skips the batches the
            saved run consumed.  Pass a freshly built ``batches`` iterator.  A damaged
            checkpoint or data position raises ``CheckpointError`` (a ``ValueError``)
            and a source that runs out while skipping a ``ValueError``, both before the
            model is modified.
        progress: ``True`` (a tqdm bar on stderr), ``False``, or a file object for the
            bar.  Its postfix shows the loss, tokens/s and lr.

    Raises ``FloatingPointError`` when the loss stops being finite, and ``ValueError``
    before the first step when ``cfg.checkpoint_dir`` cannot be created or written.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg: expected a TrainConfig, got {type(cfg).__name__}")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback: expected a callable, got {type(callback).__name__}")
    if cfg.checkpoint_dir is not None:  # fail now, not at the first save after training ran
        check_writable_folder(cfg.checkpoint_dir, "TrainConfig.checkpoint_dir")
    it: Iterator = iter(batches)
    eval_source = _eval_source(eval_batches)
    device = _model_device(model)
    optimizer = configure_optimizer(model, cfg)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    was_training = model.training
    res = TrainResult()
    t_start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        step, consumed = 0, 0
        if resume is not None:
            path = _resume_path(resume)
            pending = prepare_load(path, model, optimizer)  # everything checked; nothing modified yet
            info = pending.info
            saved_cfg, consumed = _resume_fields(info, path)
            _compare_configs(saved_cfg, cfg, path)
            step = info.step
            # Skip what the saved run consumed, before touching the model: a source that runs
            # out leaves it as it was.  Only a run with steps left needs its data position, so
            # the skip is bounded by cfg.steps (the run's own length), whatever the file says.
            skip = consumed if step < cfg.steps else 0
            for k in range(skip):
                try:
                    next(it)
                except StopIteration:
                    raise ValueError(
                        f"resume: batches ran out after {k} batches while skipping the {consumed} "
                        "the checkpointed run consumed"
                    ) from None
            pending.apply()
            torch.set_rng_state(info.rng_state)  # after skipping, in case the data touched the global RNG
        res.start_step = res.final_step = step
        bar = _progress(progress, cfg.steps, step)
        model.train()
        win_tokens, win_time = 0, 0.0
        try:
            while step < cfg.steps:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    warnings.warn(
                        f"batches: ran out after {consumed} batches, at step {step} of {cfg.steps}; stopping early",
                        stacklevel=2,
                    )
                    res.stopped_early = True
                    break
                consumed += 1
                inputs, targets = _check_batch(batch, step, cfg, device)
                lr = lr_at(step, cfg)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                optimizer.zero_grad(set_to_none=True)
                with _autocast(cfg.dtype, device):
                    logits = _logits(model(inputs))
                _check_targets(targets, logits.shape[-1], f"batch at step {step}")
                loss = lm_loss(logits, targets)
                loss.backward()
                grads = [p.grad for p in params if p.grad is not None]
                if cfg.grad_clip is not None:
                    norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                else:
                    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
                optimizer.step()
                loss_v = float(loss.detach())
                if not math.isfinite(loss_v):
                    raise FloatingPointError(
                        f"loss is {loss_v} at step {step} (lr={lr:.3g}, grad norm={float(norm):.3g})"
                    )
                dt = time.perf_counter() - t0
                tokens = inputs.numel()
                tps = tokens / dt if dt > 0 else float("inf")
                res.losses.append(loss_v)
                res.lrs.append(lr)
                res.grad_norms.append(float(norm))
                res.tokens_per_s.append(tps)
                win_tokens, win_time = win_tokens + tokens, win_time + dt
                step += 1
                res.final_step = step
                last = step == cfg.steps
                eval_loss = None
                if eval_source is not None and (last or (cfg.eval_every and step % cfg.eval_every == 0)):
                    eval_loss = evaluate(model, eval_source(), dtype=cfg.dtype)
                    model.train()
                    res.eval_losses.append((step, eval_loss))
                stop = False
                if callback is not None:
                    stop = (
                        callback(StepInfo(step - 1, loss_v, lr, float(norm), tps, eval_loss, model, optimizer)) is True
                    )
                if cfg.checkpoint_dir is not None and (
                    last or stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                ):
                    extra = {
                        "train_config": cfg.to_dict(),
                        "data": {"batches_consumed": consumed},
                        "model_config": _model_config(model),
                    }
                    res.checkpoints.append(
                        save_checkpoint(Path(cfg.checkpoint_dir) / f"step-{step:07d}", model, optimizer, step, extra)
                    )
                if last or stop or step % cfg.log_every == 0 or eval_loss is not None:
                    post = f"loss={loss_v:.4f}, tok/s={win_tokens / win_time if win_time else 0:,.0f}, lr={lr:.2e}"
                    if res.eval_losses:
                        post += f", val={res.eval_losses[-1][1]:.4f}"
                    bar.set_postfix_str(post, refresh=False)
                    win_tokens, win_time = 0, 0.0
                bar.update(1)
                if stop:
                    res.stopped_early = not last
                    break
        finally:
            bar.close()
            model.train(was_training)
            optimizer.zero_grad(set_to_none=True)
    res.elapsed_s = time.perf_counter() - t_start
    return res


def _model_config(model: nn.Module) -> dict | None:
    cfg = getattr(model, "cfg", None)
    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        return None
    try:
        return json.loads(json.dumps(to_dict()))
    except (TypeError, ValueError):
        return None
