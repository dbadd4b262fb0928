"""Repository-level pytest settings.

``--doctest-modules`` (pyproject.toml) would also import every ``conftest.py`` under
tests/ as a module named ``conftest``; the test directories are not packages, so two of
them collide ("import file mismatch").  They are conftests, not doctest modules: do not
collect them (pytest still loads them as conftests).
"""

collect_ignore_glob = ["tests/*conftest.py"]


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
