"""``attnlab lab recall``: multi-query associative recall, attention vs linear attention vs SSM."""

HELP = "associative recall (MQAR): softmax attention vs linear attention vs a state-space mixer"
RUNTIME = "about 2.5 min (two training processes); cached after"
SHARED = {"quick": "a small, fast run"}


def add_arguments(p):
    from attnlab.commands.options import positive_int

    p.add_argument("--force", action="store_true", help="retrain even if a cached result exists")
    p.add_argument("--workers", type=positive_int, default=2, help="training processes (default 2)")


def run(args) -> int:
    from attnlab.commands.options import write_json
    from attnlab.lab import recall

    result = recall.run(quick=args.quick, force=args.force, workers=args.workers)
    print(recall.summary(result))
    write_json(args.json, result)
    return 0
