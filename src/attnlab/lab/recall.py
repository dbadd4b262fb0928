"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"): softmax attention,
linear attention and a selective SSM, in Decoders that differ only in their mixer.

One of the seed texts says state-space models have "weaker explicit content-based
retrieval capabilities compared to softmax attention".  MQAR measures exactly that: a
sequence first lists ``n`` key-value pairs, then queries every key once (in random
order, at random places, separated by filler); after each queried key the model must
produce its value::

    k1 v1 k2 v2 ... kn vn | 0 0 k2 [v2] 0 kn [vn] 0 ... k1 [v1] 0 ...
    └──── 2n tokens ────┘ └──────── seq_len + 1 - 2n tokens ────────┘

Tokens: ``0`` is the filler, keys are ``1 .. K`` and values ``K+1 .. vocab_size-1`` with
``K = (vocab_size - 1) // 2``; the ``n`` keys of a sequence are distinct, and so are its
``n`` values (as in Zoology).  Inputs and targets are the sequence shifted by one (``seq_len``
tokens each); only the positions holding a *queried* key are scored (target: its value),
so chance is ``1 / (vocab_size - 1 - K)``.

A model that has not learnt to bind keys to values can still copy *some* value of the
context, and skip the values it has already seen queried: answering the ``j``-th query
by a uniform guess among the ``n - j + 1`` values not yet queried scores
``H_n / n = (1 + 1/2 + ... + 1/n) / n`` (0.75, 0.52, 0.34, 0.21 for n = 2, 4, 8, 16).
That is the bar a mixer must clear to show content-based retrieval; results report it as
``no_binding``.

The models are trained on a mixture (each batch holds equally many sequences of every
``n`` in ``n_pairs``, at one fixed ``seq_len``), then the accuracy on the values of
held-out sequences (another random stream) is reported per ``n``.  Every model has the
same embeddings, MLPs, norms, positions (RoPE, which the SSM ignores), initial seed and
batches; only ``cfg.mixer`` differs, and the mixers' parameter counts are close (reported).

Every mixer is trained at each learning rate of ``lrs`` and reported at the one with the
lowest final training loss (Zoology sweeps the learning rate per model too): measured,
softmax attention learns the task at 3e-3 but not at 1e-2, the SSM at 1e-2 but not at
3e-3 or 1e-3, so one shared rate would decide the comparison by itself.

Sizes (:data:`FULL`), chosen by measurement on two shared CPU cores (one torch thread per
process, two processes): vocab 64, ``seq_len`` 32, ``n_pairs`` (2, 4, 8), ``d_model`` 64,
2 layers, 4 heads, 1500 steps of 48 sequences, two learning rates: about 2.5 minutes.
``seq_len`` 32 holds up to 8 pairs, where the SSM starts to fall behind; ``seq_len`` 64
(16 pairs) would double the cost.  With the Decoder's GPT-2 initialisation (std 0.02)
attention stayed on the "copy some value" plateau (accuracy = ``no_binding``) for 3000
steps at ``seq_len`` 32, and at ``seq_len`` 16 whether it left it depended on the seed;
``init_std = 0.1`` (≈ 1/sqrt(d_model), for every mixer alike) lets it solve the task in
under 1500 steps.  These are small-budget numbers from one seed: they rank how fast each
mixer learns to retrieve as much as what it can retrieve.

``run(quick=False, force=False)`` trains (a tqdm bar on stderr) or returns the cached
result, a JSON file under ``cache_dir("recall")`` named by a hash of the config.
``attnlab lab recall [--quick] [--json PATH] [--force] [--workers N]`` prints the table.

>>> x, y = next(mqar_batches(vocab_size=21, batch_size=2, seq_len=16, n_pairs=3, seed=0))
>>> x.shape, int((y != -100).sum(1)[0])                   # every key queried once
(torch.Size([2, 16]), 3)
>>> keys, values = x[0, 0:6:2], x[0, 1:6:2]
>>> q = (y[0] != -100).nonzero().flatten()
>>> all(values[keys == x[0, p]].item() == y[0, p].item() for p in q)   # the value stored with it
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from attnlab.lab import cache_dir
from attnlab.nn import Decoder, DecoderConfig
from attnlab.nn.decoder import init_weights
from attnlab.train.data import IGNORE_INDEX
from attnlab.train.loop import TrainConfig, train
from attnlab.validate import int_in, int_sequence, positive_int, real

__all__ = [
    "RecallConfig",
    "QUICK",
    "FULL",
    "DEMO",
    "mqar_batch",
    "mqar_batches",
    "build_model",
    "recall_accuracy",
    "no_binding_accuracy",
    "run",
    "summary",
]

#: Bump when the task, the model or the metric changes: old cached results stop matching.
VERSION = 1


@dataclass(frozen=True)
class RecallConfig:
    """Everything a run depends on (its hash names the cache file).

    Attributes:
        vocab_size, seq_len: the task's vocabulary and the (fixed) length of every sequence.
        n_pairs: key-value pairs per sequence, one bucket each; ``4 · max(n_pairs) <= seq_len + 1``.
        mixers: which ``DecoderConfig.mixer`` values to train.
        d_model, n_layers, n_heads, d_state, positions: the model (``DecoderConfig``).
        steps, batch_size, warmup_steps: training (AdamW, cosine; ``attnlab.train``).
        lrs: peak learning rates tried for every mixer (the best by training loss is reported).
        eval_sequences: held-out sequences per ``n_pairs`` bucket.
        gaps: the query layout (:func:`mqar_batch`).
        init_std: GPT-2-style initialisation scale of every matrix and embedding
            (:func:`attnlab.nn.decoder.init_weights`); the same for every mixer.
        seed: model init and data; the held-out sequences use another stream.
        threads: torch threads while training (restored afterwards); on two shared cores one
            thread avoids OpenMP threads stalling each other when a core is busy.
    """

    vocab_size: int = 64
    seq_len: int = 32
    n_pairs: tuple = (2, 4, 8)
    mixers: tuple = ("attention", "linear", "ssm")
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_state: int = 16
    positions: str = "rope"
    steps: int = 1500
    batch_size: int = 48
    lrs: tuple = (3e-3, 1e-2)
    warmup_steps: int = 300
    eval_sequences: int = 256
    gaps: bool = True
    init_std: float = 0.1
    seed: int = 0
    threads: int = 1

    def __post_init__(self):
        object.__setattr__(self, "n_pairs", tuple(int(n) for n in self.n_pairs))
        object.__setattr__(self, "mixers", tuple(self.mixers))
        object.__setattr__(self, "lrs", tuple(self.lrs))
        for f in (
            "vocab_size",
            "seq_len",
            "d_model",
            "n_layers",
            "n_heads",
            "d_state",
            "steps",
            "batch_size",
            "eval_sequences",
            "threads",
        ):
            positive_int(getattr(self, f), f"RecallConfig.{f}")
        int_sequence(self.n_pairs, "RecallConfig.n_pairs")
        _check_task(self.vocab_size, self.seq_len, max(self.n_pairs), "RecallConfig")
        if self.batch_size % len(self.n_pairs):
            raise ValueError(
                f"RecallConfig.batch_size: {self.batch_size} must split evenly over the "
                f"{len(self.n_pairs)} n_pairs buckets"
            )
        bad = [m for m in self.mixers if m not in ("attention", "linear", "ssm")]
        if not self.mixers or bad:
            raise ValueError(
                f"RecallConfig.mixers: expected some of ('attention', 'linear', 'ssm'), got {self.mixers!r}"
            )
        if not self.lrs:
            raise ValueError("RecallConfig.lrs: expected positive numbers, got none")
        for i, v in enumerate(self.lrs):
            real(v, f"RecallConfig.lrs[{i}]", gt=0.0)
        real(self.init_std, "RecallConfig.init_std", gt=0.0)
        w = f"[0, steps={self.steps}]"
        int_in(self.warmup_steps, "RecallConfig.warmup_steps", 0, self.steps, closed=True, interval=w)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["n_pairs"], d["mixers"], d["lrs"] = list(self.n_pairs), list(self.mixers), list(self.lrs)
        return d

    def key(self) -> str:
        blob = json.dumps({"version": VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the task
def _check_task(vocab_size, seq_len, n, where):
    K = (vocab_size - 1) // 2
    if n > K:
        raise ValueError(
            f"{where}: n_pairs={n} distinct keys need vocab_size >= {2 * n + 1} "
            f"(0 is the filler; keys and values split the rest), got vocab_size={vocab_size}"
        )
    if 4 * n > seq_len + 1:
        raise ValueError(
            f"{where}: n_pairs={n} needs seq_len >= {4 * n - 1} (n pairs, then n queried keys each "
            f"followed by its value), got seq_len={seq_len}"
        )
    if vocab_size - 1 - K < 1:
        raise ValueError(f"{where}: vocab_size={vocab_size} leaves no value ids")


def mqar_batch(
    vocab_size: int, batch_size: int, seq_len: int, n_pairs: int, generator: torch.Generator, gaps: bool = True
):
    """One MQAR batch: ``(inputs, targets)``, int64 ``(batch_size, seq_len)``; targets are
    ``-100`` except at the queried keys, where they are the keys' values.  ``gaps=True``
    scatters the queries over the query section (Zoology); ``False`` puts them right
    after the pairs (still in random order), the filler at the end."""
    _check_task(vocab_size, seq_len, n_pairs, "mqar_batch")
    g, b, n = generator, batch_size, n_pairs
    K = (vocab_size - 1) // 2
    keys = torch.rand(b, K, generator=g).topk(n, dim=1).indices + 1  # distinct, in 1..K
    values = torch.rand(b, vocab_size - 1 - K, generator=g).topk(n, dim=1).indices + K + 1  # distinct too
    s = torch.zeros(b, seq_len + 1, dtype=torch.long)
    s[:, 0 : 2 * n : 2], s[:, 1 : 2 * n : 2] = keys, values
    if gaps:
        slots = torch.rand(b, (seq_len + 1 - 2 * n) // 2, generator=g).topk(n, dim=1).indices  # distinct slots
    else:
        slots = torch.arange(n).expand(b, n)
    order = torch.rand(b, n, generator=g).argsort(1)  # which pair goes in which slot
    at = 2 * n + 2 * slots
    rows = torch.arange(b)[:, None]
    qv = values.gather(1, order)
    s[rows, at], s[rows, at + 1] = keys.gather(1, order), qv
    targets = torch.full((b, seq_len), IGNORE_INDEX, dtype=torch.long)
    targets[rows, at] = qv
    return s[:, :-1], targets


def mqar_batches(vocab_size: int, batch_size: int, seq_len: int, n_pairs, *, seed: int, gaps: bool = True) -> Iterator:
    """Infinite, deterministic MQAR batches.  ``n_pairs`` an int, or a tuple of ints: each
    batch then holds ``batch_size / len(n_pairs)`` sequences of each (in that order)."""
    ns = (n_pairs,) if isinstance(n_pairs, int) else tuple(n_pairs)
    if batch_size % len(ns):
        raise ValueError(f"batch_size: {batch_size} must split evenly over n_pairs={ns}")
    for n in ns:
        _check_task(vocab_size, seq_len, n, "mqar_batches")
    g = torch.Generator().manual_seed(seed)
    per = batch_size // len(ns)

    def gen():
        while True:
            parts = [mqar_batch(vocab_size, per, seq_len, n, g, gaps) for n in ns]
            yield torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    return gen()


#: The full run: the defaults (sizes chosen by measurement, see the module docstring).
FULL = RecallConfig()
#: The run ``attnlab demo`` shows and the claim ``ssm-weaker-content-recall`` reads: 2 and 4 pairs in
#: 16 tokens, d_model 32 (below 32 the SSM comparison broke), vocab 32, 600 steps of 32 sequences --
#: about a twelfth of FULL's work.  Softmax attention still binds every pair here; the SSM does not
#: reach the no-binding bar at this budget, where FULL shows it close behind (docs/lab.md).
DEMO = RecallConfig(
    vocab_size=32,
    seq_len=16,
    n_pairs=(2, 4),
    d_model=32,
    n_heads=2,
    d_state=4,
    steps=600,
    batch_size=32,
    warmup_steps=100,
)
#: A smoke run (seconds): too short for any mixer to learn the binding.
QUICK = RecallConfig(seq_len=16, n_pairs=(2, 4), steps=200, warmup_steps=40, batch_size=32, eval_sequences=128)


# ----------------------------------------------------------------------------- models and metric
def build_model(cfg: RecallConfig, mixer: str) -> Decoder:
    """The Decoder for ``mixer``, initialised from ``cfg.seed`` (the same draw for every mixer
    up to the mixer's own parameters)."""
    torch.manual_seed(cfg.seed)
    model = Decoder(
        DecoderConfig(
            vocab_size=cfg.vocab_size,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            positions=cfg.positions,
            max_positions=cfg.seq_len,
            mixer=mixer,
            d_state=cfg.d_state,
        )
    )
    if cfg.init_std != 0.02:  # the Decoder's own default
        torch.manual_seed(cfg.seed)
        init_weights(model, cfg.n_layers, std=cfg.init_std)
    return model


@torch.no_grad()
def recall_accuracy(model, inputs: torch.Tensor, targets: torch.Tensor, batch: int = 128) -> float:
    """Fraction of the scored targets (the queried values) that are the model's argmax."""
    was = model.training
    model.eval()
    hit = total = 0
    try:
        for i in range(0, inputs.shape[0], batch):
            x, y = inputs[i : i + batch], targets[i : i + batch]
            pred = model(x).logits.argmax(-1)
            scored = y != IGNORE_INDEX
            hit += int((pred[scored] == y[scored]).sum())
            total += int(scored.sum())
    finally:
        model.train(was)
    return hit / total


def no_binding_accuracy(n_pairs: int) -> float:
    """``H_n / n``: the expected accuracy of guessing each queried value uniformly among the
    values of the pairs not yet queried (no key-value binding; see the module docstring).

    >>> round(no_binding_accuracy(2), 3), round(no_binding_accuracy(8), 3)
    (0.75, 0.34)
    """
    return sum(1.0 / k for k in range(1, n_pairs + 1)) / n_pairs


def _mixer_params(model) -> int:
    return sum(p.numel() for b in model.blocks for p in b.attn.parameters())


# ----------------------------------------------------------------------------- the experiment
def _cache_file(cfg: RecallConfig):
    return cache_dir("recall") / f"mqar-{cfg.key()}.json"


def _train_one(cfg: RecallConfig, mixer: str, lr: float, report=None) -> dict:
    """Train and evaluate one (mixer, lr) run; ``report(n)`` is told every few steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        g = torch.Generator().manual_seed(cfg.seed + 1_000_003)  # held out: another stream than training
        eval_sets = {
            n: mqar_batch(cfg.vocab_size, cfg.eval_sequences, cfg.seq_len, n, g, cfg.gaps) for n in cfg.n_pairs
        }
        model = build_model(cfg, mixer)
        tcfg = TrainConfig(
            steps=cfg.steps,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            lr=lr,
            warmup_steps=cfg.warmup_steps,
            seed=cfg.seed,
        )
        data = mqar_batches(cfg.vocab_size, cfg.batch_size, cfg.seq_len, cfg.n_pairs, seed=cfg.seed, gaps=cfg.gaps)
        done = [0]

        def tick(info):
            if report is not None and (info.step + 1) % 10 == 0:
                report(info.step + 1 - done[0])
                done[0] = info.step + 1

        res = train(model, data, tcfg, callback=tick, progress=False)
        if report is not None and done[0] < cfg.steps:
            report(cfg.steps - done[0])
        tail = res.losses[-max(1, cfg.steps // 20) :]
        return {
            "mixer": mixer,
            "lr": lr,
            "params": sum(p.numel() for p in model.parameters()),
            "mixer_params": _mixer_params(model),
            "train_s": round(res.elapsed_s, 2),
            "final_loss": sum(tail) / len(tail),
            "accuracy": {str(n): recall_accuracy(model, *eval_sets[n]) for n in cfg.n_pairs},
        }
    finally:
        torch.set_num_threads(threads)


def _train_one_queued(cfg, mixer, lr, queue):  # in a worker process
    return _train_one(cfg, mixer, lr, queue.put)


def _run_all(cfg: RecallConfig, jobs, workers: int, bar) -> list:
    if workers == 1 or len(jobs) == 1:
        out = []
        for mixer, lr in jobs:
            bar.set_description(f"mqar {mixer} lr={lr:g}")
            out.append(_train_one(cfg, mixer, lr, bar.update))
        return out
    import multiprocessing as mp
    import queue as queue_mod
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked OpenMP state
    with ctx.Manager() as manager, ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx) as pool:
        q = manager.Queue()
        futures = [pool.submit(_train_one_queued, cfg, mixer, lr, q) for mixer, lr in jobs]
        bar.set_description(f"mqar {len(jobs)} runs on {min(workers, len(jobs))} processes")
        while not all(f.done() for f in futures):
            with contextlib.suppress(queue_mod.Empty):
                bar.update(q.get(timeout=0.2))
        while not q.empty():
            bar.update(q.get())
        return [f.result() for f in futures]


def run(
    quick: bool = False,
    force: bool = False,
    *,
    config: RecallConfig | None = None,
    progress: bool = True,
    workers: int = 2,
) -> dict:
    """Train one Decoder per mixer and learning rate on MQAR; measure held-out recall.

    For each mixer, every learning rate in ``config.lrs`` is tried and the run with the
    lowest final *training* loss is reported (the held-out sequences are not used to
    choose); all runs are kept under ``runs``.  ``workers`` processes train in parallel
    (one torch thread each; the results do not depend on it).

    ``config`` overrides ``QUICK``/``FULL``.  The result (a JSON-able dict) is cached under
    ``cache_dir("recall")``; a second call with the same config reads it back (``force``
    retrains).  Keys: ``experiment``, ``key``, ``config``, ``n_pairs``, ``chance``,
    ``no_binding`` {str(n): H_n/n}, ``models`` (per mixer: ``params``, ``mixer_params``,
    ``lr``, ``train_s``, ``final_loss``, ``accuracy`` {str(n): fraction}, ``runs``),
    ``elapsed_s``, ``torch``.
    """
    cfg = config if config is not None else (QUICK if quick else FULL)
    if not isinstance(cfg, RecallConfig):
        raise TypeError(f"config: expected a RecallConfig, got {type(cfg).__name__}")
    positive_int(workers, "workers")
    path = _cache_file(cfg)
    if path.exists() and not force:
        return json.loads(path.read_text())
    t_start = time.perf_counter()
    jobs = [(mixer, lr) for mixer in cfg.mixers for lr in cfg.lrs]
    with tqdm(
        total=cfg.steps * len(jobs), desc="mqar", unit="step", file=sys.stderr, disable=not progress, dynamic_ncols=True
    ) as bar:
        runs = _run_all(cfg, jobs, workers, bar)
    models = {}
    for mixer in cfg.mixers:
        mine = [r for r in runs if r["mixer"] == mixer]
        best = min(mine, key=lambda r: r["final_loss"])
        models[mixer] = {k: v for k, v in best.items() if k != "mixer"}
        models[mixer]["runs"] = [{k: r[k] for k in ("lr", "final_loss", "train_s", "accuracy")} for r in mine]
    K = (cfg.vocab_size - 1) // 2
    result = {
        "experiment": "mqar",
        "key": cfg.key(),
        "config": cfg.to_dict(),
        "n_pairs": list(cfg.n_pairs),
        "chance": 1.0 / (cfg.vocab_size - 1 - K),
        "no_binding": {str(n): no_binding_accuracy(n) for n in cfg.n_pairs},
        "models": models,
        "elapsed_s": round(time.perf_counter() - t_start, 2),
        "torch": torch.__version__,
    }
    result = json.loads(json.dumps(result))  # exactly what a cached read returns
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return result


def summary(result: dict) -> str:
    """A text table: accuracy per mixer and ``n_pairs`` (the chosen learning rate's run, and
    every run below it), with parameter counts and the no-binding bar."""
    ns = [str(n) for n in result["n_pairs"]]
    c = result["config"]
    head = " ".join(f"{'n=' + n:>6}" for n in ns)
    lines = [
        f"MQAR: vocab {c['vocab_size']}, seq_len {c['seq_len']}, d_model {c['d_model']}, {c['n_layers']} layers, "
        f"{c['n_heads']} heads, {c['steps']} steps x {c['batch_size']} sequences, lr in {c['lrs']}; "
        f"held-out accuracy on the queried values (chance {result['chance']:.3f})",
        f"{'mixer':<10} {'params':>8} {'mixer':>7} {'lr':>7} {head} {'loss':>6} {'train s':>8}",
        f"{'no-binding':<10} {'':>8} {'':>7} {'':>7} "
        + " ".join(f"{result['no_binding'][n]:>6.3f}" for n in ns)
        + "   (H_n/n: copy a not-yet-queried value)",
    ]
    base = result["models"].get("attention", {}).get("params")
    for mixer, m in result["models"].items():
        rel = f" ({m['params'] / base - 1:+.1%} params)" if base and mixer != "attention" else ""
        lines.append(
            f"{mixer:<10} {m['params']:>8} {m['mixer_params']:>7} {m['lr']:>7.0e} "
            + " ".join(f"{m['accuracy'][n]:>6.3f}" for n in ns)
            + f" {m['final_loss']:>6.3f} {m['train_s']:>8.1f}{rel}"
        )
        for r in m["runs"]:
            if r["lr"] != m["lr"]:
                lines.append(
                    f"{'':<10} {'':>8} {'':>7} {r['lr']:>7.0e} "
                    + " ".join(f"{r['accuracy'][n]:>6.3f}" for n in ns)
                    + f" {r['final_loss']:>6.3f} {r['train_s']:>8.1f}  (not chosen)"
                )
    lines.append(
        f"(params: whole model; mixer: the sequence mixers of all layers; lr chosen per mixer by final "
        f"training loss; run {result['elapsed_s']:.0f} s)"
    )
    return "\n".join(lines)
