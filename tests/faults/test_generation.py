"""Faults and bad input in generation (attnlab.generate, attnlab.speculative), issue 13.

The property: a row generated in a ragged batch equals the same prompt generated alone,
for every sampling option and cache.  The model is a tiny attnlab Decoder in float64:
batched and unbatched matmuls may differ in the last ulp, and float64 logits (which
``Sampling`` rounds to float32) make an argmax tie or a sampling boundary flipping on
such a difference astronomically unlikely (measured here: the batched and the alone
logits are bit-equal).  ``derandomize=True`` keeps the examples the same on every run.
Sampled rows are compared with per-row seeds (``seed=[s0, s1, ...]``, vLLM's per-request
seed; or one ``seed`` and :func:`attnlab.generate.row_seed`).

Each test fails on the code before issue 13 (see docs/reliability/generation.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings, strategies as st

from attnlab.generate import Sampling, generate
from attnlab.nn import Decoder, DecoderConfig
from attnlab.speculative import speculative_generate

V = 8  # a small vocabulary: repeated tokens, stop tokens and the padding id collide often

SETTINGS = dict(
    deadline=None,
    derandomize=True,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _decoder(seed=0, n_layers=1, scale=3.0):
    torch.manual_seed(seed)
    m = Decoder(DecoderConfig(vocab_size=V, d_model=16, n_layers=n_layers, n_heads=2, positions="rope"))
    with torch.no_grad():  # larger weights: context-sensitive, non-uniform next-token distributions
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return m.double().eval()


MODEL = _decoder()
TARGET, DRAFT = _decoder(0, 2), _decoder(1, 1)

prompts = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=6), min_size=2, max_size=4)
caches = st.sampled_from([None, "static", "dynamic", "paged"])
stops = st.lists(st.integers(0, V - 1), max_size=2)
penalties = st.one_of(st.just(1.0), st.floats(0.2, 20.0))


def _rows_alone_equal_batch(prompts, batch, alone_kw, **kw):
    for i, p in enumerate(prompts):
        alone = generate(MODEL, [p], **alone_kw(i), **kw)
        note(f"row {i}: batch {batch.new_tokens[i]} alone {alone.new_tokens[0]}")
        assert alone.new_tokens[0] == batch.new_tokens[i]
        assert alone.finished[0] == batch.finished[i]


@settings(max_examples=30, **SETTINGS)
@given(
    prompts=prompts,
    cache=caches,
    rp=penalties,
    stop=stops,
    pad=st.integers(0, V - 1),
    top_k=st.one_of(st.none(), st.integers(1, V + 1)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    n=st.integers(1, 5),
    as_tensor=st.booleans(),
)
def test_greedy_row_in_a_ragged_batch_equals_the_row_alone(prompts, cache, rp, stop, pad, top_k, top_p, n, as_tensor):
    """Greedy with every deterministic option: exact equality of tokens and stop flags.
    The batch is a list of prompts, or a right-padded tensor with its attention_mask."""
    kw = dict(
        max_new_tokens=n,
        cache=cache,
        repetition_penalty=rp,
        stop_tokens=stop,
        pad_token_id=pad,
        top_k=top_k,
        top_p=top_p,
    )
    if as_tensor:
        P = max(map(len, prompts))
        ids = torch.tensor([p + [pad] * (P - len(p)) for p in prompts])
        mask = torch.tensor([[1] * len(p) + [0] * (P - len(p)) for p in prompts])
        batch = generate(MODEL, ids, attention_mask=mask, **kw)
    else:
        batch = generate(MODEL, prompts, **kw)
    _rows_alone_equal_batch(prompts, batch, lambda i: {}, **kw)


@settings(max_examples=25, **SETTINGS)
@given(
    prompts=prompts,
    cache=caches,
    rp=penalties,
    stop=stops,
    temperature=st.floats(0.05, 4.0),
    top_k=st.one_of(st.none(), st.integers(1, V + 1)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    seeds=st.lists(st.integers(0, 2**64 - 1), min_size=4, max_size=4),
    one_seed=st.booleans(),
    n=st.integers(1, 5),
)
def test_sampled_row_in_a_ragged_batch_equals_the_row_alone_with_its_seed(
    prompts, cache, rp, stop, temperature, top_k, top_p, seeds, one_seed, n
):
    """Temperature, top-k, top-p, penalty and stops combined; each row draws from its own
    generator: a per-row seed list, or one seed split by ``row_seed``."""
    from attnlab.generate import row_seed

    kw = dict(
        max_new_tokens=n,
        cache=cache,
        repetition_penalty=rp,
        stop_tokens=stop,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    if one_seed:
        batch = generate(MODEL, prompts, seed=seeds[0], **kw)
        _rows_alone_equal_batch(prompts, batch, lambda i: {"seed": [row_seed(seeds[0], i)]}, **kw)
    else:
        batch = generate(MODEL, prompts, seed=seeds[: len(prompts)], **kw)
        _rows_alone_equal_batch(prompts, batch, lambda i: {"seed": [seeds[i]]}, **kw)


def test_padding_is_no_token_for_the_repetition_penalty():
    logits = torch.tensor([[2.0, 1.0, 2.0, -1.0]])
    out = Sampling(repetition_penalty=2.0).process(logits, torch.tensor([[-1, -1, 2]]))  # two pads, then token 2
    assert out.tolist() == [[2.0, 1.0, 1.0, -1.0]]


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    # three tied tokens of mass ~0.3 each: top_p=0.2 is reached by the first; a sort may put any of
    # the three first, so all three are kept (as top_k keeps ties) and the result is order-free
    logits = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    kept = torch.isfinite(Sampling(temperature=1.0, top_p=0.2).process(logits))
    assert kept.tolist() == [[True, False, True, True]]


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324])
def test_a_tiny_temperature_is_the_greedy_limit(temperature):
    greedy = generate(MODEL, [[1, 2, 3], [4]], max_new_tokens=4)
    tiny = generate(MODEL, [[1, 2, 3], [4]], max_new_tokens=4, temperature=temperature, seed=0)
    assert tiny.new_tokens == greedy.new_tokens
    spec = speculative_generate(
        TARGET, DRAFT, [1, 2, 3], max_new_tokens=4, branching=(2,), temperature=temperature, seed=0
    )
    assert spec.tokens == generate(TARGET, [[1, 2, 3]], max_new_tokens=4).new_tokens[0]


def test_an_extreme_repetition_penalty_gives_finite_probabilities():
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.5]])
    for rp in (1e-300, 1e300):
        p = Sampling(temperature=1.0, repetition_penalty=rp).probs(logits, torch.tensor([[0, 1, 2]]))
        assert bool(torch.isfinite(p).all()) and math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)


def test_inputs_that_mean_the_same_give_the_same_tokens():
    want = generate(MODEL, [[1, 2, 3]], max_new_tokens=4, stop_tokens=[5]).new_tokens
    assert generate(MODEL, [torch.tensor([1, 2, 3])], max_new_tokens=4, stop_tokens=5).new_tokens == want
    spec = speculative_generate(TARGET, DRAFT, torch.tensor([1, 2, 3]), max_new_tokens=4, branching=(2,))
    assert spec.tokens == speculative_generate(TARGET, DRAFT, [1, 2, 3], max_new_tokens=4, branching=(2,)).tokens


GENERATE_BAD = [
    (dict(input_ids=[[1.7, 2]]), "input_ids"),  # not silently token 1
    (dict(input_ids=[[True, 2]]), "input_ids"),
    (dict(input_ids=[[1 + 0j, 2]]), "input_ids"),
    (dict(input_ids=torch.tensor([[True, False]])), "input_ids"),
    (dict(input_ids=torch.tensor([[1 + 0j, 2]])), "input_ids"),
    (dict(input_ids=[1, 2, 3]), r"input_ids: .*flat list"),
    (dict(input_ids=[[1, 2]], attention_mask=torch.ones(1, 2, dtype=torch.bool)), "attention_mask"),
    (dict(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[2, 1]])), "attention_mask"),
    (dict(pad_token_id=V), "pad_token_id"),  # out of vocab: named as such
    (dict(pad_token_id=-1), "pad_token_id"),
    (dict(pad_token_id=1.5), "pad_token_id"),
    (dict(input_ids=[[1, 2]], pad_token_id=V + 3), "pad_token_id"),  # not even used: still refused
    (dict(stop_tokens=[1.7]), "stop_tokens"),
    (dict(stop_tokens=[V + 5]), "stop_tokens"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=True), "top_p"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(seed=1.5, temperature=1.0), "seed"),
    (dict(seed=True, temperature=1.0), "seed"),
    (dict(seed=2**64, temperature=1.0), "seed"),
    (dict(seed=[1], temperature=1.0), "seed"),  # one seed for two rows
    (dict(cache=5), "cache"),
    (dict(cache_options=[1]), "cache_options"),
    (dict(on_token=5), "on_token"),
    (dict(output_logits="yes"), "output_logits"),
    (dict(cache="quantized"), "quantized"),  # ragged: the quantization groups would depend on the padding
]


@pytest.mark.parametrize("bad, words", GENERATE_BAD, ids=[f"{i}-{w}" for i, (_, w) in enumerate(GENERATE_BAD)])
def test_generate_refuses_bad_arguments_by_name(bad, words):
    kw = dict(input_ids=[[1, 2, 3], [4]], max_new_tokens=2)
    kw.update(bad)
    with pytest.raises(ValueError, match=words):
        generate(MODEL, kw.pop("input_ids"), **kw)


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(input_ids=[[1.7]]), "input_ids"),  # before: 1.7 became 1 at next()
        (dict(input_ids=[[1, 2], [3]], cache="quantized"), "quantized"),
    ],
)
def test_stream_refuses_bad_arguments_at_the_call_not_at_the_first_token(bad, words):
    from attnlab.generate import stream

    with pytest.raises(ValueError, match=words):
        stream(MODEL, bad.pop("input_ids"), max_new_tokens=2, **bad)


SPECULATIVE_BAD = [
    (dict(max_new_tokens=-1), "max_new_tokens"),  # generate's own check, shared
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(prompt=[1.7, 2]), "prompt"),
    (dict(prompt=[3, 1.7]), "prompt"),
    (dict(prompt=[V]), "prompt"),
    (dict(prompt=[[1, 2]]), "prompt"),
    (dict(stop_tokens=[1.5]), "stop_tokens"),
    (dict(stop_tokens=[V]), "stop_tokens"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=True), "top_p"),
    (dict(seed=1.5, temperature=1.0), "seed"),
    (dict(branching=2), "branching"),
]


@pytest.mark.parametrize("bad, words", SPECULATIVE_BAD, ids=[f"{i}-{w}" for i, (_, w) in enumerate(SPECULATIVE_BAD)])
def test_speculative_generate_refuses_bad_arguments_like_generate(bad, words):
    kw = dict(prompt=[1, 2, 3], max_new_tokens=3, branching=(2,))
    kw.update(bad)
    with pytest.raises(ValueError, match=words):
        speculative_generate(TARGET, DRAFT, kw.pop("prompt"), **kw)
