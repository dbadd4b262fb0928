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
hidden by the attention mask, every row gets its own positions (``cumsum(mask) - 1``),
and padding is no token for the repetition penalty, the stops or the filters; with a
``seed`` each row samples from its own generator (``seed=[s0, s1, ...]``: one per row,
vLLM's per-request seed).  So a row's tokens do not depend on the other rows
(tests/faults/test_generation.py holds it as a property).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from attnlab.validate import integer, nonneg_int, real, rng_seed

CACHES = ("dynamic", "static", "paged", "quantized", "streaming")


# -- argument checks shared with attnlab.speculative ---------------------------------------


def model_vocab(model) -> int | None:
    """``model.cfg.vocab_size`` when the model has one (token ids are checked against it)."""
    v = getattr(getattr(model, "cfg", None), "vocab_size", None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _in_vocab(t: int, name: str, vocab: int | None) -> int:
    if t < 0 or (vocab is not None and t >= vocab):
        raise ValueError(
            f"{name}: token id {t} is outside the vocabulary [0, {'vocab_size' if vocab is None else vocab})"
        )
    return t


def token_id(x, name: str, vocab: int | None = None) -> int:
    """One token id: a Python/numpy integer or a 0-d integer tensor in ``[0, vocab)``.
    Floats (``1.7`` is not silently ``1``), bools, complex numbers and strings are refused."""
    if isinstance(x, torch.Tensor) and x.dim() == 0 and _integer_dtype(x.dtype):
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{name}: expected an integer token id, got {x!r} ({type(x).__name__})")
    return _in_vocab(int(x), name, vocab)


def _integer_dtype(dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def token_row(row, name: str, vocab: int | None = None) -> list:
    """One sequence of token ids (a list/tuple of ints or a 1-d integer tensor) as a list."""
    if isinstance(row, torch.Tensor):
        if row.dim() != 1 or not _integer_dtype(row.dtype):
            raise ValueError(f"{name}: expected a 1-d integer tensor, got {row.dtype} {tuple(row.shape)}")
        toks = row.tolist()
        if toks:
            _in_vocab(min(toks), name, vocab)
            _in_vocab(max(toks), name, vocab)
        return toks
    if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
        raise ValueError(f"{name}: expected a sequence of token ids, got {type(row).__name__} {row!r}")
    return [token_id(t, name, vocab) for t in row]


def stop_token_set(stop_tokens, vocab: int | None = None) -> set:
    """``stop_tokens``: one token id or a sequence of them (like transformers' ``eos_token_id``)."""
    if isinstance(stop_tokens, numbers.Integral) and not isinstance(stop_tokens, bool):
        stop_tokens = [stop_tokens]
    return set(token_row(stop_tokens, "stop_tokens", vocab))


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row`` when ``generate`` is given one int ``seed`` (splitmix64 of
    both): ``generate(batch, seed=s)`` row ``i`` equals ``generate([batch[i]],
    seed=[row_seed(s, i)])``."""
    m = 2**64
    z = (rng_seed(seed) + (row + 1) * 0x9E3779B97F4A7C15) % m
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % m
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % m
    return z ^ (z >> 31)


def row_seeds(seed, n_rows: int) -> list | None:
    """``seed`` (None, one int, or one int per row) -> a seed per row, or None."""
    if seed is None:
        return None
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return [row_seed(int(seed), i) for i in range(n_rows)]
    if isinstance(seed, (list, tuple)):
        if len(seed) != n_rows:
            raise ValueError(f"seed: a per-row seed list needs one seed per prompt ({n_rows}), got {len(seed)}")
        return [rng_seed(s, f"seed[{i}]") for i, s in enumerate(seed)]
    raise ValueError(f"seed: expected None, an int or a list of one int per prompt, got {seed!r}")


@dataclass
class Sampling:
    """How the next token is chosen from the logits of the last position.

    ``temperature == 0`` is greedy (argmax); otherwise logits are divided by the
    temperature, filtered by ``top_k`` and ``top_p`` (nucleus), and sampled.  The
    division is done on ``logits - max`` so that any finite temperature > 0, however
    small (``1e-45``), is stable: it tends to the greedy choice (ties share the mass).
    Both filters keep every token tied with the last one kept, so the result never
    depends on how a sort orders equal values.  ``repetition_penalty > 1`` divides the
    positive (multiplies the negative) logits of tokens already in the row (CTRL,
    Keskar et al. 2019); ``context`` entries ``< 0`` (padding, nothing) are no token."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        self.temperature = real(self.temperature, "temperature", ge=0.0)
        self.top_k = None if self.top_k is None else integer(self.top_k, "top_k", lo=1, hint="None: no top-k filter")
        if self.top_p is not None:
            self.top_p = real(self.top_p, "top_p", gt=0.0, le=1.0, hint="None: no top-p filter")
        self.repetition_penalty = real(self.repetition_penalty, "repetition_penalty", gt=0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def process(self, logits: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """``logits (B, V)`` -> processed float32 logits (``-inf`` where filtered out;
        when sampling, shifted so that each row's maximum is 0).  ``context (B, T)``:
        the tokens each row has seen, ``-1`` for none (padding)."""
        x = logits.float()
        V = x.shape[-1]
        if self.repetition_penalty != 1.0 and context is not None:
            ctx = context.long()
            ctx = torch.where((ctx >= 0) & (ctx < V), ctx, V)  # padding -> an extra column, dropped
            seen = torch.zeros(x.shape[0], V + 1, dtype=torch.bool).scatter_(1, ctx, True)[:, :V]
            xd, big = x.double(), torch.finfo(torch.float32).max
            pen = torch.where(xd > 0, xd / self.repetition_penalty, xd * self.repetition_penalty)
            pen = torch.where(torch.isfinite(x), pen.clamp(-big, big), xd).float()  # no overflow to +-inf
            x = torch.where(seen, pen, x)
        if self.greedy:
            return x
        top = x.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        x = ((x - top).double() / self.temperature).float()  # float64: a temperature of 1e-300 is no 0
        if self.top_k is not None and self.top_k < V:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            srt = x.sort(-1, descending=True).values
            p = srt.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (at least one token), and its ties
            n_keep = ((p.cumsum(-1) - p) < self.top_p).sum(-1, keepdim=True).clamp(min=1)
            x = x.masked_fill(x < srt.gather(-1, n_keep - 1), float("-inf"))
        return x

    def probs(self, logits, context=None) -> torch.Tensor:
        return self.process(logits, context).softmax(-1)

    def choose(self, logits, context=None, generator=None) -> torch.Tensor:
        """Next token per row, ``(B,)``.  ``generator``: None (torch's global RNG), one
        ``torch.Generator`` for the batch, or a sequence of one per row — each row then
        draws from its own, so its tokens do not depend on the other rows."""
        x = self.process(logits, context)
        if self.greedy:
            return x.argmax(-1)
        p = x.softmax(-1)
        if isinstance(generator, (list, tuple)):
            if len(generator) != p.shape[0]:
                raise ValueError(f"generator: expected one per row ({p.shape[0]}), got {len(generator)}")
            return torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i, g in enumerate(generator)])
        return torch.multinomial(p, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    """``sequences``: prompt + generated tokens per row (no padding; a stop token is
    kept); ``new_tokens``: the generated part; ``logits``: with ``output_logits=True``,
    the raw logits of every step ``(B, V)``; ``finished``: which rows hit a stop token."""

    sequences: list
    new_tokens: list
    finished: list
    logits: list = field(default_factory=list)


def _prompts(input_ids, attention_mask, pad, vocab=None):
    """Left-padded ``ids (B, P)`` and ``keep (B, P)`` from a tensor (+mask) or a list of lists."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or not _integer_dtype(input_ids.dtype):
            raise ValueError(
                f"input_ids: expected an integer tensor (B, N), got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if attention_mask is None:
            keep = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            m = torch.as_tensor(attention_mask)
            if m.shape != input_ids.shape:
                raise ValueError(f"attention_mask: expected {tuple(input_ids.shape)}, got {tuple(m.shape)}")
            if not (m.dtype == torch.bool or _integer_dtype(m.dtype)) or not bool(((m == 0) | (m == 1)).all()):
                raise ValueError(
                    f"attention_mask: expected bool or 0/1 integers (1 = real token), got "
                    f"{m.dtype} values {torch.unique(m).tolist()[:8]}"
                )
            keep = m.bool()
        rows = [token_row(input_ids[i][keep[i]], f"input_ids[{i}]", vocab) for i in range(input_ids.shape[0])]
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask: only for a padded input_ids tensor; a list of prompts needs none")
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, (list, tuple)):
            raise ValueError(
                f"input_ids: expected a (B, N) integer tensor or a list of token lists, got {type(input_ids).__name__}"
            )
        if input_ids and all(isinstance(r, numbers.Number) for r in input_ids):
            raise ValueError(
                f"input_ids: expected a list of prompts (token lists), got one flat list "
                f"{list(input_ids)[:8]}; wrap it: [[...]]"
            )
        rows = [token_row(r, f"input_ids[{i}]", vocab) for i, r in enumerate(input_ids)]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("input_ids: expected at least one prompt, each with at least one token")
    P = max(map(len, rows))
    ids = torch.full((len(rows), P), pad, dtype=torch.long)
    keep = torch.zeros(len(rows), P, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, P - len(r) :] = torch.tensor(r, dtype=torch.long)
        keep[i, P - len(r) :] = True
    return rows, ids, keep


def make_cache(kind, model, batch_size: int, capacity: int, **options):
    """A cache of ``kind`` shaped for ``model`` (a :class:`attnlab.nn.Decoder`)."""
    from attnlab import cache as C

    if kind is None or not isinstance(kind, str):
        return kind
    if getattr(model.cfg, "mixer", "attention") != "attention":  # linear / SSM mixers keep a state, not K/V
        from attnlab.nn.ssm import RecurrentCache

        if kind not in ("static", "dynamic", "recurrent"):
            raise ValueError(
                f"cache: a {model.cfg.mixer!r} mixer decodes from a recurrent state; cache={kind!r} "
                "holds keys and values (use 'static', 'dynamic' or 'recurrent')"
            )
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
        bs = options.get("block_size", 16)  # PagedCache.for_model's default
        if "n_blocks" not in options and "max_tokens" not in options and isinstance(bs, int) and bs >= 1:
            # every row holds whole blocks: batch_size * capacity tokens may be too few blocks
            options["n_blocks"] = batch_size * -(-capacity // bs)
        return C.PagedCache.for_model(model, **options)
    raise ValueError(f"cache: expected None, a Cache or one of {CACHES}, got {kind!r}")


def _check_stream_args(
    model,
    input_ids,
    attention_mask,
    max_new_tokens,
    sampling,
    stop_tokens,
    seed,
    pad_token_id,
    cache,
    cache_options,
    logits_out,
):
    """Every argument of :func:`stream` checked before anything runs."""
    max_new_tokens = nonneg_int(max_new_tokens, "max_new_tokens")
    if sampling is None:
        sampling = Sampling()
    elif not isinstance(sampling, Sampling):
        raise ValueError(f"sampling: expected None or a Sampling, got {type(sampling).__name__}")
    vocab = model_vocab(model)
    pad_token_id = token_id(pad_token_id, "pad_token_id", vocab)
    stops = stop_token_set(stop_tokens, vocab)
    rows, ids, keep = _prompts(input_ids, attention_mask, pad_token_id, vocab)
    seeds = row_seeds(seed, len(rows))
    if isinstance(cache, (bool, int, float)) or (isinstance(cache, str) and cache not in CACHES):
        raise ValueError(f"cache: expected None, a Cache or one of {CACHES}, got {cache!r}")
    if cache_options is not None and not isinstance(cache_options, dict):
        raise ValueError(f"cache_options: expected None or a dict, got {type(cache_options).__name__}")
    if logits_out is not None and not isinstance(logits_out, list):
        raise ValueError(f"logits_out: expected None or a list, got {type(logits_out).__name__}")
    return (
        max_new_tokens,
        sampling,
        pad_token_id,
        stops,
        rows,
        ids,
        keep,
        seeds,
        _open_cache(cache, model, ids, keep, max_new_tokens, cache_options),
    )


def _open_cache(cache, model, ids, keep, max_new_tokens, cache_options):
    """The cache for this call; refused where left padding would leak into a row."""
    from attnlab.cache import QuantizedCache

    (B, P), ragged = ids.shape, not bool(keep.all())
    c = make_cache(cache, model, B, P + max_new_tokens, **(cache_options or {}))
    if c is not None and getattr(c, "rotates_keys", False) and ragged:
        raise ValueError(
            "cache='streaming' keeps positions in the cache and cannot serve left-padded prompts; "
            "generate them one at a time"
        )
    if isinstance(c, QuantizedCache) and ragged:
        raise ValueError(
            "cache='quantized' quantizes keys in groups of tokens along the padded batch, so with "
            "left-padded prompts a row's quantization error would depend on the other rows' "
            "lengths; generate prompts of different lengths one at a time, or use cache='paged'"
        )
    return c


def stream(
    model,
    input_ids,
    *,
    max_new_tokens: int,
    cache="static",
    attention_mask=None,
    sampling: Sampling | None = None,
    stop_tokens=(),
    seed=None,
    pad_token_id: int = 0,
    cache_options: dict | None = None,
    logits_out: list | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, ``(B,)``, as soon as it is chosen (rows that
    have stopped yield ``pad_token_id``).  Same arguments as :func:`generate`."""
    max_new_tokens, sampling, pad_token_id, stops_set, rows, ids, keep, seeds, c = _check_stream_args(
        model,
        input_ids,
        attention_mask,
        max_new_tokens,
        sampling,
        stop_tokens,
        seed,
        pad_token_id,
        cache,
        cache_options,
        logits_out,
    )
    return _stream(model, rows, ids, keep, max_new_tokens, c, sampling, stops_set, seeds, pad_token_id, logits_out)


@torch.no_grad()
def _stream(model, rows, ids, keep, max_new_tokens, c, sampling, stops_set, seeds, pad_token_id, logits_out):
    stops = torch.tensor(sorted(stops_set), dtype=torch.long)
    B, P = ids.shape
    ragged = not bool(keep.all())
    gen = None if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]  # one per row
    pos = (keep.long().cumsum(1) - 1).clamp(min=0)
    if hasattr(c, "select_batch"):  # paged: one sequence per row, prefilled one at a time, no padding
        step_logits = c.prefill(model, rows)
    elif getattr(c, "rotates_keys", False) and P > c.capacity + 1 - c.length:
        # a streaming cache takes a chunk only while it fits; then one token at a time
        first = max(1, c.capacity + 1 - c.length)
        step_logits = model(ids[:, :first], cache=c).logits[:, -1]
        for t in range(first, P):
            step_logits = model(ids[:, t : t + 1], cache=c).logits[:, -1]
    else:
        kw = {} if not ragged else {"attention_mask": keep, "pos": pos}
        step_logits = model(ids, cache=c, **kw).logits[:, -1]
    # the tokens each row has seen, -1 for padding (and after a row stopped): never a token
    context = ids.masked_fill(~keep, -1)
    penalise = sampling.repetition_penalty != 1
    finished = torch.zeros(B, dtype=torch.bool)
    seqs, mask_all, last_pos = ids, keep, pos[:, -1]
    for step in range(max_new_tokens):
        if logits_out is not None:
            logits_out.append(step_logits.float())
        nxt = sampling.choose(step_logits, context if penalise else None, gen)
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


def generate(
    model,
    input_ids,
    *,
    max_new_tokens: int,
    cache="static",
    attention_mask=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    stop_tokens=(),
    seed=None,
    pad_token_id: int = 0,
    cache_options: dict | None = None,
    on_token: Callable | None = None,
    output_logits: bool = False,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    A row's tokens never depend on the other rows of the batch: padding is hidden from
    attention, has its own positions, and never enters the repetition penalty, the stop
    checks or the filters; with a ``seed`` every row samples from its own generator.

    Args:
        model: an :class:`attnlab.nn.Decoder` (anything with ``cfg`` and
            ``(ids, cache=, attention_mask=, pos=) -> .logits``).
        input_ids: ``(B, N)`` integer tensor (with ``attention_mask`` marking real tokens,
            any padding side) or a list of token lists of different lengths.  Token ids
            are integers in ``[0, vocab_size)``; floats, bools and complex are refused.
        cache: ``"static"`` (default), ``"dynamic"``, ``"paged"``, ``"quantized"`` (prompts
            of one length), ``"streaming"`` (one length), a :class:`attnlab.cache.Cache`
            object, or ``None`` (no cache: the whole prefix is recomputed each step — the
            reference).
        temperature, top_k, top_p, repetition_penalty: see :class:`Sampling`
            (``temperature=0``: greedy).
        stop_tokens: a token id or ids; a row stops after producing one of these.
        seed: makes sampling reproducible.  One int ``s``: row ``i`` samples from its own
            ``torch.Generator`` seeded with :func:`row_seed` ``(s, i)``.  A list of one int
            per row (vLLM's per-request seed): row ``i`` uses ``seed[i]`` itself, so a
            prompt generated with ``seed=[s]`` alone gives the same tokens as in any batch
            where its seed is ``s``.  ``None``: torch's global RNG (rows then share it).
        pad_token_id: what :func:`stream` yields for rows that have stopped, and the
            (masked) filler of left padding; must be in the vocabulary.
        on_token: called with ``(step, tokens (B,))`` as each token is chosen (streaming).
        output_logits: keep every step's raw logits in ``Generation.logits``.

    Bad arguments raise ``ValueError`` naming the argument before the model runs.
    """
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty)
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token: expected None or a callable (step, tokens), got {type(on_token).__name__}")
    if not isinstance(output_logits, bool):
        raise ValueError(f"output_logits: expected a bool, got {output_logits!r}")
    logits: list[torch.Tensor] | None = [] if output_logits else None
    max_new_tokens, sampling, pad_token_id, stops, rows, ids, keep, seeds, c = _check_stream_args(
        model,
        input_ids,
        attention_mask,
        max_new_tokens,
        sampling,
        stop_tokens,
        seed,
        pad_token_id,
        cache,
        cache_options,
        logits,
    )
    new: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    for step, tok in enumerate(
        _stream(model, rows, ids, keep, max_new_tokens, c, sampling, stops, seeds, pad_token_id, logits)
    ):
        if on_token is not None:
            on_token(step, tok)
        for i, t in enumerate(tok.tolist()):
            if not done[i]:
                new[i].append(t)
                done[i] = t in stops
    return Generation([r + n for r, n in zip(rows, new, strict=True)], new, done, logits or [])
