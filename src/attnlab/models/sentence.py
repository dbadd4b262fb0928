"""Sentence embeddings as sentence-transformers computes them for all-MiniLM-L6-v2:
mean of the last hidden states over real tokens, then L2-normalised."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.nn import mean_pool


@torch.no_grad()
def sentence_embeddings(model, tokenizer, sentences, *, batch_size: int = 32, normalize: bool = True):
    """``(len(sentences), d_model)`` float32 embeddings, batched by ``batch_size``."""
    if isinstance(sentences, str):
        raise TypeError("sentences: expected a list of str, got one str (wrap it in a list)")
    out = []
    for i in range(0, len(sentences), batch_size):
        b = tokenizer(sentences[i : i + batch_size])
        h = model(b["input_ids"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"])
        e = mean_pool(h.last_hidden_state.float(), b["attention_mask"])
        out.append(F.normalize(e, dim=-1) if normalize else e)
    if not out:
        return torch.zeros(0, model.cfg.d_model)
    return torch.cat(out)
