"""DynamicCache: the per-layer KV-cache protocol (seen, update -> (k_all, v_all, kv_offset))."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from attnlab.cache import DynamicCache
from attnlab.nn import Decoder, DecoderConfig, MultiHeadAttention
from attnlab.positions import RoPE


def kv(B, H, n, D, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, Dv or D, generator=g)


def test_update_appends_and_counts():
    c = DynamicCache()
    assert c.seen == 0 and c.k is None and c.v is None
    k1, v1 = kv(2, 3, 4, 8, Dv=5, seed=1)
    ka, va, off = c.update(k1, v1)
    assert off == 0 and c.seen == 4
    assert torch.equal(ka, k1) and torch.equal(va, v1)
    k2, v2 = kv(2, 3, 1, 8, Dv=5, seed=2)
    ka, va, off = c.update(k2, v2)
    assert off == 0 and c.seen == 5
    assert ka.shape == (2, 3, 5, 8) and va.shape == (2, 3, 5, 5)
    assert torch.equal(ka, torch.cat([k1, k2], 2)) and torch.equal(va, torch.cat([v1, v2], 2))
    assert torch.equal(c.k, ka) and torch.equal(c.v, va)
    # an empty chunk changes nothing but is accepted
    ka, _, _ = c.update(*kv(2, 3, 0, 8, Dv=5))
    assert c.seen == 5 and ka.shape[2] == 5
    assert repr(c) == "DynamicCache(seen=5)"


def test_for_model_gives_independent_caches():
    caches = DynamicCache.for_model(3)
    assert len(caches) == 3 and len({id(c) for c in caches}) == 3
    caches[0].update(*kv(1, 1, 2, 4))
    assert [c.seen for c in caches] == [2, 0, 0]


@pytest.mark.parametrize("k_shape, v_shape", [
    ((2, 3, 4), (2, 3, 4, 8)),          # k not 4-D
    ((2, 3, 4, 8), (2, 3, 5, 8)),       # different n
    ((2, 3, 4, 8), (1, 3, 4, 8)),       # different B
])
def test_update_rejects_bad_shapes(k_shape, v_shape):
    with pytest.raises(ValueError, match=r"update: expected k \(B, Hkv, n, D\) and v \(B, Hkv, n, Dv\)"):
        DynamicCache().update(torch.zeros(k_shape), torch.zeros(v_shape))


@pytest.mark.parametrize("k_shape, v_shape", [
    ((1, 2, 1, 8), (1, 2, 1, 8)),       # B changes
    ((2, 1, 1, 8), (2, 1, 1, 8)),       # Hkv changes
    ((2, 2, 1, 4), (2, 2, 1, 8)),       # D changes
    ((2, 2, 1, 8), (2, 2, 1, 6)),       # Dv changes
])
def test_update_rejects_chunks_that_do_not_continue(k_shape, v_shape):
    c = DynamicCache()
    c.update(*kv(2, 2, 3, 8))
    with pytest.raises(ValueError, match="do not continue the cached"):
        c.update(torch.zeros(k_shape), torch.zeros(v_shape))
    assert c.seen == 3 and c.k.shape == (2, 2, 3, 8)  # a rejected update leaves the cache alone


def test_mha_with_cache_equals_full_forward_and_fills_the_cache():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, 2, positions=RoPE(4)).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    full = mha(x, mask=masks.causal())
    c = DynamicCache()
    out = torch.cat([mha(x[:, :3], mask=masks.causal(), cache=c)] +
                    [mha(x[:, t:t + 1], mask=masks.causal(), cache=c) for t in range(3, 7)], 1)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    assert c.seen == 7 and c.k.shape == (2, 2, 7, 4) and c.v.shape == (2, 2, 7, 4)
    # the cached keys are those a full forward computes (rotated at their absolute positions)
    q, k, v = mha.project(x)
    torch.testing.assert_close(c.k, mha.positions(k, 0), rtol=0, atol=1e-12)
    torch.testing.assert_close(c.v, v, rtol=0, atol=1e-12)


def test_decoder_with_cache_list_equals_full_forward_and_greedy_generation_matches():
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope")
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(25)
    ids = torch.randint(0, 23, (2, 4))
    # greedy decoding with and without the cache produces the same tokens and logits
    cache = DynamicCache.for_model(2)
    seq = ids
    logits = m(seq, cache=cache).logits[:, -1]
    nocache = ids
    for _ in range(5):
        nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
        logits = m(nxt, cache=cache).logits[:, -1]
        ref_logits = m(seq).logits[:, -1]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        nocache = torch.cat([nocache, m(nocache).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq, nocache)
    assert all(c.seen == 9 for c in cache)
