"""Properties of the flash backend beyond accuracy.

* It follows the BlockMask's plan: the mask predicate is evaluated only on PARTIAL
  tiles (never on FULL ones), EMPTY tiles are never visited, and each planned tile is
  visited exactly once per pass; the plan itself is correct (never skips an allowed
  pair, never calls a tile FULL that is not) and, for the exact classifiers, tight.
* Memory: forward + backward at N = 8192 grows the process's peak RSS by far less
  than the N x N score matrix (measured in a fresh child process).
* GQA/MQA equal MHA with K/V repeated by hand (the contract behind "K/V are never
  repeated per head": the fold must route query head h to kv head h // G).
* The result does not depend on the tile sizes.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.ops import flash_attention
from tests.ops.conftest import compare_backend, dense_allowed, make_qkv, run_case

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


class Recording(masks.Mask):
    """Wraps a mask; records the (q_pos, kv_pos) ranges its predicate is called on."""

    def __init__(self, inner):
        self.inner = inner
        self.cheap_classify = getattr(inner, "cheap_classify", False)
        self.calls = []

    def predicate(self, b, h, q, kv):
        self.calls.append((int(q.min()), int(q.max()), int(kv.min()), int(kv.max())))
        return self.inner.predicate(b, h, q, kv)

    def classify(self, *args):
        return self.inner.classify(*args)

    def validate(self, *args):
        return self.inner.validate(*args)


def recording_mod():
    calls = []

    def fn(s, b, h, q, kv):
        calls.append((int(q.min()), int(q.max()), int(kv.min()), int(kv.max())))
        return s

    return scores.custom(fn), calls


IDS = torch.tensor([0] * 30 + [1] * 40 + [2] * 27)
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 5, -1, 7, 8])

# exact=True: the classifier is exact, so the plan must be tight (EMPTY and FULL tiles are
# recognised as such); False: conservative combinations, only correctness is required.
MASKS = {
    "causal": (lambda: masks.causal(), True),
    "sliding_window": (lambda: masks.sliding_window(13), True),
    "prefix_lm": (lambda: masks.prefix_lm(20), True),
    "document": (lambda: masks.document(IDS), True),
    "padding": (lambda: masks.padding([50, 0]), True),
    "tree": (lambda: masks.tree(PARENTS, prefix_len=87), True),
    "custom": (lambda: masks.custom(lambda b, h, q, kv: (kv <= q) & ((q // 20) == (kv // 20)) | (h == 1)), True),
    "~causal": (lambda: ~masks.causal(), True),
    "sink_window": (lambda: masks.sink_window(4, 9), False),
    "causal&~window": (lambda: masks.causal() & ~masks.sliding_window(5), False),
    "document&causal": (lambda: masks.document(IDS) & masks.causal(), False),
}
B, H, HKV, NQ, NK, D = 2, 4, 2, 70, 97, 16
BLOCK = (16, 32)


def _tile_of(call, q_offset, kv_offset, bq, bk):
    qlo, qhi, klo, khi = call
    i, j = (qlo - q_offset) // bq, (klo - kv_offset) // bk
    # the call covers exactly that tile (clipped at the problem's edge)
    assert qlo - q_offset == i * bq and qhi - q_offset == min(NQ, (i + 1) * bq) - 1, f"q range {call}"
    assert klo - kv_offset == j * bk and khi - kv_offset == min(NK, (j + 1) * bk) - 1, f"kv range {call}"
    return i, j


def _brute(allowed, i, j, bq, bk):
    t = allowed[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
    return bool(t.any()), bool(t.all())


@pytest.mark.parametrize("maskname", list(MASKS))
def test_flash_follows_the_blockmask_plan(maskname):
    make, exact = MASKS[maskname]
    rec = Recording(make())
    qo, ko = NK - NQ, 0
    bm = rec.block_mask(B, H, NQ, NK, block=BLOCK)
    rec.calls.clear()  # classification by evaluation (custom, tree) is not the kernel's business
    plan = bm.plan()
    planned = {(i, j) for i, row in enumerate(plan) for j, _ in row}
    partial = {(i, j) for i, row in enumerate(plan) for j, nm in row if nm}
    bq, bk = BLOCK

    # the plan is correct, and tight for exact classifiers
    allowed = dense_allowed(rec.inner, B, H, NQ, NK, qo, ko)
    nqb, nkb = -(-NQ // bq), -(-NK // bk)
    for i in range(nqb):
        for j in range(nkb):
            anyv, allv = _brute(allowed, i, j, bq, bk)
            if (i, j) not in planned:
                assert not anyv, f"tile {(i, j)} has allowed pairs but is skipped"
            elif (i, j) not in partial:
                assert allv, f"tile {(i, j)} is run without the mask but has masked pairs"
            if exact:
                assert ((i, j) in planned) == anyv, f"tile {(i, j)}: empty={not anyv} but planned={(i, j) in planned}"
                assert ((i, j) in partial) == (anyv and not allv), f"tile {(i, j)} classification is not tight"

    q, k, v = make_qkv(B, H, HKV, NQ, NK, D, dtype=F32, seed=1)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    # forward without a score mod: the mask is evaluated on exactly the PARTIAL tiles, once each
    out = attnlab.attention(q, k, v, mask=bm, backend="flash")
    fwd = [_tile_of(c, qo, ko, bq, bk) for c in rec.calls]
    assert sorted(fwd) == sorted(partial), "forward: mask evaluated on the wrong tiles"
    rec.calls.clear()
    out.backward(torch.ones_like(out))
    # the BlockMask caches evaluated partial tiles: the backward re-reads them
    assert rec.calls == [], "backward: re-evaluated tiles the forward had cached"
    bm._tiles.clear()
    bm._tile_bytes = 0
    out = attnlab.attention(q, k, v, mask=bm, backend="flash")
    rec.calls.clear()
    bm._tiles.clear()
    bm._tile_bytes = 0
    out.backward(torch.ones_like(out))
    bwd = [_tile_of(c, qo, ko, bq, bk) for c in rec.calls]
    assert sorted(bwd) == sorted(partial), "backward (cache emptied): mask evaluated on the wrong tiles"

    # with a score mod every planned tile is visited exactly once, and only those
    rec.calls.clear()
    bm._tiles.clear()
    bm._tile_bytes = 0
    mod, mod_calls = recording_mod()
    out = attnlab.attention(q, k, v, mask=bm, score_mod=mod, backend="flash")
    visited = [_tile_of(c, qo, ko, bq, bk) for c in mod_calls]
    assert sorted(visited) == sorted(planned), "forward visited tiles != plan"
    assert sorted(_tile_of(c, qo, ko, bq, bk) for c in rec.calls) == sorted(partial)
    mod_calls.clear()
    rec.calls.clear()
    out.backward(torch.ones_like(out))
    assert sorted(_tile_of(c, qo, ko, bq, bk) for c in mod_calls) == sorted(planned), "backward visited tiles != plan"
    assert rec.calls == [], "backward re-evaluated cached tiles"


def test_tile_cache_respects_its_byte_budget(monkeypatch):
    rec = Recording(masks.causal())
    bm = rec.block_mask(1, 1, 64, 64, block=(16, 16))
    monkeypatch.setattr(type(bm), "TILE_CACHE_BYTES", 16 * 16 * 2)  # room for two tiles
    q = torch.randn(1, 1, 64, 8)
    rec.calls.clear()
    o1 = attnlab.attention(q, q, q, mask=bm, backend="flash")
    n_partial = sum(nm for row in bm.plan() for _, nm in row)
    assert len(rec.calls) == n_partial == 4 and len(bm._tiles) == 2 and bm._tile_bytes == 512
    rec.calls.clear()
    o2 = attnlab.attention(q, q, q, mask=bm, backend="flash")
    assert len(rec.calls) == n_partial - 2  # the two cached tiles are not re-evaluated
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("maskname", ["causal", "sliding_window", "prefix_lm", "document", "padding", "~causal"])
@pytest.mark.parametrize("n", [(200, 1500), (1025, 1025)], ids=["200x1500", "1025"])
def test_default_tiles_skip_empty_and_full_tiles(maskname, n):
    """With the kernel's own tile choice: every mask evaluation is on a tile that is
    neither empty nor full, and no visited tile is empty."""
    Nq, Nk = n
    Bb, Hh = 1, 1
    make, exact = MASKS[maskname]
    assert exact
    if maskname == "padding":
        inner = masks.padding([600])
    elif maskname == "document":
        inner = masks.document(torch.arange(Nk) * 7 // Nk)  # 7 contiguous documents
    else:
        inner = make()
    rec = Recording(inner)
    q, k, v = make_qkv(Bb, Hh, Hh, Nq, Nk, 16, dtype=F32, seed=2)
    qo = Nk - Nq
    allowed = dense_allowed(inner, Bb, Hh, Nq, Nk, qo)
    mod, mod_calls = recording_mod()
    for score_mod, calls in ((None, rec.calls), (mod, mod_calls)):
        rec.calls.clear()
        mod_calls.clear()
        attnlab.attention(q, k, v, mask=rec, score_mod=score_mod, backend="flash")
        assert calls, "the problem has partial tiles, so the mask must be evaluated somewhere"
        if score_mod is not None and n == (1025, 1025):
            assert len(set(calls)) > 1, "this test needs several visited tiles to mean anything"
        for qlo, qhi, klo, khi in calls:
            t = allowed[..., qlo - qo : qhi - qo + 1, klo : khi + 1]
            assert t.any(), f"visited an empty tile q {qlo}..{qhi}, kv {klo}..{khi}"
            if score_mod is None:
                assert not t.all(), f"evaluated the mask on a full tile q {qlo}..{qhi}, kv {klo}..{khi}"


def test_no_mask_visits_every_tile_once():
    mod, calls = recording_mod()
    q, k, v = make_qkv(1, 2, 1, 40, 70, 8, dtype=F64, seed=3)
    flash_attention(q, k, v, score_mod=mod, scale=0.3, q_offset=30, block=(16, 32))
    tiles = sorted(((c[0] - 30) // 16, c[2] // 32) for c in calls)
    assert tiles == [(i, j) for i in range(3) for j in range(3)]


# ----------------------------------------------------------------------------- memory
_CHILD = textwrap.dedent("""
    import resource, sys, torch, attnlab
    torch.set_num_threads(1)
    def run(n, backend):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, n, 64, generator=g).requires_grad_(True) for _ in range(3))
        out = attnlab.attention(q, k, v, backend=backend)
        out.backward(torch.ones_like(out))
        assert torch.isfinite(q.grad).all()
    run(256, "flash")                      # load kernels, warm the allocator
    run(256, "reference")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(int(sys.argv[1]), sys.argv[2])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024)            # ru_maxrss is in KiB on Linux
""")


def _peak_growth_bytes(n, backend):
    r = subprocess.run([sys.executable, "-c", _CHILD, str(n), backend], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units differ off Linux")
def test_flash_memory_is_far_below_the_score_matrix():
    """N = 8192, one head, D = 64, float32, forward + backward: the N x N float32 score
    matrix alone would be 256 MiB.  The flash path holds O(N) tensors plus a few tiles:
    measured ~39 MiB of peak growth here.  Bound: a quarter of the matrix (64 MiB)."""
    n = 8192
    matrix = n * n * 4
    growth = _peak_growth_bytes(n, "flash")
    assert growth < matrix / 4, f"flash peak RSS grew by {growth / 2**20:.0f} MiB; N x N is {matrix / 2**20:.0f} MiB"


# --------------------------------------------------------------------- GQA == repeated MHA
GQA_MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(),
    "head-dependent": lambda: masks.custom(lambda b, h, q, kv: (kv <= q) & ((kv + h) % 3 != 0)),
}


def _gqa_mod(name, H):
    if name == "none":
        return None, None
    if name == "alibi":  # per *query* head slopes
        return (lambda p: scores.alibi(p)), torch.linspace(0.05, 0.5, H, dtype=F64)
    if name == "relative_bias":
        return (lambda p: scores.relative_bias(p)), torch.randn(
            H, 7, generator=torch.Generator().manual_seed(4), dtype=F64
        )
    raise KeyError(name)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa-8:2", "mqa-8:1"])
@pytest.mark.parametrize("maskname", list(GQA_MASKS))
@pytest.mark.parametrize("modname", ["none", "alibi", "relative_bias"])
@pytest.mark.parametrize("backend", ["flash", "flash-tiles", "auto"])
def test_gqa_equals_mha_with_kv_repeated(dtype, hkv, maskname, modname, backend):
    Hq, Nq, Nk = 8, 33, 50
    q, k, v = make_qkv(2, Hq, hkv, Nq, Nk, 16, 12, dtype=dtype, seed=5)
    G = Hq // hkv
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    factory, param = _gqa_mod(modname, Hq)
    kw = dict(
        mask=GQA_MASKS[maskname](),
        mod_factory=factory,
        param=param,
        param_dtype=torch.float64 if dtype == F64 else torch.float32,
        lse=backend != "auto",
    )
    if backend == "flash-tiles":
        kw["block"] = (16, 32)
    gqa = run_case(q, k, v, backend=backend, **kw)
    mha = run_case(q, kr, vr, backend=backend, **kw)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == F64 else dict(atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(gqa["out"], mha["out"], **tol)
    if gqa["lse"] is not None:
        torch.testing.assert_close(gqa["lse"], mha["lse"], **tol)
    torch.testing.assert_close(gqa["dq"], mha["dq"], **tol)
    # kv head j's gradient is the sum over the G query heads that read it
    Bb = q.shape[0]
    torch.testing.assert_close(gqa["dk"], mha["dk"].view(Bb, hkv, G, Nk, -1).sum(2), **tol)
    torch.testing.assert_close(gqa["dv"], mha["dv"].view(Bb, hkv, G, Nk, -1).sum(2), **tol)
    if param is not None:
        torch.testing.assert_close(gqa["dparam"], mha["dparam"], **tol)


# -------------------------------------------------------------------------- tile sizes
@pytest.mark.parametrize(
    "block", [(1, 1), (5, 3), (16, 32), (64, 16), (128, 128), (1024, 512)], ids=lambda b: f"{b[0]}x{b[1]}"
)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_result_does_not_depend_on_tiles(block, dtype):
    if block == (1, 1):
        Nq, Nk = 9, 11  # 99 tiles: keep it small
    else:
        Nq, Nk = 45, 77
    q, k, v = make_qkv(1, 4, 2, Nq, Nk, 24, dtype=dtype, seed=6)
    factory = lambda p: scores.relative_bias(p)  # noqa: E731
    param = torch.randn(4, 5, generator=torch.Generator().manual_seed(6), dtype=F64)
    for mask in (None, masks.causal() | masks.prefix_lm(3)):
        compare_backend(q, k, v, backend="flash-tiles", block=block, mask=mask, what=f"block {block}")
        compare_backend(
            q,
            k,
            v,
            backend="flash-tiles",
            block=block,
            mask=mask,
            mod_factory=factory,
            param=param,
            what=f"block {block} + relative_bias",
        )


def test_identity_score_mod_matches_the_fast_path():
    """The tile path with a score mod and the mod-free fast path compute the same thing."""
    q, k, v = make_qkv(2, 4, 2, 45, 77, 32, dtype=F64, seed=7)
    ident = scores.custom(lambda s, b, h, qp, kp: s)
    for mask in (None, masks.causal()):
        a = run_case(q, k, v, backend="flash-tiles", block=(16, 32), mask=mask)
        b = run_case(q, k, v, backend="flash-tiles", block=(16, 32), mask=mask, mod_factory=lambda p: ident)
        for key in ("out", "lse", "dq", "dk", "dv"):
            torch.testing.assert_close(a[key], b[key], atol=1e-12, rtol=1e-10)


def test_blockmask_is_reused_and_results_are_deterministic():
    q, k, v = make_qkv(1, 2, 2, 40, 60, 16, dtype=F32, seed=8)
    m = masks.sliding_window(9)
    bm1 = m.block_mask(1, 2, 40, 60, block=(16, 32))
    assert m.block_mask(1, 2, 40, 60, block=(16, 32)) is bm1, "a BlockMask is built once per shape and cached"
    a = attnlab.attention(q, k, v, mask=bm1, backend="flash", return_lse=True)
    b = attnlab.attention(q, k, v, mask=bm1, backend="flash", return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # the scale and offsets reach the kernel unchanged: compare with the oracle
    out = attnlab.attention(q, k, v, mask=bm1, backend="flash")
    want = attnlab.attention(q.double(), k.double(), v.double(), mask=m, backend="reference")
    assert (out.double() - want).abs().max() < 1e-5
    assert math.isclose(bm1.density(), sum(len(r) for r in bm1.plan()) / (3 * 2))
