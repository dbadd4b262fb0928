"""The native kernel's parallel regions really run on several threads.

``at::parallel_for`` is a header template: an extension compiled without ``-fopenmp``
drops its ``#pragma omp parallel`` without a word and runs every region on the calling
thread, which is how the kernel was built until this test (half the speed on 2 cores,
every result still exact, so no accuracy test could see it).  ``parallel_threads(n)``
counts the distinct OS threads that ran the items of one region.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def two_threads():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_parallel_regions_use_every_thread(native_ext, two_threads):
    assert native_ext.parallel_threads(8) == 2


def test_one_thread_is_one_thread(native_ext):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert native_ext.parallel_threads(8) == 1
    finally:
        torch.set_num_threads(old)


def test_build_says_openmp(native_ext):
    assert "openmp" in native_ext.features()
