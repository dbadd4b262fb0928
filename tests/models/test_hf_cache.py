"""attnlab caches inside transformers models (``past_key_values=as_hf_cache(cache)``),
with transformers' own attention and with the attnlab bridge."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import F32_DECODE_STEPS

transformers = pytest.importorskip("transformers")

from attnlab.cache import DynamicCache, PagedCache, QuantizedCache, StaticCache, StreamingCache  # noqa: E402
from attnlab.models import bridge  # noqa: E402
from attnlab.models.hf_cache import as_hf_cache  # noqa: E402

PROMPT = torch.tensor([[5, 17, 3, 44, 9, 12, 7]])


def caches(kind, n_layers, hkv, dh):
    if kind == "dynamic":
        return DynamicCache(n_layers)
    if kind == "static":
        return StaticCache(n_layers, 1, hkv, dh, capacity=64)
    if kind == "paged":
        c = PagedCache(n_layers, 16, hkv, dh, block_size=4)
        seq, _ = c.add_sequence()
        return c.select([seq])
    raise AssertionError(kind)


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("attn", ["eager", "attnlab"])
def test_generation_with_an_attnlab_cache_equals_transformers_own(hf_checkpoint, name, kind, attn):
    _, hf = hf_checkpoint(name)
    bridge.register()
    hf.set_attn_implementation(attn)
    try:
        cfg = hf.config
        L = cfg.num_hidden_layers
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dh = cfg.hidden_size // cfg.num_attention_heads
        c = caches(kind, L, hkv, dh)
        kw = dict(
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        got = hf.generate(PROMPT, past_key_values=as_hf_cache(c), **kw)
        want = hf.generate(PROMPT, **kw)
    finally:
        hf.set_attn_implementation("eager")
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, **F32_DECODE_STEPS)
    seen = c.seen if isinstance(c.seen, int) else int(c.seen[0])
    assert seen == PROMPT.shape[1] + 9  # the last token is produced, not cached


def test_int8_cache_stays_close(hf_checkpoint):
    _, hf = hf_checkpoint("llama-gqa")
    kw = dict(
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    q = QuantizedCache(2, bits=8, group_size=4, residual=4)
    got = hf.generate(PROMPT, past_key_values=as_hf_cache(q), **kw)
    want = hf.generate(PROMPT, **kw)
    scale = max(float(x.abs().max()) for x in want.logits)
    err = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits, strict=True))
    assert 0 < err < 0.02 * scale  # quantized: not exact, but close (int8 step ~ range/255)


def test_caches_with_other_positions_are_refused():
    with pytest.raises(ValueError, match="non-contiguous positions"):
        as_hf_cache(StreamingCache(2, 2, 8))
    with pytest.raises(ValueError, match="non-contiguous positions"):
        as_hf_cache(StaticCache(2, 1, 2, 8, capacity=8, evict="window"))
