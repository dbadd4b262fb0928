"""``attnlab demo``, ``attnlab report`` and ``attnlab inspect``: the main job and its report.

``demo`` trains (or loads from the lab cache) the induction models, analyses the
pretrained MiniLM's sinks, decodes with the KV cache, compares softmax attention, linear
attention and a state-space mixer on associative recall, measures Hopfield capacity, runs
the seeds' claims, prints a summary table and writes one offline HTML report.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from attnlab.lab import pages

_STEP: dict[str, float] = {}


def _step_done() -> None:
    """Print the time the current step took (on stderr), if one is running, and end it."""
    if "t" in _STEP:
        print(f"      ({time.perf_counter() - _STEP.pop('t'):.0f} s)", file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    """Start a step: its line on stderr, after the time the previous step took."""
    _step_done()
    _STEP["t"] = time.perf_counter()
    print(msg, file=sys.stderr, flush=True)


def continuations(model, cfg, n: int = 4, seed: int = 0) -> list[dict]:
    """Greedy continuations of repeated segments, with the static KV cache and without."""
    from attnlab.generate import generate

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _i in range(n):
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
        rows.append(
            {
                "prompt": " ".join(map(str, prompt[0].tolist())),
                "continuation": " ".join(map(str, got.tolist())),
                "expected": " ".join(map(str, want.tolist())),
                "accuracy": float((got == want).float().mean()),
                "equal": torch.equal(cached, plain),
            }
        )
    return rows


def demo(out: str = "out/report.html", *, quick: bool = False, force: bool = False, claims: bool = True) -> Path:
    """Run the lab's main experiments and write the report; returns its path."""
    from attnlab.lab import induction, sinks
    from attnlab.report import Report

    t0 = time.perf_counter()
    _STEP.clear()
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

    rec = recall.run(quick=quick, force=force, config=None if quick else recall.DEMO)  # the claim reads DEMO too
    hop = hopfield.run()
    results = []
    if claims:
        _say("[5/5] the seeds' claims (first the small text model the sink-eviction claim reads, cached after)")
        from attnlab.lab.claims import run_claims
        from attnlab.lab.streaming import text_model

        text_model(progress=True)  # here, on every core: the claims run on one torch thread
        results = run_claims(workers=min(2, os.cpu_count() or 1))  # one torch thread per worker
    _say("writing the report")
    r = Report(
        "attnlab demo",
        subtitle="Induction heads forming, attention sinks in a real model, KV-cache "
        "decoding and the seed texts' claims — everything measured on this machine.",
    )
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
    _step_done()
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

    lines = [
        "",
        "== induction heads ==",
        summary(ind),
        "",
        "== attention sinks (MiniLM) ==",
        __import__("attnlab.lab.sinks", fromlist=["summary"]).summary(snk),
        "",
        "== KV-cache decoding ==",
        f"{len(gens)} continuations: mean accuracy {sum(g['accuracy'] for g in gens) / len(gens):.2f}, "
        f"cache = recompute in {sum(g['equal'] for g in gens)}/{len(gens)}",
        "",
        "== associative recall (MQAR) ==",
        __import__("attnlab.lab.recall", fromlist=["summary"]).summary(rec),
    ]
    if results:
        from collections import Counter

        c = Counter(x.verdict.value if x.verdict is not None else "error" for x in results)
        lines += [
            "",
            "== the seeds' claims ==",
            f"{len(results)} claims: "
            + ", ".join(f"{n} {v}" for v, n in c.items())
            + "  (attnlab claims for the table)",
        ]
    lines.append(f"\ndone in {seconds:.0f} s")
    return "\n".join(lines)


#: ``attnlab inspect`` prints the first SHOW_TOKENS tokens; the report's subtitle the first SUBTITLE_CHARS characters.
SHOW_TOKENS = 40
SUBTITLE_CHARS = 200

_LEGEND = {
    "previous_token": "mass on the token just before",
    "duplicate_token": "mass on earlier copies of the current token",
    "induction": "mass on the token after an earlier copy of the current token",
    "sink": "mass on the first token (e.g. [CLS] or BOS), rows after it",
    "positional": "mass on the key at the head's best fixed offset (|offset| <= 8)",
}


def inspect_legend(names) -> list[str]:
    """What the columns of ``attnlab inspect`` mean, for the detectors in ``names``."""
    out = ["columns: each score is the head's mean attention mass (0..1) on the keys the detector names:"]
    for d, what in _LEGEND.items():
        if d in names:
            out.append(f"  {d:<16} {what}")
    if any(n.endswith("_vw") for n in names):
        out.append(
            "  *_vw             the same, value-weighted: each key's attention times the norm of the value it "
            "passes on, renormalized (a head that parks mass on a key with a ~0 value writes little)"
        )
    return out


def format_inspect(
    toks: list[str], scores: dict, *, n_layers: int, n_heads: int, cut_to: int | None = None
) -> list[str]:
    """The lines ``attnlab inspect`` prints: the tokens (saying when only the first
    :data:`SHOW_TOKENS` are shown, and when the tokenizer cut the text to ``cut_to``), the
    top heads per detector (``scores``: name -> :class:`attnlab.interp.detectors.HeadScores`;
    heads that round to 0.00 are not listed), and what the columns mean."""
    lines = [f"tokens: {' '.join(repr(t) for t in toks[:SHOW_TOKENS])}"]
    if len(toks) > SHOW_TOKENS:
        lines.append(
            f"  (the first {SHOW_TOKENS} of {len(toks)} tokens shown here; every token is scored and in the report)"
        )
    if cut_to is not None:
        lines.append(f"  (the text is longer than the model's limit: only its first {cut_to} tokens are read)")
    lines += [
        f"{len(toks)} tokens, {n_layers} layers × {n_heads} heads",
        f"{'detector':<22} top heads (mean attention mass, 0..1; heads that round to 0.00 omitted)",
    ]
    for name, hs in scores.items():
        top = [(l, h, s) for l, h, s in hs.top(4) if f"{s:.2f}" != "0.00"]
        lines.append(
            f"{name:<22} "
            + (
                ", ".join(f"L{l}H{h} {s:.2f}" for l, h, s in top)
                if top
                else "none (every head rounds to 0: nothing of this kind in this text)"
            )
        )
    lines += ["", *inspect_legend(sorted(scores))]
    return lines


def _cut_by_tokenizer(tok, text: str) -> bool:
    """Whether the tokenizer truncated ``text`` (to its ``max_length``)."""
    inner, limit = getattr(tok, "tok", None), getattr(tok, "max_length", None)
    if inner is None or limit is None:
        return False
    return bool(getattr(inner.encode(text), "overflowing", None))


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

    def fwd(m, x):
        return m(x, **kw)

    scores = D.detect(model, ids, forward=fwd, value_weighted_too=True)
    with torch.no_grad(), capture(model) as cap:
        fwd(model, ids)
    pats = torch.stack([cap.pattern(l)[0] for l in cap.layers])
    ent = torch.stack([cap.stats(l).per_head()["entropy"] for l in cap.layers])
    toks = tok.to_str_tokens(ids[0])  # special tokens ([CLS], [SEP]) visible
    lines = format_inspect(
        toks,
        scores,
        n_layers=pats.shape[0],
        n_heads=pats.shape[1],
        cut_to=tok.max_length if _cut_by_tokenizer(tok, text) else None,
    )
    from attnlab.report.token_view import MAX_TOKENS

    if len(text) > SUBTITLE_CHARS:
        print(f"(the report's subtitle shows the first {SUBTITLE_CHARS} of the text's {len(text)} characters)")
    if len(toks) > MAX_TOKENS:
        print(f"(no token-to-token head view in the report: {len(toks)} tokens, it draws at most {MAX_TOKENS})")
    print("\n".join(lines))
    subtitle = text[:SUBTITLE_CHARS] + (
        f" … (first {SUBTITLE_CHARS} of {len(text)} characters)" if len(text) > SUBTITLE_CHARS else ""
    )
    r = Report(f"attnlab inspect: {model_name}", subtitle=f"{len(toks)} tokens: {subtitle}")
    r.section("Patterns")
    r.heatmaps(pats, toks, title="Attention patterns (all layers and heads)")
    if len(toks) <= MAX_TOKENS:
        r.head_view(pats, toks, title="Head view: token to token (every head of a layer)")
    r.head_grid(ent, title="Mean attention entropy per head (nats)")
    pages.detectors_section(r, scores, "Head detectors (raw and value-weighted)")
    path = r.write(out)
    print(f"report: {Path(path).resolve()}")
    return path
