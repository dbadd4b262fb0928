"""``attnlab train``: a small Decoder trained on CPU, end to end.

Tasks: ``text`` (a byte-level BPE trained on the Python standard library's source,
then next-token prediction on it), ``induction`` (random sequences repeated twice:
the second half is predictable only by copying) and ``recall`` (associative recall of
key/value pairs).
"""

from __future__ import annotations

import math
import time

import torch

from attnlab.nn import Decoder, DecoderConfig
from attnlab.train.atomic import check_writable_folder
from attnlab.train.data import TokenStream, associative_recall, repeated_sequences
from attnlab.train.loop import TrainConfig, train
from attnlab.train.tokenizer import ByteBPE, stdlib_corpus

TASKS = ("text", "induction", "recall")


def build(task: str, *, vocab: int, seq_len: int, batch: int, seed: int, corpus_bytes: int = 1_000_000):
    """``(batches, eval_batches, vocab_size, tokenizer or None)`` for a task."""
    if task == "text":
        t0 = time.perf_counter()
        texts = stdlib_corpus(corpus_bytes, seed=seed)
        tok = ByteBPE.train(texts, vocab)
        stream = TokenStream.from_texts(texts, tok)
        tr, va = stream.split(0.95)
        print(
            f"tokenizer: {tok.vocab_size} tokens trained on {sum(map(len, texts)) / 1e6:.1f} MB of stdlib "
            f"source in {time.perf_counter() - t0:.1f} s; {len(stream)} tokens"
        )
        evals = list(va.eval_batches(batch, seq_len))[:8]
        return tr.batches(batch, seq_len, seed=seed), evals, tok.vocab_size, tok
    if task == "induction":
        ev = repeated_sequences(vocab, batch, seq_len, seed=seed + 1)
        return repeated_sequences(vocab, batch, seq_len, seed=seed), [next(ev) for _ in range(4)], vocab, None
    if task == "recall":
        n_pairs = max(1, (seq_len - 2) // 2)
        ev = associative_recall(vocab, batch, n_pairs, seed=seed + 1)
        return associative_recall(vocab, batch, n_pairs, seed=seed), [next(ev) for _ in range(4)], vocab, None
    raise ValueError(f"task: expected one of {TASKS}, got {task!r}")


def main(
    task="induction",
    steps=300,
    layers=2,
    d_model=128,
    heads=4,
    positions="rope",
    seq_len=64,
    batch=16,
    lr=3e-3,
    vocab=None,
    seed=0,
    out=None,
    resume=False,
    attn_only=False,
) -> dict:
    if resume and not out:
        raise ValueError(
            "--resume (resume=True) needs --out DIR (out=...): the folder whose latest checkpoint to continue from"
        )
    if out:  # before the tokenizer and the training run, not at the first save
        check_writable_folder(out, "--out")
    vocab = vocab or (512 if task == "text" else 64)
    batches, evals, V, tok = build(task, vocab=vocab, seq_len=seq_len, batch=batch, seed=seed)
    if task == "recall":
        seq_len = next(iter(evals))[0].shape[1]
    cfg = DecoderConfig(
        vocab_size=V,
        d_model=d_model,
        n_layers=layers,
        n_heads=heads,
        positions=positions,
        max_positions=max(1024, seq_len),
        attn_only=attn_only,
    )
    torch.manual_seed(seed)
    model = Decoder(cfg)
    tcfg = TrainConfig(
        steps=steps,
        batch_size=batch,
        seq_len=seq_len,
        lr=lr,
        warmup_steps=max(1, steps // 20),
        seed=seed,
        eval_every=max(1, steps // 5),
        checkpoint_dir=out,
        checkpoint_every=max(1, steps // 5) if out else None,
    )
    res = train(model, batches, tcfg, eval_batches=evals, resume=out if resume else None)
    first = sum(res.losses[:10]) / max(1, len(res.losses[:10]))
    last = sum(res.losses[-10:]) / max(1, len(res.losses[-10:]))
    summary = {
        "task": task,
        "steps": res.final_step,
        "params": sum(p.numel() for p in model.parameters()),
        "loss_first10": first,
        "loss_last10": last,
        "eval": res.eval_losses[-1:] or None,
        "tokens_per_s": res.tokens_per_second,
        "uniform_loss": math.log(V),
    }
    print(
        f"{task}: {summary['params']:,} parameters, loss {first:.3f} -> {last:.3f} (uniform {math.log(V):.3f}), "
        f"eval {res.eval_losses[-1][1]:.3f}, {res.tokens_per_second:,.0f} tokens/s"
        if res.eval_losses
        else ""
    )
    if tok is not None:
        model.eval()
        ids = torch.tensor([tok.encode("def ")])
        with torch.no_grad():
            for _ in range(40):
                nxt = model(ids[:, -seq_len:]).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
        print("greedy sample:", repr(tok.decode(ids[0].tolist())))
    return summary
