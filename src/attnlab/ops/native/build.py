"""Build the native CPU kernel (``kernel.cpp``) once, on first use, and cache it.

``torch.utils.cpp_extension.load`` compiles it with ninja into
``$TORCH_EXTENSIONS_DIR/attnlab_native_<variant>_<hash of source and flags>`` (default: torch's
``~/.cache/torch_extensions/...``); later processes load the cached library in
milliseconds (ninja sees nothing to do).  An ``fcntl`` lock on
``<build dir>.lock`` makes parallel processes (pytest-xdist workers) build it once.

The variant, and its compiler flags, come from the CPU's flags in ``/proc/cpuinfo``:
``avx512bf16`` / ``avx512`` (``-mavx512f -mavx512bw -mavx512vl -mavx512dq``, plus
``-mavx512bf16``), ``avx2`` (``-mavx2 -mfma``) or ``portable`` (no ``-m`` flag);
``ATTNLAB_NATIVE_VARIANT`` builds a lesser one (tests of the portable path).

``ATTNLAB_NATIVE=0`` disables the kernel (nothing is built).  No compiler, no ninja or a
failed build gives one ``RuntimeWarning`` line and :func:`load` returns None: callers
take the torch-ops flash path.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

SOURCES = ("kernel.cpp", "decode.cpp")
# included by kernel.cpp (through tiles.h, forward.h and backward.h, its attention code) and
# decode.cpp: every *.h of this folder is part of the build directory's hash (_compile globs
# them), so editing one rebuilds
HEADERS = (
    "backward.h",
    "forward.h",
    "fwd_tile.h",
    "gemm_bf16.h",
    "gemm_f32.h",
    "mask_args.h",
    "masking.h",
    "rowmath.h",
    "sched.h",
    "scoremods.h",
    "scratch.h",
    "tiles.h",
    "vecmath.h",
)
_BASE_FLAGS = ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-std=c++17"]
# ATen's CPU parallel backend is OpenMP, and at::parallel_for is a header template: compiled
# without -fopenmp its `#pragma omp parallel` is silently dropped and every region of the
# kernel runs on one thread (the first builds did, at half the speed on 2 cores).  Linking
# with -fopenmp resolves to the libgomp.so.1 torch has already loaded (one thread pool).
_PARALLEL_FLAGS = ["-fopenmp"]
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")

_lock = threading.Lock()
_state: dict = {}  # "module", "reason", "seconds", "variant"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (empty when unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def variant(flags: frozenset[str] | None = None) -> tuple[str, list[str]]:
    """``(name, compiler flags)`` for a CPU with these ``/proc/cpuinfo`` flags."""
    flags = cpu_flags() if flags is None else flags
    if all(f in flags for f in _AVX512):
        extra = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mprefer-vector-width=512"]
        if "avx512_bf16" in flags:
            return "avx512bf16", [*extra, "-mavx512bf16"]
        return "avx512", extra
    if "avx2" in flags and "fma" in flags:
        return "avx2", ["-mavx2", "-mfma"]
    return "portable", []


_RANK = ("portable", "avx2", "avx512", "avx512bf16")
_FLAGS_OF = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": frozenset({"avx2", *_AVX512}),
    "avx512bf16": frozenset({"avx2", *_AVX512, "avx512_bf16"}),
}


def chosen_variant() -> tuple[str, list[str]]:
    """The variant to build: the CPU's best (:func:`variant`), or ``ATTNLAB_NATIVE_VARIANT``
    (``portable`` / ``avx2`` / ``avx512`` / ``avx512bf16``) to build a lesser one, e.g. to
    test the portable path on an AVX-512 machine.  A variant the CPU cannot run is an error."""
    best = variant()
    forced = os.environ.get("ATTNLAB_NATIVE_VARIANT", "").strip().lower()
    if not forced:
        return best
    if forced not in _RANK:
        raise ValueError(f"ATTNLAB_NATIVE_VARIANT={forced!r}: expected one of {', '.join(_RANK)}")
    if _RANK.index(forced) > _RANK.index(best[0]):
        raise RuntimeError(f"ATTNLAB_NATIVE_VARIANT={forced}: this CPU runs at most the {best[0]} variant")
    return variant(_FLAGS_OF[forced])


def disabled() -> bool:
    """``ATTNLAB_NATIVE=0`` (or ``false``/``off``/``no``) turns the kernel off."""
    return os.environ.get("ATTNLAB_NATIVE", "1").strip().lower() in ("0", "false", "off", "no")


def _build_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _ensure_ninja_on_path() -> None:
    """The ``ninja`` PyPI package puts its binary beside the interpreter's scripts, which is
    not on PATH when the venv is not activated."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def _compile():
    name, flags = chosen_variant()
    _state["variant"] = name
    _ensure_ninja_on_path()
    if shutil.which("ninja") is None:
        raise RuntimeError("ninja is not installed (pip install ninja)")
    from torch.utils.cpp_extension import load as cpp_load

    here = Path(__file__).resolve().parent
    digest = hashlib.sha1()
    for src in (*SOURCES, *sorted(p.name for p in here.glob("*.h"))):  # the headers kernel.cpp includes too
        digest.update((here / src).read_bytes())
    digest.update(" ".join(_BASE_FLAGS + _PARALLEL_FLAGS + flags).encode())
    # one directory per source version and flag set: two checkouts never rebuild each other's
    ext = f"attnlab_native_{name}_{digest.hexdigest()[:10]}"
    build_dir = _build_root() / ext
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(str(build_dir) + ".lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)  # one build per machine; the others wait, then load it
        try:
            # a library of torch ops, not a Python module: torch.ops.load_library loads it and its
            # TORCH_LIBRARY blocks register torch.ops.attnlab_native.* (kernel.cpp) and
            # torch.ops.attnlab_decode.* (decode.cpp)
            cpp_load(
                name=ext,
                sources=[str(here / s) for s in SOURCES],
                extra_cflags=_BASE_FLAGS + _PARALLEL_FLAGS + flags,
                extra_ldflags=_PARALLEL_FLAGS,
                build_directory=str(build_dir),
                verbose=False,
                is_python_module=False,
            )
        finally:
            fcntl.flock(lk, fcntl.LOCK_UN)
    _state["seconds"] = time.perf_counter() - t0
    return Ops(ext)


class Ops:
    """The loaded build: its torch ops (``torch.ops.attnlab_native``) by their names --
    ``fwd``, ``bwd`` (ops.py's custom ops call them), ``features()``, ``parallel_threads(n)``,
    ``last_bwd_plan()``, ``last_fwd_plan()``, ``release_scratch()`` (:func:`release_scratch`)."""

    def __init__(self, name: str):
        import torch

        self.name = name
        self._ops = torch.ops.attnlab_native

    def __getattr__(self, op: str):
        if op.startswith("_"):  # not an op (and no recursion before __init__ has run: copy, pickle)
            raise AttributeError(op)
        return getattr(self._ops, op)

    def __repr__(self) -> str:
        return f"<attnlab native ops {self.name}>"


def load() -> Ops | None:
    """The compiled extension's ops (:class:`Ops`), or None (disabled, or it cannot be built: one
    warning)."""
    if disabled():
        return None
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _compile()
                _state["reason"] = None
            except Exception as e:  # noqa: BLE001 -- no compiler, no ninja, a failed build: fall back, never fail
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                _state["module"] = None
                _state["reason"] = f"build failed: {first}"
                warnings.warn(
                    f"attnlab: the native CPU attention kernel is unavailable ({first}); using the "
                    "torch-ops flash path",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _state["module"]


def release_scratch() -> int:
    """Frees the native kernel's scratch for its large K/V packs (``scratch.h``: packs of 8 MiB
    and more are views into buffers the process keeps between calls, grown to the largest
    call's, so that a long-context call does not fault in fresh pages every time); returns
    the bytes freed (0 where the kernel is not loaded).  ``ATTNLAB_NATIVE_SCRATCH=0`` (or
    ``false``/``off``/``no``, as ``ATTNLAB_NATIVE``) turns the scratch off (every pack allocated
    per call)."""
    mod = _state.get("module")
    return 0 if mod is None else int(mod.release_scratch())


def loaded() -> bool:
    """True when the extension is already loaded (no build, no file access: safe to call
    while torch.compile traces)."""
    return _state.get("module") is not None


def status() -> str:
    """One line: which CPU kernel runs and why (for ``attnlab doctor`` and benchmark headers)."""
    if disabled():
        return "native kernel disabled (ATTNLAB_NATIVE=0): torch-ops flash path"
    mod = load()
    if mod is None:
        return f"native kernel unavailable ({_state.get('reason')}): torch-ops flash path"
    secs = _state.get("seconds")
    return f"native kernel {_state.get('variant')} ({mod.features()})" + (
        f", loaded in {secs:.1f} s" if secs is not None else ""
    )


__all__ = [
    "HEADERS",
    "SOURCES",
    "Ops",
    "chosen_variant",
    "cpu_flags",
    "disabled",
    "load",
    "release_scratch",
    "status",
    "variant",
]
