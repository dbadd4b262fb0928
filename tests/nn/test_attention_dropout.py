"""``MultiHeadAttention(dropout=p)`` in training mode runs the op's dropout
(``attention(..., dropout_p=p)``, :mod:`attnlab.ops.dropout`) for every mask and score
mod, without materializing the pattern, and the flash backward regenerates its mask."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
import attnlab.nn.attention as mha_mod
from attnlab import masks
from attnlab.nn import Decoder, DecoderConfig, MultiHeadAttention
from attnlab.positions import ALiBi, RoPE
from tests.helpers import FLOOR, max_err

P = 0.3
PAD = masks.key_padding(torch.tensor([[False, True, True, True, True, True], [True] * 6]))


def _mha(positions=None, backend="auto", dtype=torch.float64, **kw):
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, 2, dropout=P, positions=positions, backend=backend, **kw).to(dtype)
    return m.train()


def _x(dtype=torch.float64):
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), dtype=dtype)


POSITIONS = {"none": lambda: None, "rope": lambda: RoPE(4), "alibi": lambda: ALiBi(4)}
MASKS = {"none": None, "causal": masks.causal(), "window3": masks.sliding_window(3), "key_padding": PAD}


@pytest.mark.parametrize("pos", list(POSITIONS))
@pytest.mark.parametrize("mask", list(MASKS))
def test_training_dropout_is_the_ops_dropout(mask, pos):
    """Same torch seed: the module's output is the op's ``dropout_p`` output on its q, k, v."""
    mha = _mha(POSITIONS[pos]())
    x, m = _x(), MASKS[mask]
    torch.manual_seed(5)
    got = mha(x, mask=m)
    q, k, v = mha.project(x)
    mod = None
    if pos == "rope":
        q, k = mha.positions(q, 0), mha.positions(k, 0)
    elif pos == "alibi":
        mod = mha._alibi
    torch.manual_seed(5)
    z = attnlab.attention(q, k, v, mask=m, score_mod=mod, scale=mha.scale, dropout_p=P)
    want = mha._out(z, 2, 6)
    assert max_err(got.detach(), want.detach()) <= 1e2 * FLOOR[torch.float64]
    mha.eval()
    assert max_err(mha(x, mask=m).detach(), got.detach()) > 1e-3, "dropout changed nothing in training"


@pytest.mark.parametrize("mask", ["window3", "key_padding"])  # (causal: the old path ran SDPA)
def test_training_dropout_never_materializes_and_flash_grads_match_reference(mask, monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the training path materialized the attention pattern")

    monkeypatch.setattr(mha_mod, "attention_probs", refuse)
    grads = {}
    for backend in ("flash", "reference"):
        mha = _mha(RoPE(4), backend=backend)
        torch.manual_seed(9)
        mha(_x(), mask=MASKS[mask]).pow(2).sum().backward()
        grads[backend] = [p.grad for p in mha.parameters()]
    for a, b in zip(grads["flash"], grads["reference"], strict=True):
        assert torch.isfinite(a).all() and max_err(a, b) <= 1e3 * FLOOR[torch.float64]


def test_sdpa_backend_refuses_training_dropout_and_eval_is_fine():
    mha = _mha(backend="sdpa", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"sdpa.*dropout"):
        mha(_x(torch.float32), mask=masks.causal())
    mha.eval()
    assert mha(_x(torch.float32), mask=masks.causal()).shape == (2, 6, 16)


def test_decoder_training_with_attn_dropout_is_reproducible_and_learns(monkeypatch):
    seen = []
    real = mha_mod.attention

    def spy(*a, dropout_p=0.0, **kw):
        seen.append(dropout_p)
        return real(*a, dropout_p=dropout_p, **kw)

    monkeypatch.setattr(mha_mod, "attention", spy)
    ids = torch.randint(0, 23, (2, 10), generator=torch.Generator().manual_seed(2))

    def run(seed):
        torch.manual_seed(0)
        model = Decoder(
            DecoderConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, d_mlp=32, attn_dropout=0.1, backend="flash")
        ).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(seed)
        losses = []
        for _ in range(5):
            logits = model(ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 23), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    a = run(1)
    assert seen and all(p == 0.1 for p in seen), "the decoder's attention ran without the op's dropout"
    assert a == run(1) and a != run(2)
    assert a[-1] < a[0] - 0.1 and all(math.isfinite(x) for x in a)
