"""Claims measured by the lab's experiments: induction heads need two layers; trained models
park attention on sinks; evicting the sink collapses quality.  The induction models and the
small text model come from the lab cache (:func:`attnlab.lab.induction.load_or_train`,
:func:`attnlab.lab.streaming.text_model`: trained on the first call, then read back)."""

from __future__ import annotations

from attnlab.lab.claims.registry import SEED_002, Outcome, Verdict, claim


@claim(
    "induction-heads-need-two-layers",
    title="induction heads (query for the token that followed the current one) form by composing two layers",
    seed=SEED_002,
    quote=(
        "It predicts induction heads — the circuit implementing “I saw AB earlier, I’m now at A, so predict B” by "
        "querying for the token that followed the current token last time"
    ),
)
def _induction() -> Outcome:
    from attnlab.lab import induction

    res = induction.run(progress=False)
    f2, f1 = res["models"]["2L"]["final"], res["models"]["1L"]["final"]
    ind2 = max(map(max, f2["induction"][1:]))
    ind1 = max(f1["induction"][0])
    b = f2["k_comp_baseline"]
    kc = f2["k_comp_induction_prev"]
    ev = {
        "2-layer best induction score": ind2,
        "1-layer best induction score": ind1,
        "K-composition (induction, prev-token)": kc,
        "random baseline mean": b["mean"],
        "random baseline std": b["std"],
        "2-layer second-copy loss": f2["second_half_loss"],
        "1-layer second-copy loss": f1["second_half_loss"],
        "phase change step (2-layer)": res["models"]["2L"]["phase_change_step"],
    }
    ok = ind2 > 0.5 and ind1 < 0.25 and kc > b["mean"] + 4 * b["std"]
    return Outcome.judge(
        ok,
        evidence=ev,
        explanation="a 2-layer attention-only model forms induction heads fed by a previous-token head "
        "(K-composition far above random); a 1-layer model trained the same way has none",
        key_figure=f"induction {ind2:.2f} (2L) vs {ind1:.2f} (1L); K-comp {kc:.2f} vs {b['mean']:.2f}±{b['std']:.2f}",
    )


@claim(
    "attention-sinks-in-trained-models",
    title="trained models dump excess attention on a semantically empty token",
    seed=SEED_002,
    quote=(
        "so trained models learn attention sinks: they dump excess attention mass onto a semantically empty token "
        "(very often the first/BOS token)"
    ),
)
def _sinks() -> Outcome:
    from attnlab.lab import sinks

    res = sinks.run(sinks.SENTENCES[:8])
    raw, vw = res["heads_over_half_raw"], res["heads_over_half_vw"]
    ev = {
        "heads with > half their mass on [CLS]/[SEP] (raw)": raw,
        "heads with > half their value-weighted mass there": vw,
        "heads": res["n_heads"],
        "mean raw mass": res["mean_raw"],
        "mean value-weighted mass": res["mean_vw"],
    }
    if raw == 0:
        return Outcome(
            Verdict.DOES_NOT_HOLD,
            ev,
            "no head of the pretrained MiniLM parks its attention on [CLS]/[SEP]",
            key_figure=f"0/{res['n_heads']} heads",
        )
    return Outcome(
        Verdict.HOLDS_UNDER_CONDITIONS if vw < raw else Verdict.HOLDS,
        ev,
        f"in the pretrained MiniLM {raw} of {res['n_heads']} heads put most of their attention on [CLS]/[SEP]",
        conditions="in raw attention mass; weighted by the norms of the values read, the sinks carry little "
        f"({vw} heads over half): the heads attend there but write almost nothing",
        key_figure=f"{raw}/{res['n_heads']} heads raw, {vw} value-weighted",
    )


@claim(
    "evicting-the-sink-collapses-quality",
    title="a sliding-window cache that drops the first tokens collapses quality; keeping sinks fixes it",
    seed=SEED_002,
    quote=(
        "naive sliding-window or “drop the oldest tokens” truncation silently deletes the token the model parks "
        "its idle attention on, and quality collapses"
    ),
)
def _streaming() -> Outcome:
    import torch

    from attnlab.interp.capture import capture
    from attnlab.lab.streaming import streaming_table, text_model
    from attnlab.train.textmodels import LAB

    tm = text_model(progress=False)  # the lab's small text model (trained once, then the lab cache)
    mc = tm.target.cfg
    size = f"{mc.n_layers}-layer, d_model {mc.d_model}, {LAB['target']['steps']} steps"
    rows = {r["method"]: r["ppl"] for r in streaming_table(tm, n_tokens=1024, timed_recompute=False)}
    window = rows["window only"]
    sinks = next(v for k, v in rows.items() if k.startswith("sinks"))
    N = tm.target.cfg.max_positions
    ids = tm.heldout[: 4 * N].view(4, N)  # windows of the training length, each opening as trained
    with torch.no_grad(), capture(tm.target) as cap:
        tm.target(ids)
    first = max(float(cap.stats(l, sink_tokens=1).per_head(skip_first=1)["sink_mass"].max()) for l in cap.layers)
    ev = {
        "perplexity, window only (128)": window,
        "perplexity, 4 sinks + 124 window": sinks,
        "perplexity, window recomputed per token": rows["sliding window 128, recomputed per token"],
        "largest mean attention on the first token (any head)": first,
    }
    if window > 1.5 * sinks:
        return Outcome(
            Verdict.HOLDS,
            ev,
            "dropping the first tokens from the cache collapses perplexity; keeping 4 sink tokens restores it",
            key_figure=f"ppl {window:.1f} (window) vs {sinks:.1f} (sinks)",
        )
    return Outcome(
        Verdict.DOES_NOT_HOLD,
        ev,
        f"in attnlab's small text model ({size}) no head parks attention on the first token (at most "
        f"{first:.2f} of its mass), and evicting it costs nothing: the collapse needs a sink, which this "
        "small model never formed — the seed states it as universal",
        key_figure=f"ppl {window:.2f} (window only) vs {sinks:.2f} (sinks); first-token mass ≤ {first:.2f}",
    )
