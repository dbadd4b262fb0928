"""TokenStream, repeated_sequences, associative_recall (attnlab.train.data)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from attnlab.train.data import IGNORE_INDEX, TokenStream, associative_recall, repeated_sequences
from attnlab.train.tokenizer import ByteTokenizer


def take(gen, n):
    return list(itertools.islice(gen, n))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def check_batch(x, y, batch_size, seq_len):
    assert x.shape == y.shape == (batch_size, seq_len)
    assert x.dtype == y.dtype == torch.int64


# -- TokenStream ------------------------------------------------------------------------


def test_token_stream_windows_are_shifted_slices():
    s = TokenStream(torch.arange(1000, dtype=torch.int32))
    assert len(s) == 1000 and s.tokens.dtype == torch.int64
    for x, y in take(s.batches(8, 33, seed=5), 5):
        check_batch(x, y, 8, 33)
        assert torch.equal(y, x + 1)  # next token
        assert torch.equal(x, x[:, :1] + torch.arange(33))  # contiguous windows
        assert int(x.min()) >= 0 and int(y.max()) <= 999


def test_token_stream_reaches_both_ends():
    s = TokenStream(torch.arange(6))
    starts = torch.cat([x[:, 0] for x, _ in take(s.batches(16, 4, seed=0), 10)])
    assert set(starts.tolist()) == {0, 1}  # windows of 5 tokens in 6: starts 0 and 1 only


def test_token_stream_determinism():
    s = TokenStream(torch.randint(0, 50, (500,), generator=torch.Generator().manual_seed(0)))
    a = take(s.batches(4, 16, seed=1), 3)
    torch.manual_seed(123)  # the global RNG does not matter
    torch.rand(10)
    assert_same_batches(a, take(s.batches(4, 16, seed=1), 3))
    c = take(s.batches(4, 16, seed=2), 3)
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c, strict=True))


def test_from_texts_joins_documents_with_eot():
    tok = ByteTokenizer()
    s = TokenStream.from_texts(["hi", "", "é"], tok)
    assert s.tokens.tolist() == [104, 105, 256, 256, 195, 169, 256]
    with pytest.raises(TypeError, match="single str"):
        TokenStream.from_texts("hi", tok)


def test_split_by_position():
    s = TokenStream(torch.arange(10))
    train, val = s.split(0.8)
    assert train.tokens.tolist() == list(range(8)) and val.tokens.tolist() == [8, 9]
    for bad in (0, 1, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="fraction"):
            s.split(bad)
    with pytest.raises(ValueError, match="each needs >= 2"):
        s.split(0.95)


def test_eval_batches_cover_the_stream_once():
    s = TokenStream(torch.arange(101))
    xs = [x for x, _ in s.eval_batches(3, 10)]
    assert [x.shape for x in xs] == [(3, 10), (3, 10), (3, 10), (1, 10)]
    assert torch.equal(torch.cat(xs).flatten(), torch.arange(100))
    assert all(torch.equal(y, x + 1) for x, y in s.eval_batches(3, 10))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TokenStream(torch.zeros(2, 3, dtype=torch.long)), "1-D"),
        (lambda: TokenStream(torch.zeros(5)), "integer dtype"),
        (lambda: TokenStream(torch.tensor([1, -2, 3])), ">= 0"),
        (lambda: TokenStream(torch.arange(10)).batches(2, 10, seed=0), "seq_len=10"),
        (lambda: TokenStream(torch.arange(10)).batches(0, 4, seed=0), "batch_size"),
        (lambda: TokenStream(torch.arange(10)).batches(2, 0, seed=0), "seq_len"),
        (lambda: TokenStream(torch.arange(10)).eval_batches(2, 10), "seq_len"),
    ],
)
def test_token_stream_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()  # raised on the call itself, not at the first next()


def test_token_stream_type_errors():
    with pytest.raises(TypeError, match="tokens"):
        TokenStream([1, 2, 3])
    with pytest.raises(TypeError, match="seed"):
        TokenStream(torch.arange(10)).batches(2, 4, seed=None)


# -- repeated_sequences ---------------------------------------------------------------


def check_repeated(x, y, vocab_size, batch_size, seq_len, P, distinct=True):
    check_batch(x, y, batch_size, seq_len)
    assert int(x.min()) >= 0 and int(x.max()) < vocab_size
    # inputs are periodic with period P (the second half is a copy of the first)
    t = torch.arange(seq_len)
    assert torch.equal(x, x[:, t % P])
    # first P targets ignored, then the next token
    assert (y[:, :P] == IGNORE_INDEX).all()
    assert torch.equal(y[:, P:-1], x[:, P + 1 :])
    assert torch.equal(y[:, -1], x[:, seq_len % P])  # s[seq_len] = r[seq_len mod P]
    if distinct:
        assert all(len(set(row)) == P for row in x[:, :P].tolist())


def test_repeated_sequences_even():
    for x, y in take(repeated_sequences(100, 4, 20, seed=0), 3):
        check_repeated(x, y, 100, 4, 20, 10)
        assert torch.equal(x[:, :10], x[:, 10:])  # second half == first half
        assert (y[:, :10] == -100).all() and (y[:, 10:] != -100).all()


def test_repeated_sequences_odd():
    x, y = next(repeated_sequences(100, 4, 21, seed=0))
    check_repeated(x, y, 100, 4, 21, 10)
    assert torch.equal(x[:, :10], x[:, 10:20]) and torch.equal(x[:, 20], x[:, 0])
    assert int((y != -100).sum(dim=1).min()) == 11


def test_repeated_sequences_prefix_len_and_replacement():
    x, y = next(repeated_sequences(5, 3, 12, seed=1, prefix_len=3))
    check_repeated(x, y, 5, 3, 12, 3)
    # with replacement, the prefix may exceed the vocabulary
    x, y = next(repeated_sequences(4, 3, 20, seed=1, prefix_len=8, distinct=False))
    check_repeated(x, y, 4, 3, 20, 8, distinct=False)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    vocab=st.integers(2, 40),
    batch=st.integers(1, 4),
    seq_len=st.integers(2, 40),
    prefix=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    distinct=st.booleans(),
)
def test_repeated_sequences_property(vocab, batch, seq_len, prefix, seed, distinct):
    P = min(prefix, seq_len - 1, vocab if distinct else seq_len)
    x, y = next(repeated_sequences(vocab, batch, seq_len, seed=seed, prefix_len=P, distinct=distinct))
    check_repeated(x, y, vocab, batch, seq_len, P, distinct)


def test_repeated_sequences_determinism():
    a = take(repeated_sequences(50, 3, 16, seed=7), 4)
    torch.manual_seed(0)
    assert_same_batches(a, take(repeated_sequences(50, 3, 16, seed=7), 4))
    assert not torch.equal(a[0][0], a[1][0])  # successive batches differ
    b = take(repeated_sequences(50, 3, 16, seed=8), 1)
    assert not torch.equal(a[0][0], b[0][0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab_size=10, batch_size=2, seq_len=1), "seq_len"),
        (dict(vocab_size=0, batch_size=2, seq_len=8), "vocab_size"),
        (dict(vocab_size=10, batch_size=0, seq_len=8), "batch_size"),
        (dict(vocab_size=10, batch_size=2, seq_len=8, prefix_len=8), "prefix_len"),
        (dict(vocab_size=10, batch_size=2, seq_len=8, prefix_len=0), "prefix_len"),
        (dict(vocab_size=3, batch_size=2, seq_len=8), "prefix_len=4 distinct tokens.*vocab_size=3"),
    ],
)
def test_repeated_sequences_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        repeated_sequences(**kwargs, seed=0)


# -- associative_recall ---------------------------------------------------------------


def test_associative_recall_layout():
    V, B, n = 41, 16, 6
    K = (V - 1) // 2
    for x, y in take(associative_recall(V, B, n, seed=0), 3):
        check_batch(x, y, B, 2 * n + 2)
        keys, values = x[:, 0 : 2 * n : 2], x[:, 1 : 2 * n : 2]
        assert ((keys >= 0) & (keys < K)).all()
        assert ((values >= K) & (values < V - 1)).all()
        assert all(len(set(row)) == n for row in keys.tolist())  # distinct keys
        assert (x[:, 2 * n] == V - 1).all()  # query token
        q = x[:, -1]
        assert ((keys == q[:, None]).sum(dim=1) == 1).all()  # the queried key is in the context
        assert torch.equal(y[:, -1], values[keys == q[:, None]])  # its value is the target
        assert (y[:, :-1] == IGNORE_INDEX).all()


def test_associative_recall_smallest_vocab_and_queries_vary():
    x, _y = next(associative_recall(2 * 3 + 1, 64, 3, seed=0))  # exactly enough ids
    assert set(x[:, 1:6:2].flatten().tolist()) == {3, 4, 5}  # 3 keys (0-2), 3 values (3-5), query 6
    assert set(x[:, -1].tolist()) <= {0, 1, 2}
    assert len(set(x[:, -1].tolist())) == 3  # every pair gets queried over 64 rows


def test_associative_recall_determinism():
    a = take(associative_recall(30, 4, 5, seed=3), 3)
    torch.manual_seed(99)
    assert_same_batches(a, take(associative_recall(30, 4, 5, seed=3), 3))
    assert not torch.equal(a[0][0], next(associative_recall(30, 4, 5, seed=4))[0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab_size=6, batch_size=2, n_pairs=3), "vocab_size=6.*vocab_size >= 7"),
        (dict(vocab_size=20, batch_size=2, n_pairs=0), "n_pairs"),
        (dict(vocab_size=20, batch_size=0, n_pairs=2), "batch_size"),
    ],
)
def test_associative_recall_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        associative_recall(**kwargs, seed=0)


# -- the ignore index works with the loss ---------------------------------------------


def test_cross_entropy_scores_only_unignored_targets():
    _x, y = next(repeated_sequences(30, 2, 12, seed=0))
    logits = torch.randn(2, 12, 30, generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    keep = y != IGNORE_INDEX
    manual = F.cross_entropy(logits[keep], y[keep])
    assert torch.allclose(loss, manual)
