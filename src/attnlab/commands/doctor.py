"""``attnlab doctor``: which attention kernels run on this machine, and why.

One line each: attnlab / torch / Python versions; the CPU and the native kernel variant its
flags select (``avx512bf16`` / ``avx512`` / ``avx2`` / ``portable``); the CPU attention kernel
that runs (:func:`attnlab.ops.native.build.status`: built and loaded, disabled by
``ATTNLAB_NATIVE=0``, or unavailable and why, e.g. no compiler); the native decode
operators; the compiler and ninja; Triton (installed?  a CUDA device to run on?); threads.
Never fails: a probe that raises prints its error on its line.
"""

from __future__ import annotations

HELP = "which attention kernel runs here and why (native build and variant, triton, torch, threads)"
SHARED: dict = {}


def add_arguments(p):
    p.add_argument(
        "--no-build",
        action="store_true",
        help="do not build the native kernel when it is not built yet (say so instead)",
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _probe(name, fn) -> str:
    try:
        return f"{name}: {fn()}"
    except Exception as e:  # noqa: BLE001 -- the doctor reports, it never fails
        return f"{name}: ({type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})"


def _cpu_kernel(build_now: bool) -> str:
    from attnlab.ops.native import build

    if not build_now and not build.disabled() and not build.loaded():
        return "native kernel not loaded yet (--no-build: not built here); the first CPU attention call builds it"
    line = build.status()
    if "disabled" in line or "unavailable" in line:
        return line
    return f"{line}: attention(backend='auto') on CPU runs it where the mask and score mod allow, else the torch-ops flash path"


def _decode() -> str:
    import torch

    from attnlab.ops.native import build

    if build.disabled() or not build.loaded():
        return "not available (the native kernel is not loaded): the caches' split-KV paths run"
    ok = hasattr(torch.ops.attnlab_decode, "paged") and hasattr(torch.ops.attnlab_decode, "quantized")
    return (
        "native paged and quantized decode (PagedKV.attend, QuantizedKV.attend)"
        if ok
        else "the loaded build has no decode operators: the caches' split-KV paths run"
    )


def _toolchain() -> str:
    import importlib.util
    import os
    import shutil

    cxx = os.environ.get("CXX") or "c++"
    ninja = shutil.which("ninja") or ("the ninja package" if importlib.util.find_spec("ninja") else "not found")
    return f"compiler {shutil.which(cxx) or f'{cxx} not found'}, ninja {ninja}"


def _triton() -> str:
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is None:
        return "not installed: the Triton kernels are not available"
    import triton

    gpu = torch.cuda.is_available()
    where = (
        f"CUDA device {torch.cuda.get_device_name(0)}" if gpu else "no CUDA device: the Triton kernels do not run here"
    )
    return f"{triton.__version__} installed; {where}"


def lines(build_now: bool = True) -> list[str]:
    import os
    import platform

    import torch

    import attnlab
    from attnlab.ops.native import build

    env = os.environ.get("ATTNLAB_NATIVE")
    return [
        f"attnlab {attnlab.__version__}, torch {torch.__version__}, Python {platform.python_version()}",
        _probe("cpu", lambda: f"{_cpu_model()}; native variant {build.variant()[0]}"),
        _probe("cpu attention kernel", lambda: _cpu_kernel(build_now)),
        _probe("decode", _decode),
        _probe("ATTNLAB_NATIVE", lambda: "unset (native kernel on)" if env is None else repr(env)),
        _probe("toolchain", _toolchain),
        _probe("triton", _triton),
        _probe(
            "threads",
            lambda: (
                f"torch {torch.get_num_threads()} intra-op / {torch.get_num_interop_threads()} inter-op, "
                f"{os.cpu_count()} CPUs"
            ),
        ),
    ]


def run(args) -> int:
    for line in lines(build_now=not args.no_build):
        print(line)
    return 0
