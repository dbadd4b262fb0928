"""Issue 13, "Arguments": caches never lose data on a write and never read blocks that were
handed to another sequence (docs/reliability/arguments.md)."""

from __future__ import annotations

import pytest
import torch

from attnlab import cache as C
from attnlab.cache import DynamicCache, H2OCache, PagedCache, StaticCache, StreamingCache
from tests.helpers import EXACT

# looked up so that, run against code without it, each test fails on its own instead of the module
StaleViewError = getattr(C, "StaleViewError", type("NoStaleViewError", (Exception,), {}))


def kv(n, dtype=torch.float32, value=None, seed=0, B=1, H=2, D=4):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, n, D, generator=g).to(dtype)
    v = torch.randn(B, H, n, D, generator=g).to(dtype)
    if value is not None:
        k[..., 0, 0] = value
    return k, v


# ----------------------------------------------------------------------------- lossy writes
@pytest.mark.parametrize(
    "src, value",
    [(torch.float64, 1.0), (torch.float32, 1e6), (torch.float64, 1e300), (torch.bfloat16, 1.0)],
    ids=["float64", "float32 1e6", "float64 1e300", "bfloat16"],
)
def test_static_cache_refuses_a_lossy_write_and_writes_nothing(src, value):
    c = StaticCache(2, 1, 2, 4, capacity=8, dtype=torch.float16)
    c.update(0, *kv(2, torch.float16))
    before = c.k[0].clone(), c.v[0].clone()
    with pytest.raises(TypeError) as e:
        c.update(0, *kv(3, src, value=value))
    msg = str(e.value)
    assert "layer 0" in msg and str(src) in msg and "torch.float16" in msg
    assert c.seen_at(0) == 2 and torch.equal(c.k[0], before[0]) and torch.equal(c.v[0], before[1])
    assert bool(torch.isfinite(c.k[0]).all())


@pytest.mark.parametrize(
    "make",
    [
        lambda: DynamicCache(1),
        lambda: StreamingCache(1, sinks=1, window=8),
        lambda: H2OCache(1, budget=8, recent=2),
    ],
    ids=["dynamic", "streaming", "h2o"],
)
def test_growing_caches_keep_the_dtype_of_their_first_write(make):
    # torch.cat would promote the whole cache to float64 (or round new keys to float16)
    for first, second in ((torch.float16, torch.float64), (torch.float32, torch.float16)):
        c = make()
        c.update(0, *kv(2, first))
        with pytest.raises(TypeError, match=f"layer 0.*{second}.*{first}"):
            c.update(0, *kv(1, second))
        assert c.seen_at(0) == 2


def test_paged_cache_refuses_a_lossy_write():  # a regression test: PagedCache always refused
    c = PagedCache(1, 4, 2, 4, block_size=4, dtype=torch.float16)
    a, _ = c.add_sequence()
    with pytest.raises(TypeError, match=r"layer 0.*torch.float32.*torch.float16"):
        c.select([a]).update(0, *kv(2, torch.float32, value=1e6))


@pytest.mark.parametrize(
    "make",
    [
        lambda dt: StaticCache(1, 1, 2, 4, capacity=4, dtype=dt),
        lambda dt: PagedCache(1, 4, 2, 4, block_size=4, dtype=dt),
    ],
    ids=["static", "paged"],
)
def test_caches_hold_floating_dtypes_only(make):
    # an int64 buffer would truncate every key to an integer
    for dt in (torch.int64, torch.bool, "float16"):
        with pytest.raises(TypeError, match="dtype"):
            make(dt)


# ----------------------------------------------------------------------------- stale paged views
def _paged():
    c = PagedCache(1, 2, 2, 4, block_size=4)
    a, _ = c.add_sequence()
    view = c.select([a]).update(0, *kv(4, seed=1))
    return c, a, view


def _reuse(c):
    b, _ = c.add_sequence()
    c.select([b]).update(0, *kv(4, seed=2, value=50.0))  # takes the block a released
    return b


@pytest.mark.parametrize("read", ["attend", "dense", "pieces"])
def test_paged_view_after_free_raises_instead_of_reading_the_new_owner(read):
    c, a, view = _paged()
    q = torch.randn(1, 2, 1, 4)
    c.free(a)
    _reuse(c)
    with pytest.raises(StaleViewError, match=f"sequence {a}"):
        {"attend": lambda: view.attend(q), "dense": view.dense, "pieces": lambda: view.pieces(0)}[read]()


@pytest.mark.parametrize("change", ["evict", "truncate", "reset"])
def test_paged_view_after_other_releases_raises(change):
    c, a, view = _paged()
    {"evict": lambda: c.evict(a, 1), "truncate": lambda: c.truncate(a, 0), "reset": c.reset}[change]()
    _reuse(c)
    with pytest.raises(StaleViewError):
        view.attend(torch.randn(1, 2, 1, 4))


def test_paged_view_stays_valid_while_its_blocks_are_held():
    # no false alarm: another sequence's free, or a later write of the same sequence,
    # leaves what the view reads untouched (copy-on-write protects shared blocks)
    c = PagedCache(1, 8, 2, 4, block_size=4)
    a, _ = c.add_sequence()
    b, _ = c.add_sequence()
    view = c.select([a]).update(0, *kv(3, seed=1))
    want = view.attend(q := torch.randn(1, 2, 1, 4))
    f = c.fork(a)
    c.select([f]).update(0, *kv(2, seed=3))
    c.select([b]).update(0, *kv(4, seed=4))
    c.free(b)
    c.select([a]).update(0, *kv(1, seed=5))
    torch.testing.assert_close(view.attend(q), want, **EXACT)


@pytest.mark.parametrize("token", [2**63, 10**30])
def test_paged_prefix_tokens_beyond_int64_are_refused_up_front(token):
    # they are hashed as int64 once their block is full: array('q') raised a bare OverflowError
    c = PagedCache(1, 4, 2, 4, block_size=2)
    with pytest.raises(ValueError, match="token ids"):
        a, _ = c.add_sequence([1, token, 3])
        c.select([a]).update(0, *kv(3))
