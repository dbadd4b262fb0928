"""Byte-compile the installed distributions every test process imports, on every core.

``make test`` installs with ``pip --no-compile`` and runs this after.  pip compiles on one core;
and a module first compiled inside the run is compiled by every process that imports it before
its ``.pyc`` lands: the two pytest workers at the same moment, and the spawned ranks of the
distributed tests (which then overran their bounds).  So what every test process imports is
compiled here, up front and in parallel: attnlab's own requirements (torch, numpy, ...), pytest,
pytest-xdist, hypothesis and triton, with everything they require in turn (sympy, networkx,
jinja2, ...), read from the installed metadata (nothing is imported, nothing listed by hand).

The rest of the venv -- transformers' hundreds of model folders, pandas, scipy, wandb and the
other optional parts, about two thirds of its bytecode, of which the tests import about a tenth
-- compiles on first import, once, into the venv (``make test`` runs with
``PYTHONDONTWRITEBYTECODE`` unset).  Files that do not compile (torch ships Python 3.12 syntax
in its testing helpers) are left as pip leaves them.

Usage: ``python scripts/precompile.py [DIST ...]`` with the venv's python (default: the roots
above, each skipped where it is not installed; a DIST named here must be); ``--list`` prints
the distributions instead.
"""

from __future__ import annotations

import argparse
import compileall
import concurrent.futures
import functools
import os
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: what every test process imports: the op and its dependencies, the test runner, triton
ROOTS = ("attnlab", "pytest", "pytest-xdist", "hypothesis", "triton")


def closure(roots=ROOTS) -> list[metadata.Distribution]:
    """The installed distributions ``roots`` name and everything they require (no extras,
    markers evaluated here); a root that is not installed is skipped."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [seen[k] for k in sorted(seen)]


def sources(dists) -> list[str]:
    """The ``.py`` files the distributions installed (an editable install lists none)."""
    out = []
    for dist in dists:
        for f in dist.files or []:
            if f.suffix == ".py":
                out.append(str(dist.locate_file(f)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/precompile.py", description=__doc__.split("\n")[0])
    p.add_argument("dists", nargs="*", default=list(ROOTS))
    p.add_argument("--list", action="store_true", help="print the distributions and their file counts")
    a = p.parse_args(argv)
    named = [d for d in a.dists if d not in ROOTS]  # asked for by name: must be installed
    missing = [d for d in named if not closure([d])]
    if missing:
        p.error(f"not installed in this environment: {', '.join(missing)}")
    dists = closure(a.dists)
    if a.list:
        for d in dists:
            print(d.metadata["Name"], len(sources([d])))
        return 0
    files = sources(dists)
    compile_one = functools.partial(compileall.compile_file, quiet=2)
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, files, chunksize=64))
    return 0


if __name__ == "__main__":
    sys.exit(main())
