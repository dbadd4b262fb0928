"""``attnlab bench attention``: attnlab's backends against torch SDPA and FlexAttention."""

HELP = "attnlab backends vs torch SDPA and FlexAttention"
SHARED = {
    "quick": "a subset of the cases (about a third of the time)",
    "reps": (3, "timed repetitions per backend (median reported)"),
}


def add_arguments(p):
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    p.add_argument("--only", metavar="TEXT", help="only the cases whose name contains TEXT")
    p.add_argument("--no-memory", action="store_true", help="skip the per-backend memory probes")
    p.add_argument(
        "--no-warm", action="store_true", help="skip the warm times (each backend's fastest back-to-back call)"
    )


def run(args) -> int:
    from attnlab.bench import attention

    attention.main(
        quick=args.quick,
        json_path=args.json,
        reps=args.reps,
        flex=not args.no_flex,
        only=args.only,
        memory=not args.no_memory,
        warm=not args.no_warm,
    )
    return 0
