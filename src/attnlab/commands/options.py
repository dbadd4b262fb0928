"""The options every command spells the same way: ``--quick``, ``--json PATH``, ``--reps N``;
and those of the benchmarks over a ragged batch (:func:`ragged_batch`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1 (argparse names the option in its error)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {n}")
    return n


def ragged_batch(p: argparse.ArgumentParser, *, lo: int, hi: int, dim: int, seqs: int = 16, heads: int = 8) -> None:
    """The options of a benchmark over a ragged batch (``bench varlen``, ``bench decode``):
    ``--seqs``, ``--min`` / ``--max`` (sequence lengths), ``--heads`` (query heads) and
    ``--dim``, each a positive int with these defaults."""
    p.add_argument("--seqs", type=positive_int, default=seqs, help=f"sequences in the batch (default {seqs})")
    p.add_argument("--min", type=positive_int, default=lo, help=f"shortest sequence length (default {lo})")
    p.add_argument("--max", type=positive_int, default=hi, help=f"longest sequence length (default {hi})")
    p.add_argument("--heads", type=positive_int, default=heads, help=f"query heads (default {heads})")
    p.add_argument("--dim", type=positive_int, default=dim, help=f"head dim (default {dim})")


def shared(
    *, quick: str | None = None, reps: tuple[int | None, str] | None = None, json: bool = True
) -> argparse.ArgumentParser:
    """The parent parser of one command: ``--quick`` (when ``quick`` gives its help),
    ``--reps N`` (a positive int; ``reps = (default, help)``) and ``--json PATH`` (unless
    ``json=False``)."""
    p = argparse.ArgumentParser(add_help=False)
    if quick:
        p.add_argument("--quick", action="store_true", help=quick)
    if reps is not None:
        default, what = reps
        p.add_argument(
            "--reps",
            type=positive_int,
            default=default,
            metavar="N",
            help=what if default is None else f"{what} (default {default})",
        )
    if json:
        p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p


def write_json(path: str | None, obj, **kw) -> None:
    """Write ``obj`` as indented JSON to ``path`` (creating its folder) and say so; nothing when None."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, **kw) + "\n", encoding="utf-8")
    print(f"wrote {p}")
