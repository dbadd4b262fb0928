"""``attnlab report``: the offline HTML report of the lab's experiments (cached runs reused)."""

from attnlab.commands.demo import SHARED, add_arguments, run  # noqa: F401  (the same job as demo)

HELP = "write the offline HTML report of the lab's experiments (cached runs reused)"
