"""``attnlab claims [IDS...]``: the seeds' claims as experiments with verdicts.

IDS are claim ids, substrings of ids, or a seed's name (``000``, ``002``, or the seed's
file name).  With no IDS every claim runs.  When the selection is one claim, it is shown
whole: the seed's quote, the conditions, the measured figures, the verdict and why.
Exit status: 0 when every selected experiment ran (verdicts are findings, not failures),
1 when one raised, 2 for an id that matches nothing."""

import sys

from attnlab.commands.options import positive_int

HELP = "the seeds' claims as experiments with verdicts; one claim id shows it whole"
SHARED: dict[str, object] = {}


def add_arguments(p):
    p.add_argument(
        "ids", nargs="*", metavar="ID", help="claim ids, substrings of ids, or a seed's name such as 000 (default: all)"
    )
    p.add_argument("--list", action="store_true", help="list the claims (id, seed, title) and exit, running nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="run the experiments on N spawned processes, one torch thread each (default 1: in this process)",
    )


def run(args) -> int:
    from attnlab.commands.options import write_json
    from attnlab.lab.claims import registry as R

    try:
        claims = R.select(args.ids or None)
    except ValueError as e:
        print(f"attnlab claims: {e}", file=sys.stderr)
        return 2
    if args.list:
        print(R.format_list(claims))
        return 0
    results = R.run_claims([c.id for c in claims], progress=not args.no_progress, workers=args.workers)
    print(R.format_table(results))
    if len(results) == 1:
        print("\n" + R.format_claim(results[0]))
    for r in results:
        if r.error:
            print(f"\n{r.id}: {r.error}", file=sys.stderr)
    if args.json:
        write_json(args.json, R.as_document(results), ensure_ascii=False)
    return 0 if all(r.ok for r in results) else 1
