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


def streaming_table(tm, n_tokens=3072, sinks=4, window=124, bar=None):
    """Rows ``{"method", "ppl", "tok_s"[, "cache_tokens"]}`` over the first ``n_tokens`` of
    ``tm.heldout`` (a :class:`attnlab.train.textmodels.TextModels`); ``bar`` (a tqdm bar)
    advances once per token of each streamed pass."""
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
        nll = 0.0
        for t in range(n_tokens):
            lg = model(x[max(0, t - W + 1) : t + 1][None]).logits[0, -1]
            nll += float(torch.nn.functional.cross_entropy(lg[None], y[t : t + 1]))
            if bar is not None:
                bar.update(1)
        rows.append(
            {
                "method": f"sliding window {W}, recomputed per token",
                "ppl": math.exp(nll / n_tokens),
                "tok_s": n_tokens / (time.perf_counter() - t0),
            }
        )
    return rows
