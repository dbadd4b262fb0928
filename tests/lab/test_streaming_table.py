"""The streaming table's sliding window recomputed per token: the batched form (the claim's)
gives the per-token loop's loss, token for token."""

import math

import pytest
import torch

from attnlab.lab.streaming import recomputed_window_nll, streaming_table
from attnlab.nn import Decoder, DecoderConfig
from attnlab.train.textmodels import TextModels
from tests.helpers import F64_REORDER


def _model():
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope", max_positions=64
    )
    return Decoder(cfg).double().eval()


def _per_token(model, x, y, W):
    out = []
    with torch.no_grad():
        for t in range(x.numel()):
            lg = model(x[max(0, t - W + 1) : t + 1][None]).logits[0, -1]
            out.append(float(torch.nn.functional.cross_entropy(lg[None], y[t : t + 1])))
    return out


@pytest.mark.parametrize(("n", "W", "batch"), [(50, 12, 7), (11, 12, 4), (12, 12, 128), (30, 1, 8)])
def test_batched_windows_give_the_per_token_loss(n, W, batch):
    model = _model()
    ids = torch.randint(0, 64, (n + 1,), generator=torch.Generator().manual_seed(1))
    x, y = ids[:-1], ids[1:]
    want = _per_token(model, x, y, W)
    got = recomputed_window_nll(model, x, y, W, batch=batch)
    assert got == pytest.approx(math.fsum(want), rel=F64_REORDER["rtol"], abs=F64_REORDER["atol"])
    if n > W:  # the window matters: a wider one reads more context and gives another loss
        assert recomputed_window_nll(model, x, y, W + 3, batch=batch) != pytest.approx(got, rel=1e-6)


def test_the_table_reports_the_same_recomputed_perplexity_either_way():
    model = _model()
    tm = TextModels(None, model, None, torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(2)), 0.0)
    timed = streaming_table(tm, n_tokens=40, sinks=2, window=10)
    fast = streaming_table(tm, n_tokens=40, sinks=2, window=10, timed_recompute=False)
    assert [r["method"] for r in timed] == [r["method"] for r in fast]
    for a, b in zip(timed, fast, strict=True):
        assert b["ppl"] == pytest.approx(a["ppl"], rel=F64_REORDER["rtol"]), a["method"]
    assert timed[-1]["tok_s"] > 0 and fast[-1]["tok_s"] is None
