"""``attnlab doctor`` says which attention kernel runs here and why."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.ops.native import build


def test_doctor_names_the_kernel_the_reason_and_the_environment(capsys, monkeypatch):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and f"attnlab {attnlab.__version__}" in out
    assert f"torch {torch.get_num_threads()} intra-op" in out
    assert f"native variant {build.variant()[0]}" in out
    assert f"cpu attention kernel: {build.status()}" in out  # built and loaded, or unavailable and why
    assert "triton: " in out
    if build.load() is not None:
        assert "decode: native paged and quantized decode" in out
    # disabled: the reason is the variable, and nothing is built
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "cpu attention kernel: native kernel disabled (ATTNLAB_NATIVE=0): torch-ops flash path" in out
    assert "ATTNLAB_NATIVE: '0'" in out and "decode: not available" in out


def test_doctor_reports_a_failed_build_in_one_line(capsys, monkeypatch):
    def broken():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_compile", broken)
    monkeypatch.delenv("ATTNLAB_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="native CPU attention kernel is unavailable"):
        assert main(["doctor"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cpu attention kernel:")]
    assert lines == [
        "cpu attention kernel: native kernel unavailable (build failed: c++: command not found): torch-ops flash path"
    ]
