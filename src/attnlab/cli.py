"""The ``attnlab`` command, built from one table.

    attnlab bench attention|tiles|models|inference|distributed|interp|capture|compile|varlen|triton|decode [options]
    attnlab train [--task text|induction|recall] [--steps N] [--out DIR [--resume]] ...
    attnlab demo | report [--out PATH] [--quick] [--force] [--no-claims]
    attnlab inspect TEXT [--model minilm|FOLDER] [--out PATH]
    attnlab claims [IDS...] [--json PATH] [--list]
    attnlab lab induction|sinks|recall|hopfield|crossover [options of that experiment]
    attnlab doctor [--no-build]
    attnlab --version

Each leaf is a module of :mod:`attnlab.commands` with ``HELP``, ``SHARED``,
``add_arguments(parser)`` and ``run(args) -> int``; the options every command spells the
same way (``--quick``, ``--json PATH``, ``--reps N``) come from one parent parser
(:func:`attnlab.commands.options.shared`).  ``attnlab COMMAND --help`` says what each takes.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: The command tree: (words, module of attnlab.commands).  Groups are in GROUPS.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("bench attention", "bench_attention"),
    ("bench tiles", "bench_tiles"),
    ("bench models", "bench_models"),
    ("bench inference", "bench_inference"),
    ("bench distributed", "bench_distributed"),
    ("bench interp", "bench_interp"),
    ("bench capture", "bench_capture"),
    ("bench compile", "bench_compile"),
    ("bench varlen", "bench_varlen"),
    ("bench triton", "bench_triton"),
    ("bench decode", "bench_decode"),
    ("train", "train"),
    ("demo", "demo"),
    ("report", "report"),
    ("inspect", "inspect_heads"),
    ("claims", "claims"),
    ("lab induction", "lab_induction"),
    ("lab sinks", "lab_sinks"),
    ("lab recall", "lab_recall"),
    ("lab hopfield", "lab_hopfield"),
    ("lab crossover", "lab_crossover"),
    ("doctor", "doctor"),
)

GROUPS = {
    "bench": "benchmarks, side by side with their anchors (results in docs/benchmarks.md)",
    "lab": "one experiment of the lab: what it shows and about how long it takes below (docs/lab.md)",
}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; a wider column for the command names."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=30)


def _version() -> str:
    from attnlab import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The whole ``attnlab`` parser; each leaf's defaults carry its ``run``."""
    from attnlab.commands.options import shared

    p = argparse.ArgumentParser(
        prog="attnlab", description="attnlab: transformer attention, measured.", formatter_class=_Formatter
    )
    p.add_argument(
        "--version", action="version", version=f"attnlab {_version()}", help="print attnlab's version and exit"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, name in COMMANDS:
        mod = importlib.import_module(f"attnlab.commands.{name}")
        *group, leaf = words.split()
        parent = sub
        if group:
            g = group[0]
            if g not in groups:
                gp = sub.add_parser(g, help=GROUPS[g], description=GROUPS[g], formatter_class=_Formatter)
                groups[g] = gp.add_subparsers(dest=g, required=True, metavar="NAME")
            parent = groups[g]
        runtime = getattr(mod, "RUNTIME", None)
        help_ = f"{mod.HELP} [{runtime}]" if runtime else mod.HELP
        description = (mod.__doc__ or "") + (f"\n\nRun time: {runtime}." if runtime else "")
        cmd = parent.add_parser(
            leaf, help=help_, description=description, formatter_class=_Formatter, parents=[shared(**mod.SHARED)]
        )
        mod.add_arguments(cmd)
        cmd.set_defaults(_run=mod.run)
    return p


#: torch's CPU allocator backs allocations of 2 MiB and more with transparent huge pages when this
#: variable is 1 (it reads it once, at the first such allocation).  The command leaves it as the
#: environment has it.  It used to set it (fewer first-touch page faults for kept tensors), but
#: measured on a kernel whose THP defrag is ``madvise`` (the common default) the huge-page faults
#: cost more than they save: ``run_with_cache`` of a 6-layer model took 1.57 s of system time per
#: forward with it against 0.45 s without (docs/interp.md, "What a kept activation costs").
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def main(argv: list[str] | None = None) -> int:
    """Run ``attnlab ARGV``; returns the exit status (argparse's 2 for bad usage, 0 for ``--help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    args._argv = argv
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
