"""The native kernel's GEMM paths: the bf16-pairs forward (``ATTNLAB_NATIVE_BF16=pairs``:
vdpbf16ps where the build has it, emulated elsewhere) under FlexAttention's bf16 rule, the
float32 micro-kernel at every head dim and length, and the portable build variant
(``ATTNLAB_NATIVE_VARIANT=portable``, in a child process) against the float64 oracle."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.ops.native.ops import plan
from tests.ops.conftest import compare_backend, make_qkv
from tests.ops.native import portable
from tests.ops.native.flex_bf16 import assert_flex_bf16, eager_bf16

DIMS = [40, 59, 64, 111, 128, 256]
LENGTHS = [1, 97, 1025]


def _flex_errors(q, k, v, mask):
    """Mean abs errors against float64 of native and of eager bf16, for out, dq, dk, dv."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    i = torch.arange(Nq).view(-1, 1) + (Nk - Nq)
    allowed = torch.ones(Nq, Nk, dtype=torch.bool) if mask is None else i >= torch.arange(Nk).view(1, -1)
    allowed = allowed.expand(B, H, Nq, Nk)
    gout = torch.randn(B, H, Nq, v.shape[-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    res = {}
    for name, dt in (("native", torch.bfloat16), ("eager", torch.bfloat16), ("gold", torch.float64)):
        qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        if name == "native":
            out = attnlab.attention(qq, kk, vv, mask=mask, backend="native")
        else:
            out = eager_bf16(qq, kk, vv, allowed, 1 / math.sqrt(D))
        res[name] = [out.double(), *(g.double() for g in torch.autograd.grad(out, (qq, kk, vv), gout.to(dt)))]
    return {
        what: (
            (res["native"][j] - res["gold"][j]).abs().mean().item(),
            (res["eager"][j] - res["gold"][j]).abs().mean().item(),
        )
        for j, what in enumerate(("out", "dq", "dk", "dv"))
    }


@pytest.mark.parametrize("N", LENGTHS)
@pytest.mark.parametrize("D", DIMS)
def test_bf16_pairs_meet_flex_rule(D, N, monkeypatch, native_ext):
    """The bf16-pairs forward (P rounded to bf16, float32 accumulation), and the backward
    from its output: mean error at most 1.1x eager bf16's, causal, every head dim and length."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BF16", "pairs")
    assert "(bf16 forward)" in native_ext.features()
    H = 2 if N < 1025 else 1
    q, k, v = make_qkv(1, H, 1, N, N, D, dtype=torch.bfloat16, seed=D + N)
    m = masks.causal()
    assert plan(q, k, v, m, None, 0, 0)[0] is not None
    for what, (e_nat, e_ref) in _flex_errors(q, k, v, m).items():
        assert_flex_bf16(e_nat, e_ref, what)


def test_bf16_pairs_is_its_own_path(monkeypatch, native_ext):
    """ATTNLAB_NATIVE_BF16 selects the path: pairs round P to bf16, so its bits differ from
    the float32-copies path; both stay within a bf16 ulp or two of each other, and exact
    zeros stay exact (a row that sees one key returns that value)."""
    q, k, v = make_qkv(1, 2, 1, 97, 97, 64, dtype=torch.bfloat16, seed=5)
    outs = {}
    for mode in ("f32", "pairs"):
        monkeypatch.setenv("ATTNLAB_NATIVE_BF16", mode)
        assert ("(bf16 forward)" in native_ext.features()) == (mode == "pairs")
        with torch.no_grad():
            outs[mode] = attnlab.attention(q, k, v, mask=masks.causal(), backend="native")
    assert not torch.equal(outs["f32"], outs["pairs"])
    torch.testing.assert_close(outs["pairs"], outs["f32"], atol=3e-2, rtol=3e-2)
    assert torch.equal(outs["pairs"][:, :, 0], v[:, :1, 0].expand(1, 2, 64))  # row 0 sees key 0 only


@pytest.mark.parametrize("N", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_head_dim_256(dtype, N, native_ext):
    """D = 256 (the accuracy suite stops at 128): fwd+bwd against the oracle under DESIGN's rule."""
    q, k, v = make_qkv(1, 2, 1, N, N + 7, 256, dtype=dtype, seed=N)
    m = masks.causal()
    assert plan(q, k, v, m, None, 7, 0)[0] is not None
    compare_backend(q, k, v, backend="native", mask=m, what=f"d256-{N}-{dtype}")


_CHILD = (
    portable.BUILD
    + """
import torch
from attnlab import masks
from tests.ops.conftest import compare_backend, make_qkv
print(build.status(), flush=True)
assert build.loaded(), build.status()
for D, N, dt in ((59, 97, torch.float32), (111, 1025, torch.float32), (40, 97, torch.bfloat16), (128, 97, torch.bfloat16)):
    q, k, v = make_qkv(1, 2, 1, N, N, D, dtype=dt, seed=D)
    compare_backend(q, k, v, backend="native", mask=masks.causal(), what=f"portable d{D} n{N} {dt}")
print("portable ok")
"""
)


def test_portable_variant_matches_oracle(native_ext):
    """The portable build (no -m flags: 4-lane vectors, no FMA contraction by the ISA) gives
    the oracle's answers too, float32 and bf16 through the emulated pairs forward.

    The child builds kernel.cpp alone (tests/ops/native/portable.py), with the variant's own
    flags: the attention ops under test live there, and decode.cpp (the paged / quantized
    decode ops, a third of the compile) is never called by these checks.  In a full
    ``pytest -n N`` run the root conftest has started that build in the background."""
    r = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=portable.env(),
        cwd=portable.ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "native kernel portable (portable" in r.stdout and "f32 gemm portable 6x8" in r.stdout, r.stdout
    assert "portable ok" in r.stdout
