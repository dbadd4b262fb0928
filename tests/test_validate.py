"""attnlab.validate's int_in / int_sequence / rng_seed / hints, and the callers that moved to them
(issue 14, "one set of validators"): one message shape, the argument's name, what would work."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

from attnlab import validate as V


def test_int_in_half_open_and_closed():
    assert V.int_in(0, "layer", 0, 3) == 0 and V.int_in(np.int64(2), "layer", 0, 3) == 2
    assert type(V.int_in(np.int64(2), "layer", 0, 3)) is int
    with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 3\), got 3$"):
        V.int_in(3, "layer", 0, 3)
    with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 3\), got -1$"):
        V.int_in(-1, "layer", 0, 3)
    assert V.int_in(3, "n", 0, 3, closed=True) == 3
    with pytest.raises(ValueError, match=r"^n: expected an int in \[0, 3\], got 4$"):
        V.int_in(4, "n", 0, 3, closed=True)


@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_int_in_refuses_non_ints_as_both_type_and_value_errors(bad):
    with pytest.raises(V.ArgumentTypeError, match=r"^k: expected an int in \[0, 5\)"):
        V.int_in(bad, "k", 0, 5)
    assert issubclass(V.ArgumentTypeError, TypeError) and issubclass(V.ArgumentTypeError, ValueError)
    with pytest.raises(TypeError, match=r"^k: ") as e:
        V.int_in(bad, "k", 0, 5, type_error=TypeError)
    assert type(e.value) is TypeError


def test_int_in_interval_text_and_note():
    with pytest.raises(ValueError, match=r"^w: expected an int in \[0, steps=4\] \(why\), got 5$"):
        V.int_in(5, "w", 0, 4, closed=True, interval="[0, steps=4]", note=" (why)")


def test_int_sequence():
    assert V.int_sequence([1, np.int32(2)], "b") == (1, 2)
    assert V.int_sequence(range(2, 4), "b", lo=2) == (2, 3)
    assert V.int_sequence((0,), "b", lo=0) == (0,)
    with pytest.raises(ValueError, match=r"^b\[1\]: expected an int >= 1, got 0$"):
        V.int_sequence([3, 0], "b")
    with pytest.raises(V.ArgumentTypeError, match=r"^b\[0\]: expected an int, got float 1.5"):
        V.int_sequence([1.5], "b")
    with pytest.raises(ValueError, match=r"^b: expected a non-empty sequence of ints >= 1, got an empty one$"):
        V.int_sequence([], "b")
    for bad in (3, "12", None):
        with pytest.raises(V.ArgumentTypeError, match=r"^b: expected a non-empty sequence of ints >= 1, got "):
            V.int_sequence(bad, "b")


def test_rng_seed_is_torch_generators_range():
    lo, hi = V.SEED_RANGE
    assert V.rng_seed(lo) == lo and V.rng_seed(hi - 1) == hi - 1
    for bad in (hi, lo - 1):
        with pytest.raises(ValueError, match=r"^seed: expected an int in \[-2\*\*63, 2\*\*64\) \(torch.Generator's"):
            V.rng_seed(bad)
    with pytest.raises(V.ArgumentTypeError, match=r"^s\[0\]: expected an int"):
        V.rng_seed(1.0, "s[0]")


def test_hints_end_every_message():
    with pytest.raises(ValueError, match=r"^t: must be > 0.0, got -1 \(seconds\)$"):
        V.real(-1, "t", gt=0.0, hint="seconds")
    with pytest.raises(V.ArgumentTypeError, match=r"^t: expected a number, got str 'x' \(seconds\)$"):
        V.real("x", "t", gt=0.0, hint="seconds")
    with pytest.raises(ValueError, match=r"^t: must be a finite number, got nan \(seconds\)$"):
        V.real(float("nan"), "t", hint="seconds")
    with pytest.raises(ValueError, match=r"^v: expected an int >= 257, got 3 \(why\)$"):
        V.integer(3, "v", lo=257, hint="why")
    with pytest.raises(V.ArgumentTypeError, match=r"^v: expected an int, got float 3.0 \(why\)$"):
        V.integer(3.0, "v", lo=257, hint="why")
    with pytest.raises(ValueError, match=r"^p: expected a probability in \[0, 1\), got 1.0 \(why\)$"):
        V.probability(1.0, "p", hint="why")
    # no hint: the messages are unchanged
    with pytest.raises(ValueError, match=r"^v: expected an int >= 1, got 0$"):
        V.integer(0, "v", lo=1)


# ----------------------------------------------------------------------------- the callers
def test_train_config_and_data_use_the_shared_validators():
    from attnlab.train import data
    from attnlab.train.loop import TrainConfig, lr_at

    ok = dict(steps=10, batch_size=1, seq_len=4)
    with pytest.raises(ValueError, match=r"^TrainConfig.steps: expected an int >= 1, got 0$"):
        TrainConfig(**{**ok, "steps": 0})
    with pytest.raises(ValueError, match=r"^TrainConfig.warmup_steps: expected an int in \[0, steps=10\], got 11$"):
        TrainConfig(**ok, warmup_steps=11)
    with pytest.raises(ValueError, match=r"^TrainConfig.min_lr_ratio: must be <= 1.0, got 1.5$"):
        TrainConfig(**ok, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match=r"^TrainConfig.betas\[1\]: must be < 1.0, got 1.0$"):
        TrainConfig(**ok, betas=(0.9, 1.0))
    with pytest.raises(TypeError, match=r"^TrainConfig.seed: expected an int in \[-2\*\*63, 2\*\*64\)"):
        TrainConfig(**ok, seed=1.0)
    assert TrainConfig(**ok, betas=(0, 0.5), min_lr_ratio=1).betas == (0.0, 0.5)
    with pytest.raises(ValueError, match=r"^step: expected an int >= 0, got -1$"):
        lr_at(-1, TrainConfig(**ok))
    with pytest.raises(ValueError, match=r"^seq_len: expected an int >= 2, got 1$"):
        next(data.repeated_sequences(10, 1, 1, seed=0))
    with pytest.raises(TypeError, match=r"^seed: expected an int"):
        next(data.repeated_sequences(10, 1, 7, seed="0"))


def test_generation_speculation_and_layouts_use_the_shared_validators():
    import torch

    from attnlab.distributed.failure import resolve_timeout
    from attnlab.distributed.layouts import shard_positions
    from attnlab.generate import Sampling

    with pytest.raises(ValueError, match=r"^top_k: expected an int >= 1, got 0 \(None: no top-k filter\)$"):
        Sampling(top_k=0)
    with pytest.raises(ValueError, match=r"^top_p: must be <= 1.0, got 1.5 \(None: no top-p filter\)$"):
        Sampling(top_p=1.5)
    with pytest.raises(ValueError, match=r"^temperature: must be >= 0.0, got -1$"):
        Sampling(temperature=-1)
    assert Sampling(temperature=1, top_k=np.int64(3)).top_k == 3
    with pytest.raises(ValueError, match=r"^rank: expected an int in \[0, world_size=2\), got 2$"):
        shard_positions(8, 2, 2, "contiguous")
    assert shard_positions(8, 2, np.int64(1), "contiguous").tolist() == [4, 5, 6, 7]
    assert resolve_timeout(datetime.timedelta(seconds=3)) == 3.0
    with pytest.raises(ValueError, match=r"^timeout: must be > 0.0, got 0 \(seconds, or a datetime.timedelta\)$"):
        resolve_timeout(0)
    q = torch.zeros(1, 1, 1, 4)
    import attnlab

    with pytest.raises(ValueError, match=r"^dropout_p: expected a probability in \[0, 1\), got 1.0 \(p = 1 would"):
        attnlab.attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"^dropout_seed: expected an int in \[-2\*\*63, 2\*\*64\)"):
        attnlab.attention(q, q, q, dropout_p=0.1, dropout_seed=2**64)


def test_caches_use_the_shared_validators():
    from attnlab.cache import PagedCache, QuantizedCache

    with pytest.raises(ValueError, match=r"^PagedCache: block_size: expected an int >= 1, got 0$"):
        PagedCache(1, 4, 1, 2, block_size=0)
    with pytest.raises(ValueError, match=r"^QuantizedCache: residual: expected an int >= 0, got -1$"):
        QuantizedCache(1, residual=-1)
    c = PagedCache(1, 4, 1, 2, block_size=2)
    a, _ = c.add_sequence()
    with pytest.raises(ValueError, match=r"^PagedCache.evict: n_blocks: expected an int in \[0, 0\] \(the full"):
        c.evict(a, 1)
    with pytest.raises(ValueError, match=r"^PagedCache.reserve: n: expected an int >= 0, got -1$"):
        c.reserve(-1)
    with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 1\), got 1$"):
        c.seen_at(1)
