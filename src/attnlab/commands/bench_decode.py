"""``attnlab bench decode``: native paged / int8 decode of a ragged batch vs one padded SDPA call."""

import sys

HELP = "native paged and int8 quantized decode of a ragged batch vs one dense padded SDPA call"
SHARED = {
    "quick": "4 sequences of 16..256 keys, D=64 (a smoke run)",
    "reps": (5, "timed repetitions (median reported)"),
}


def add_arguments(p):
    from attnlab.commands.options import positive_int, ragged_batch

    ragged_batch(p, lo=128, hi=4096, dim=128)
    p.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (default 2)")
    p.add_argument("--split", action="store_true", help="also time the caches' split-KV paths (slow)")


def run(args) -> int:
    from attnlab.bench import decode

    if args.min > args.max or args.heads % args.kv_heads:
        print(
            "attnlab bench decode: need --min <= --max and --heads a multiple of --kv-heads, got "
            f"--min {args.min} --max {args.max} --heads {args.heads} --kv-heads {args.kv_heads}",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.seqs, args.min, args.max, args.dim, args.reps = 4, 16, 256, 64, 1
    return decode.main(
        seqs=args.seqs,
        lo=args.min,
        hi=args.max,
        heads=args.heads,
        kv_heads=args.kv_heads,
        dim=args.dim,
        reps=args.reps,
        split=args.split,
        json_path=args.json,
    )
