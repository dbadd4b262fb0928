"""A small CPU training loop for language models (:class:`attnlab.nn.Decoder`).

One step::

    inputs, targets = next(batches)                        # (B, N) int64 each; -100 = not scored
    logits = model(inputs).logits                          # (B, N, vocab)
    loss = cross_entropy(logits, targets, ignore_index=-100)   # mean over scored targets
    loss.backward(); clip the global grad norm; AdamW step at lr_at(step)

* Configuration, schedule and optimizer (:mod:`attnlab.train.config`): :class:`TrainConfig`,
  :func:`lr_at`, :func:`configure_optimizer`.
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
import json
import math
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
from attnlab.train.config import BOOKKEEPING, DTYPES, TrainConfig, configure_optimizer, lr_at
from attnlab.train.data import IGNORE_INDEX

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
    diff = [k for k in now if k not in BOOKKEEPING and k in saved and saved[k] != now[k]]
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
