"""Data sources for language-model training: a token stream and two synthetic tasks.

Every source yields ``(inputs, targets)``: two int64 tensors of shape
``(batch_size, seq_len)`` for next-token prediction, ``targets[:, t]`` being the token
that follows ``inputs[:, t]``.  A target of ``-100`` (:data:`IGNORE_INDEX`, the default
``ignore_index`` of ``torch.nn.functional.cross_entropy``) means "not scored"::

    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())   # -100 skipped

The generators are infinite and deterministic: each owns a ``torch.Generator`` seeded
with ``seed``, so the same arguments give the same batches, whatever else uses torch's
global RNG.  Arguments are checked when the function is called (not at the first
``next()``), and a bad one raises ValueError naming it.

* :class:`TokenStream` — random windows of a tokenized corpus.
* :func:`repeated_sequences` — the induction-head task: a random segment followed by
  its copy; only the copy is scored.
* :func:`associative_recall` — ``k1 v1 ... kn vn <query> ki``, scored on ``vi`` only.

>>> x, y = next(repeated_sequences(vocab_size=50, batch_size=2, seq_len=8, seed=0))
>>> x.shape, x.dtype
(torch.Size([2, 8]), torch.int64)
>>> torch.equal(x[:, :4], x[:, 4:])
True
>>> (y[:, :4] == -100).all().item(), torch.equal(y[:, 4:7], x[:, 5:])
(True, True)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from attnlab.validate import integer, real, rng_seed

if TYPE_CHECKING:  # pragma: no cover
    from attnlab.train.tokenizer import Tokenizer

__all__ = ["IGNORE_INDEX", "Batch", "TokenStream", "repeated_sequences", "associative_recall"]

#: Target value that the loss ignores (``F.cross_entropy``'s default ``ignore_index``).
IGNORE_INDEX = -100

Batch = tuple[torch.Tensor, torch.Tensor]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sample_distinct(rows: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``(rows, k)`` int64: per row, ``k`` distinct ids from ``[0, n)`` in uniformly random order
    (the indices of the ``k`` largest of ``n`` iid uniforms)."""
    return torch.rand(rows, n, generator=g).topk(k, dim=1).indices


class TokenStream:
    """A 1-D sequence of token ids, sampled as random windows of ``seq_len + 1`` tokens.

    ``tokens``: 1-D integer tensor (stored as int64, shape ``(N,)``); ``len(stream) == N``.

    >>> s = TokenStream(torch.arange(100))
    >>> train, val = s.split(0.9)
    >>> len(train), len(val)
    (90, 10)
    >>> x, y = next(train.batches(4, 16, seed=0))
    >>> x.shape, torch.equal(y, x + 1)            # targets are the inputs shifted by one
    (torch.Size([4, 16]), True)
    """

    def __init__(self, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D (N,), got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
        if tokens.numel() and int(tokens.min()) < 0:
            raise ValueError(f"tokens must be >= 0 (token ids), got min {int(tokens.min())}")
        self.tokens = tokens.detach().to(device="cpu", dtype=torch.long).contiguous()

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer: Tokenizer) -> TokenStream:
        """Tokenize each document and append ``tokenizer.eot_id`` after it:
        ``doc1 <eot> doc2 <eot> ...``.

        >>> from attnlab.train.tokenizer import ByteTokenizer
        >>> TokenStream.from_texts(["ab", "c"], ByteTokenizer()).tokens.tolist()
        [97, 98, 256, 99, 256]
        """
        if isinstance(texts, str):
            raise TypeError("texts must be an iterable of documents (str), not a single str; wrap it in a list")
        eot = tokenizer.eot_id
        ids: list[int] = []
        for text in texts:
            ids.extend(tokenizer.encode(text))
            ids.append(eot)
        return cls(torch.tensor(ids, dtype=torch.long))

    def __len__(self) -> int:
        return self.tokens.numel()

    def __repr__(self) -> str:
        return f"TokenStream({len(self)} tokens)"

    def split(self, fraction: float) -> tuple[TokenStream, TokenStream]:
        """``(train, val)`` by position: the first ``round(fraction * N)`` tokens, and the rest.

        ``fraction`` is the share of the training part, strictly between 0 and 1; both
        parts must keep at least 2 tokens (one input and its target).
        """
        real(fraction, "fraction", gt=0.0, lt=1.0, hint="the train share, strictly between 0 and 1")
        n = len(self)
        cut = round(fraction * n)
        if cut < 2 or n - cut < 2:
            raise ValueError(
                f"split({fraction}) of {n} tokens gives parts of {cut} and {n - cut} tokens; each needs >= 2"
            )
        return TokenStream(self.tokens[:cut]), TokenStream(self.tokens[cut:])

    def _check_window(self, batch_size: int, seq_len: int) -> None:
        integer(batch_size, "batch_size", lo=1)
        integer(seq_len, "seq_len", lo=1)
        if seq_len + 1 > len(self):
            raise ValueError(
                f"seq_len={seq_len} needs windows of seq_len + 1 = {seq_len + 1} tokens, but the stream has "
                f"{len(self)}; use seq_len <= {len(self) - 1}"
            )

    def batches(self, batch_size: int, seq_len: int, *, seed: int) -> Iterator[Batch]:
        """Infinite generator of ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64.

        Every row is an independent window ``tokens[s : s + seq_len + 1]`` with ``s``
        uniform in ``[0, N - seq_len - 1]``; ``inputs = window[:-1]``, ``targets = window[1:]``
        (no ignored positions).
        """
        self._check_window(batch_size, seq_len)
        rng_seed(seed)
        return self._batches(batch_size, seq_len, seed)

    def _batches(self, batch_size: int, seq_len: int, seed: int) -> Iterator[Batch]:
        g = _generator(seed)
        offsets = torch.arange(seq_len + 1)
        high = len(self) - seq_len  # starts in [0, high)
        while True:
            starts = torch.randint(0, high, (batch_size, 1), generator=g)
            w = self.tokens[starts + offsets]
            yield w[:, :-1], w[:, 1:]

    def eval_batches(self, batch_size: int, seq_len: int) -> Iterator[Batch]:
        """Finite, in-order batches of non-overlapping windows covering the stream once
        (for a validation loss).  Window ``i`` starts at ``i * seq_len``; a trailing piece
        shorter than ``seq_len + 1`` tokens is dropped, and the last batch may have fewer rows.

        >>> [x.shape[0] for x, _ in TokenStream(torch.arange(50)).eval_batches(2, 10)]
        [2, 2]
        """
        self._check_window(batch_size, seq_len)
        n_windows = (len(self) - 1) // seq_len
        offsets = torch.arange(seq_len + 1)

        def gen() -> Iterator[Batch]:
            for lo in range(0, n_windows, batch_size):
                starts = torch.arange(lo, min(lo + batch_size, n_windows)).unsqueeze(1) * seq_len
                w = self.tokens[starts + offsets]
                yield w[:, :-1], w[:, 1:]

        return gen()


def repeated_sequences(
    vocab_size: int, batch_size: int, seq_len: int, *, seed: int, prefix_len: int | None = None, distinct: bool = True
) -> Iterator[Batch]:
    """The induction-head task: a random segment of ``P = prefix_len`` tokens, repeated.

    Row ``b`` of the underlying sequence is ``s[t] = r[t mod P]`` for ``t`` in
    ``[0, seq_len]``, with ``r`` random tokens in ``[0, vocab_size)``; ``inputs = s[:-1]``
    and ``targets = s[1:]``, both ``(batch_size, seq_len)`` int64.  ``P`` defaults to
    ``seq_len // 2``, so for even ``seq_len`` the inputs are exactly ``r r`` (the second half
    a copy of the first); for odd ``seq_len`` one more token, ``r[0]``, ends the inputs.

    Targets at positions ``t < P`` are ``-100``: the next token is new, unpredictable.
    From ``t = P`` on, ``inputs[t]`` has occurred ``P`` positions earlier and the target
    is the token that followed it there — predictable by induction::

        seq_len = 6, P = 3:   inputs   a    b    c    a  b  c
                              targets  -100 -100 -100 b  c  a

    ``distinct=True`` draws the ``P`` tokens of a row without replacement (needs
    ``prefix_len <= vocab_size``) so every scored target is determined uniquely by the
    copy; ``distinct=False`` draws them independently.

    >>> x, y = next(repeated_sequences(10, 1, 7, seed=0))     # odd seq_len: P = 3
    >>> x[0, :3].tolist() == x[0, 3:6].tolist() and x[0, 6].item() == x[0, 0].item()
    True
    >>> (y[0] == -100).tolist()
    [True, True, True, False, False, False, False]
    """
    integer(vocab_size, "vocab_size", lo=1)
    integer(batch_size, "batch_size", lo=1)
    integer(seq_len, "seq_len", lo=2)
    rng_seed(seed)
    P = seq_len // 2 if prefix_len is None else prefix_len
    integer(P, "prefix_len", lo=1)
    if P >= seq_len:
        raise ValueError(f"prefix_len must be < seq_len={seq_len} so that some target is scored, got {P}")
    if distinct and P > vocab_size:
        raise ValueError(
            f"prefix_len={P} distinct tokens do not fit in vocab_size={vocab_size}; "
            "use a larger vocab_size, a smaller prefix_len, or distinct=False"
        )
    return _repeated(vocab_size, batch_size, seq_len, seed, P, bool(distinct))


def _repeated(vocab_size: int, batch_size: int, seq_len: int, seed: int, P: int, distinct: bool) -> Iterator[Batch]:
    g = _generator(seed)
    cycle = torch.arange(seq_len + 1) % P
    while True:
        if distinct:
            r = _sample_distinct(batch_size, vocab_size, P, g)
        else:
            r = torch.randint(0, vocab_size, (batch_size, P), generator=g)
        s = r[:, cycle]
        inputs = s[:, :-1]
        targets = s[:, 1:].clone()
        targets[:, :P] = IGNORE_INDEX
        yield inputs, targets


def associative_recall(vocab_size: int, batch_size: int, n_pairs: int, *, seed: int) -> Iterator[Batch]:
    """Associative recall: ``k1 v1 k2 v2 ... kn vn <query> ki``, predict ``vi``.

    Token ids: the query token is ``vocab_size - 1``; keys come from
    ``[0, K)`` and values from ``[K, vocab_size - 1)`` with ``K = (vocab_size - 1) // 2``
    (disjoint halves).  The ``n_pairs`` keys of a row are distinct; values are drawn
    independently (they may repeat); the queried pair ``i`` is uniform.

    ``inputs`` and ``targets`` are ``(batch_size, 2 * n_pairs + 2)`` int64; every target is
    ``-100`` except the last, which is ``vi``::

        inputs   k1   v1   k2   v2   Q    k2
        targets  -100 -100 -100 -100 -100 v2

    Needs ``n_pairs <= K`` (distinct keys), i.e. ``vocab_size >= 2 * n_pairs + 1``.

    >>> x, y = next(associative_recall(vocab_size=21, batch_size=3, n_pairs=4, seed=0))
    >>> x.shape, (x[:, -2] == 20).all().item(), (y[:, :-1] == -100).all().item()
    (torch.Size([3, 10]), True, True)
    >>> keys, values = x[:, 0:8:2], x[:, 1:8:2]
    >>> torch.equal(values[keys == x[:, -1:]], y[:, -1])   # the value stored with the queried key
    True
    """
    integer(vocab_size, "vocab_size", lo=1)
    integer(batch_size, "batch_size", lo=1)
    integer(n_pairs, "n_pairs", lo=1)
    rng_seed(seed)
    K = (vocab_size - 1) // 2
    if n_pairs > K:
        need = 2 * n_pairs + 1
        raise ValueError(
            f"vocab_size={vocab_size} leaves {K} key ids (keys and values take disjoint halves of "
            f"vocab_size - 1 ids, one id is the query token); n_pairs={n_pairs} distinct keys need "
            f"vocab_size >= {need}"
        )
    return _recall(vocab_size, batch_size, n_pairs, seed, K)


def _recall(vocab_size: int, batch_size: int, n: int, seed: int, K: int) -> Iterator[Batch]:
    g = _generator(seed)
    query = vocab_size - 1
    n_values = vocab_size - 1 - K
    rows = torch.arange(batch_size)
    while True:
        keys = _sample_distinct(batch_size, K, n, g)
        values = torch.randint(K, K + n_values, (batch_size, n), generator=g)
        which = torch.randint(0, n, (batch_size,), generator=g)
        s = torch.empty(batch_size, 2 * n + 3, dtype=torch.long)
        s[:, 0 : 2 * n : 2] = keys
        s[:, 1 : 2 * n : 2] = values
        s[:, 2 * n] = query
        s[:, 2 * n + 1] = keys[rows, which]
        s[:, 2 * n + 2] = values[rows, which]
        inputs = s[:, :-1]
        targets = torch.full_like(inputs, IGNORE_INDEX)
        targets[:, -1] = s[:, -1]
        yield inputs, targets
