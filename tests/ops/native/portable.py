"""The native kernel's two builds a full test run needs, and how to start them early.

The portable build is what test_native_gemm.py's child process checks; the machine's own
variant is what every other native test loads.  The root conftest starts both when a full
``pytest -n N`` run starts, and ``make test``'s install starts them as soon as torch is in the
venv (``python tests/ops/native/portable.py``), on the core pip leaves idle while it installs
the rest: the tests then find them built, or wait on the build under way (its flock), then load
it.  No torch import here: the conftest reads this module in the pytest-xdist controller.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

#: builds (or loads the cached) portable variant: kernel.cpp alone, the attention ops the test
#: calls; decode.cpp's paged / quantized decode ops never run there
BUILD = """
from attnlab.ops.native import build
build.SOURCES = ("kernel.cpp",)
build.load()
"""


#: builds (or loads the cached) variant this machine runs, every source (the root conftest starts
#: it first in a full run: the suite's first native call would otherwise wait on it)
BUILD_MAIN = """
from attnlab.ops.native import build
build.load()
"""


def env_main() -> dict[str, str]:
    """The main build's environment: the caller's, with this checkout's attnlab first on the path
    (a variant or bf16 path forced by the caller is kept: it is the one the tests will load)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def env() -> dict[str, str]:
    """The child's environment: the portable variant (no -m flag), the bf16-pairs forward
    (emulated without avx512_bf16), and this checkout's attnlab and tests first on the path."""
    return {
        **os.environ,
        "ATTNLAB_NATIVE_VARIANT": "portable",
        "ATTNLAB_NATIVE_BF16": "pairs",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def start_builds() -> list[subprocess.Popen]:
    """Start both builds in the background (or load them, when cached) and return at once: the
    machine's own variant at normal priority (the suite's first native call waits on it), the
    portable one at the lowest CPU priority (nice 19: it runs on whatever core is left idle).
    Each runs in its own process group, so ninja and the compiler end with it."""
    procs = []
    for code, child_env, nice in ((BUILD_MAIN, env_main(), 0), (BUILD, env(), 19)):
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            env=child_env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if nice:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, p.pid, nice)  # before it starts ninja (it imports torch first)
        procs.append(p)
    return procs


if __name__ == "__main__":
    start_builds()  # make test's install: the builds go on after this returns
