"""``attnlab bench distributed``: ring and Ulysses attention on local gloo ranks."""

import sys

HELP = "ring and Ulysses attention on local gloo ranks vs one process"
SHARED = {
    "quick": "N=2048,4096 and one round (a smoke run)",
    "reps": (2, "interleaved rounds per variant (median reported)"),
}


def add_arguments(p):
    p.add_argument("--seq", default="16384,32768", metavar="N,N", help="sequence lengths, comma-separated")
    p.add_argument("--ranks", default="2,4", metavar="P,P", help="group sizes, comma-separated")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")


def run(args) -> int:
    from attnlab.bench import distributed

    try:
        seqs, ranks = distributed.parse_ints(args.seq, "--seq"), distributed.parse_ints(args.ranks, "--ranks")
    except ValueError as e:
        print(f"attnlab bench distributed: {e}", file=sys.stderr)
        return 2
    distributed.main(
        seqs=seqs, ranks=ranks, reps=args.reps, quick=args.quick, memory=not args.no_memory, json_path=args.json
    )
    return 0
