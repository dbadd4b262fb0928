"""``attnlab bench interp``: per-head statistics at O(N) memory against materialized patterns."""

import sys

HELP = "per-head statistics at O(N) memory vs materialized patterns"
SHARED = {"quick": "a short sequence (overrides --n)", "reps": (1, "timed full-size runs per method (median)")}


def add_arguments(p):
    from attnlab.commands.options import positive_int

    p.add_argument("--n", type=positive_int, default=32768, help="sequence length (default 32768)")
    p.add_argument("--heads", type=positive_int, default=1, help="query heads (default 1)")
    p.add_argument("--d-head", type=positive_int, default=64, help="head dim (default 64)")


def run(args) -> int:
    from attnlab.bench import interp_stats

    try:
        interp_stats.main(
            n=args.n, d_head=args.d_head, heads=args.heads, quick=args.quick, reps=args.reps, json_path=args.json
        )
    except ValueError as e:
        print(f"attnlab bench interp: {e}", file=sys.stderr)
        return 2
    return 0
