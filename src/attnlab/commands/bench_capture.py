"""``attnlab bench capture``: interp.capture's overhead and memory against a plain forward pass."""

HELP = "interp.capture's overhead and memory against a plain forward pass"
SHARED = {"quick": "a smaller model and batch", "reps": (5, "timed repetitions per contender (median reported)")}


def add_arguments(p):
    p.add_argument("--no-memory", action="store_true", help="skip the per-contender memory probes (child processes)")


def run(args) -> int:
    from attnlab.bench import capture

    capture.main(quick=args.quick, reps=args.reps, memory=not args.no_memory, json_path=args.json)
    return 0
