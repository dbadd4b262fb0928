"""StreamingCache (sinks + window, positions in the cache) and H2OCache (heavy hitters)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.cache import H2OCache, StreamingCache
from attnlab.nn import Decoder, DecoderConfig
from tests.helpers import F32_AGAINST_F64, F32_RECOMPUTE, F64_REORDER_ABS


def decoder(positions, n_layers=2, seed=0):
    torch.manual_seed(seed)
    m = (
        Decoder(
            DecoderConfig(vocab_size=41, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, positions=positions)
        )
        .double()
        .eval()
    )
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(6)
    return m


@pytest.mark.parametrize("first_chunk", [1, 5, 8])
def test_without_positions_streaming_equals_the_sink_window_mask(first_chunk):
    # With no position encoding, slot positions do not matter: token t sees the sinks,
    # the `window` tokens before it and itself: masks.sink_window(S, W + 1) over the sequence.
    m = decoder("none")
    S, W, N = 2, 5, 24
    ids = torch.randint(0, 41, (2, N), generator=torch.Generator().manual_seed(1))

    def full_forward():
        x = m.embed(ids)
        for blk in m.blocks:
            x, _ = blk(x, mask=masks.sink_window(S, W + 1))
        return m.lm_head(m.norm(x))

    want = full_forward()
    c = StreamingCache.for_model(m, sinks=S, window=W)
    outs = [m(ids[:, :first_chunk], cache=c).logits]
    outs += [m(ids[:, t : t + 1], cache=c).logits for t in range(first_chunk, N)]
    torch.testing.assert_close(torch.cat(outs, 1), want, **F64_REORDER_ABS)
    assert c.length == S + W and c.seen == N


def test_rope_positions_are_slots_in_the_cache():
    # One layer: keys and values depend only on the token, so step t of the stream equals a
    # fresh forward over the kept tokens at positions 0..len-1 (what StreamingLLM specifies).
    m = decoder("rope", n_layers=1)
    S, W, N = 2, 4, 15
    ids = torch.randint(0, 41, (1, N), generator=torch.Generator().manual_seed(2))
    c = StreamingCache.for_model(m, sinks=S, window=W)
    for t in range(N):
        got = m(ids[:, t : t + 1], cache=c).logits[:, -1]
        kept = list(range(min(S, t + 1))) + list(range(max(S, t - W), t + 1))
        want = m(ids[:, kept]).logits[:, -1]
        torch.testing.assert_close(got, want, **F64_REORDER_ABS)


def test_memory_stays_bounded_over_20000_tokens():
    c = StreamingCache(n_layers=2, sinks=4, window=64)
    k = torch.randn(1, 2, 1, 16)
    sizes = set()
    for t in range(20_000):
        for layer in range(2):
            c.update(layer, k, k)
        if t >= 100:
            sizes.add(c.nbytes())
    assert c.length == 68 and c.seen == 20_000 and len(sizes) == 1
    assert sizes.pop() == 2 * 2 * 68 * 2 * 16 * 4  # layers x (k, v) x slots x heads x D x 4 bytes


def test_generate_feeds_a_long_prompt_in_pieces_and_matches_token_by_token():
    from attnlab.generate import generate

    m = decoder("rope")
    prompt = torch.randint(0, 41, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    c = StreamingCache.for_model(m, sinks=2, window=6)
    got = generate(m, [prompt], max_new_tokens=5, cache=c, output_logits=True)
    c2 = StreamingCache.for_model(m, sinks=2, window=6)
    logits = [m(torch.tensor([[t]]), cache=c2).logits[:, -1] for t in prompt][-1]
    torch.testing.assert_close(got.logits[0].double(), logits.float().double(), **F32_RECOMPUTE)
    assert c.seen == 17 + 4 and c.length == 8


def test_streaming_errors():
    with pytest.raises(ValueError, match="window: expected an int >= 1"):
        StreamingCache(1, 2, 0)
    with pytest.raises(TypeError, match=r"rope must be a positions.RoPE"):
        StreamingCache(1, 2, 3, rope=object())


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: StreamingCache(1, -1, 4), "StreamingCache: sinks: expected an int >= 0, got -1"),
        (lambda: StreamingCache(1, True, 4), "StreamingCache: sinks: expected an int, got bool True"),
        (lambda: StreamingCache(1, 2, 0), "StreamingCache: window: expected an int >= 1, got 0"),
        (lambda: StreamingCache(1, 2, 3.0), "StreamingCache: window: expected an int, got float 3.0"),
        (lambda: H2OCache(1, 0, 0), "H2OCache: budget: expected an int >= 1, got 0"),
        (lambda: H2OCache(1, 4, 4), "H2OCache: recent: expected an int in [0, budget=4), got 4"),
        (lambda: H2OCache(1, 4, -1), "H2OCache: recent: expected an int in [0, budget=4), got -1"),
        (lambda: H2OCache(1, 4, 1.0), "H2OCache: recent: expected an int in [0, budget=4), got float 1.0"),
    ],
)
def test_size_errors_name_the_argument_the_bound_and_the_value(build, message):
    with pytest.raises(ValueError) as e:  # a wrong type is an ArgumentTypeError: a ValueError too
        build()
    assert str(e.value) == message


# ----------------------------------------------------------------------------- H2O
def test_h2o_with_room_for_everything_equals_full_attention():
    m = decoder("rope")
    ids = torch.randint(0, 41, (2, 12), generator=torch.Generator().manual_seed(3))
    want = m(ids).logits
    c = H2OCache(n_layers=2, budget=64, recent=4)
    got = torch.cat([m(ids[:, :5], cache=c).logits] + [m(ids[:, t : t + 1], cache=c).logits for t in range(5, 12)], 1)
    torch.testing.assert_close(got, want, **F64_REORDER_ABS)


def test_h2o_scores_are_the_attention_received():
    # accumulated scores equal the column sums of the materialized pattern (summed over the
    # query heads of each kv head), computed here by attention_probs
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    c = H2OCache(n_layers=1, budget=100, recent=1)
    c.update(0, k, v).attend(q, mask=masks.causal())
    p = attnlab.attention_probs(q, k, mask=masks.causal())  # (1, 4, 6, 6)
    want = p.sum(2).view(1, 2, 2, 6).sum(2)
    torch.testing.assert_close(c.score[0].double(), want, **F32_AGAINST_F64)


def test_h2o_keeps_heavy_hitters_and_the_recent_window_within_budget():
    D = 8
    c = H2OCache(n_layers=1, budget=4, recent=2)
    heavy = torch.zeros(1, 1, 1, D)
    heavy[..., 0] = 10.0  # a key every query aligns with
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    for t in range(12):
        k = heavy if t == 3 else 0.1 * torch.randn(1, 1, 1, D, generator=torch.Generator().manual_seed(t))
        c.update(0, k, torch.randn(1, 1, 1, D)).attend(q)
        assert c.length <= 4
    kept = c.pos[0][0, 0].tolist()
    assert 3 in kept and kept[-2:] == [10, 11] and c.seen == 12


def test_h2o_refuses_chunks_after_eviction():
    c = H2OCache(n_layers=1, budget=2, recent=1)
    for _ in range(3):
        c.update(0, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)).attend(torch.randn(1, 1, 1, 4))
    with pytest.raises(ValueError, match="only single-token decode steps"):
        c.update(0, torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)).attend(torch.randn(1, 1, 2, 4))
