"""Tokenizers for the training experiments: a byte-level BPE written from scratch.

Two tokenizers share one interface (:class:`Tokenizer`): ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``encode_batch``, ``vocab_size`` and ``eot_id``.

* :class:`ByteTokenizer` — ids 0..255 are the UTF-8 bytes, id 256 is ``<|endoftext|>``.
* :class:`ByteBPE` — byte-level BPE learned GPT-2 style.  The base vocabulary is the
  256 bytes (so every string round-trips, whatever it contains); merge ``r`` (0-based
  rank) creates token id ``256 + r``; ``<|endoftext|>`` is the last id,
  ``eot_id == vocab_size - 1``.

Training (:meth:`ByteBPE.train`) splits each text into chunks with a regex (:data:`PATTERN`:
contractions, words with an optional leading space, digit runs, punctuation runs,
whitespace), counts the unique chunks, and learns merges on the unique chunks only,
weighting each by its frequency.  Merges never cross a chunk boundary.  Pair counts are
updated incrementally: a merge only revisits the chunks that contain its pair, and the
best pair comes from a lazy max-heap.  Ties between equally frequent pairs go to the
smallest ``(left id, right id)``, so training is deterministic.

Encoding splits the text with the same regex, and encodes each chunk by repeatedly
merging its lowest-ranked adjacent pair (the same result as replaying the merges in
order); chunk encodings are cached.

:func:`stdlib_corpus` gives a deterministic training text that every machine has: the
Python standard library's own source.

>>> bpe = ByteBPE.train(["low lower lowest"] * 10 + ["newer newest"] * 5, vocab_size=270)
>>> ids = bpe.encode("lowest newer")
>>> len(ids) < len("lowest newer".encode())       # merges compress
True
>>> bpe.decode(ids)
'lowest newer'
>>> bpe.eot_id == bpe.vocab_size - 1 == 269
True
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import random
import re
import sysconfig
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from attnlab.validate import int_in, integer, nonneg_int

__all__ = ["PATTERN", "EOT", "Tokenizer", "ByteTokenizer", "ByteBPE", "stdlib_corpus"]

#: The special end-of-text token (documents are joined with it).
EOT = "<|endoftext|>"

#: The pre-tokenization regex (GPT-2's, restated for Python's ``re``, which has no
#: ``\p{L}``): contractions; letters with an optional leading space (``[^\W\d_]`` is
#: "word character but not digit or underscore", i.e. letters); digit runs; runs of
#: anything else that is not whitespace (punctuation, and the underscore, as in GPT-2);
#: whitespace not followed by non-space (so a single space stays attached to the next
#: word); remaining whitespace.  Every character falls in one class, so the chunks
#: always concatenate back to the text.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""

_FORMAT = "attnlab.ByteBPE"
_VERSION = 1
_CACHE_LIMIT = 1 << 18  # chunk encodings kept; the cache is cleared when it is full


@runtime_checkable
class Tokenizer(Protocol):
    """What the data sources need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eot_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _utf8(text: str, what: str = "text") -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} contains a lone surrogate {text[e.start]!r} at index {e.start}, which has no "
            "UTF-8 encoding; pass valid Unicode (e.g. s.encode('utf-8', 'replace').decode())"
        ) from None


def _as_id_list(ids) -> list[int]:
    if hasattr(ids, "tolist"):  # torch / numpy
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
    return list(ids)


def _chunks(pat: re.Pattern, text: str) -> list[str]:
    """The regex's matches, plus any text between them as chunks of its own, so the
    chunks always concatenate back to ``text`` (also for a custom pattern that does
    not cover every character)."""
    chunks = pat.findall(text)
    if sum(map(len, chunks)) == len(text):
        return chunks
    out, pos = [], 0
    for m in pat.finditer(text):
        if m.start() > pos:
            out.append(text[pos : m.start()])
        if m.end() > m.start():
            out.append(m.group())
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


def _split_special(text: str, allow_special: bool) -> list[tuple[str, bool]]:
    """[(piece, is_eot)] — the text cut at ``<|endoftext|>`` when that is allowed."""
    if not allow_special or EOT not in text:
        return [(text, False)]
    out: list[tuple[str, bool]] = []
    for i, piece in enumerate(text.split(EOT)):
        if i:
            out.append((EOT, True))
        if piece:
            out.append((piece, False))
    return out


class _Base:
    """Shared decode / batch logic over a table ``id -> bytes``."""

    _bytes: list[bytes]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special token included."""
        return len(self._bytes) + 1

    @property
    def eot_id(self) -> int:
        """Id of ``<|endoftext|>`` (the last id)."""
        return len(self._bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (``b'<|endoftext|>'`` for the special token)."""
        int_in(token_id, "token_id", 0, self.vocab_size)
        return EOT.encode() if token_id == self.eot_id else self._bytes[token_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (list, tuple, or a 1-D tensor / array).

        Bytes that do not form complete UTF-8 (a sequence cut inside a character) are
        decoded with ``errors="replace"``; the EOT id decodes to ``<|endoftext|>``.
        """
        ids = _as_id_list(ids)
        table, eot = self._bytes, self.eot_id
        try:
            if ids and (min(ids) < 0 or max(ids) > eot):
                raise IndexError
            parts = [EOT.encode() if i == eot else table[i] for i in ids]
        except (IndexError, TypeError):
            bad = next((i for i in ids if not isinstance(i, int) or not 0 <= i <= eot), None)
            raise ValueError(
                f"ids must be ints in [0, {self.vocab_size}) (vocab_size={self.vocab_size}); got {bad!r}"
            ) from None
        return b"".join(parts).decode("utf-8", errors="replace")

    def to_str_tokens(self, text_or_ids, *, allow_special: bool = True) -> list:
        """One display string per token (TransformerLens' ``to_str_tokens``): the token's
        bytes as UTF-8, bytes that are not complete UTF-8 on their own shown as ``\\xNN``
        escapes, the special token as ``<|endoftext|>``.

        ``text_or_ids``: a ``str`` (encoded with ``allow_special``, so ``<|endoftext|>`` in
        the text is the special token by default), a sequence of ids, or an integer tensor
        ``(N,)``; ``(B, N)`` gives one list per row.

        >>> ByteTokenizer().to_str_tokens("hé<|endoftext|>")
        ['h', '\\\\xc3', '\\\\xa9', '<|endoftext|>']
        """
        if isinstance(text_or_ids, str):
            ids = self.encode(text_or_ids, allow_special=allow_special)
        elif hasattr(text_or_ids, "dim") and text_or_ids.dim() == 2:
            return [self.to_str_tokens(row) for row in text_or_ids]
        else:
            ids = _as_id_list(text_or_ids)
        eot = self.eot_id
        bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= eot), None)
        if bad is not None:
            raise ValueError(f"text_or_ids: ids must be ints in [0, {self.vocab_size}); got {bad!r}")
        return [EOT if i == eot else self._bytes[i].decode("utf-8", errors="backslashreplace") for i in ids]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def encode_batch(self, texts: Iterable[str], *, allow_special: bool = False) -> list[list[int]]:
        """``[encode(t) for t in texts]``."""
        if isinstance(texts, str):
            raise TypeError("texts must be an iterable of str, not a single str; use encode()")
        return [self.encode(t, allow_special=allow_special) for t in texts]


class ByteTokenizer(_Base):
    """The trivial byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256 is ``<|endoftext|>``.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode([104, 195, 169, tok.eot_id])
    'hé<|endoftext|>'
    >>> tok.vocab_size, tok.eot_id
    (257, 256)
    """

    def __init__(self) -> None:
        self._bytes = [bytes([i]) for i in range(256)]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """UTF-8 bytes of ``text``.  ``<|endoftext|>`` in the text is plain text unless
        ``allow_special=True``, which maps it to :attr:`eot_id`."""
        out: list[int] = []
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        for piece, special in _split_special(text, allow_special):
            if special:
                out.append(self.eot_id)
            else:
                out.extend(_utf8(piece))
        return out

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257)"


class ByteBPE(_Base):
    """Byte-level BPE tokenizer.

    ``ByteBPE(merges)`` builds one from a list of merges ``(left_id, right_id)``; merge
    ``r`` creates id ``256 + r``, so each pair may only use ids below ``256 + r``.  Use
    :meth:`train` to learn the merges and :meth:`save` / :meth:`load` to keep them.

    ``vocab_size = 256 + len(merges) + 1``; ``eot_id = vocab_size - 1``.

    >>> bpe = ByteBPE([(ord("a"), ord("b")), (256, ord("c"))])   # "ab" -> 256, "abc" -> 257
    >>> bpe.encode("abc ab")
    [257, 32, 256]
    >>> bpe.vocab_size, bpe.eot_id, bpe.token_bytes(257)
    (259, 258, b'abc')
    """

    def __init__(self, merges: Sequence[tuple[int, int]], *, pattern: str = PATTERN) -> None:
        ranks: dict[tuple[int, int], int] = {}
        table = [bytes([i]) for i in range(256)]
        for r, pair in enumerate(merges):
            if (
                not isinstance(pair, (tuple, list))
                or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
            ):
                raise ValueError(f"merges[{r}] must be a pair of ints, got {pair!r}")
            a, b = pair
            new = 256 + r
            if not (0 <= a < new and 0 <= b < new):
                raise ValueError(
                    f"merges[{r}] = {list(pair)} uses an id outside [0, {new}): merge {r} creates id "
                    f"{new} and may only combine ids created before it"
                )
            if (a, b) in ranks:
                raise ValueError(f"merges[{r}] = {list(pair)} repeats merges[{ranks[(a, b)] - 256}]")
            ranks[(a, b)] = new
            table.append(table[a] + table[b])
        try:
            self._pat = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"pattern is not a valid regular expression: {e}") from None
        if self._pat.groups:
            raise ValueError(f"pattern must have no capturing groups (use (?:...)), got {pattern!r}")
        self.pattern = pattern
        self.merges: list[tuple[int, int]] = [(int(a), int(b)) for a, b in merges]
        self._ranks = ranks
        self._bytes = table
        self._cache: dict[str, tuple[int, ...]] = {}

    # -- training ------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, progress: bool = False, pattern: str = PATTERN) -> ByteBPE:
        """Learn ``vocab_size - 257`` merges from ``texts``.

        ``vocab_size`` counts the 256 bytes, the merges and ``<|endoftext|>`` (the last id).
        When the corpus runs out of pairs (every chunk already one token) training stops
        early and the tokenizer's ``vocab_size`` is smaller than asked.  ``progress=True``
        shows a tqdm bar over the merges (rate and ETA) on stderr.

        >>> bpe = ByteBPE.train(["the cat sat on the mat"] * 3, vocab_size=260)
        >>> [bpe.token_bytes(i) for i in range(256, 259)]
        [b'at', b'he', b'the']
        """
        if isinstance(texts, str):
            raise TypeError("texts must be an iterable of str (documents), not a single str; wrap it in a list")
        integer(vocab_size, "vocab_size", lo=257, hint="256 bytes + <|endoftext|>")
        pat = cls([], pattern=pattern)._pat  # validates the pattern
        counts: Counter[str] = Counter()
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
            counts.update(_chunks(pat, t))
        chunks: dict[bytes, int] = {}
        for chunk, c in counts.items():
            b = _utf8(chunk, "texts")
            if len(b) >= 2:  # single bytes have no pairs to merge
                chunks[b] = chunks.get(b, 0) + c
        merges = _learn_merges(chunks, vocab_size - 257, progress)
        return cls(merges, pattern=pattern)

    # -- encoding ------------------------------------------------------------------
    def _encode_chunk(self, chunk: str) -> tuple[int, ...]:
        ids = list(chunk.encode("utf-8"))
        ranks = self._ranks
        while len(ids) >= 2:
            best = None
            best_new = 1 << 62
            for pair in itertools.pairwise(ids):
                new = ranks.get(pair)
                if new is not None and new < best_new:
                    best, best_new = pair, new
            if best is None:
                break
            ids = _merge_word(ids, best[0], best[1], best_new)
        return tuple(ids)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``decode(encode(text)) == text`` for every valid str.

        ``<|endoftext|>`` inside the text is encoded as plain text (so user text cannot
        inject the control token) unless ``allow_special=True``, which maps it to
        :attr:`eot_id`.  A str with a lone surrogate (no UTF-8 form) raises ValueError.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        out: list[int] = []
        cache = self._cache
        for piece, special in _split_special(text, allow_special):
            if special:
                out.append(self.eot_id)
                continue
            for chunk in _chunks(self._pat, piece):
                ids = cache.get(chunk)
                if ids is None:
                    try:
                        ids = self._encode_chunk(chunk)
                    except UnicodeEncodeError:
                        _utf8(text)  # raises the ValueError naming the position
                        raise
                    if len(cache) >= _CACHE_LIMIT:
                        cache.clear()
                    cache[chunk] = ids
                out.extend(ids)
        return out

    # -- files ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "vocab_size": self.vocab_size,
            "pattern": self.pattern,
            "special_tokens": {EOT: self.eot_id},
            "merges": [list(m) for m in self.merges],
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as JSON (format, version, vocab_size, pattern, special_tokens, merges).

        >>> import tempfile, os
        >>> bpe = ByteBPE([(104, 105)])
        >>> with tempfile.TemporaryDirectory() as d:
        ...     bpe.save(os.path.join(d, "tok.json"))
        ...     ByteBPE.load(os.path.join(d, "tok.json")).merges == bpe.merges
        True
        """
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d, *, source: str = "tokenizer data") -> ByteBPE:
        """Build from :meth:`to_dict`'s output, checking every field (ValueError naming it)."""

        def bad(msg: str) -> ValueError:
            return ValueError(f"{source}: {msg}")

        if not isinstance(d, dict):
            raise bad(f"expected a JSON object, got {type(d).__name__}")
        for key in ("format", "version", "merges", "special_tokens"):
            if key not in d:
                raise bad(f"missing field {key!r}")
        if d["format"] != _FORMAT:
            raise bad(f"field 'format' is {d['format']!r}, expected {_FORMAT!r}")
        if d["version"] != _VERSION or isinstance(d["version"], bool):
            raise bad(f"field 'version' is {d['version']!r}; this attnlab reads version {_VERSION}")
        merges = d["merges"]
        if not isinstance(merges, list):
            raise bad(f"field 'merges' must be a list of [left_id, right_id] pairs, got {type(merges).__name__}")
        pattern = d.get("pattern", PATTERN)
        if not isinstance(pattern, str):
            raise bad(f"field 'pattern' must be a str, got {type(pattern).__name__}")
        try:
            tok = cls([tuple(m) if isinstance(m, list) else m for m in merges], pattern=pattern)
        except ValueError as e:
            raise bad(f"field {e!s}") from None
        specials = d["special_tokens"]
        if specials != {EOT: tok.eot_id}:
            raise bad(
                f"field 'special_tokens' is {specials!r}, expected {{{EOT!r}: {tok.eot_id}}} "
                f"(the id after the {len(merges)} merges)"
            )
        if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
            raise bad(f"field 'vocab_size' is {d['vocab_size']!r} but {len(merges)} merges give {tok.vocab_size}")
        return tok

    @classmethod
    def load(cls, path: str | os.PathLike) -> ByteBPE:
        """Read a file written by :meth:`save`; a malformed file raises ValueError saying what is wrong."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e})") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(path))

    def __eq__(self, other) -> bool:
        return isinstance(other, ByteBPE) and self.merges == other.merges and self.pattern == other.pattern

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ByteBPE(vocab_size={self.vocab_size}, merges={len(self.merges)})"


def _merge_word(w: list[int], a: int, b: int, new: int) -> list[int]:
    out = []
    i, n = 0, len(w)
    while i < n:
        if i < n - 1 and w[i] == a and w[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(w[i])
            i += 1
    return out


def _learn_merges(chunks: dict[bytes, int], n_merges: int, progress: bool) -> list[tuple[int, int]]:
    """BPE on unique chunks (bytes -> frequency) with incremental pair counts."""
    from tqdm import tqdm

    words = [list(b) for b in chunks]
    freqs = list(chunks.values())
    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for i, w in enumerate(words):
        f = freqs[i]
        for p in itertools.pairwise(w):
            pair_counts[p] = pair_counts.get(p, 0) + f
            s = where.get(p)
            if s is None:
                where[p] = {i}
            else:
                s.add(i)
    # Max-heap by count, ties to the smallest pair; stale entries are skipped on pop.
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[int, int]] = []
    bar = tqdm(total=n_merges, desc="BPE merges", unit="merge", disable=not progress)
    try:
        while len(merges) < n_merges and heap:
            negc, p = heapq.heappop(heap)
            if pair_counts.get(p, 0) != -negc:
                continue
            a, b = p
            new = 256 + len(merges)
            merges.append(p)
            delta: dict[tuple[int, int], int] = {}
            for i in where.pop(p, ()):
                w = words[i]
                nw = _merge_word(w, a, b, new)
                if len(nw) == len(w):
                    continue  # stale index: the pair left this word in an earlier merge
                f = freqs[i]
                for q in itertools.pairwise(w):
                    delta[q] = delta.get(q, 0) - f
                for q in itertools.pairwise(nw):
                    delta[q] = delta.get(q, 0) + f
                    s = where.get(q)
                    if s is None:
                        where[q] = {i}
                    else:
                        s.add(i)
                words[i] = nw
            for q, d in delta.items():
                if d == 0:
                    continue
                c = pair_counts.get(q, 0) + d
                if c > 0:
                    pair_counts[q] = c
                    heapq.heappush(heap, (-c, q))
                else:
                    pair_counts.pop(q, None)
                    where.pop(q, None)
            bar.update(1)
    finally:
        bar.close()
    return merges


# -- the corpus every machine has ---------------------------------------------------
_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})


def _stdlib_files(root: str) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        out.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int = 2_000_000, *, seed: int = 0) -> list[str]:
    """Source texts of the Python standard library, one str per ``.py`` file.

    The files under ``sysconfig.get_paths()["stdlib"]`` (skipping ``test``, ``tests``,
    ``idlelib``, ``site-packages`` and ``__pycache__`` directories, and files that are
    not UTF-8), sorted by relative path and shuffled with ``random.Random(seed)``, are
    read in that order until their UTF-8 size reaches ``max_bytes``; the last text is
    cut so the total is ``max_bytes`` (a few bytes less when the cut falls inside a
    multi-byte character; less when the library is smaller).  Deterministic for a given seed and Python installation.

    >>> texts = stdlib_corpus(10_000, seed=1)
    >>> sum(len(t.encode()) for t in texts)
    10000
    >>> texts == stdlib_corpus(10_000, seed=1)
    True
    """
    nonneg_int(max_bytes, "max_bytes")
    root = sysconfig.get_paths()["stdlib"]
    files = _stdlib_files(root)
    random.Random(seed).shuffle(files)
    texts: list[str] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text:
            continue
        data = text.encode("utf-8", errors="surrogatepass")
        if total + len(data) > max_bytes:
            text = data[: max_bytes - total].decode("utf-8", errors="ignore")
            if text:
                texts.append(text)
            break
        texts.append(text)
        total += len(data)
    return texts
