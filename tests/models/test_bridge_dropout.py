"""Training transformers models with attention dropout through the bridge.

GPT-2 (``attn_pdrop``) and BERT (``attention_probs_dropout_prob``) keep their default
dropout of 0.1 everywhere; in ``train()`` mode the bridge runs the op's counter-based
dropout (:mod:`attnlab.ops.dropout`).  A few optimizer steps on one batch lower the
loss with finite gradients, the same seed gives the same losses twice, and after
training the model in ``eval()`` mode equals eager attention."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import F32_MODEL_PARITY

T = pytest.importorskip("transformers")
from attnlab.models import bridge  # noqa: E402

V = 61
STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert bridge.register() == "attnlab"


def _gpt2():
    cfg = T.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=V, n_positions=32)
    assert cfg.attn_pdrop == 0.1
    return T.GPT2LMHeadModel(cfg), lambda ids: dict(input_ids=ids, labels=ids)


def _bert():
    cfg = T.BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    assert cfg.attention_probs_dropout_prob == 0.1

    def batch(ids):
        am = torch.ones_like(ids)
        am[1, -3:] = 0  # a padded sequence: the bridge's dense-mask path
        return dict(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))

    return T.BertForMaskedLM(cfg), batch


MODELS = {"gpt2": _gpt2, "bert": _bert}


def _train(name, seed, impl="attnlab"):
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model.set_attn_implementation(impl)
    model.train()
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(seed)
    losses, finite = [], True
    for _ in range(STEPS):
        loss = model(**batch(ids)).loss
        opt.zero_grad()
        loss.backward()
        finite &= all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(float(loss.detach()))
    return model, batch(ids), losses, finite


@pytest.mark.parametrize("name", list(MODELS))
def test_training_with_attention_dropout_lowers_the_loss(name, monkeypatch):
    seen = []
    real = bridge.attention

    def spy(*a, dropout_p=0.0, **kw):
        seen.append(dropout_p)
        return real(*a, dropout_p=dropout_p, **kw)

    monkeypatch.setattr(bridge, "attention", spy)
    _, _, losses, finite = _train(name, seed=3)
    assert seen == [0.1] * (2 * STEPS), "every layer's attention runs with the config's dropout"
    assert finite, "a gradient is not finite"
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("name", list(MODELS))
def test_same_seed_same_losses_other_seed_other_losses(name):
    a = _train(name, seed=3)[2]
    assert a == _train(name, seed=3)[2]
    assert a != _train(name, seed=4)[2]  # the masks depend on the seed


@pytest.mark.parametrize("name", list(MODELS))
def test_after_training_eval_mode_equals_eager(name):
    model, batch, _, _ = _train(name, seed=3)
    model.eval()
    batch = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        got = model(**batch).logits
        model.set_attn_implementation("eager")
        want = model(**batch).logits
    if "attention_mask" in batch:  # padded query rows: eager averages uniformly, attnlab gives 0
        real = batch["attention_mask"].bool()
        got, want = got[real], want[real]
    torch.testing.assert_close(got, want, **F32_MODEL_PARITY)


def test_the_bridge_runs_the_ops_dropout_in_training_only():
    import attnlab
    from attnlab import masks

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    torch.manual_seed(11)
    got, _ = bridge.attention_forward(module, q, k, v, None, dropout=0.3)
    torch.manual_seed(11)
    want = attnlab.attention(q, k, v, mask=masks.causal(), q_offset=0, dropout_p=0.3)
    assert torch.equal(got, want.transpose(1, 2))
    module.eval()
    got, _ = bridge.attention_forward(module, q, k, v, None, dropout=0.3)
    assert torch.equal(got, attnlab.attention(q, k, v, mask=masks.causal(), q_offset=0).transpose(1, 2))
