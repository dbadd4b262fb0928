"""The lab's small text model (the streaming claim's): trained once per run into the lab cache, read
back unchanged; and the text-model sets' checks."""

import pytest
import torch

from attnlab.train import textmodels as T


def test_specs_need_a_target():
    with pytest.raises(ValueError, match="specs: expected a 'target'"):
        T.load_or_train("unused", progress=False, specs={"draft": T.SPECS["draft"]})
    with pytest.raises(ValueError, match="specs: expected a 'target'"):
        T.load_or_train("unused", progress=False, specs={**T.LAB, "critic": T.SPECS["draft"]})


@pytest.mark.slow
def test_the_lab_model_is_lab_sized_and_cached(text_models):
    from attnlab.lab.streaming import text_model

    spec, cfg = T.LAB["target"], text_models.target.cfg
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (
        spec["d_model"],
        spec["n_layers"],
        spec["n_heads"],
        spec["n_kv_heads"],
    )
    assert text_models.draft is None  # the claim reads no draft: none is trained
    again = text_model(progress=False)  # from the lab cache: no training, the same weights and held-out text
    assert again.train_seconds == 0.0 and torch.equal(again.heldout, text_models.heldout)
    for (k, a), (_, b) in zip(text_models.target.state_dict().items(), again.target.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
