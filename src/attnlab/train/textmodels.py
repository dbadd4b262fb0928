"""Small decoders trained on the standard library's source, for the inference and
interpretability experiments.  Trained once with :func:`attnlab.train.train` and kept
in a folder (safetensors), so later runs load them in a second.

* ``target``: 4 layers, d_model 128, 4 heads (2 kv heads), RoPE — the model that streams,
  is quantized and is sped up.
* ``draft``: 1 layer, d_model 64 — the speculative draft.

:data:`LAB` is the one model the lab's streaming claim reads (``evicting-the-sink-collapses-quality``):
the target's design at half its width and depth, trained for fewer steps (about a sixth of the
work of :data:`SPECS`; no draft), so ``make demo`` and ``make test`` train it in seconds.  Each set
lives in its own folder (the caller's), with its own tokenizer trained the same way.

Every model reads a 1024-token byte-level BPE trained on the same text.  Every training window
opens with the end-of-text token, as a model's contexts open with BOS — which is what
lets an attention sink form on the first token (StreamingLLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab.nn import Decoder, DecoderConfig

SEQ = 128
#: The models of ``attnlab bench inference``: a target and its speculative draft.
SPECS: dict[str, dict[str, Any]] = {
    "target": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, steps=600, lr=3e-3),
    "draft": dict(d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, steps=300, lr=3e-3),
}
#: The lab's streaming claim: one target, no draft (measured on 2 loaded cores: 0.14 CPU s a step
#: against the bench target's 0.59).
LAB: dict[str, dict[str, Any]] = {
    "target": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, steps=400, lr=3e-3),
}
CORPUS_BYTES = 1_500_000
VOCAB = 1024


@dataclass
class TextModels:
    tokenizer: object
    target: Decoder
    draft: Decoder | None  # None for a set without one (:data:`LAB`)
    heldout: torch.Tensor  # 1-D token ids never trained on
    train_seconds: float


def _cfg(spec):
    return DecoderConfig(
        vocab_size=VOCAB,
        d_model=spec["d_model"],
        n_layers=spec["n_layers"],
        n_heads=spec["n_heads"],
        n_kv_heads=spec["n_kv_heads"],
        positions="rope",
        norm="rmsnorm",
        mlp="swiglu",
        act="silu",
        bias=False,
        max_positions=SEQ,
        d_mlp=3 * spec["d_model"],
    )


def load_or_train(
    folder="out/bench-cache/text-models", progress: bool = True, *, specs: dict[str, dict[str, Any]] | None = None
) -> TextModels:
    """The models of ``specs`` (default :data:`SPECS`; it must name a ``"target"``), loaded from
    ``folder`` when it holds this very set, else trained (tokenizer included) and saved there."""
    from attnlab.train import ByteBPE, TokenStream, TrainConfig, load_checkpoint, save_checkpoint, stdlib_corpus, train

    specs = SPECS if specs is None else specs
    if "target" not in specs or not set(specs) <= {"target", "draft"}:
        raise ValueError(f"specs: expected a 'target' and optionally a 'draft', got {sorted(specs)}")
    folder = Path(folder)
    key = json.dumps({"specs": specs, "seq": SEQ, "bytes": CORPUS_BYTES, "vocab": VOCAB, "v": 3}, sort_keys=True)
    texts = stdlib_corpus(CORPUS_BYTES, seed=0)
    fresh = not (folder / "key.json").is_file() or (folder / "key.json").read_text() != key
    if fresh:
        tok = ByteBPE.train(texts, VOCAB)
    else:
        tok = ByteBPE.load(folder / "tokenizer.json")
    stream = TokenStream.from_texts(texts, tok)
    tr, held = stream.split(0.9)
    models, seconds = {}, 0.0
    for name, spec in specs.items():
        torch.manual_seed(0)
        model = Decoder(_cfg(spec))
        ck = folder / name
        if not fresh and ck.is_dir():
            load_checkpoint(ck, model)
        else:
            cfg = TrainConfig(
                steps=spec["steps"], batch_size=16, seq_len=SEQ, lr=spec["lr"], warmup_steps=spec["steps"] // 20, seed=0
            )
            res = train(model, document_batches(tr.tokens, tok.eot_id, 16, SEQ, seed=0), cfg, progress=progress)
            seconds += res.elapsed_s
            save_checkpoint(ck, model, None, spec["steps"], {"final_loss": res.losses[-1]})
        models[name] = model.eval()
    if fresh:
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(folder / "tokenizer.json")
        (folder / "key.json").write_text(key)
    # held-out text opens with end-of-text, as every training window does
    h = torch.cat([torch.tensor([tok.eot_id]), held.tokens])
    return TextModels(tok, models["target"], models.get("draft"), h, seconds)


def document_batches(tokens: torch.Tensor, eot: int, batch_size: int, seq_len: int, *, seed: int):
    """Endless ``(inputs, targets)`` of ``seq_len`` tokens: the end-of-text token (a BOS)
    followed by a random window of the stream, drawn with a seeded generator."""
    if tokens.numel() < seq_len + 1:
        raise ValueError(f"document_batches: {tokens.numel()} tokens cannot fill a window of {seq_len}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(seq_len)
    bos = torch.full((batch_size, 1), eot, dtype=torch.long)
    while True:
        s = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=g)
        w = torch.cat([bos, tokens[s[:, None] + idx]], 1)
        yield w[:, :-1], w[:, 1:]
