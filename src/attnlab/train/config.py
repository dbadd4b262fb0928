"""The configuration of :func:`attnlab.train.loop.train`: :class:`TrainConfig` (checked on
construction), its learning-rate schedule and its optimizer.

* Schedule (:func:`lr_at`): linear warmup from 0 over ``warmup_steps``, then a cosine
  from ``lr`` down to ``min_lr = min_lr_ratio * lr`` at ``steps``.
* Optimizer (:func:`configure_optimizer`): AdamW, nanoGPT's split — weight decay on
  parameters with ``dim >= 2`` (matmul weights and embeddings), none on biases and norm
  weights; a tied weight is one parameter, listed once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from attnlab.validate import int_in, nonneg_int, positive_int, real, rng_seed

__all__ = ["BOOKKEEPING", "DTYPES", "TrainConfig", "configure_optimizer", "lr_at"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Fields that change only logging / saving, not the trajectory (not compared on resume).
BOOKKEEPING = ("log_every", "eval_every", "checkpoint_every", "checkpoint_dir")


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
