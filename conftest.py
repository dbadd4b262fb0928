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


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tests on one torch thread (tiny problems: a second OpenMP thread only
    spins on the shared cores), restoring the previous setting after."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
