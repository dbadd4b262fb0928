"""Files where they belong: the import directions docs/design.md states, read from the
source (no imports run), and no pytest file or import-time environment change inside the package."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import attnlab

PKG = Path(attnlab.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports inside functions count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_lab_does_not_import_bench():
    bad = {
        str(p.relative_to(PKG)): sorted(m for m in _imports(p) if m.startswith("attnlab.bench"))
        for p in (PKG / "lab").rglob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_memprobe_does_not_import_the_attention_benchmark():
    assert not any(
        m.startswith("attnlab.bench.attention") and m != "attnlab.bench.attention_probe"
        for m in _imports(PKG / "bench" / "memprobe.py")
    )


def test_the_triton_benchmark_lives_in_bench():
    assert (PKG / "bench" / "triton.py").is_file() and not (PKG / "ops" / "triton" / "bench.py").exists()


def test_no_pytest_files_inside_the_package():
    assert sorted(str(p.relative_to(PKG)) for p in PKG.rglob("conftest.py")) == []


def test_importing_the_benchmarks_changes_no_environment():
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    code = (
        "import os, attnlab.bench.models, attnlab.bench.inference, attnlab.cli; print(os.environ.get('HF_HUB_OFFLINE'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_cache_files_are_under_600_lines():
    long = {
        p.name: n for p in (PKG / "cache").glob("*.py") if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600
    }
    assert long == {}


def test_the_design_layout_lists_every_package_folder():
    """docs/design.md's layout block names every folder of the package (``name/``)."""
    text = (PKG.parents[1] / "docs" / "design.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```")[1]
    folders = sorted(p for p in PKG.rglob("*") if p.is_dir() and p.name != "__pycache__")
    assert [str(p.relative_to(PKG)) for p in folders if f" {p.name}/ " not in block] == []
