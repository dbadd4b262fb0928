"""``attnlab lab crossover``: where linear attention overtakes softmax attention in wall time."""

import sys

HELP = "the sequence length where causal linear attention (elu+1, FAVOR+) overtakes softmax attention"
RUNTIME = "about 1 min with --quick, several minutes without"
SHARED = {"quick": "N = 256 … 2048, 3 repetitions", "reps": (None, "repetitions per size (default 5, quick 3)")}


def add_arguments(p):
    from attnlab.commands.options import positive_int

    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's; 1 is steadier on a shared machine)",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def run(args) -> int:
    from attnlab.lab import crossover

    try:
        crossover.main(
            quick=args.quick, reps=args.reps, threads=args.threads, progress=not args.no_progress, json_path=args.json
        )
    except ValueError as e:
        print(f"attnlab lab crossover: {e}", file=sys.stderr)
        return 2
    return 0
