"""``attnlab bench models``: whole models against transformers, same weights, same run.

Cases (CPU, float32 unless named):

* GPT-2 (random weights, a small config): forward tokens/s and training-step tokens/s
  (forward + cross-entropy + backward + AdamW step) of attnlab's :class:`Decoder`
  loaded from the transformers checkpoint, against ``GPT2LMHeadModel`` with its default
  attention (SDPA).  bfloat16 forward too.
* The shipped MiniLM: sentences/s of attnlab's :class:`Encoder` (+ mean pooling)
  against transformers' ``BertModel`` on a padded batch of varied sentences.

Timing: every contender warmed up, then measured in interleaved rounds (A, B, A, B,
...) and the median reported; the ratio is attnlab's throughput over transformers'.
``--profile`` prints where attnlab's time goes (torch profiler, by operator).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from attnlab.bench.attention import machine_info


@dataclass
class GPTShape:
    n_layer: int = 6
    n_embd: int = 512
    n_head: int = 8
    vocab: int = 8192
    batch: int = 8
    seq: int = 256


SENTENCES = [
    "Attention is all you need.",
    "The cat sat on the mat.",
    "Rotary embeddings rotate query and key pairs.",
    "A KV cache stores the keys and values of earlier tokens so that decoding does not recompute them.",
    "Induction heads look back for the previous occurrence of the current token and copy what followed.",
    "short",
    "FlashAttention tiles the softmax so that the score matrix never exists in memory at once, "
    "which lets long sequences fit.",
    "¿Dónde está la biblioteca?",
    "Numbers like 3.14159 and 2.71828.",
    "Grouped-query attention shares each key/value head among several query heads.",
]


def _gpt2_pair(shape: GPTShape, dtype):
    from transformers.models.gpt2 import GPT2Config, GPT2LMHeadModel

    from attnlab.models import load

    cfg = GPT2Config(
        n_layer=shape.n_layer,
        n_embd=shape.n_embd,
        n_head=shape.n_head,
        vocab_size=shape.vocab,
        n_positions=max(1024, shape.seq),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours, _ = load(d)
    return hf.to(dtype), ours.to(dtype)


def _timed(fns: dict, reps: int, bar, label: str) -> dict:
    for n, f in fns.items():
        bar.set_postfix_str(f"{label} | {n} | warm-up")
        f()
        bar.update(1)
    times: dict[str, list[float]] = {n: [] for n in fns}
    for i in range(reps):
        for n, f in fns.items():
            bar.set_postfix_str(f"{label} | {n} | rep {i + 1}/{reps}")
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
            bar.update(1)
    return {n: statistics.median(t) for n, t in times.items()}


def _train_step(model, ids, opt, hf: bool):
    opt.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    opt.step()


def cases(quick: bool):
    s = GPTShape()
    if quick:
        s = GPTShape(n_layer=2, n_embd=256, n_head=4, vocab=4096, batch=4, seq=128)
    return s


def run(reps: int = 5, quick: bool = False, progress: bool = True) -> dict:
    from tqdm import tqdm
    from transformers.models.bert import BertModel

    from attnlab.models import load, minilm_path
    from attnlab.nn import mean_pool

    shape = cases(quick)
    plan = [("gpt2 forward f32", 2), ("gpt2 forward bf16", 2), ("gpt2 train step f32", 2), ("minilm encode f32", 2)]
    bar = tqdm(
        total=sum(n * (reps + 1) for _, n in plan),
        desc="bench models",
        unit="run",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    out = {"machine": machine_info(), "gpt2_shape": shape.__dict__, "cases": []}
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0))
    tokens = ids.numel()

    for dtype, name in ((torch.float32, "gpt2 forward f32"), (torch.bfloat16, "gpt2 forward bf16")):
        hf, ours = _gpt2_pair(shape, dtype)
        hf.eval(), ours.eval()
        with torch.no_grad():
            diff = (hf(ids).logits.float() - ours(ids).logits.float()).abs().max().item()
            t = _timed({"attnlab": lambda ours=ours: ours(ids), "transformers": lambda hf=hf: hf(ids)}, reps, bar, name)
        out["cases"].append(_case(name, "tokens/s", tokens, t, {"max_abs_logit_diff": diff}))

    hf, ours = _gpt2_pair(shape, torch.float32)
    hf.train(), ours.train()
    opts = {
        "attnlab": torch.optim.AdamW(ours.parameters(), lr=1e-4),
        "transformers": torch.optim.AdamW(hf.parameters(), lr=1e-4),
    }
    t = _timed(
        {
            "attnlab": lambda: _train_step(ours, ids, opts["attnlab"], False),
            "transformers": lambda: _train_step(hf, ids, opts["transformers"], True),
        },
        reps,
        bar,
        "gpt2 train step f32",
    )
    out["cases"].append(_case("gpt2 train step f32", "tokens/s", tokens, t, {}))

    ours, tok = load("minilm")
    hf = BertModel.from_pretrained(str(minilm_path())).eval()  # transformers' default attention (sdpa)
    sents = (SENTENCES * 7)[: 64 if not quick else 16]
    batch = tok(sents)

    def enc_ours():
        h = ours(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])
        return mean_pool(h.last_hidden_state, batch["attention_mask"])

    def enc_hf():
        return mean_pool(hf(**batch).last_hidden_state, batch["attention_mask"])

    with torch.no_grad():
        diff = (enc_ours() - enc_hf()).abs().max().item()
        t = _timed({"attnlab": enc_ours, "transformers": enc_hf}, reps, bar, "minilm encode f32")
    out["cases"].append(
        _case(
            "minilm encode f32",
            "sentences/s",
            len(sents),
            t,
            {"max_abs_diff": diff, "batch_tokens": list(batch["input_ids"].shape)},
        )
    )
    bar.close()
    return out


def _case(name, unit, work, t, extra):
    return {
        "case": name,
        "unit": unit,
        "attnlab": work / t["attnlab"],
        "transformers": work / t["transformers"],
        "ratio": t["transformers"] / t["attnlab"],
        **extra,
    }


def profile(quick: bool = False, rows: int = 12) -> str:
    """Where attnlab's GPT-2 training step spends its time, by operator (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    shape = cases(quick)
    _, ours = _gpt2_pair(shape, torch.float32)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    _train_step(ours, ids, opt, False)
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        _train_step(ours, ids, opt, False)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def format_table(res: dict) -> str:
    m = res["machine"]
    s = res["gpt2_shape"]
    lines = [
        f"torch {m['torch']}, {m['threads']} threads, {m['cpu']}, {m['date']}",
        f"GPT-2 shape: {s['n_layer']} layers, d_model {s['n_embd']}, {s['n_head']} heads, vocab {s['vocab']}, "
        f"batch {s['batch']} x {s['seq']} tokens",
        "",
    ]
    hdr = f"{'case':<22} {'unit':<12} {'attnlab':>10} {'transformers':>13} {'ratio':>7}  notes"
    lines += [hdr, "-" * len(hdr)]
    for c in res["cases"]:
        notes = ", ".join(
            f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
            for k, v in c.items()
            if k not in ("case", "unit", "attnlab", "transformers", "ratio")
        )
        lines.append(
            f"{c['case']:<22} {c['unit']:<12} {c['attnlab']:>10.1f} {c['transformers']:>13.1f} "
            f"{c['ratio']:>6.2f}x  {notes}"
        )
    return "\n".join(lines)


def main(quick: bool = False, json_path: str | None = None, reps: int = 5, show_profile: bool = False) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never wait on the network
    res = run(reps=reps, quick=quick)
    print(format_table(res))
    if show_profile:
        print("\nattnlab GPT-2 training step, by operator:\n" + profile(quick))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return res
