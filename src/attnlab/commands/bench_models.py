"""``attnlab bench models``: attnlab's GPT-2 decoder and MiniLM encoder against transformers."""

HELP = "attnlab's GPT-2 decoder and MiniLM encoder vs transformers"
SHARED = {"quick": "a smaller GPT-2 and batch", "reps": (5, "timed repetitions per contender (median reported)")}


def add_arguments(p):
    p.add_argument("--profile", action="store_true", help="also show where attnlab's training step spends time")


def run(args) -> int:
    from attnlab.bench import models

    models.main(quick=args.quick, json_path=args.json, reps=args.reps, show_profile=args.profile)
    return 0
