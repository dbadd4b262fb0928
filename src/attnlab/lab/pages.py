"""Report sections for the lab's results (:class:`attnlab.report.Report` blocks)."""

from __future__ import annotations

import torch

from attnlab.interp.capture import capture


def induction_section(r, res: dict, model2=None, cfg=None) -> None:
    """Training curves, detector grids, K-composition, ablation and patterns of the
    induction experiment (:func:`attnlab.lab.induction.run`)."""
    m2, m1 = res["models"]["2L"], res["models"]["1L"]
    l2, l1 = m2["log"], m1["log"]
    f2, f1 = m2["final"], m1["final"]
    r.section(
        "Induction heads form",
        "A 2-layer attention-only transformer and a 1-layer control, trained on "
        "random segments repeated (the segment length varies per row, so only content-based lookup "
        "predicts the second copy). The 2-layer model's loss drops suddenly when an induction head "
        "appears in layer 1, fed by a previous-token head in layer 0 (K-composition); the 1-layer model "
        "cannot compose and stays at the bag-of-tokens loss.",
    )
    pc = m2["phase_change_step"]
    r.text(
        f"Phase change of the 2-layer model (induction score half-way to its final value): "
        f"**{'step ' + str(pc) if pc is not None else 'not observed'}**. "
        f"Final second-copy loss: 2-layer **{f2['second_half_loss']:.3f}**, 1-layer **{f1['second_half_loss']:.3f}** "
        f"nats (uniform: {torch.tensor(float(res['config']['vocab'])).log():.2f})."
    )
    r.line_plot(
        {"2-layer": (l2["step"], l2["loss"]), "1-layer": (l1["step"], l1["loss"])},
        title="Held-out loss during training",
        x_label="step",
        y_label="loss (nats)",
    )
    r.line_plot(
        {
            "2-layer induction": (l2["step"], l2["induction_max"]),
            "2-layer previous-token": (l2["step"], l2["prev_token_max"]),
            "1-layer induction": (l1["step"], l1["induction_max"]),
        },
        title="Best head scores during training",
        x_label="step",
        y_label="attention mass",
    )
    r.line_plot(
        {"2-layer": (l2["step"], l2["icl"]), "1-layer": (l1["step"], l1["icl"])},
        title="In-context learning score (loss on the 2nd copy minus the 1st)",
        x_label="step",
        y_label="Δ loss (nats)",
    )
    r.head_grid(torch.tensor(f2["induction"]), title="Induction score per head (2-layer)", vmin=0, vmax=1)
    r.head_grid(torch.tensor(f2["previous_token"]), title="Previous-token score per head (2-layer)", vmin=0, vmax=1)
    r.head_grid(torch.tensor(f1["induction"]), title="Induction score per head (1-layer control)", vmin=0, vmax=1)
    if "k_composition" in f2:
        b = f2["k_comp_baseline"]
        r.text(
            f"K-composition of the induction head L{f2['induction_head'][0]}H{f2['induction_head'][1]} with the "
            f"previous-token head L0H{f2['prev_token_head'][1]}: **{f2['k_comp_induction_prev']:.3f}** against "
            f"{b['mean']:.3f} ± {b['std']:.3f} for random matrices of the same shapes."
        )
        r.head_grid(
            torch.tensor(f2["k_composition"]),
            title="K-composition: last-layer head (rows) × layer-0 head (columns)",
            row_label="layer-1 head",
            col_label="layer-0 head",
            fmt=".3f",
        )
    r.head_grid(torch.tensor(f2["ablation"]), title="Loss increase when one head is zero-ablated (2-layer)", fmt=".2f")
    if model2 is not None and cfg is not None:
        from attnlab.interp import circuits as C
        from attnlab.lab.induction import repeated_tokens

        rep = repeated_tokens(cfg, T=min(12, cfg.seq_len // 2), B=1, seed=7)
        with torch.no_grad(), capture(model2) as cap:
            model2(rep)
        pats = torch.stack([cap.pattern(l)[0] for l in cap.layers])
        toks = [f"t{int(t)}" for t in rep[0]]
        ih, ph = f2.get("induction_head"), f2.get("prev_token_head")
        labels = {}
        if ih:
            labels[tuple(ih)] = "induction head"
        if ph:
            labels[tuple(ph)] = "previous-token head"
        r.heatmaps(pats, toks, title="Patterns of the 2-layer model on a repeated sequence", labels=labels)
        if ih and ph:
            qk = C.qk_circuit(model2.blocks[ih[0]].attn)[ih[1]].svdvals().detach()
            ov = C.ov_circuit(model2.blocks[ih[0]].attn)[ih[1]].svdvals().detach()
            pqk = C.qk_circuit(model2.blocks[0].attn)[ph[1]].svdvals().detach()
            r.bar_plot(
                {"induction W_QK": qk, "induction W_OV": ov, "prev-token W_QK": pqk},
                labels=list(range(1, len(qk) + 1)),
                title="Singular values of the heads' circuits (rank ≤ d_head)",
                x_label="index",
                y_label="singular value",
                log_y=True,
            )


def sinks_section(r, res: dict, model=None, tokenizer=None) -> None:
    """MiniLM sink heads: raw and value-weighted mass on [CLS]/[SEP] (:mod:`attnlab.lab.sinks`)."""
    raw = torch.tensor(res["cls"]) + torch.tensor(res["sep"])
    vw = torch.tensor(res["cls_vw"]) + torch.tensor(res["sep_vw"])
    r.section(
        "Attention sinks in MiniLM",
        f"The pretrained all-MiniLM-L6-v2, run through attnlab on "
        f"{res['n_sentences']} sentences. {res['heads_over_half_raw']} of {res['n_heads']} heads put more "
        f"than half their attention on [CLS] or [SEP]; weighted by the norm of the values they read, "
        f"{res['heads_over_half_vw']} do: mean mass {res['mean_raw']:.2f} raw vs {res['mean_vw']:.2f} "
        "value-weighted. Raw attention overstates sinks: the sink tokens' values are small, so the heads "
        "park attention there without writing much.",
    )
    r.head_grid(raw, title="Mass on [CLS] + [SEP] (raw)", vmin=0, vmax=1)
    r.head_grid(vw, title="Mass on [CLS] + [SEP] (value-weighted)", vmin=0, vmax=1)
    r.table(
        ["head", "raw", "value-weighted"],
        [[f"L{h['layer']}H{h['head']}", h["raw"], h["value_weighted"]] for h in res["top_heads"]],
        caption="The strongest sink heads",
        highlight=[1, 2],
    )
    if model is not None and tokenizer is not None:
        ex = res["example"]
        from attnlab.lab.sinks import SENTENCES

        b = tokenizer([SENTENCES[ex["row"]]])
        with torch.no_grad(), capture(model) as cap:
            model(b["input_ids"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"])
        pats = torch.stack([cap.pattern(l)[0] for l in cap.layers])
        r.heatmaps(pats, ex["tokens"], title="MiniLM patterns on one sentence (all layers and heads)")


def generation_section(r, rows: list[dict]) -> None:
    r.section(
        "Decoding with the KV cache",
        "The 2-layer induction model continues a repeated segment. Greedy "
        "decoding with attnlab's static KV cache gives exactly the tokens of recomputing the whole "
        "prefix at every step.",
    )
    r.table(
        ["prompt", "continuation (cache)", "expected", "correct", "cache = recompute"],
        [[x["prompt"], x["continuation"], x["expected"], x["accuracy"], "yes" if x["equal"] else "NO"] for x in rows],
        highlight=[3],
    )


def claims_section(r, results) -> None:
    from collections import Counter

    c = Counter(x.verdict.value if x.verdict is not None else "error" for x in results)
    r.section(
        "The seeds' claims, measured",
        f"{len(results)} claims quoted from the seed texts, each run as an "
        "experiment: " + ", ".join(f"{n} {v}" for v, n in c.items()) + ". `attnlab claims` prints the table; "
        "`--json` writes the evidence.",
    )
    r.table(
        ["claim", "verdict", "key figure", "seed says"],
        [
            [x.id, x.verdict.value if x.verdict else f"error: {x.error}", x.key_figure, _short(x.claim.quotes[0])]
            for x in results
        ],
    )


def detectors_section(r, scores: dict, title: str) -> None:
    r.section(title)
    for name, hs in scores.items():
        r.head_grid(hs.scores, title=f"{name.replace('_', ' ')} score per head", vmin=0, vmax=1)


def _short(s: str, n: int = 160) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def hopfield_section(r, res: dict) -> None:
    """Retrieval accuracy against stored patterns (:mod:`attnlab.lab.hopfield`)."""
    c = res["config"]
    r.section(
        "Hopfield capacity",
        f"One attention read is one update of a modern Hopfield network (stored patterns "
        f"= keys = values, β = softmax scale). Random ±1 patterns, {c['frac']:.0%} of a pattern's entries "
        f"flipped as the probe, β = {c['beta']}; retrieved = cosine with the stored pattern > 0.99. "
        f"The modern network's capacity grows exponentially with the dimension (log2 capacity "
        f"+{res['growth']['modern_log2_capacity_per_dim']:.2f} per dimension); the classical Hebbian "
        "network's linearly and far lower.",
    )
    ns = res["ns"]
    series = {}
    for d in res["dims"]:
        series[f"modern d={d}"] = (ns, res["modern"]["accuracy"][str(d)])
        if res.get("classical"):
            series[f"classical d={d}"] = (ns, res["classical"]["accuracy"][str(d)])
    r.line_plot(
        series,
        title="Retrieval accuracy against the number of stored patterns",
        x_label="stored patterns N",
        y_label="fraction retrieved",
        log_x=True,
    )
    r.table(
        ["d", "modern capacity", "classical capacity", "0.138·d"],
        [
            [d, res["modern"]["capacity"][str(d)], (res["classical"] or {}).get("capacity", {}).get(str(d)), 0.138 * d]
            for d in res["dims"]
        ],
    )


def crossover_section(r, res: dict) -> None:
    """Linear attention against softmax attention in time and error (:mod:`attnlab.lab.crossover`)."""
    ns = res["ns"]
    c = res["crossover"]["fwdbwd"]["elu/sdpa"]
    n_star = c.get("interpolated") or c.get("n")
    r.section(
        "Linear attention: crossover and error",
        f"Causal attention with d_head {res['config']['d_head']}: "
        f"time of linear attention (elu+1 and FAVOR+, chunked) over softmax attention (torch SDPA, attnlab "
        f"flash), forward and backward, medians of interleaved runs. Linear attention wins past N ≈ "
        f"{n_star:.0f} against SDPA. FAVOR+ approximates softmax; elu+1 is a different model.",
    )
    r.line_plot(
        {k: (ns, v) for k, v in res["ratios"]["fwdbwd"].items()},
        title="Time ratio linear / softmax (forward + backward); below 1 = linear is faster",
        x_label="sequence length N",
        y_label="time ratio",
        log_x=True,
        log_y=True,
    )
    err = {f"FAVOR+ σ={s}": (ns, v) for s, v in res["errors"]["favor"].items()}
    err.update({f"elu+1 σ={s}": (ns, v) for s, v in res["errors"]["elu"].items()})
    r.line_plot(
        err,
        title="Relative error against exact softmax attention",
        x_label="sequence length N",
        y_label="relative error",
        log_x=True,
    )
    fv = res["favor_vs_features"]
    r.line_plot(
        {f"σ={s}": (fv["features"], v) for s, v in fv["rel_error"].items()},
        title=f"FAVOR+ error against the number of random features (N={fv['n']})",
        x_label="features m",
        y_label="relative error",
        log_x=True,
        log_y=True,
    )


def recall_section(r, res: dict) -> None:
    """Multi-query associative recall by mixer (:mod:`attnlab.lab.recall`)."""
    c = res["config"]
    ns = [str(n) for n in res["n_pairs"]]
    r.section(
        "Associative recall: softmax attention, linear attention, a state-space model",
        f"Multi-query associative recall (Zoology's MQAR): key-value pairs, then queries for some keys; "
        f"accuracy on the queried values, held out. Equal-size 2-layer Decoders that differ only in the "
        f"sequence mixer (d_model {c['d_model']}, {c['steps']} steps, sequence length {c['seq_len']}, learning "
        "rate chosen per mixer by training loss). The no-binding bar is what copying a random not-yet-queried "
        "value from the context scores: below it a model has not bound keys to values.",
    )
    labels = [f"{n} pairs" for n in ns]
    vals = {m: [round(res["models"][m]["accuracy"][n], 3) for n in ns] for m in res["models"]}
    vals["no-binding bar"] = [round(res["no_binding"][n], 3) for n in ns]
    r.bar_plot(vals, labels=labels, title="Recall accuracy by mixer", x_label="key-value pairs", y_label="accuracy")
    r.table(
        ["mixer", "parameters", "learning rate", *labels],
        [[m, res["models"][m]["params"], res["models"][m]["lr"], *vals[m]] for m in res["models"]],
        highlight=labels,
    )
