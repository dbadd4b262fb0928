"""The portable build of the native kernel that test_native_gemm.py's child process checks.

Shared with the root conftest, which starts this build early in a full ``pytest -n N`` run, in
the background at the lowest CPU priority, so that the test finds it built (its flock makes the
test's child wait for a build under way, then load it).  No torch import here: the conftest
reads this module in the pytest-xdist controller.
"""

from __future__ import annotations

import os
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
