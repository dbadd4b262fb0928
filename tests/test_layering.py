"""No module under src/attnlab imports another module's private (``_``) names (docs/design.md).

Read with ``ast`` (nothing is imported).  A *private name* is one that starts with a single
underscore (dunders such as ``__version__`` are public).  Counted as importing one:

* ``from attnlab.a.b import _x`` (absolute or relative) from any module but ``attnlab.a.b``;
* ``from attnlab.a._m import x`` / ``import attnlab.a._m``: a private *module* — allowed only
  inside its own package ``attnlab.a`` (``report/_css.py`` serves ``report/``, the claims'
  ``_measure.py`` serves ``lab/claims/``);
* ``mod._x`` where ``mod`` is a name bound to an attnlab module by an import
  (``from attnlab.ops import flash as f; f._backward``) — the same import by another route.

Private attributes of imported *classes* (``SomeClass._helper``) are not imports and are not
checked here.  ``ALLOWED`` lists the exceptions that remain, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "attnlab"

# (importing module, imported module, name): left for the helper or issue that owns the files
ALLOWED = {
    # ops/triton/resources.py compiles what its own subpackage's launchers would launch: it
    # intercepts the launch (a measuring tool, not a second implementation)
    ("attnlab.ops.triton.resources", "attnlab.ops.triton.autograd", "_launch"),
    ("attnlab.ops.triton.resources", "attnlab.ops.triton.autograd", "_forward"),
    ("attnlab.ops.triton.resources", "attnlab.ops.triton.autograd", "_backward"),
    ("attnlab.ops.triton.resources", "attnlab.ops.triton.autograd", "_KERNELS"),
    ("attnlab.ops.triton.resources", "attnlab.ops.triton.autograd", "_Problem"),
    # lab/ is outside this change (issue 14: lab/ is reorganised separately)
    ("attnlab.lab.sinks", "attnlab.interp.detectors", "_masked_mean"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    p = SRC.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(node: ast.ImportFrom, module: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    base = _package(module, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_module_outside(target: str, module: str) -> bool:
    """``target`` has a private component and ``module`` is not inside the package that holds it."""
    parts = target.split(".")
    for i, p in enumerate(parts):
        if _private(p):
            owner = ".".join(parts[:i])
            return not (module == owner or module.startswith(owner + "."))
    return False


def violations(path: Path, source: str | None = None) -> list[tuple[str, str, str, int]]:
    """``(importing module, imported module, private name, line)`` for each private import in
    ``path`` (its text, or ``source`` read as if it were at ``path``)."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, filename=str(path))
    out = []
    module_aliases: dict[str, str] = {}  # local name -> attnlab module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, path)
            if not (target == "attnlab" or target.startswith("attnlab.")):
                continue
            if _private_module_outside(target, module):
                out.append((module, target, "*", node.lineno))
            for a in node.names:
                sub = f"{target}.{a.name}"
                if _is_module(sub):
                    module_aliases[a.asname or a.name] = sub
                    if _private(a.name) and _private_module_outside(sub, module):
                        out.append((module, target, a.name, node.lineno))
                elif _private(a.name) and target != module:
                    out.append((module, target, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "attnlab" or a.name.startswith("attnlab."):
                    if _private_module_outside(a.name, module):
                        out.append((module, a.name, "*", node.lineno))
                    if a.asname:
                        module_aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
            target = module_aliases.get(node.value.id)
            if target is not None and target != module:
                out.append((module, target, node.attr, node.lineno))
    return out


FILES = sorted(PKG.rglob("*.py"))


def test_the_package_is_found():
    assert len(FILES) > 50 and (PKG / "ops" / "tiling.py").is_file()


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PKG)) for p in FILES])
def test_no_module_imports_another_modules_private_names(path):
    bad = [v for v in violations(path) if v[:3] not in ALLOWED]
    assert not bad, "private imports (make the name public, or move it where it belongs):\n" + "\n".join(
        f"  {path.relative_to(SRC)}:{line}: {mod} imports {name!r} from {target}" for mod, target, name, line in bad
    )


def test_the_allowed_exceptions_still_exist():
    """An exception that no longer occurs is removed from ALLOWED (the list only shrinks)."""
    found = {v[:3] for p in FILES for v in violations(p)}
    stale = ALLOWED - found
    assert not stale, f"remove from ALLOWED (fixed): {sorted(stale)}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from attnlab.ops.flash import _backward\n", [("attnlab.ops.flash", "_backward")]),
        ("from ..ops.dispatch import _auto\n", [("attnlab.ops.dispatch", "_auto")]),
        ("from attnlab.ops import flash as f\nf._Problem\n", [("attnlab.ops.flash", "_Problem")]),
        ("import attnlab.ops.flash as f\nf._backward\n", [("attnlab.ops.flash", "_backward")]),
        ("from attnlab.report._util import x\n", [("attnlab.report._util", "*")]),
        ("from attnlab.ops.flash import flash_attention, __all__\n", []),
        ("import torch\ntorch._C\n", []),
    ],
)
def test_the_checker_sees_every_route(source, expected):
    """The checker itself, on ``source`` read as if it were attnlab/distributed/probe.py."""
    got = [(t, n) for _, t, n, _ in violations(PKG / "distributed" / "probe.py", source)]
    assert got == expected
