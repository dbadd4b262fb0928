"""attnlab.generate: every cache against recomputation (cache=None), sampling, stops, seeds."""

from __future__ import annotations

import pytest
import torch

from attnlab.generate import Sampling, generate, stream
from attnlab.nn import Decoder, DecoderConfig
from tests.helpers import F32_RECOMPUTE

V = 61


def model(positions="rope", n_kv_heads=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = Decoder(
        DecoderConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, positions=positions, **kw)
    ).eval()
    with torch.no_grad():  # larger weights: peaked, position-sensitive next-token distributions
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return m


PROMPTS = [[5, 9, 2, 7, 7, 1, 3], [11, 4], [8, 8, 8, 30, 2]]


@pytest.mark.parametrize("positions", ["rope", "learned", "alibi"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_equals_recomputation_on_ragged_prompts(positions, cache):
    m = model(positions)
    ref = generate(m, PROMPTS, max_new_tokens=8, cache=None, output_logits=True)
    got = generate(m, PROMPTS, max_new_tokens=8, cache=cache, output_logits=True)
    assert got.sequences == ref.sequences
    for a, b in zip(got.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, **F32_RECOMPUTE)


def test_a_row_does_not_depend_on_the_other_rows():
    m = model()
    together = generate(m, PROMPTS, max_new_tokens=6, output_logits=True)
    for i, p in enumerate(PROMPTS):
        alone = generate(m, [p], max_new_tokens=6, output_logits=True)
        assert alone.new_tokens[0] == together.new_tokens[i]
        for a, b in zip(alone.logits, together.logits, strict=True):
            torch.testing.assert_close(a[0], b[i], **F32_RECOMPUTE)


def test_tensor_input_with_right_padding_mask_equals_list_input():
    m = model()
    ids = torch.tensor([[5, 9, 2, 0], [11, 4, 0, 0]])
    mask = ids != 0
    a = generate(m, ids, attention_mask=mask, max_new_tokens=5)
    b = generate(m, [[5, 9, 2], [11, 4]], max_new_tokens=5)
    assert a.sequences == b.sequences


def test_stop_tokens_end_rows_independently():
    m = model()
    free = generate(m, PROMPTS, max_new_tokens=8)
    stop = free.new_tokens[1][2]  # the third token of row 1
    out = generate(m, PROMPTS, max_new_tokens=8, stop_tokens=[stop])
    assert out.new_tokens[1] == free.new_tokens[1][: free.new_tokens[1].index(stop) + 1]
    assert out.finished[1]
    for i in (0, 2):
        toks = free.new_tokens[i]
        expect = toks[: toks.index(stop) + 1] if stop in toks else toks
        assert out.new_tokens[i] == expect


def test_sampling_is_reproducible_with_a_seed_and_varies_without():
    m = model()
    kw = dict(max_new_tokens=10, temperature=1.5, top_k=20, top_p=0.95)
    a = generate(m, PROMPTS, seed=3, **kw)
    b = generate(m, PROMPTS, seed=3, **kw)
    c = generate(m, PROMPTS, seed=4, **kw)
    assert a.sequences == b.sequences and a.sequences != c.sequences


def test_streaming_callback_sees_tokens_in_order():
    m = model()
    seen = []
    out = generate(m, PROMPTS, max_new_tokens=4, on_token=lambda s, t: seen.append((s, t.tolist())))
    assert [s for s, _ in seen] == [0, 1, 2, 3]
    assert [t[0] for _, t in seen] == out.new_tokens[0]
    assert len(list(stream(m, PROMPTS, max_new_tokens=4))) == 4


def test_top_k_top_p_filter_as_defined():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    s = Sampling(temperature=1.0, top_k=2)
    assert torch.isfinite(s.process(logits)).tolist() == [[True, True, False, False, False]]
    p = logits.softmax(-1)[0]
    s = Sampling(temperature=1.0, top_p=float(p[0] + p[1] / 2))  # needs the first two tokens
    assert torch.isfinite(s.process(logits)).tolist() == [[True, True, False, False, False]]
    s = Sampling(temperature=1.0, top_p=float(p[0]) - 1e-6)  # the first alone reaches it
    assert torch.isfinite(s.process(logits)).tolist() == [[True, False, False, False, False]]


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 2.0, -1.0]])
    out = Sampling(repetition_penalty=2.0).process(logits, torch.tensor([[0, 1]]))
    assert out.tolist() == [[1.0, -2.0, 2.0, -1.0]]


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    s = Sampling(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([s.choose(logits, generator=g) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    assert (freq - torch.tensor([0.5, 0.3, 0.2])).abs().max() < 0.03  # ~4 sigma at n=4000


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(cache="bogus"), "cache: expected None"),
    ],
)
def test_bad_arguments_are_named(bad, words):
    kw = dict(max_new_tokens=2)
    kw.update(bad)
    with pytest.raises(ValueError, match=words):
        generate(model(), PROMPTS, **kw)


def test_streaming_cache_refuses_padded_prompts_and_learned_positions():
    with pytest.raises(ValueError, match="left-padded"):
        generate(model(), PROMPTS, max_new_tokens=2, cache="streaming")
    with pytest.raises(ValueError, match="absolute 'learned' positions"):
        generate(model("learned"), [PROMPTS[0]], max_new_tokens=2, cache="streaming")


@pytest.mark.parametrize("mixer,positions", [("ssm", "none"), ("linear", "rope")])
def test_recurrent_mixers_decode_from_their_state(mixer, positions):
    from attnlab.nn import Decoder, DecoderConfig

    torch.manual_seed(0)
    m = Decoder(
        DecoderConfig(vocab_size=30, d_model=32, n_layers=2, n_heads=4, mixer=mixer, positions=positions)
    ).eval()
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    want = generate(m, prompts, max_new_tokens=6, cache=None).new_tokens  # recompute: the reference
    assert generate(m, prompts, max_new_tokens=6).new_tokens == want  # default cache -> the recurrent state
    with pytest.raises(ValueError, match="recurrent state"):
        generate(m, prompts, max_new_tokens=2, cache="paged")
