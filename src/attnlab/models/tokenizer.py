"""Checkpoint tokenizers (``tokenizer.json``, read with the ``tokenizers`` library).

Batches come back as tensors, right-padded to the longest sequence::

    tok(["a sentence", "another, longer sentence"]) ->
        {"input_ids": (B, N) int64, "attention_mask": (B, N) int64 (1 = real token),
         "token_type_ids": (B, N) int64}
"""

from __future__ import annotations

from pathlib import Path

import torch


def _id_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() > 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"ids: expected integer ids (N,), got a {tuple(ids.shape)} {ids.dtype} tensor")
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"ids: expected a sequence of ints or an integer tensor, got {type(ids).__name__}")
    out = list(ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise TypeError(f"ids: expected ints, got {[type(i).__name__ for i in out if not isinstance(i, int)][:3]}")
    return out


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
    def from_folder(cls, folder, *, max_length: int | None = None) -> Tokenizer | None:
        """The folder's ``tokenizer.json``, or ``None`` if it has none."""
        p = Path(folder) / "tokenizer.json"
        if not p.is_file():
            return None
        from tokenizers import Tokenizer as _Tok

        try:
            tok = _Tok.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
            raise ValueError(f"{p}: not a readable tokenizer.json ({e})") from None
        pad = tok.padding["pad_id"] if tok.padding else (tok.token_to_id("[PAD]") or 0)
        return cls(tok, max_length=max_length, pad_id=pad)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (``[CLS]``, ``[SEP]``, ``[PAD]`` ...) are dropped
        unless ``skip_special_tokens=False``."""
        return self.tok.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)

    def to_str_tokens(self, text_or_ids) -> list:
        """One display string per token, special tokens visible (TransformerLens' ``to_str_tokens``).

        ``text_or_ids``: a ``str`` (encoded as :meth:`encode` does, so ``[CLS]``/``[SEP]`` are
        included), a list of ids, or an integer tensor ``(N,)``; ``(B, N)`` gives one list per
        row.  Each id is decoded alone with special tokens kept (``[CLS]``, ``##ing``, ``' the'``);
        an id whose decoding is empty shows its vocabulary entry instead.
        MiniLM: ``tok.to_str_tokens("unbelievably")`` is ``['[CLS]', 'un', '##bel', '##ie',
        '##va', '##bly', '[SEP]']`` (``tok.decode([101])`` is ``''``).
        """
        if isinstance(text_or_ids, str):
            ids = self.encode(text_or_ids)
        elif isinstance(text_or_ids, torch.Tensor) and text_or_ids.dim() == 2:
            return [self.to_str_tokens(row) for row in text_or_ids]
        else:
            ids = _id_list(text_or_ids)
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"text_or_ids: ids must be in [0, {n}) (vocab_size={n}); got {bad[:5]}")
        out = []
        for i in ids:
            s = self.tok.decode([i], skip_special_tokens=False)
            out.append(s if s else (self.tok.id_to_token(i) or ""))
        return out

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
