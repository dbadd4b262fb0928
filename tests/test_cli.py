"""The ``attnlab`` command's shape: one table, one set of shared options, help everywhere,
``--version``, the lab's list of experiments, and ``attnlab claims`` showing one claim whole.
Everything runs in-process through ``attnlab.cli.main`` and stops before any experiment
(``--help``, bad arguments), except the claims, which run the quickest one."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import attnlab
import attnlab.commands
from attnlab.cli import COMMANDS, build_parser, main


def _leaves(parser: argparse.ArgumentParser, words=()):
    """``(words, parser)`` for every parser in the tree (groups and leaves), depth first."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*words, name))


def _options(parser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_option_and_command_has_help():
    missing = []
    for words, p in _leaves(build_parser()):
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
                continue
            if isinstance(a, argparse._SubParsersAction):
                missing += [f"{' '.join((*words, c.dest))} (command)" for c in a._choices_actions if not c.help]
            elif not (a.help and a.help.strip()):
                missing.append(f"attnlab {' '.join(words)} {a.option_strings or a.dest}")
    assert missing == []


def test_the_table_lists_every_command_module_and_each_has_the_shape():
    mods = {m.name for m in pkgutil.iter_modules(attnlab.commands.__path__)} - {"options"}
    assert {name for _, name in COMMANDS} == mods
    for _, name in COMMANDS:
        mod = importlib.import_module(f"attnlab.commands.{name}")
        assert callable(mod.add_arguments) and callable(mod.run) and mod.HELP and isinstance(mod.SHARED, dict)


def test_shared_options_are_spelled_the_same_everywhere():
    for words, p in _leaves(build_parser()):
        for a in _options(p):
            if a.option_strings == ["--json"]:
                assert a.metavar == "PATH" and a.nargs is None, words  # a path everywhere, never a flag
            if a.option_strings == ["--reps"]:
                assert a.type.__name__ == "positive_int", words
            if a.option_strings == ["--quick"]:
                assert isinstance(a, argparse._StoreTrueAction), words


WITH_REPS = [
    " ".join(w) for w, p in _leaves(build_parser()) if any(a.option_strings == ["--reps"] for a in _options(p))
]


def test_the_commands_that_repeat_take_reps():
    assert {
        "bench attention",
        "bench models",
        "bench inference",
        "bench distributed",
        "bench interp",
        "bench capture",
        "bench compile",
        "bench varlen",
        "bench decode",
        "lab crossover",
    } == set(WITH_REPS)


@pytest.mark.parametrize("words", WITH_REPS)
def test_reps_zero_is_a_usage_error_naming_the_option(words, capsys):
    assert main([*words.split(), "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err


@pytest.mark.parametrize(
    "words, defaults",
    [
        ("bench varlen", {"seqs": 16, "min": 64, "max": 2048, "heads": 8, "dim": 64}),
        ("bench decode", {"seqs": 16, "min": 128, "max": 4096, "heads": 8, "dim": 128, "kv_heads": 2}),
    ],
)
def test_ragged_batch_benchmarks_share_their_options(words, defaults, capsys):
    args = build_parser().parse_args(words.split())
    assert {k: getattr(args, k) for k in defaults} == defaults
    for opt in ("--seqs", "--min", "--max", "--heads", "--dim"):
        assert main([*words.split(), opt, "0"]) == 2
        assert opt in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"attnlab {attnlab.__version__}"


def test_help_names_the_command_as_typed(capsys):
    assert main(["lab", "crossover", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnlab lab crossover") and "attnlab.lab.crossover" not in out.split("\n")[0]
    assert main(["bench", "triton", "--help"]) == 0
    assert "--markdown" in capsys.readouterr().out


def test_lab_help_lists_each_experiment_with_what_it_shows_and_its_time(capsys):
    assert main(["lab", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for _, name in COMMANDS:
        if name.startswith("lab_"):
            mod = importlib.import_module(f"attnlab.commands.{name}")
            assert " ".join(f"{mod.HELP} [{mod.RUNTIME}]".split()) in out
            assert "about" in mod.RUNTIME


def test_usage_errors_return_2_not_raise(capsys):
    assert main([]) == 2
    assert main(["lab", "nonsense"]) == 2
    assert main(["bench", "varlen", "--min", "9", "--max", "3"]) == 2
    assert "--min" in capsys.readouterr().err


# ----------------------------------------------------------------------------- claims
def test_claims_accepts_a_seed_name(capsys):
    from attnlab.lab import claims as C

    assert main(["claims", "000", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    expect = [c.id for c in C.all_claims() if c.seed == C.SEED_000]
    assert listed == expect and expect
    assert [c.id for c in C.select([C.SEED_000])] == expect  # the file name works too
    assert main(["claims", "999", "--list"]) == 2
    assert "000" in capsys.readouterr().err  # names the seeds there are


def test_claims_id_shows_the_claim_whole(capsys, tmp_path):
    from attnlab.lab import claims as C

    c = C.select(["dot-product-cosine"])[0]
    out = tmp_path / "one.json"
    assert main(["claims", "dot-product-cosine", "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())["claims"][0]
    flat = " ".join(text.split())
    for q in c.quotes:
        assert " ".join(q.split()) in flat  # the seed's quote, whole
    assert f"verdict: {doc['verdict']}" in text and f"why: {doc['explanation']}" in flat
    assert "conditions: none" in text
    for k in doc["evidence"]:
        assert k in text  # every measured figure
    assert doc["key_figure"] in flat


def test_claims_detail_states_the_conditions(monkeypatch, capsys):
    from attnlab.lab import claims as C

    def exp():
        return C.Outcome(
            C.Verdict.HOLDS_UNDER_CONDITIONS,
            {"error": 1.5e-3, "sizes": [1, 2, 3]},
            "small error once the rows are long",
            conditions="only for rows longer than 64 keys",
            key_figure="error 1.5e-03",
        )

    C.all_claims()
    monkeypatch.setitem(
        C.REGISTRY._claims,
        "zz-conditional",
        C.Claim("zz-conditional", "a conditional claim", C.SEED_002, ("a quote",), exp, "tests"),
    )
    assert main(["claims", "zz-conditional", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "conditions: only for rows longer than 64 keys" in text
    assert "verdict: holds under conditions" in text and "0.0015" in text and "[1, 2, 3]" in text


def test_claims_table_wraps_long_figures_instead_of_cutting_them():
    from attnlab.lab import claims as C

    reg = C.Registry()
    long_figure = "a key figure " + " ".join(f"word{i}" for i in range(40)) + " end-of-figure"

    @reg.claim("long-one", title="t", seed=C.SEED_002, quote="q")
    def _():
        return C.Outcome.judge(True, evidence={"x": 1.0}, explanation="e", key_figure=long_figure)

    table = C.format_table(reg.run(progress=False), width=30)
    assert "…" not in table
    assert " ".join(table.split()).count("end-of-figure") == 1
    assert all(w in table for w in long_figure.split())
    assert max(len(line) for line in table.splitlines()) < len(long_figure)


def test_the_command_leaves_huge_page_allocations_as_the_environment_has_them(monkeypatch):
    from attnlab import cli

    monkeypatch.delenv(cli.THP_ENV, raising=False)
    assert cli.main(["--version"]) == 0
    assert cli.THP_ENV not in os.environ  # not turned on behind the user's back (it slowed run_with_cache)
    for v in ("0", "1"):
        monkeypatch.setenv(cli.THP_ENV, v)
        assert cli.main(["--version"]) == 0
        assert os.environ[cli.THP_ENV] == v


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_with_the_variable_set_kept_tensors_are_backed_by_huge_pages():
    # What the setting is for: fresh 2 MiB+ tensors come in huge pages (fewer first-touch faults).
    code = (
        "import torch\n"
        "keep = [torch.ones(1 << 20) for _ in range(16)]\n"  # 16 x 4 MiB
        "print([l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')][0])\n"
    )
    huge = {}
    for v in ("0", "1"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "THP_MEM_ALLOC_ENABLE": v},
            capture_output=True,
            text=True,
            check=True,
        )
        huge[v] = int(out.stdout.split()[-1])
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().find("[never]") >= 0:
        pytest.skip("transparent huge pages are disabled on this kernel")
    assert huge["1"] > huge["0"], huge
