#!/usr/bin/env bash
# The style and type checks that `make test` runs before pytest, for a developer:
#   scripts/lint.sh          check (exit status non-zero on any finding)
#   scripts/lint.sh --fix    also apply ruff's safe fixes and format the files (then review the diff)
# Uses the tools pinned in pyproject.toml's `test` extra, from .venv (`make venv`) or $BIN.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-.venv/bin}"
for tool in ruff mypy; do
    if [ ! -x "$BIN/$tool" ]; then
        echo "lint.sh: $BIN/$tool not found; run 'make venv' (or set BIN to a folder holding ruff and mypy)" >&2
        exit 2
    fi
done
if [ "${1:-}" = "--fix" ]; then
    "$BIN/ruff" check --fix src tests
    "$BIN/ruff" format src tests
fi
status=0
"$BIN/ruff" check src tests || status=1
"$BIN/ruff" format --check src tests || status=1
"$BIN/mypy" src/attnlab || status=1
exit $status
