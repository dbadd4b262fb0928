"""``attnlab bench varlen``: packed varlen attention against padded torch SDPA on a ragged batch."""

import sys

HELP = "packed varlen attention vs padded torch SDPA on a ragged batch"
SHARED = {"quick": "4 sequences of 16..128 tokens (a smoke run)", "reps": (3, "timed repetitions (median reported)")}


def add_arguments(p):
    from attnlab.commands.options import positive_int

    p.add_argument("--seqs", type=positive_int, default=16, help="sequences in the batch (default 16)")
    p.add_argument("--min", type=positive_int, default=64, help="shortest sequence length (default 64)")
    p.add_argument("--max", type=positive_int, default=2048, help="longest sequence length (default 2048)")
    p.add_argument("--heads", type=positive_int, default=8, help="heads (default 8)")
    p.add_argument("--dim", type=positive_int, default=64, help="head dim (default 64)")
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
