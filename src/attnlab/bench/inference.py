"""``attnlab bench inference``: decoding, caches, quantization, streaming, speculation.

Everything runs on CPU in one process, anchors side by side:

1. **Decode speed** — attnlab's ``generate`` (static cache) against transformers'
   ``GPT2LMHeadModel.generate`` with the same weights (greedy, fixed length).
2. **Cache memory per token** — bytes each cache kind holds (its tensors' storage)
   after the same 1,024 tokens.
3. **Quantized perplexity** — held-out text through a float cache and through int8 /
   int4 / int2 caches, in 64-token chunks, with a model trained by ``attnlab.train``.
4. **StreamingLLM** — perplexity on a long held-out text: dense attention over the whole
   text, window only, sinks + window, and a sliding window recomputed for every token;
   with the speed of sinks + window against the recomputation.
5. **Speculative decoding** — acceptance and wall-clock speed-up of a 1-layer draft for
   the 4-layer target (chain and tree), against plain greedy decoding of the target.
6. **Paged waste** — allocated minus used slots for a batch of ragged sequences.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from attnlab.bench.attention import machine_info
from attnlab.lab.streaming import streaming_table


def _median_time(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def decode_speed(reps=3, new_tokens=128, shapes=((4, 256, 4096, 1), (4, 256, 4096, 8), (2, 128, 1024, 1))):
    from transformers.models.gpt2 import GPT2Config, GPT2LMHeadModel

    from attnlab.generate import generate
    from attnlab.models import load

    rows = []
    for L, D, V, B in shapes:
        cfg = GPT2Config(n_layer=L, n_embd=D, n_head=4, vocab_size=V, n_positions=1024, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(cfg).eval()
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            ours, _ = load(d)
        prompt = torch.randint(1, V, (B, 64), generator=torch.Generator().manual_seed(0))
        a = generate(ours, prompt, max_new_tokens=new_tokens, cache="static")
        h = hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        same = sum(
            x == y for r, s in zip(a.new_tokens, h[:, 64:].tolist(), strict=False) for x, y in zip(r, s, strict=False)
        )
        fns = {
            "attnlab": lambda ours=ours, prompt=prompt: generate(
                ours, prompt, max_new_tokens=new_tokens, cache="static"
            ),
            "transformers": lambda hf=hf, prompt=prompt: hf.generate(
                prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            ),
        }
        t: dict[str, list[float]] = {n: [] for n in fns}
        for f in fns.values():
            f()
        for _ in range(reps):  # interleaved rounds
            for n, f in fns.items():
                t0 = time.perf_counter()
                f()
                t[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(v) for n, v in t.items()}
        rows.append(
            {
                "layers": L,
                "d_model": D,
                "vocab": V,
                "batch": B,
                "prompt": 64,
                "new_tokens": new_tokens,
                "attnlab_tok_s": B * new_tokens / med["attnlab"],
                "transformers_tok_s": B * new_tokens / med["transformers"],
                "ratio": med["transformers"] / med["attnlab"],
                "same_tokens": f"{same}/{B * new_tokens}",
            }
        )
    return rows


def cache_memory(n_tokens=1024, n_layers=4, n_kv_heads=4, d_head=64):
    from attnlab import cache as C

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, n_kv_heads, n_tokens, d_head, generator=g)
    v = torch.randn(1, n_kv_heads, n_tokens, d_head, generator=g)
    kinds: dict[str, Any] = {
        "dynamic float32": lambda: C.DynamicCache(n_layers),
        "static float32 (capacity 2048)": lambda: C.StaticCache(n_layers, 1, n_kv_heads, d_head, 2048),
        "dynamic bfloat16": lambda: C.DynamicCache(n_layers),
        "quantized int8": lambda: C.QuantizedCache(n_layers, bits=8),
        "quantized int4": lambda: C.QuantizedCache(n_layers, bits=4),
        "quantized int2": lambda: C.QuantizedCache(n_layers, bits=2),
        "streaming 4+252": lambda: C.StreamingCache(n_layers, 4, 252),
    }
    if hasattr(C, "PagedCache"):
        kinds["paged float32 (block 16)"] = None
    rows = []
    for name, make in kinds.items():
        if make is None:
            c = C.PagedCache(n_layers, n_tokens // 16 + 4, n_kv_heads, d_head, block_size=16)
            seq, _ = c.add_sequence()
            c.select([seq])
        else:
            c = make()
        kk, vv = (k.bfloat16(), v.bfloat16()) if "bfloat16" in name else (k, v)
        for layer in range(n_layers):
            if name.startswith("streaming"):
                for t0 in range(0, n_tokens, 1):
                    c.update(layer, kk[:, :, t0 : t0 + 1], vv[:, :, t0 : t0 + 1])
            else:
                c.update(layer, kk, vv)
        if hasattr(c, "nbytes"):
            nbytes = c.nbytes()
        elif isinstance(c, C.DynamicCache):
            nbytes = sum(t.numel() * t.element_size() for t in c.k + c.v if t is not None)
        else:
            raise TypeError(f"{name}: {type(c).__name__} has neither nbytes() nor k/v lists")
        rows.append(
            {
                "cache": name,
                "bytes": nbytes,
                "bytes_per_token": nbytes / n_tokens,
                "vs_float32": nbytes / (2 * n_layers * n_kv_heads * d_head * 4 * n_tokens),
            }
        )
    return rows


def _nll_chunks(model, ids, cache, chunk):
    """Mean next-token NLL of ``ids`` (1-D) fed in chunks through ``cache``."""
    tot, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, chunk):
            x = ids[s : min(s + chunk, len(ids) - 1)][None]
            y = ids[s + 1 : s + 1 + x.shape[1]]
            lg = model(x, cache=cache).logits[0].float()
            tot += float(torch.nn.functional.cross_entropy(lg, y, reduction="sum"))
            n += y.numel()
    return tot / n


def quantized_perplexity(tm, n_tokens=2048, chunk=64):
    from attnlab.cache import DynamicCache, QuantizedCache

    ids = tm.heldout[: n_tokens + 1]
    rows = []

    # the model was trained on 128-token windows: evaluate 128-token documents one after another
    def run(make):
        tot = 0.0
        docs = [ids[i : i + 129] for i in range(0, n_tokens - 128, 128)]
        for d in docs:
            tot += _nll_chunks(tm.target, d, make(), 16)
        return tot / len(docs)

    base = run(lambda: DynamicCache(tm.target.cfg.n_layers))
    rows.append({"cache": "float32", "ppl": math.exp(base), "delta_ppl": 0.0})
    for bits in (8, 4, 2):
        nll = run(lambda bits=bits: QuantizedCache(tm.target.cfg.n_layers, bits=bits, group_size=16, residual=16))
        rows.append(
            {
                "cache": f"int{bits} (group 16, window 16)",
                "ppl": math.exp(nll),
                "delta_ppl": math.exp(nll) - math.exp(base),
            }
        )
    return rows


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def streaming_generation(tm, n_tokens=20_000, sinks=4, window=124, bar=None):
    """Generate ``n_tokens`` with a StreamingCache; the cache's bytes and the process's
    resident set at checkpoints (both should stop growing once the window is full)."""
    from attnlab.cache import StreamingCache
    from attnlab.generate import Sampling, stream

    c = StreamingCache.for_model(tm.target, sinks=sinks, window=window)
    marks, t0 = [], time.perf_counter()
    checkpoints = {1_000, n_tokens // 4, n_tokens // 2, n_tokens}
    prompt = [tm.heldout[:8].tolist()]
    for i, _ in enumerate(
        stream(
            tm.target, prompt, max_new_tokens=n_tokens, cache=c, sampling=Sampling(temperature=0.8, top_k=40), seed=0
        ),
        start=1,
    ):
        if bar is not None:
            bar.update(1)
        if i in checkpoints:
            marks.append({"tokens": i, "cache_bytes": c.nbytes(), "rss_mib": _rss_kib() / 1024})
    return {"tokens": n_tokens, "tok_s": n_tokens / (time.perf_counter() - t0), "marks": marks}


def speculative_table(tm, new_tokens=96, prompts=4):
    from attnlab.generate import generate
    from attnlab.speculative import speculative_generate

    rows = []
    ps = [tm.heldout[i * 500 : i * 500 + 32].tolist() for i in range(prompts)]
    t0 = time.perf_counter()
    base = [generate(tm.target, [p], max_new_tokens=new_tokens, cache="dynamic").new_tokens[0] for p in ps]
    t_base = time.perf_counter() - t0
    rows.append({"method": "target greedy (dynamic cache)", "tok_s": prompts * new_tokens / t_base})
    t0 = time.perf_counter()
    for p in ps:
        generate(tm.draft, [p], max_new_tokens=new_tokens, cache="dynamic")
    rows.append({"method": "draft greedy (dynamic cache)", "tok_s": prompts * new_tokens / (time.perf_counter() - t0)})
    for branching in ((1, 1, 1), (1, 1, 1, 1, 1), (2, 2, 1), (3, 2, 2, 1)):
        t0 = time.perf_counter()
        outs = [
            speculative_generate(tm.target, tm.draft, p, max_new_tokens=new_tokens, branching=branching) for p in ps
        ]
        t = time.perf_counter() - t0
        rows.append(
            {
                "method": f"speculative, tree {branching}",
                "tok_s": prompts * new_tokens / t,
                "speedup": t_base / t,
                "accepted_per_round": statistics.mean(o.acceptance_rate for o in outs),
                "tokens_per_target_pass": statistics.mean(o.tokens_per_round for o in outs),
                "equals_greedy": all(o.tokens == b for o, b in zip(outs, base, strict=True)),
            }
        )
    return rows


def paged_waste(n_seqs=16, block_size=16, seed=0):
    from attnlab import cache as C

    if not hasattr(C, "PagedCache"):
        return None
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 501, (n_seqs,), generator=g).tolist()
    c = C.PagedCache(1, sum(-(-n // block_size) for n in lengths) + 8, 1, 8, block_size=block_size)
    for n in lengths:
        s, _ = c.add_sequence()
        c.select([s])
        c.update(0, torch.zeros(1, 1, n, 8), torch.zeros(1, 1, n, 8))
    w = c.waste()
    total = w["total"] if isinstance(w, dict) else int(w)
    return {
        "sequences": n_seqs,
        "block_size": block_size,
        "tokens": sum(lengths),
        "waste_slots": total,
        "waste_blocks_per_sequence": total / block_size / n_seqs,
    }


def run(quick: bool = False, reps: int = 3, progress: bool = True) -> dict:
    from tqdm import tqdm

    from attnlab.train.textmodels import load_or_train

    out: dict[str, Any] = {"machine": machine_info()}
    steps = ["decode", "memory", "models", "quantized", "streaming", "speculative", "paged"]
    bar = tqdm(total=len(steps), desc="bench inference", unit="part", disable=not progress, file=sys.stderr)
    bar.set_postfix_str("decode vs transformers")
    out["decode"] = decode_speed(
        reps=1 if quick else reps,
        new_tokens=32 if quick else 128,
        shapes=((2, 128, 1024, 1),) if quick else ((4, 256, 4096, 1), (4, 256, 4096, 8), (2, 128, 1024, 1)),
    )
    bar.update(1)
    bar.set_postfix_str("cache memory")
    out["memory"] = cache_memory(n_tokens=256 if quick else 1024)
    bar.update(1)
    bar.set_postfix_str("text models (trained once, then cached)")
    tm = load_or_train(progress=progress)
    out["train_seconds"] = tm.train_seconds
    bar.update(1)
    bar.set_postfix_str("quantized perplexity")
    out["quantized"] = quantized_perplexity(tm, n_tokens=512 if quick else 2048)
    bar.update(1)
    bar.set_postfix_str("StreamingLLM")
    n = 512 if quick else 3072
    with tqdm(total=3 * n, desc="streaming", unit="tok", disable=not progress, file=sys.stderr, leave=False) as sb:
        out["streaming"] = streaming_table(tm, n_tokens=n, bar=sb)
    bar.update(1)
    n = 2_000 if quick else 20_000
    with tqdm(
        total=n, desc="streaming generation", unit="tok", disable=not progress, file=sys.stderr, leave=False
    ) as sb:
        out["streaming_generation"] = streaming_generation(tm, n_tokens=n, bar=sb)
    bar.set_postfix_str("speculative decoding")
    out["speculative"] = speculative_table(tm, new_tokens=32 if quick else 96, prompts=2 if quick else 4)
    bar.update(1)
    out["paged"] = paged_waste()
    bar.update(1)
    bar.close()
    return out


def format_report(r: dict) -> str:
    m = r["machine"]
    L = [f"torch {m['torch']}, {m['threads']} threads, {m['cpu']}, {m['date']}", "", "Decode (greedy, static cache):"]
    for d in r["decode"]:
        L.append(
            f"  GPT-2 {d['layers']}L d{d['d_model']} V{d['vocab']} batch {d['batch']}: attnlab "
            f"{d['attnlab_tok_s']:.0f} tok/s, transformers {d['transformers_tok_s']:.0f} tok/s, "
            f"{d['ratio']:.2f}x (same tokens {d['same_tokens']})"
        )
    L.append("\nCache memory after 1,024 tokens (4 layers, 4 kv heads, d_head 64):")
    for c in r["memory"]:
        L.append(f"  {c['cache']:<32} {c['bytes_per_token']:>8.0f} B/token  {c['vs_float32']:.3f}x float32")
    L.append("\nQuantized KV perplexity (held-out stdlib text):")
    for q in r["quantized"]:
        L.append(f"  {q['cache']:<28} ppl {q['ppl']:.3f}  (+{q['delta_ppl']:.3f})")
    L.append("\nStreamingLLM (held-out stdlib text):")
    for s in r["streaming"]:
        sp = f"  {s['tok_s']:.0f} tok/s" if s.get("tok_s") else ""
        L.append(f"  {s['method']:<55} ppl {s['ppl']:>10.2f}{sp}")
    if r.get("streaming_generation"):
        g = r["streaming_generation"]
        L.append(
            f"  generating {g['tokens']} tokens with sinks + window: {g['tok_s']:.0f} tok/s; "
            + ", ".join(
                f"{m['tokens']}: cache {m['cache_bytes'] / 1024:.0f} KiB, RSS {m['rss_mib']:.0f} MiB"
                for m in g["marks"]
            )
        )
    L.append("\nSpeculative decoding (1-layer draft, 4-layer target):")
    for s in r["speculative"]:
        extra = (
            ""
            if "speedup" not in s
            else (
                f", speed-up {s['speedup']:.2f}x, accepted/round "
                f"{s['accepted_per_round']:.2f}, tokens/target pass "
                f"{s['tokens_per_target_pass']:.2f}, equals greedy {s['equals_greedy']}"
            )
        )
        L.append(f"  {s['method']:<32} {s['tok_s']:.0f} tok/s{extra}")
    if r.get("paged"):
        p = r["paged"]
        L.append(
            f"\nPaged waste: {p['sequences']} sequences, {p['tokens']} tokens, block {p['block_size']}: "
            f"{p['waste_slots']} slots = {p['waste_blocks_per_sequence']:.2f} blocks per sequence"
        )
    return "\n".join(L)


def main(quick=False, json_path=None, reps=3) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never wait on the network
    r = run(quick=quick, reps=reps)
    print(format_report(r))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(r, f, indent=1)
    return r
