"""attnlab caches inside transformers models: ``past_key_values=as_hf_cache(cache)``.

transformers' models call ``past_key_values.update(k, v, layer_idx)`` and read back
dense keys and values; this adapter forwards each call to an attnlab cache
(``cache.update(layer, k, v)``) and hands transformers the view's dense tensors
(``kv.dense()``), so a transformers model keeps its code and stores its keys and
values the attnlab way — in a preallocated :class:`~attnlab.cache.StaticCache`, or
quantized in a :class:`~attnlab.cache.QuantizedCache` (dequantized when read).

Caches whose positions are not the plain ``0..seen-1`` (``StreamingCache``, ``H2OCache``,
``StaticCache(evict="window")``, ragged ``PagedCache`` batches) are refused: transformers
builds its masks and positions for contiguous caches.

>>> import pytest; _ = pytest.importorskip("transformers")
>>> import torch, transformers
>>> from attnlab.cache import StaticCache
>>> from attnlab.models.hf_cache import as_hf_cache
>>> cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                                num_attention_heads=4, num_key_value_heads=2)
>>> _ = torch.manual_seed(0); model = transformers.LlamaForCausalLM(cfg).eval()
>>> ids = torch.tensor([[3, 1, 4, 1, 5]])
>>> cache = StaticCache(2, 1, 2, 8, capacity=32)
>>> out = model.generate(ids, past_key_values=as_hf_cache(cache), max_new_tokens=6, do_sample=False)
>>> torch.equal(out, model.generate(ids, max_new_tokens=6, do_sample=False)), cache.seen
(True, 10)
"""

from __future__ import annotations


def as_hf_cache(cache):
    """Wrap an attnlab :class:`~attnlab.cache.Cache` for ``past_key_values=``."""
    from transformers.cache_utils import Cache as HFCache, CacheLayerMixin

    if (
        getattr(cache, "rotates_keys", False)
        or isinstance(getattr(cache, "evict", None), str)
        or type(cache).__name__ == "H2OCache"
    ):
        raise ValueError(
            f"as_hf_cache: {type(cache).__name__} keeps non-contiguous positions; transformers builds "
            "masks for a contiguous cache (use DynamicCache, StaticCache, QuantizedCache or PagedCache)"
        )

    class _Layer(CacheLayerMixin):
        is_sliding = False
        is_compileable = False

        def __init__(self, layer):
            super().__init__()
            self.layer = layer
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            kv = cache.update(self.layer, key_states, value_states).dense()
            return kv.k, kv.v

        def _seen(self):
            s = cache.seen_at(self.layer)
            if not isinstance(s, int):
                if bool((s != s.view(-1)[0]).any()):
                    raise ValueError("as_hf_cache: ragged sequences (different lengths per row) are not supported")
                s = int(s.view(-1)[0])
            return s

        def get_seq_length(self):
            return self._seen()

        def get_mask_sizes(self, query_length):
            return self._seen() + query_length, 0

        def get_max_length(self):
            return getattr(cache, "capacity", -1) or -1

        def reset(self):
            cache.reset()

    class _Adapter(HFCache):
        def __init__(self):
            super().__init__(layers=[_Layer(i) for i in range(cache.n_layers)])
            self.attnlab_cache = cache

    return _Adapter()
