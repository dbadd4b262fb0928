"""``attnlab bench compile``: a Decoder training step, torch.compile against eager."""

HELP = "a Decoder training step, torch.compile vs eager (ratio)"
SHARED = {
    "quick": "tiny sizes (checks that it runs; no figures)",
    "reps": (5, "timed steps per mode (median reported)"),
}


def add_arguments(p):
    p.add_argument(
        "--backend",
        default="inductor",
        choices=("inductor", "aot_eager"),
        help="torch.compile backend (default inductor)",
    )


def run(args) -> int:
    from attnlab.bench import compile as bench_compile

    bench_compile.main(quick=args.quick, reps=args.reps, backend=args.backend, json_path=args.json)
    return 0
