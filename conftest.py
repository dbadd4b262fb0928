"""Repository-level pytest settings.

``--doctest-modules`` (pyproject.toml) would also import every ``conftest.py`` under
tests/ as a module named ``conftest``; the test directories are not packages, so two of
them collide ("import file mismatch").  They are conftests, not doctest modules: do not
collect them (pytest still loads them as conftests).
"""

collect_ignore_glob = ["tests/*conftest.py"]

# ``--doctest-modules`` also imports every module under src/attnlab.  The Triton kernel
# modules import ``triton`` (absent without the extra) and, with it, define their kernels
# for the GPU or the interpreter depending on ``TRITON_INTERPRET`` at that moment, which
# tests/ops/triton/conftest.py must set first.  They hold no doctests: do not collect them.
# (This lived in a conftest.py inside the package; the package ships no pytest files.)
collect_ignore = [f"src/attnlab/ops/triton/{name}.py" for name in ("autograd", "backward", "forward", "jitlib")]


import contextlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist, give each worker its share of the cores as torch threads.

    torch starts one intra-op thread per core in every process: ``pytest -n 2`` on two cores
    then runs four OpenMP threads on two cores, and on the suite's tiny problems a parallel
    region waits for a thread the kernel has descheduled (measured on the loaded 2-core machine,
    one process, two torch threads against one: a speculative decoding call 19x the CPU time,
    test_decoder_greedy_with_quantized_cache 20x).  One worker's share
    is ``cores // workers`` (at least one); ``OMP_NUM_THREADS`` also reaches the processes the
    tests spawn.  An ``OMP_NUM_THREADS`` set by the caller wins; a test that needs another
    count sets it itself (tests/ops/native/test_native_properties.py runs 1 and 2)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # a plugin imported it first: the variable came too late
        sys.modules["torch"].set_num_threads(threads)


# ----------------------------------------------------------------------------- the native builds
# In a fresh clone the first test that calls the native kernel waits on its build (~25 s on 2 cores),
# and tests/ops/native/test_native_gemm.py::test_portable_variant_matches_oracle builds the portable
# variant in a child process: ~40 CPU s of compiling, one worker waiting on it.  In a full
# `pytest -n N` run (`make test`) both builds start here instead, when the session starts: the
# machine's variant at normal priority (it overlaps collection and the first tests), the portable
# one in a background process at the lowest CPU priority (nice 19): it runs on whatever core the workers leave
# idle (while one waits on the main variant's build, on a lab model another trains, on a sleeping
# rank), and the build directory's flock makes the test's child wait for a build under way, then load
# it.  At worst the test waits as it did.  Only where the work is certain to be wanted: the xdist
# controller of a run of the whole testpaths, with no -k / -m / --lf selection.
_BUILDS: list = []


def pytest_sessionstart(session):
    config = session.config
    whole_run = (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.getoption("keyword", "")
        and not config.getoption("markexpr", "")
        and not config.getoption("collectonly", False)
        and not config.getoption("lf", False)
    )
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) or not whole_run:
        return
    if os.environ.get("ATTNLAB_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
        return
    from tests.ops.native import portable

    # the machine's own variant first, at normal priority: the first test that runs the kernel
    # (in a fresh clone, one in tests/faults) otherwise waited ~25 s on its build; started here
    # it overlaps collection and the first tests, and that test's flock waits for what is left
    # (make test's install has usually started both already: these then wait or load)
    _BUILDS.extend(portable.start_builds())


def pytest_unconfigure(config):
    """A build still running when the session ends (an interrupted run) is stopped with
    SIGINT, as Ctrl-C would: torch's cpp_extension then removes its ``lock`` file in the build
    directory on the way out (a process killed outright leaves it, and every later build of that
    directory waits on it for ever), and ninja stops its compiler."""
    import signal
    import subprocess

    while _BUILDS:
        p = _BUILDS.pop()
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tests on one torch thread (tiny problems: a second OpenMP thread only
    spins on the shared cores), restoring the previous setting after."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- the lab's trained models
# Several tests read the same trained models (the induction pair, the text models of the streaming
# claim).  Each is trained once per run into the lab cache (out/lab-cache, or $ATTNLAB_CACHE); under
# pytest-xdist a file lock makes one worker train it while the others wait, then read the cache,
# instead of every worker training its own copy at the same time.
@contextlib.contextmanager
def _training_threads():
    """One torch thread while a lab model trains under pytest-xdist (each worker has a core; a
    second OpenMP thread would only contend with the other worker), the default otherwise."""
    import os

    import torch
    n = torch.get_num_threads()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def induction_models():
    """The lab's 2-layer and 1-layer induction models, ``{n_layers: (model, log)}``."""
    from attnlab.lab import induction as I
    from tests.helpers import lab_lock
    cfg = I.InductionConfig()
    with lab_lock("induction"), _training_threads():
        return {n: I.load_or_train(cfg, n, progress=False) for n in (2, 1)}


@pytest.fixture(scope="session")
def text_models():
    """The small text model the streaming claim reads (:func:`attnlab.lab.streaming.text_model`)."""
    from attnlab.lab.streaming import text_model
    from tests.helpers import lab_lock
    with lab_lock("text-model"), _training_threads():
        return text_model(progress=False)


@pytest.fixture(scope="session")
def recall_demo():
    """The associative-recall run ``attnlab demo`` shows and its claim reads (``recall.DEMO``),
    trained in this process on one torch thread (the workers already hold the cores)."""
    from attnlab.lab import recall
    from tests.helpers import lab_lock
    with lab_lock("recall"):
        return recall.run(config=recall.DEMO, progress=False, workers=1)
