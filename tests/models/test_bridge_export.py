"""torch.export of a Decoder and of a bridged transformers GPT-2; fullgraph through the bridge
with a padded attention mask (no data-dependent branch)."""

import pytest
import torch
import torch._dynamo as dynamo

from attnlab import masks
from attnlab.nn import Decoder
from attnlab.nn.config import DecoderConfig
from tests.helpers import EXACT, F32_FEW_ULPS

transformers = pytest.importorskip("transformers")


class _Logits(torch.nn.Module):
    def __init__(self, m, **kw):
        super().__init__()
        self.m, self.kw = m, kw

    def forward(self, ids, *args):
        if isinstance(self.m, Decoder):
            return self.m(ids, mask=masks.sliding_window(4)).logits
        return self.m(input_ids=ids, attention_mask=args[0]).logits


def test_export_of_a_decoder_matches_eager():
    torch.manual_seed(0)
    dec = Decoder(
        DecoderConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_positions=32, backend="flash")
    ).eval()
    ids = torch.randint(0, 32, (2, 10))
    ep = torch.export.export(_Logits(dec), (ids,))
    other = torch.randint(0, 32, (2, 10))
    torch.testing.assert_close(ep.module()(other), _Logits(dec)(other), **EXACT)
    assert "attnlab.flash_fwd" in ep.graph_module.print_readable(print_output=False)


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnlab.models import bridge

    bridge.register()
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=50,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).eval()
    model.set_attn_implementation("attnlab")
    return model


def _padded():
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    keep = torch.ones(2, 10, dtype=torch.long)
    keep[1, :3] = 0  # left padding: transformers builds a 4-D mask
    return ids, keep


def test_bridged_gpt2_with_padding_traces_fullgraph(gpt2):
    ids, keep = _padded()
    dynamo.reset()
    ex = dynamo.explain(lambda i, a: gpt2(input_ids=i, attention_mask=a).logits)(ids, keep)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]


def test_export_of_a_bridged_gpt2_matches_eager(gpt2):
    # transformers' 4-D padding mask has no structure: eagerly on CPU it runs the native kernel
    # through a BlockMask, exported it runs the flash op (no BlockMask is built while tracing), so
    # the two agree to float32 rounding, not bit for bit (docs/compile.md); a mask read wrongly
    # would be off by O(1)
    ids, keep = _padded()
    ep = torch.export.export(_Logits(gpt2), (ids, keep))
    assert "attnlab.flash_fwd" in ep.graph_module.print_readable(print_output=False)
    want = gpt2(input_ids=ids, attention_mask=keep).logits
    torch.testing.assert_close(ep.module()(ids, keep), want, **F32_FEW_ULPS)
    keep2 = keep.clone()
    keep2[0, :5] = 0  # another padding pattern: the exported program reads the mask's values
    torch.testing.assert_close(
        ep.module()(ids, keep2), gpt2(input_ids=ids, attention_mask=keep2).logits, **F32_FEW_ULPS
    )
