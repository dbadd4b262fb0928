"""The native kernel's scratch for its large K/V packs (scratch.h): packs of 8 MiB and more are
views into buffers the process keeps between calls.  The same bits with and without it
(forward and backward, float32 and the bf16 pairs), no fresh pages on a repeated call,
release_scratch() frees what it held, and concurrent calls (one holds the scratch, the other
allocates) agree with serial ones."""

from __future__ import annotations

import resource
import threading

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.ops.native import build


@pytest.fixture(scope="module", autouse=True)
def native_ext():
    if build.load() is None:
        pytest.skip(f"the native extension cannot be built here: {build.status()}")


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# packs of 8 MiB: float32 Kᵀ of (1, 8, 4096, 64); bf16 pairs of (1, 8, 8192, 64)
PROBLEMS = {
    "float32": (torch.float32, 8, 4096, 64),
    "bfloat16": (torch.bfloat16, 8, 8192, 64),
}


def run(dtype, H, Nk, D, grad):
    q = rand(1, H, 48, D, seed=1, dtype=dtype).requires_grad_(grad)
    k = rand(1, H, Nk, D, seed=2, dtype=dtype).requires_grad_(grad)
    v = rand(1, H, Nk, D, seed=3, dtype=dtype).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, lse = attnlab.attention(
            q, k, v, mask=masks.sliding_window(700), q_offset=Nk - 48, backend="native", return_lse=True
        )
        if not grad:
            return [out, lse]
        out.backward(rand(*out.shape, seed=4, dtype=dtype))
    return [out, lse, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_the_scratch_gives_the_same_bits(name, monkeypatch):
    dtype, H, Nk, D = PROBLEMS[name]
    grad = dtype == torch.float32  # the bf16 backward runs on float32 copies (the float32 packs)
    # the backward's split schedule packs Kᵀ, Vᵀ and K (the fused one reads them in place)
    monkeypatch.setenv("ATTNLAB_NATIVE_BWD", "split")
    with_scratch = run(dtype, H, Nk, D, grad)
    again = run(dtype, H, Nk, D, grad)  # the second call reuses the buffers
    monkeypatch.setenv("ATTNLAB_NATIVE_SCRATCH", "0")
    without = run(dtype, H, Nk, D, grad)
    for a, b, c in zip(with_scratch, again, without, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_a_repeated_call_faults_in_no_fresh_pages_and_release_frees_the_buffers():
    # (1, 8, 16384, 128) bf16: two 32 MiB packs, at glibc's largest mmap threshold: allocated per
    # call they come from fresh pages every time (16,384 faults a call, measured)
    q = rand(1, 8, 16, 128, seed=5, dtype=torch.bfloat16)
    k, v = (rand(1, 8, 16384, 128, seed=s, dtype=torch.bfloat16) for s in (6, 7))
    with torch.no_grad():
        out = attnlab.attention(q, k, v, backend="native")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            out = attnlab.attention(q, k, v, backend="native")
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 1024, faults
    assert torch.isfinite(out).all()
    freed = build.release_scratch()
    assert freed >= 2 * (32 << 20)
    assert build.release_scratch() == 0


@pytest.mark.parametrize("off", ["0", " Off ", "FALSE", "no"])
def test_the_scratch_turns_off_with_the_values_attnlab_native_takes(off, monkeypatch):
    dtype, H, Nk, D = PROBLEMS["bfloat16"]
    q, k, v = (
        rand(1, H, 16, D, seed=8, dtype=dtype),
        rand(1, H, Nk, D, seed=9, dtype=dtype),
        rand(1, H, Nk, D, seed=10, dtype=dtype),
    )
    build.release_scratch()
    with torch.no_grad():
        monkeypatch.setenv("ATTNLAB_NATIVE_SCRATCH", off)
        attnlab.attention(q, k, v, backend="native")
        assert build.release_scratch() == 0  # nothing kept
        monkeypatch.setenv("ATTNLAB_NATIVE_SCRATCH", "1")
        attnlab.attention(q, k, v, backend="native")
        assert build.release_scratch() >= 2 * (8 << 20)


def test_concurrent_calls_agree_with_serial_ones():
    _, H, Nk, D = PROBLEMS["float32"]
    inputs = [tuple(rand(1, H, n, D, seed=10 * i + j) for j, n in enumerate((32, Nk, Nk))) for i in range(4)]
    with torch.no_grad():
        serial = [attnlab.attention(*x, mask=masks.causal(), q_offset=Nk - 32, backend="native") for x in inputs]
        results: list[torch.Tensor | None] = [None] * len(inputs)

        def work(i):
            with torch.no_grad():
                for _ in range(3):
                    results[i] = attnlab.attention(*inputs[i], mask=masks.causal(), q_offset=Nk - 32, backend="native")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for r, s in zip(results, serial, strict=True):
        assert r is not None and torch.equal(r, s)
