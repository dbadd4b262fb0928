"""DynamicCache and StaticCache: the cache interface (update(layer, k, v) -> KV view, seen,
length, reset, fork, free) and their use by MultiHeadAttention and Decoder."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from attnlab.cache import DenseKV, DynamicCache, StaticCache
from attnlab.nn import Decoder, DecoderConfig, MultiHeadAttention
from attnlab.positions import RoPE
from tests.helpers import F32_RECOMPUTE, F64_FLOOR


def kv(B, H, n, D, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, Dv or D, generator=g)


def make(kind, n_layers=1, B=2, H=3, D=8, Dv=5, capacity=16, evict=None):
    if kind == "dynamic":
        return DynamicCache(n_layers)
    return StaticCache(n_layers, B, H, D, capacity, d_v=Dv, dtype=torch.float32, evict=evict)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_update_appends_and_counts(kind):
    c = make(kind, n_layers=2)
    assert c.seen == 0 and c.length == 0
    k1, v1 = kv(2, 3, 4, 8, Dv=5, seed=1)
    view = c.update(0, k1, v1)
    assert isinstance(view, DenseKV) and view.kv_offset == 0 and view.q_offset == 0
    assert c.seen_at(0) == 4 and c.seen_at(1) == 0
    k2, v2 = kv(2, 3, 1, 8, Dv=5, seed=2)
    view = c.update(0, k2, v2)
    assert view.q_offset == 4 and c.seen_at(0) == 5
    assert torch.equal(view.k, torch.cat([k1, k2], 2)) and torch.equal(view.v, torch.cat([v1, v2], 2))
    view = c.update(0, *kv(2, 3, 0, 8, Dv=5))  # an empty chunk changes nothing
    assert c.seen_at(0) == 5 and view.k.shape[2] == 5
    c.reset()
    assert c.seen == 0


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_fork_is_independent(kind):
    c = make(kind)
    c.update(0, *kv(2, 3, 4, 8, Dv=5, seed=1))
    f = c.fork()
    a = c.update(0, *kv(2, 3, 1, 8, Dv=5, seed=2))
    b = f.update(0, *kv(2, 3, 1, 8, Dv=5, seed=3))
    assert torch.equal(a.k[:, :, :4], b.k[:, :, :4]) and not torch.equal(a.k[:, :, 4], b.k[:, :, 4])
    assert c.seen == f.seen == 5


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize(
    "k_shape, v_shape",
    [
        ((2, 3, 4), (2, 3, 4, 5)),  # k not 4-D
        ((2, 3, 4, 8), (2, 3, 5, 5)),  # different n
        ((2, 3, 4, 8), (1, 3, 4, 5)),  # different B
    ],
)
def test_update_rejects_bad_shapes(kind, k_shape, v_shape):
    with pytest.raises(ValueError, match=r"update: expected k \(B, Hkv, n, D\) and v \(B, Hkv, n, Dv\)"):
        make(kind).update(0, torch.zeros(k_shape), torch.zeros(v_shape))


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize(
    "k_shape, v_shape",
    [
        ((1, 3, 1, 8), (1, 3, 1, 5)),  # B changes
        ((2, 1, 1, 8), (2, 1, 1, 5)),  # Hkv changes
        ((2, 3, 1, 4), (2, 3, 1, 5)),  # D changes
        ((2, 3, 1, 8), (2, 3, 1, 6)),  # Dv changes
    ],
)
def test_update_rejects_chunks_that_do_not_continue(kind, k_shape, v_shape):
    c = make(kind)
    c.update(0, *kv(2, 3, 3, 8, Dv=5))
    with pytest.raises(ValueError, match=r"do not continue the cached|do not fit buffers"):
        c.update(0, torch.zeros(k_shape), torch.zeros(v_shape))
    assert c.seen == 3  # a rejected update leaves the cache alone


def test_layer_index_is_checked():
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 2\)"):
        make("dynamic", n_layers=2).update(2, *kv(1, 1, 1, 4))
    for layer, got in ((-1, "-1"), (2, "2"), (1.0, "float 1.0"), (True, "bool True")):
        with pytest.raises(ValueError) as e:
            make("dynamic", n_layers=2).update(layer, *kv(1, 1, 1, 4))
        assert str(e.value) == f"layer: expected an int in [0, 2), got {got}"
    with pytest.raises(IndexError):
        make("dynamic", n_layers=2)[5]


def test_static_capacity_error_writes_nothing():
    c = make("static", capacity=5)
    c.update(0, *kv(2, 3, 4, 8, Dv=5, seed=1))
    before = c.k[0].clone()
    with pytest.raises(ValueError, match="holds 4 of 5 slots and 2 more were written"):
        c.update(0, *kv(2, 3, 2, 8, Dv=5, seed=2))
    assert c.seen == 4 and torch.equal(c.k[0], before)


def test_static_window_eviction_is_sliding_window_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, 2, positions=RoPE(4)).double().eval()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    W = 5
    full = mha(x, mask=masks.causal() & masks.sliding_window(W))
    c = StaticCache(1, 1, 2, 4, W, dtype=torch.float64, evict="window")
    out = torch.cat([mha(x[:, t : t + 1], mask=masks.causal(), cache=c[0]) for t in range(12)], 1)
    torch.testing.assert_close(out, full, **F64_FLOOR)
    assert c.length == W and c.seen == 12 and c.offsets[0] == 12 - W


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_mha_with_cache_equals_full_forward_and_fills_the_cache(kind):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, 2, positions=RoPE(4)).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    full = mha(x, mask=masks.causal())
    c = DynamicCache(1) if kind == "dynamic" else StaticCache(1, 2, 2, 4, 8, dtype=torch.float64)
    out = torch.cat(
        [mha(x[:, :3], mask=masks.causal(), cache=c[0])]
        + [mha(x[:, t : t + 1], mask=masks.causal(), cache=c[0]) for t in range(3, 7)],
        1,
    )
    torch.testing.assert_close(out, full, **F64_FLOOR)
    K = c.k[0][:, :, :7]
    _q, k, _v = mha.project(x)
    torch.testing.assert_close(K, mha.positions(k, 0), **F64_FLOOR)  # rotated at absolute positions


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_decoder_cached_greedy_equals_recomputation(kind):
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope")
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(25)
    ids = torch.randint(0, 23, (2, 4))
    cache = DynamicCache(2) if kind == "dynamic" else StaticCache.for_model(m, 2, 16)
    seq = ids
    with torch.no_grad():
        logits = m(seq, cache=cache).logits[:, -1]
        nocache = ids
        for _ in range(5):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = m(nxt, cache=cache).logits[:, -1]
            torch.testing.assert_close(logits, m(seq).logits[:, -1], **F32_RECOMPUTE)
            nocache = torch.cat([nocache, m(nocache).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq, nocache)
    assert cache.seen == 9
