"""Checkpoint tokenizers (``tokenizer.json``, read with the ``tokenizers`` library).

Batches come back as tensors, right-padded to the longest sequence::

    tok(["a sentence", "another, longer sentence"]) ->
        {"input_ids": (B, N) int64, "attention_mask": (B, N) int64 (1 = real token),
         "token_type_ids": (B, N) int64}
"""

from __future__ import annotations

from pathlib import Path

import torch


class Tokenizer:
    def __init__(self, tok, *, max_length: int | None = None, pad_id: int = 0):
        self.tok = tok
        self.max_length = max_length
        self.pad_id = pad_id
        tok.no_padding()
        if max_length is not None:
            tok.enable_truncation(max_length)
        else:
            tok.no_truncation()

    @classmethod
    def from_folder(cls, folder, *, max_length: int | None = None) -> "Tokenizer | None":
        """The folder's ``tokenizer.json``, or ``None`` if it has none."""
        p = Path(folder) / "tokenizer.json"
        if not p.is_file():
            return None
        from tokenizers import Tokenizer as _Tok
        try:
            tok = _Tok.from_file(str(p))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise ValueError(f"{p}: not a readable tokenizer.json ({e})") from None
        pad = tok.padding["pad_id"] if tok.padding else (tok.token_to_id("[PAD]") or 0)
        return cls(tok, max_length=max_length, pad_id=pad)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(map(int, ids)))

    def __call__(self, texts) -> dict[str, torch.Tensor]:
        if isinstance(texts, str):
            texts = [texts]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("texts: expected a str or a list of str")
        encs = self.tok.encode_batch(list(texts))
        n = max((len(e.ids) for e in encs), default=0)
        ids = torch.full((len(encs), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encs), n), dtype=torch.long)
        types = torch.zeros((len(encs), n), dtype=torch.long)
        for i, e in enumerate(encs):
            k = len(e.ids)
            ids[i, :k] = torch.tensor(e.ids, dtype=torch.long)
            mask[i, :k] = 1
            types[i, :k] = torch.tensor(e.type_ids, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
