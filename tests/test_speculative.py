"""Speculative decoding with token trees: greedy equals the target's greedy decoding
exactly; sampling keeps the target's distribution (statistically)."""

from __future__ import annotations

import pytest
import torch

from attnlab.generate import Sampling, generate
from attnlab.nn import Decoder, DecoderConfig
from attnlab.speculative import accept_sampled, speculative_generate


def decoder(n_layers, seed, vocab=37, scale=6.0, positions="rope", n_kv_heads=2):
    torch.manual_seed(seed)
    m = Decoder(
        DecoderConfig(
            vocab_size=vocab, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=n_kv_heads, positions=positions
        )
    ).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return m


@pytest.mark.parametrize("branching", [(1,), (1, 1, 1, 1), (2, 2), (3, 2, 1), (4,)])
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_greedy_speculation_equals_greedy_decoding_of_the_target(branching, positions):
    target, draft = decoder(2, 0, positions=positions), decoder(1, 1, positions=positions)
    prompt = [3, 14, 15, 9, 2]
    want = generate(target, [prompt], max_new_tokens=20, cache=None).new_tokens[0]
    got = speculative_generate(target, draft, prompt, max_new_tokens=20, branching=branching)
    assert got.tokens == want


def test_a_perfect_draft_is_always_accepted():
    target = decoder(2, 0)
    prompt = [1, 2, 3]
    out = speculative_generate(target, target, prompt, max_new_tokens=16, branching=(1, 1, 1))
    assert out.accepted[:-1] == [3] * (len(out.accepted) - 1)  # every round: the whole chain
    assert out.tokens_per_round == pytest.approx(4.0, abs=1.0)
    assert out.tokens == generate(target, [prompt], max_new_tokens=16).new_tokens[0]


def test_a_wider_tree_accepts_at_least_as_much_as_a_chain():
    target, draft = decoder(2, 0), decoder(1, 3)
    prompt = [5, 6, 7, 8]
    chain = speculative_generate(target, draft, prompt, max_new_tokens=30, branching=(1, 1))
    tree = speculative_generate(target, draft, prompt, max_new_tokens=30, branching=(4, 4))
    assert chain.tokens == tree.tokens
    assert tree.acceptance_rate >= chain.acceptance_rate


def test_accept_sampled_returns_tokens_distributed_as_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])  # a poor draft
    n, counts = 20000, torch.zeros(4)
    for _ in range(n):
        drafts = torch.multinomial(q, 2, replacement=True, generator=g).tolist()
        i, tok = accept_sampled(p, q, drafts, g)
        counts[drafts[i] if i is not None else tok] += 1
    freq = counts / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() < 5 * sigma).all(), (freq, p)


def test_sampled_speculation_keeps_the_targets_first_token_distribution():
    V = 6
    target, draft = decoder(2, 0, vocab=V, scale=2.0), decoder(1, 5, vocab=V, scale=2.0)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p = Sampling(temperature=1.0).probs(target(torch.tensor([prompt])).logits[:, -1])[0]
    n, counts = 600, torch.zeros(V)
    for seed in range(n):
        out = speculative_generate(
            target, draft, prompt, max_new_tokens=1, branching=(2, 1), temperature=1.0, seed=seed
        )
        counts[out.tokens[0]] += 1
    # Pearson chi-square, V-1 = 5 degrees of freedom: 20.5 is the 0.1% critical value
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5, (counts / n, p)


def test_stop_tokens_and_arguments():
    target, draft = decoder(2, 0), decoder(1, 1)
    free = speculative_generate(target, draft, [3, 4], max_new_tokens=12, branching=(2,))
    stop = free.tokens[4]
    out = speculative_generate(target, draft, [3, 4], max_new_tokens=12, branching=(2,), stop_tokens=[stop])
    assert out.tokens == free.tokens[: free.tokens.index(stop) + 1]
    with pytest.raises(ValueError, match="branching"):
        speculative_generate(target, draft, [3], max_new_tokens=2, branching=(0,))
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, decoder(1, 1, vocab=11), [3], max_new_tokens=2)
