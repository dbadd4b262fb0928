"""Per-head ablation: zero ablation equals zeroing the head's W_O; mean and resample put the
reference's outputs in place; the effects table matches ablating by hand."""

import pytest
import torch

from attnlab.interp import ablate, ablation_effects, capture
from attnlab.nn import Decoder, DecoderConfig
from tests.helpers import F32_ZEROED_HEADS


def _model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=30, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope")
    cfg.update(kw)
    return Decoder(DecoderConfig(**cfg)).eval()


def _loss(model, ids):
    return model(ids).logits.float().pow(2).mean()


def test_zero_ablation_equals_zeroing_W_O():
    model = _model()
    ids = torch.randint(0, 30, (2, 10))
    with ablate(model, [(1, 2), (0, 0)]):
        got = model(ids).logits
    with torch.no_grad():
        model.blocks[1].attn.W_O[2] = 0
        model.blocks[0].attn.W_O[0] = 0
    torch.testing.assert_close(got, model(ids).logits, **F32_ZEROED_HEADS)
    assert all(not b.attn.hooks for b in model.blocks)


@pytest.mark.parametrize("kind", ["mean", "resample"])
def test_mean_and_resample_put_reference_outputs_in_place(kind):
    model = _model()
    ids, ref = torch.randint(0, 30, (2, 8)), torch.randint(0, 30, (3, 8))
    with capture(model, layers=[1]) as clean_ref:
        model(ref)
    with capture(model, layers=[1]) as clean:
        model(ids)
    with ablate(model, [(1, 3)], kind=kind, reference=ref), capture(model, layers=[1]) as cap:
        model(ids)
    z, zc, zr = cap[1].z, clean[1].z, clean_ref[1].z
    torch.testing.assert_close(z[:, :3], zc[:, :3])  # other heads untouched (layer 0 is not ablated)
    if kind == "mean":
        want = zr[:, 3].mean(dim=(0, 1)).expand(2, 8, -1)
    else:
        want = zr[[0, 1], 3]
    torch.testing.assert_close(z[:, 3], want)


def test_effects_equal_ablating_each_head_by_hand():
    model = _model()
    ids = torch.randint(0, 30, (2, 9))
    eff = ablation_effects(model, ids, loss_fn=_loss, progress=False)
    assert eff.scores.shape == (2, 4)
    with torch.no_grad():
        clean = float(_loss(model, ids))
    for l, h in [(0, 1), (1, 3)]:
        w = model.blocks[l].attn.W_O
        keep = w[h].clone()
        with torch.no_grad():
            w[h] = 0
            want = float(_loss(model, ids)) - clean
            w[h] = keep
        assert eff.scores[l, h] == pytest.approx(want, abs=1e-6)


def test_errors():
    model = _model()
    with pytest.raises(ValueError, match="kind"), ablate(model, [(0, 0)], kind="noise"):
        pass
    with pytest.raises(ValueError, match="head 4"), ablate(model, [(0, 4)]):
        pass
    with pytest.raises(ValueError, match="reference"), ablate(model, [(0, 0)], kind="mean"):
        pass
    with (
        pytest.raises(ValueError, match="sequence length"),
        ablate(model, [(0, 0)], kind="resample", reference=torch.randint(0, 30, (1, 5))),
    ):
        model(torch.randint(0, 30, (1, 7)))
