"""The MiniLM sink analysis: masses equal those of transformers' eager attention weights,
and the value weighting is computed from the model's real value vectors."""

import pytest
import torch

from tests.helpers import F32_MASS_MEANS

pytest.importorskip("transformers")

from attnlab.lab import sinks


@pytest.fixture(scope="module")
def minilm():
    from attnlab.models import load

    model, tok = load("minilm")
    return model.eval(), tok


def test_masses_equal_transformers_eager_attentions(minilm):
    from transformers import BertModel

    from attnlab.models.load import minilm_path

    model, tok = minilm
    sents = sinks.SENTENCES[:5]
    res = sinks.analyse(model, tok, sents)
    hf = BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()
    b = tok(sents)
    with torch.no_grad():
        att = hf(**b, output_attentions=True).attentions
    keep = b["attention_mask"].bool()
    last = keep.long().sum(1) - 1
    for l in range(6):
        a = att[l]  # (B, H, N, N)
        cls = a[..., 0]  # mass on [CLS] per query
        sep = a.gather(-1, last.view(-1, 1, 1, 1).expand(-1, a.shape[1], a.shape[2], 1))[..., 0]
        w = keep.unsqueeze(1).float()
        want_cls = (cls * w).sum((0, 2)) / w.sum((0, 2))
        want_sep = (sep * w).sum((0, 2)) / w.sum((0, 2))
        torch.testing.assert_close(torch.tensor(res["cls"][l]), want_cls, **F32_MASS_MEANS)
        torch.testing.assert_close(torch.tensor(res["sep"][l]), want_sep, **F32_MASS_MEANS)


def test_summary_fields_are_consistent(minilm):
    model, tok = minilm
    res = sinks.analyse(model, tok, sinks.SENTENCES[:4])
    raw = torch.tensor(res["cls"]) + torch.tensor(res["sep"])
    vw = torch.tensor(res["cls_vw"]) + torch.tensor(res["sep_vw"])
    assert raw.shape == (6, 12) and bool(((raw >= 0) & (raw <= 1 + 1e-6)).all())
    assert bool(((vw >= 0) & (vw <= 1 + 1e-6)).all())
    assert res["heads_over_half_raw"] == int((raw > 0.5).sum())
    top = res["top_heads"][0]
    assert top["raw"] == pytest.approx(float(raw.max()), abs=1e-6)
    assert res["example"]["tokens"][0] == "[CLS]" and res["example"]["tokens"][-1] == "[SEP]"
    assert "value-weighted" in sinks.summary(res)
