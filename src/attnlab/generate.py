"""Generation: the sampling loop over a KV cache.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.generate import generate
>>> model = Decoder(DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, positions="rope")).eval()
>>> out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4, cache="static")   # ragged prompts
>>> [len(s) for s in out.sequences], out.new_tokens[0] == generate(model, [[1, 2, 3]], max_new_tokens=4,
...                                                                   cache=None).new_tokens[0]
([7, 6], True)

``cache=None`` recomputes the whole prefix at every step: the reference every cache
is tested against.  Prompts of different lengths are left-padded; the padding is
hidden by the attention mask and every row gets its own positions
(``cumsum(mask) - 1``), so a row's tokens do not depend on the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

CACHES = ("dynamic", "static", "paged", "quantized", "streaming")


@dataclass
class Sampling:
    """How the next token is chosen from the logits of the last position.

    ``temperature == 0`` is greedy (argmax); otherwise logits are divided by the
    temperature, filtered by ``top_k`` and ``top_p`` (nucleus), and sampled.
    ``repetition_penalty > 1`` divides the positive (multiplies the negative) logits of
    tokens already in the row (CTRL, Keskar et al. 2019)."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k: expected None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected None or a number in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty: expected a number > 0, got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def process(self, logits: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """``logits (B, V)`` -> processed float32 logits (``-inf`` where filtered out)."""
        x = logits.float()
        if self.repetition_penalty != 1.0 and context is not None:
            seen = torch.zeros_like(x, dtype=torch.bool).scatter_(1, context.clamp(min=0), True)
            pen = torch.where(x > 0, x / self.repetition_penalty, x * self.repetition_penalty)
            x = torch.where(seen, pen, x)
        if self.greedy:
            return x
        x = x / self.temperature
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            srt, idx = x.sort(-1, descending=True)
            cum = srt.softmax(-1).cumsum(-1)
            drop = cum - srt.softmax(-1) >= self.top_p  # keep the smallest prefix whose mass reaches top_p
            x = x.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
        return x

    def probs(self, logits, context=None) -> torch.Tensor:
        return self.process(logits, context).softmax(-1)

    def choose(self, logits, context=None, generator=None) -> torch.Tensor:
        """Next token per row, ``(B,)``."""
        x = self.process(logits, context)
        if self.greedy:
            return x.argmax(-1)
        return torch.multinomial(x.softmax(-1), 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    """``sequences``: prompt + generated tokens per row (no padding; a stop token is
    kept); ``new_tokens``: the generated part; ``logits``: with ``output_logits=True``,
    the raw logits of every step ``(B, V)``; ``finished``: which rows hit a stop token."""
    sequences: list
    new_tokens: list
    finished: list
    logits: list = field(default_factory=list)


def _prompts(input_ids, attention_mask, pad):
    """Left-padded ``ids (B, P)`` and ``keep (B, P)`` from a tensor (+mask) or a list of lists."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids: expected an integer tensor (B, N), got {tuple(input_ids.shape)}")
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else \
            torch.as_tensor(attention_mask).bool()
        if keep.shape != input_ids.shape:
            raise ValueError(f"attention_mask: expected {tuple(input_ids.shape)}, got {tuple(keep.shape)}")
        rows = [input_ids[i][keep[i]].tolist() for i in range(input_ids.shape[0])]
    else:
        rows = [list(map(int, r)) for r in input_ids]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("input_ids: every prompt needs at least one token")
    P = max(map(len, rows))
    ids = torch.full((len(rows), P), pad, dtype=torch.long)
    keep = torch.zeros(len(rows), P, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
        keep[i, P - len(r):] = True
    return rows, ids, keep


def make_cache(kind, model, batch_size: int, capacity: int, **options):
    """A cache of ``kind`` shaped for ``model`` (a :class:`attnlab.nn.Decoder`)."""
    from attnlab import cache as C
    if kind is None or not isinstance(kind, str):
        return kind
    if getattr(model.cfg, "mixer", "attention") != "attention":  # linear / SSM mixers keep a state, not K/V
        from attnlab.nn.ssm import RecurrentCache
        if kind not in ("static", "dynamic", "recurrent"):
            raise ValueError(f"cache: a {model.cfg.mixer!r} mixer decodes from a recurrent state; cache={kind!r} "
                             "holds keys and values (use 'static', 'dynamic' or 'recurrent')")
        return RecurrentCache.for_layers(model.cfg.n_layers)
    if kind == "dynamic":
        return C.DynamicCache(model.cfg.n_layers)
    if kind == "static":
        return C.StaticCache.for_model(model, batch_size, capacity, **options)
    if kind == "streaming":
        return C.StreamingCache.for_model(model, **options)
    if kind == "quantized":
        return C.QuantizedCache.for_model(model, **options)
    if kind == "paged":
        options.setdefault("max_tokens", batch_size * capacity)
        return C.PagedCache.for_model(model, **options)
    raise ValueError(f"cache: expected None, a Cache or one of {CACHES}, got {kind!r}")


@torch.no_grad()
def stream(model, input_ids, *, max_new_tokens: int, cache="static", attention_mask=None,
           sampling: Sampling | None = None, stop_tokens=(), seed: int | None = None, pad_token_id: int = 0,
           cache_options: dict | None = None, logits_out: list | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, ``(B,)``, as soon as it is chosen (rows that
    have stopped yield ``pad_token_id``).  Same arguments as :func:`generate`."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    sampling = sampling or Sampling()
    stops = torch.tensor(sorted(set(int(t) for t in stop_tokens)), dtype=torch.long)
    rows, ids, keep = _prompts(input_ids, attention_mask, pad_token_id)
    B, P = ids.shape
    ragged = not bool(keep.all())
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    c = make_cache(cache, model, B, P + max_new_tokens, **(cache_options or {}))
    if c is not None and getattr(c, "rotates_keys", False) and ragged:
        raise ValueError("cache='streaming' keeps positions in the cache and cannot serve left-padded prompts; "
                         "generate them one at a time")
    pos = (keep.long().cumsum(1) - 1).clamp(min=0)
    if hasattr(c, "select_batch"):  # paged: one sequence per row, prefilled one at a time, no padding
        step_logits = c.prefill(model, rows)
    elif getattr(c, "rotates_keys", False) and P > c.capacity + 1 - c.length:
        # a streaming cache takes a chunk only while it fits; then one token at a time
        first = max(1, c.capacity + 1 - c.length)
        step_logits = model(ids[:, :first], cache=c).logits[:, -1]
        for t in range(first, P):
            step_logits = model(ids[:, t:t + 1], cache=c).logits[:, -1]
    else:
        kw = {} if not ragged else {"attention_mask": keep, "pos": pos}
        step_logits = model(ids, cache=c, **kw).logits[:, -1]
    context = ids.masked_fill(~keep, -1)
    finished = torch.zeros(B, dtype=torch.bool)
    seqs, mask_all, last_pos = ids, keep, pos[:, -1]
    for step in range(max_new_tokens):
        if logits_out is not None:
            logits_out.append(step_logits.float())
        nxt = sampling.choose(step_logits, context.clamp(min=0) if sampling.repetition_penalty != 1 else None, gen)
        nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
        yield nxt
        if stops.numel():
            finished |= torch.isin(nxt, stops)
        if bool(finished.all()) or step == max_new_tokens - 1:
            return
        context = torch.cat([context, torch.where(finished, -1, nxt).unsqueeze(1)], 1)
        last_pos = last_pos + 1
        mask_all = torch.cat([mask_all, torch.ones(B, 1, dtype=torch.bool)], 1)
        seqs = torch.cat([seqs, nxt.unsqueeze(1)], 1)
        if c is None:  # the reference: recompute everything
            kw = {} if not ragged else {"attention_mask": mask_all, "pos": (mask_all.long().cumsum(1) - 1).clamp(min=0)}
            step_logits = model(seqs, **kw).logits[:, -1]
        elif hasattr(c, "select_batch"):
            step_logits = model(nxt.unsqueeze(1), cache=c).logits[:, -1]
        else:
            kw = {} if not ragged else {"attention_mask": mask_all, "pos": last_pos.unsqueeze(1)}
            step_logits = model(nxt.unsqueeze(1), cache=c, **kw).logits[:, -1]


def generate(model, input_ids, *, max_new_tokens: int, cache="static", attention_mask=None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             repetition_penalty: float = 1.0, stop_tokens=(), seed: int | None = None, pad_token_id: int = 0,
             cache_options: dict | None = None, on_token: Callable | None = None,
             output_logits: bool = False) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: an :class:`attnlab.nn.Decoder` (anything with ``cfg`` and
            ``(ids, cache=, attention_mask=, pos=) -> .logits``).
        input_ids: ``(B, N)`` tensor (with ``attention_mask`` marking real tokens, any
            padding side) or a list of token lists of different lengths.
        cache: ``"static"`` (default), ``"dynamic"``, ``"paged"``, ``"quantized"``,
            ``"streaming"``, a :class:`attnlab.cache.Cache` object, or ``None`` (no
            cache: the whole prefix is recomputed each step — the reference).
        temperature, top_k, top_p, repetition_penalty: see :class:`Sampling`
            (``temperature=0``: greedy).
        stop_tokens: a row stops after producing one of these.
        seed: makes sampling reproducible (a private ``torch.Generator``).
        on_token: called with ``(step, tokens (B,))`` as each token is chosen (streaming).
        output_logits: keep every step's raw logits in ``Generation.logits``.
    """
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty)
    rows, _, _ = _prompts(input_ids, attention_mask, pad_token_id)
    logits = [] if output_logits else None
    new = [[] for _ in rows]
    done = [False] * len(rows)
    stops = set(int(t) for t in stop_tokens)
    for step, tok in enumerate(stream(model, input_ids, max_new_tokens=max_new_tokens, cache=cache,
                                      attention_mask=attention_mask, sampling=sampling, stop_tokens=stop_tokens,
                                      seed=seed, pad_token_id=pad_token_id, cache_options=cache_options,
                                      logits_out=logits)):
        if on_token is not None:
            on_token(step, tok)
        for i, t in enumerate(tok.tolist()):
            if not done[i]:
                new[i].append(t)
                done[i] = t in stops
    return Generation([r + n for r, n in zip(rows, new)], new, done, logits or [])
