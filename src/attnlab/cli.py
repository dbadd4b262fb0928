"""The ``attnlab`` command.

    attnlab bench attention [--quick] [--json PATH] [--reps N] [--no-flex] [--no-memory] [--only TEXT]
    attnlab bench tiles [--json PATH]
    attnlab bench models [--quick] [--json PATH] [--reps N] [--profile]
    attnlab bench inference [--quick] [--json PATH] [--reps N]
    attnlab bench distributed [--quick] [--json PATH] [--reps N] [--seq 16384,32768] [--ranks 2,4] [--no-memory]
    attnlab bench interp [--n N] [--quick] [--json PATH]
    attnlab bench capture [--quick] [--reps N] [--json PATH] [--no-memory]
    attnlab bench compile [--quick] [--reps N] [--backend inductor|aot_eager] [--json PATH]
    attnlab bench varlen [--quick] [--reps N] [--seqs 16] [--min 64] [--max 2048] [--backward] [--json PATH]
    attnlab train [--task text|induction|recall] [--steps N] [--out DIR [--resume]] ...
    attnlab demo [--out PATH] [--quick] [--force] [--no-claims]
    attnlab report [--out PATH] [--quick] [--force] [--no-claims]
    attnlab inspect TEXT [--model minilm|FOLDER] [--out PATH]
    attnlab claims [IDS...] [--json PATH] [--list]
    attnlab lab induction|sinks|recall|hopfield|crossover [options of that experiment]
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnlab", description="attnlab: transformer attention, measured.")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks, side by side with their anchors")
    bsub = bench.add_subparsers(dest="bench", required=True)
    a = bsub.add_parser("attention", help="attnlab backends vs torch SDPA and FlexAttention")
    a.add_argument("--quick", action="store_true", help="a subset of the cases (about a third of the time)")
    a.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a.add_argument("--reps", type=int, default=3, help="timed repetitions per backend (median reported)")
    a.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    a.add_argument("--only", metavar="TEXT", help="only the cases whose name contains TEXT")
    a.add_argument("--no-memory", action="store_true", help="skip the per-backend memory probes")
    t = bsub.add_parser("tiles", help="measure the flash backend's tile sizes per dtype and head dim")
    t.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    m = bsub.add_parser("models", help="attnlab's GPT-2 decoder and MiniLM encoder vs transformers")
    m.add_argument("--quick", action="store_true", help="a smaller GPT-2 and batch")
    m.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    m.add_argument("--reps", type=int, default=5, help="timed repetitions per contender (median reported)")
    m.add_argument("--profile", action="store_true", help="also show where attnlab's training step spends time")
    inf = bsub.add_parser("inference", help="decoding vs transformers, caches, quantization, streaming, speculation")
    inf.add_argument("--quick", action="store_true", help="smaller sizes (about a fifth of the time)")
    inf.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    inf.add_argument("--reps", type=int, default=3, help="timed repetitions of the decode comparison")
    dd = bsub.add_parser("distributed", help="ring and Ulysses attention on local gloo ranks vs one process")
    dd.add_argument("--quick", action="store_true", help="N=2048,4096 and one round (a smoke run)")
    dd.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    dd.add_argument("--reps", type=int, default=2, help="interleaved rounds per variant (median reported)")
    dd.add_argument("--seq", default="16384,32768", help="sequence lengths, comma-separated")
    dd.add_argument("--ranks", default="2,4", help="group sizes, comma-separated")
    dd.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    bsub.add_parser("compile", help="a Decoder training step, torch.compile vs eager (ratio)", add_help=False)
    bsub.add_parser("interp", help="per-head statistics at O(N) memory vs materialized patterns", add_help=False)
    bsub.add_parser("varlen", help="packed varlen attention vs padded torch SDPA on a ragged batch", add_help=False)
    bsub.add_parser("capture", help="interp.capture's overhead and memory against a plain forward pass",
                    add_help=False)
    tr = sub.add_parser("train", help="train a small Decoder on CPU (progress bar, checkpoints, resume)")
    tr.add_argument("--task", default="induction", choices=("text", "induction", "recall"))
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--layers", type=int, default=2)
    tr.add_argument("--d-model", type=int, default=128)
    tr.add_argument("--heads", type=int, default=4)
    tr.add_argument("--positions", default="rope", choices=("learned", "sinusoidal", "rope", "alibi", "none"))
    tr.add_argument("--attn-only", action="store_true", help="no MLPs, no norms (circuits-style)")
    tr.add_argument("--seq-len", type=int, default=64)
    tr.add_argument("--batch", type=int, default=16)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--vocab", type=int, help="vocabulary (text: BPE size, default 512; tasks: 64)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", metavar="DIR", help="checkpoint folder (safetensors)")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    for name, hlp in (("demo", "the main job: induction heads, MiniLM sinks, KV-cache decoding, the seeds' claims; "
                                "prints a summary and writes the HTML report"),
                      ("report", "write the offline HTML report of the lab's experiments (cached runs reused)")):
        d = sub.add_parser(name, help=hlp)
        d.add_argument("--out", default="out/report.html", help="the HTML file to write (default out/report.html)")
        d.add_argument("--quick", action="store_true", help="fewer training steps for the induction models")
        d.add_argument("--force", action="store_true", help="retrain even when the lab cache has the models")
        d.add_argument("--no-claims", action="store_true", help="skip the seeds' claims")
    ins = sub.add_parser("inspect", help="score every head of a model on a text; print the table, write a report")
    ins.add_argument("text")
    ins.add_argument("--model", default="minilm", help="'minilm' (default) or a checkpoint folder (bert/gpt2/llama)")
    ins.add_argument("--out", default="out/inspect.html")
    sub.add_parser("claims", help="the seeds' claims as experiments with verdicts (attnlab claims --help)",
                   add_help=False)
    sub.add_parser("lab", help="one experiment: induction | sinks | recall | hopfield | crossover", add_help=False)
    return p


_LAB = ("induction", "sinks", "recall", "hopfield", "crossover")


def _lab(argv: list[str]) -> int:
    """``attnlab lab NAME [options]``: run one experiment and print its summary."""
    if not argv or argv[0] not in _LAB:
        print(f"attnlab lab: expected one of {', '.join(_LAB)}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    import importlib
    mod = importlib.import_module(f"attnlab.lab.{name}")
    if hasattr(mod, "main"):
        return mod.main(rest) or 0
    import argparse as ap
    import json
    p = ap.ArgumentParser(prog=f"attnlab lab {name}")
    p.add_argument("--json", metavar="PATH")
    if name == "induction":
        p.add_argument("--quick", action="store_true")
        p.add_argument("--force", action="store_true")
    a = p.parse_args(rest)
    res = mod.run(**({"quick": a.quick, "force": a.force} if name == "induction" else {}))
    print(mod.summary(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["claims"]:
        from attnlab.lab.claims import main as claims_main
        return claims_main(argv[1:])
    if argv[:1] == ["lab"]:
        return _lab(argv[1:])
    if argv[:2] == ["bench", "capture"]:
        from attnlab.bench import capture
        return capture.main(argv[2:]) or 0
    if argv[:2] == ["bench", "compile"]:
        from attnlab.bench import compile as bench_compile
        return bench_compile.main(argv[2:]) or 0
    if argv[:2] == ["bench", "varlen"]:
        from attnlab.bench import varlen
        return varlen.main(argv[2:]) or 0
    if argv[:2] == ["bench", "interp"]:
        from attnlab.bench import interp_stats
        return interp_stats.main(argv[2:]) or 0
    args = _parser().parse_args(argv)
    if args.command in ("demo", "report"):
        from attnlab.lab.demo import demo
        demo(args.out, quick=args.quick, force=args.force, claims=not args.no_claims)
        return 0
    if args.command == "inspect":
        from attnlab.lab.demo import inspect
        try:
            inspect(args.text, model_name=args.model, out=args.out)
        except ValueError as e:
            print(f"attnlab inspect: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "bench" and args.bench == "attention":
        if args.reps < 1:
            print("attnlab bench attention: --reps must be >= 1", file=sys.stderr)
            return 2
        from attnlab.bench import attention
        attention.main(quick=args.quick, json_path=args.json, reps=args.reps, flex=not args.no_flex, only=args.only,
                       memory=not args.no_memory)
        return 0
    if args.command == "bench" and args.bench == "tiles":
        from attnlab.bench import tiles
        tiles.main(json_path=args.json)
        return 0
    if args.command == "bench" and args.bench == "models":
        if args.reps < 1:
            print("attnlab bench models: --reps must be >= 1", file=sys.stderr)
            return 2
        from attnlab.bench import models
        models.main(quick=args.quick, json_path=args.json, reps=args.reps, show_profile=args.profile)
        return 0
    if args.command == "bench" and args.bench == "inference":
        if args.reps < 1:
            print("attnlab bench inference: --reps must be >= 1", file=sys.stderr)
            return 2
        from attnlab.bench import inference
        inference.main(quick=args.quick, json_path=args.json, reps=args.reps)
        return 0
    if args.command == "bench" and args.bench == "distributed":
        from attnlab.bench import distributed
        try:
            if args.reps < 1:
                raise ValueError("--reps must be >= 1")
            seqs, ranks = distributed.parse_ints(args.seq, "--seq"), distributed.parse_ints(args.ranks, "--ranks")
        except ValueError as e:
            print(f"attnlab bench distributed: {e}", file=sys.stderr)
            return 2
        distributed.main(seqs=seqs, ranks=ranks, reps=args.reps, quick=args.quick, memory=not args.no_memory,
                         json_path=args.json)
        return 0
    if args.command == "train":
        from attnlab.train import run
        try:
            run.main(task=args.task, steps=args.steps, layers=args.layers, d_model=args.d_model, heads=args.heads,
                     positions=args.positions, seq_len=args.seq_len, batch=args.batch, lr=args.lr, vocab=args.vocab,
                     seed=args.seed, out=args.out, resume=args.resume, attn_only=args.attn_only)
        except ValueError as e:
            print(f"attnlab train: {e}", file=sys.stderr)
            return 2
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
