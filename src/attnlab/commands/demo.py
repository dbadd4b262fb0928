"""``attnlab demo``: the main job — induction heads, MiniLM sinks, KV-cache decoding, recall,
Hopfield capacity, the seeds' claims; prints a summary and writes the HTML report."""

HELP = (
    "the main job: induction heads, MiniLM sinks, KV-cache decoding, the seeds' claims; "
    "prints a summary and writes the HTML report"
)
SHARED = {"quick": "fewer training steps for the induction models", "json": False}


def add_arguments(p):
    p.add_argument("--out", default="out/report.html", help="the HTML file to write (default out/report.html)")
    p.add_argument("--force", action="store_true", help="retrain even when the lab cache has the models")
    p.add_argument("--no-claims", action="store_true", help="skip the seeds' claims")


def run(args) -> int:
    from attnlab.lab.demo import demo

    demo(args.out, quick=args.quick, force=args.force, claims=not args.no_claims)
    return 0
