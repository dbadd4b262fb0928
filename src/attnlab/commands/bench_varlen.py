"""``attnlab bench varlen``: packed varlen attention against padded torch SDPA on a ragged batch."""

import sys

HELP = "packed varlen attention vs padded torch SDPA on a ragged batch"
SHARED = {"quick": "4 sequences of 16..128 tokens (a smoke run)", "reps": (3, "timed repetitions (median reported)")}


def add_arguments(p):
    from attnlab.commands.options import ragged_batch

    ragged_batch(p, lo=64, hi=2048, dim=64)
    p.add_argument("--backward", action="store_true", help="time forward+backward")


def run(args) -> int:
    from attnlab.bench import varlen

    if args.min > args.max:
        print(f"attnlab bench varlen: need --min <= --max, got --min {args.min} --max {args.max}", file=sys.stderr)
        return 2
    if args.quick:
        args.seqs, args.min, args.max, args.heads, args.dim, args.reps = 4, 16, 128, 2, 16, 1
    varlen.main(
        seqs=args.seqs,
        lo=args.min,
        hi=args.max,
        heads=args.heads,
        dim=args.dim,
        reps=args.reps,
        backward=args.backward,
        json_path=args.json,
    )
    return 0
