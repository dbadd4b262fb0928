"""Shared helpers for the native kernel's tests: skip (saying why) only where the extension
cannot be built on this machine; every test checks that the native kernel really ran."""

from __future__ import annotations

import pytest

from attnlab.ops.native import build


@pytest.fixture(scope="session")
def native_ext():
    mod = build.load()
    if mod is None:
        pytest.skip(f"the native extension cannot be built here: {build.status()}")
    return mod
