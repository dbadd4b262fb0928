"""A Decoder / Encoder training step under torch.compile(fullgraph=True): zero graph breaks,
loss and gradients equal to eager."""

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F

from attnlab import masks
from attnlab.nn import Decoder, Encoder
from attnlab.nn.config import DecoderConfig, EncoderConfig
from tests.helpers import F64_FLOOR

V = 32


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=V,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        max_positions=32,
        backend="flash",
        positions="alibi",
    )
    return Decoder(cfg).double()


def _loss(model, ids, w):
    logits = model(ids, mask=masks.sliding_window(w)).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def test_decoder_sliding_window_training_step_compiles_with_zero_graph_breaks(decoder):
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    dynamo.reset()
    ex = dynamo.explain(_loss)(decoder, ids, 4)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
    dynamo.reset()
    step = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    params = [p for p in decoder.parameters() if p.requires_grad]
    got = step(decoder, ids, 4)
    g_got = torch.autograd.grad(got, params)
    want = _loss(decoder, ids, 4)
    g_want = torch.autograd.grad(want, params)
    torch.testing.assert_close(got, want, **F64_FLOOR)  # float64: summation order only
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, **F64_FLOOR)


def test_encoder_with_padding_compiles_with_zero_graph_breaks():
    torch.manual_seed(0)
    enc = Encoder(EncoderConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_positions=32, backend="flash"))
    ids = torch.randint(1, V, (2, 10), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(2, 10, dtype=torch.long)
    keep[1, 7:] = 0
    dynamo.reset()
    ex = dynamo.explain(lambda i, a: enc(i, attention_mask=a).last_hidden_state.sum())(ids, keep)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
