"""``attnlab lab induction``: induction heads forming in 2-layer vs 1-layer attention-only models."""

HELP = "induction heads form in a 2-layer attention-only model, not in a 1-layer one (phase change, K-composition)"
RUNTIME = "about 10 s on quiet cores (it stops once the task is solved), minutes on a loaded machine; cached after"
SHARED = {"quick": "600 training steps instead of 2,000 (still shows the phase change)"}


def add_arguments(p):
    p.add_argument("--force", action="store_true", help="retrain even when the lab cache has the models")


def run(args) -> int:
    from attnlab.commands.options import write_json
    from attnlab.lab import induction

    res = induction.run(quick=args.quick, force=args.force)
    print(induction.summary(res))
    write_json(args.json, res)
    return 0
