"""``attnlab bench inference``: decoding, caches, quantization, streaming, speculation."""

HELP = "decoding vs transformers, caches, quantization, streaming, speculation"
SHARED = {
    "quick": "smaller sizes (about a fifth of the time)",
    "reps": (3, "timed repetitions of the decode comparison"),
}


def add_arguments(p):
    pass


def run(args) -> int:
    from attnlab.bench import inference

    inference.main(quick=args.quick, json_path=args.json, reps=args.reps)
    return 0
