"""``attnlab demo``, ``attnlab report`` and ``attnlab inspect``: the main job and its report.

``demo`` trains (or loads from the lab cache) the induction models, analyses the
pretrained MiniLM's sinks, decodes with the KV cache, compares softmax attention, linear
attention and a state-space mixer on associative recall, measures Hopfield capacity, runs
the seeds' claims, prints a summary table and writes one offline HTML report.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from attnlab.lab import pages


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def continuations(model, cfg, n: int = 4, seed: int = 0) -> list[dict]:
    """Greedy continuations of repeated segments, with the static KV cache and without."""
    from attnlab.generate import generate
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        P = int(torch.randint(cfg.p_min, min(cfg.p_max, 14) + 1, (1,), generator=g))
        seg = torch.randperm(cfg.vocab, generator=g)[:P]  # distinct: the continuation is unambiguous
        prompt_len = P + P // 2
        new = min(cfg.seq_len - prompt_len, 16)
        full = seg[torch.arange(prompt_len + new) % P]
        prompt = full[:prompt_len].view(1, -1)
        cached = torch.as_tensor(generate(model, prompt, max_new_tokens=new, cache="static").new_tokens[0])
        plain = torch.as_tensor(generate(model, prompt, max_new_tokens=new, cache=None).new_tokens[0])
        want = full[prompt_len:]
        got = cached
        rows.append({"prompt": " ".join(map(str, prompt[0].tolist())), "continuation": " ".join(map(str, got.tolist())),
                     "expected": " ".join(map(str, want.tolist())),
                     "accuracy": float((got == want).float().mean()),
                     "equal": torch.equal(cached, plain)})
    return rows


def demo(out: str = "out/report.html", *, quick: bool = False, force: bool = False, claims: bool = True) -> Path:
    """Run the lab's main experiments and write the report; returns its path."""
    from attnlab.lab import induction, sinks
    from attnlab.report import Report
    t0 = time.perf_counter()
    torch.manual_seed(0)
    _say("[1/5] induction heads: training a 2-layer and a 1-layer attention-only model (cached after the first run)")
    ind = induction.run(quick=quick, force=force)
    cfg = induction.InductionConfig(**ind["config"])
    model2, _ = induction.load_or_train(cfg, 2)
    _say("[2/5] attention sinks in the pretrained MiniLM")
    from attnlab.models import load
    mini, tok = load("minilm")
    mini.eval()
    snk = sinks.analyse(mini, tok)
    _say("[3/5] decoding with the KV cache")
    gens = continuations(model2, cfg)
    _say("[4/5] associative recall: softmax vs linear attention vs a state-space model (cached after the first run)")
    from attnlab.lab import hopfield, recall
    rec = recall.run(quick=quick, force=force)
    hop = hopfield.run()
    results = []
    if claims:
        _say("[5/5] the seeds' claims")
        from attnlab.lab.claims import run_claims
        results = run_claims()
    r = Report("attnlab demo", subtitle="Induction heads forming, attention sinks in a real model, KV-cache "
               "decoding and the seed texts' claims — everything measured on this machine.")
    pages.induction_section(r, ind, model2, cfg)
    pages.sinks_section(r, snk, mini, tok)
    pages.generation_section(r, gens)
    pages.recall_section(r, rec)
    pages.hopfield_section(r, hop)
    for name, section in (("crossover", pages.crossover_section),):  # measured by `attnlab lab <name>`
        cached = _cached(name)
        if cached is not None:
            section(r, cached)
    if results:
        pages.claims_section(r, results)
    path = r.write(out)
    print(_summary(ind, snk, gens, rec, results, time.perf_counter() - t0))
    print(f"\nreport: {path.resolve()}  (one offline HTML file; open it in a browser)")
    return path


def _cached(name: str):
    """A lab experiment's cached result (``attnlab lab <name>`` writes it), or None."""
    import json
    from attnlab.lab import cache_dir
    p = cache_dir(name) / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _summary(ind, snk, gens, rec, results, seconds) -> str:
    from attnlab.lab.induction import summary
    lines = ["", "== induction heads ==", summary(ind), "", "== attention sinks (MiniLM) ==",
             __import__("attnlab.lab.sinks", fromlist=["summary"]).summary(snk), "",
             "== KV-cache decoding ==",
             f"{len(gens)} continuations: mean accuracy {sum(g['accuracy'] for g in gens) / len(gens):.2f}, "
             f"cache = recompute in {sum(g['equal'] for g in gens)}/{len(gens)}",
             "", "== associative recall (MQAR) ==",
             __import__("attnlab.lab.recall", fromlist=["summary"]).summary(rec)]
    if results:
        from collections import Counter
        c = Counter(x.verdict.value if x.verdict is not None else "error" for x in results)
        lines += ["", "== the seeds' claims ==", f"{len(results)} claims: " + ", ".join(f"{n} {v}" for v, n in
                                                                                     c.items())
                  + "  (attnlab claims for the table)"]
    lines.append(f"\ndone in {seconds:.0f} s")
    return "\n".join(lines)


def inspect(text: str, *, model_name: str = "minilm", out: str = "out/inspect.html") -> Path:
    """Score every head of a loaded model on ``text``, print the table, write the report."""
    from attnlab.interp import detectors as D
    from attnlab.interp.capture import capture
    from attnlab.models import load
    from attnlab.report import Report
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text: expected a non-empty string")
    model, tok = load(model_name)
    model.eval()
    if tok is None:
        raise ValueError(f"model {model_name!r}: no tokenizer.json next to the weights; inspect needs one")
    b = tok([text])
    ids = b["input_ids"]
    encoder = "token_type_ids" in b and hasattr(model, "pooler")
    kw = {"attention_mask": b["attention_mask"]}
    if encoder:
        kw["token_type_ids"] = b["token_type_ids"]
    fwd = (lambda m, x: m(x, **kw))
    scores = D.detect(model, ids, forward=fwd, value_weighted_too=True)
    with torch.no_grad(), capture(model) as cap:
        fwd(model, ids)
    pats = torch.stack([cap.pattern(l)[0] for l in cap.layers])
    ent = torch.stack([cap.stats(l).per_head()["entropy"] for l in cap.layers])
    toks = tok.to_str_tokens(ids[0])                  # special tokens ([CLS], [SEP]) visible
    shown = " ".join(repr(t) for t in toks[:40]) + (" …" if len(toks) > 40 else "")
    lines = [f"tokens: {shown}",
             f"{len(toks)} tokens, {pats.shape[0]} layers × {pats.shape[1]} heads",
             f"{'detector':<22} top heads (score)"]
    for name, hs in scores.items():
        lines.append(f"{name:<22} " + ", ".join(f"L{l}H{h} {s:.2f}" for l, h, s in hs.top(4)))
    print("\n".join(lines))
    r = Report(f"attnlab inspect: {model_name}", subtitle=f"{len(toks)} tokens: {text[:200]}")
    r.section("Patterns")
    r.heatmaps(pats, toks, title="Attention patterns (all layers and heads)")
    from attnlab.report.token_view import MAX_TOKENS
    if len(toks) <= MAX_TOKENS:
        r.head_view(pats, toks, title="Head view: token to token (every head of a layer)")
    r.head_grid(ent, title="Mean attention entropy per head (nats)")
    pages.detectors_section(r, scores, "Head detectors (raw and value-weighted)")
    path = r.write(out)
    print(f"report: {Path(path).resolve()}")
    return path
