"""The StreamingLLM perplexity table: a trained text model reads a long held-out text with
dense attention over all of it, a window-only cache, a sinks + window cache, and a sliding
window recomputed for every token.  Used by ``attnlab bench inference`` (with the speeds) and
by the claim ``evicting-the-sink-collapses-quality``, which reads the lab's own smaller text model
(:func:`text_model`)."""

from __future__ import annotations

import math
import time

import torch


def text_model(progress: bool = True):
    """The small text model of the streaming claim (:data:`attnlab.train.textmodels.LAB`), trained
    on the first call (with the caller's torch threads) and kept in the lab cache (``text-model``)."""
    from attnlab.lab import cache_dir
    from attnlab.train.textmodels import LAB, load_or_train

    return load_or_train(cache_dir("text-model"), progress=progress, specs=LAB)


def streaming_table(tm, n_tokens=3072, sinks=4, window=124, bar=None, *, timed_recompute=True):
    """Rows ``{"method", "ppl", "tok_s"[, "cache_tokens"]}`` over the first ``n_tokens`` of
    ``tm.heldout`` (a :class:`attnlab.train.textmodels.TextModels`); ``bar`` (a tqdm bar)
    advances once per token of each streamed pass.

    The sliding window recomputed per token is run one call per token when
    ``timed_recompute`` (its ``tok_s`` is what a generation loop gets); otherwise its
    perplexity alone is wanted and the windows run as a few batched calls
    (:func:`recomputed_window_nll`: the same windows, the same positions), ``tok_s`` None."""
    from attnlab.cache import StreamingCache

    model = tm.target
    ids = tm.heldout[: n_tokens + 1]
    x, y = ids[:-1], ids[1:]
    rows = []
    with torch.no_grad():
        lg = model(x[None]).logits[0]
        rows.append(
            {
                "method": f"dense attention over {n_tokens} tokens (trained on {model.cfg.max_positions})",
                "ppl": math.exp(float(torch.nn.functional.cross_entropy(lg, y))),
                "tok_s": None,
            }
        )
        for name, s, w in (("window only", 0, sinks + window), (f"sinks {sinks} + window {window}", sinks, window)):
            c = StreamingCache.for_model(model, sinks=s, window=w)
            t0 = time.perf_counter()
            nll = 0.0
            for t in range(n_tokens):
                lg = model(x[t : t + 1][None], cache=c).logits[0, -1]
                nll += float(torch.nn.functional.cross_entropy(lg[None], y[t : t + 1]))
                if bar is not None:
                    bar.update(1)
            rows.append(
                {
                    "method": name,
                    "ppl": math.exp(nll / n_tokens),
                    "tok_s": n_tokens / (time.perf_counter() - t0),
                    "cache_tokens": c.length,
                }
            )
        W = sinks + window
        t0 = time.perf_counter()
        if timed_recompute:
            nll = 0.0
            for t in range(n_tokens):
                lg = model(x[max(0, t - W + 1) : t + 1][None]).logits[0, -1]
                nll += float(torch.nn.functional.cross_entropy(lg[None], y[t : t + 1]))
                if bar is not None:
                    bar.update(1)
        else:
            nll = recomputed_window_nll(model, x, y, W)
            if bar is not None:
                bar.update(n_tokens)
        rows.append(
            {
                "method": f"sliding window {W}, recomputed per token",
                "ppl": math.exp(nll / n_tokens),
                "tok_s": n_tokens / (time.perf_counter() - t0) if timed_recompute else None,
            }
        )
    return rows


def recomputed_window_nll(model, x, y, W: int, batch: int = 128) -> float:
    """The summed next-token loss of reading ``x`` (1-D ids) with a sliding window of ``W``
    tokens recomputed from scratch for every token, in a few batched calls: token ``t``'s
    logits are those of the window ``x[max(0, t-W+1) : t+1]`` at positions ``0..``, as in
    one call per token.  The first ``W - 1`` tokens' windows are prefixes of ``x[:W-1]``,
    so one causal call over it gives them all (a causal model's logits at a position see
    only what precedes it); every later token's window is one row of
    ``x.unfold(0, W, 1)``, run ``batch`` rows per call."""
    n = x.numel()
    head = min(n, W - 1)
    nll = 0.0
    with torch.no_grad():
        if head:
            lg = model(x[:head][None]).logits[0]
            nll += float(torch.nn.functional.cross_entropy(lg, y[:head], reduction="sum"))
        if n >= W:
            rows = x.unfold(0, W, 1)  # row j is the window ending at token j + W - 1
            for lo in range(0, rows.shape[0], batch):
                chunk = rows[lo : lo + batch]
                lg = model(chunk).logits[:, -1]
                tgt = y[W - 1 + lo : W - 1 + lo + chunk.shape[0]]
                nll += float(torch.nn.functional.cross_entropy(lg, tgt, reduction="sum"))
    return nll
