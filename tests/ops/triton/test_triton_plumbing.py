"""How masks and score mods reach the kernels, the dispatch, and life without triton.

Host-side pieces are checked against the masks' own predicates: the block lists list
exactly the non-empty tiles (partial first), the bit-packed table holds exactly the
partial tiles' predicate, the built-ins lower to the compiled family.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.masks import EMPTY, FULL, PARTIAL
from attnlab.ops.dispatch import choose_backend as _auto
from attnlab.ops.triton import config
from attnlab.ops.triton.masking import block_lists, lower_mask, plan_for, tile_table
from attnlab.ops.triton.scoremods import lower_score_mod
from tests.helpers import PARAM_GRAD_SLACK_EPS, mask_dense
from tests.ops.conftest import make_qkv
from tests.ops.triton.conftest import F32, TRITON

pytestmark = TRITON
ROOT = Path(__file__).resolve().parents[3]


def test_block_lists_are_partial_then_full_and_skip_empty():
    g = torch.Generator().manual_seed(0)
    states = torch.randint(0, 3, (2, 3, 5, 7), generator=g, dtype=torch.int8)
    lists = block_lists(states)
    assert lists.shape == (2, 3, 5, 9) and lists.dtype == torch.int32
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(5)).tolist():
        s, row = states[tuple(idx)], lists[tuple(idx)].tolist()
        n_part, n_full = row[0], row[1]
        part, full = row[2 : 2 + n_part], row[2 + n_part : 2 + n_part + n_full]
        assert part == torch.nonzero(s == PARTIAL).flatten().tolist()
        assert full == torch.nonzero(s == FULL).flatten().tolist()
        assert n_part + n_full == int((s != EMPTY).sum())


LOWERED = [
    (masks.causal(), "band"),
    (masks.sliding_window(5), "band"),
    (masks.prefix_lm(3), "band"),
    (masks.sink_window(2, 4), "band"),
    (masks.document(torch.tensor([0] * 9 + [1] * 14)), "doc"),
    (masks.padding([7, 23]), "keep"),
    (masks.key_padding(torch.arange(23).view(1, -1).expand(2, -1) % 4 > 0), "keep"),
    (masks.causal() & masks.sliding_window(6), "band"),
    (masks.padding([9, 20]) & masks.key_padding(torch.arange(23).view(1, -1).expand(2, -1) % 3 > 0), "keep"),
    (masks.document(torch.tensor([0] * 9 + [1] * 14)) & masks.causal() & masks.padding([20, 15]), "band+doc+keep"),
    (masks.band(3, 2), "band"),
    (masks.band(None, 2) & masks.prefix_lm(3), "band"),  # read from the structure
    (masks.prefix_lm(3) & masks.sliding_window(4), None),
    (masks.causal() | masks.prefix_lm(3), None),
    (~masks.causal(), None),
    (masks.tree(torch.tensor([-1, 0, 0, 1]), prefix_len=19), None),
    (masks.custom(lambda b, h, q, kv: (q + kv) % 2 == 0), None),
]


@pytest.mark.parametrize("mask, kind", LOWERED, ids=lambda x: repr(x)[:40] if not isinstance(x, str) else x)
def test_lowering_and_table_match_the_predicate(mask, kind):
    """The compiled family (evaluated here in torch, as the kernel does) and the table
    both reproduce the predicate on every partial tile."""
    B, H, Nq, Nk, qo, ko = 2, 3, 17, 23, 4, 0
    dense = mask_dense(mask, B, H, Nq, Nk, qo, ko)
    spec = lower_mask(mask, B, Nq, Nk, qo, ko, "cpu")
    assert (spec.kind if spec is not None else None) == kind
    if spec is not None:
        qp = (torch.arange(Nq) + qo).view(-1, 1)
        kp = (torch.arange(Nk) + ko).view(1, -1)
        ok = torch.ones(B, 1, Nq, Nk, dtype=torch.bool)
        if spec.band is not None:
            d = qp - kp
            band = (d >= spec.band[0]) & (d <= spec.band[1])
            if spec.sink is not None:
                band |= (kp < spec.sink[0]) & (d >= spec.sink[1])
            ok &= band
        if spec.q_ids is not None:
            ok &= (spec.q_ids[:, :, None] == spec.kv_ids[:, None, :]).view(-1, 1, Nq, Nk)
        if spec.keep is not None:
            ok &= spec.keep.bool().view(-1, 1, 1, Nk)
        assert torch.equal(ok.expand(B, H, Nq, Nk), dense)
    bm = mask.block_mask(B, H, Nq, Nk, q_offset=qo, kv_offset=ko, block=(16, 16))
    tab = tile_table(bm, "cpu")
    partial = (bm.states == PARTIAL).flatten(0, 1).any(0)
    assert int((tab.tile_id >= 0).sum()) == int(partial.sum()) == (tab.table.shape[0] if partial.any() else 0)
    for i, j in torch.nonzero(partial).tolist():
        words = tab.table[int(tab.tile_id[i, j])]  # (Bp, Hp, 16, 1)
        bits = ((words.to(torch.int64) & 0xFFFFFFFF) >> torch.arange(16)) & 1
        got = bits.bool().expand(B, H, 16, 16)[:, :, : min(16, Nq - 16 * i), : min(16, Nk - 16 * j)]
        assert torch.equal(got, dense[:, :, 16 * i : 16 * i + 16, 16 * j : 16 * j + 16]), (i, j)


def test_plans_are_cached_on_the_blockmask():
    mask = masks.custom(lambda b, h, q, kv: (q - kv) % 3 != 1)
    p1 = plan_for(mask, 1, 2, 40, 50, 10, 0, (16, 16), "cpu")
    assert p1.spec.kind == "table"
    p2 = plan_for(mask, 1, 2, 40, 50, 10, 0, (16, 16), "cpu")
    assert p2 is p1 and p2.spec is p1.spec
    bm = mask.block_mask(1, 2, 40, 50, q_offset=10, block=(32, 64))  # other tiles: re-classified
    assert plan_for(bm, 1, 2, 40, 50, 10, 0, (16, 16), "cpu") is p1


def test_blockmask_at_triton_tiles_sets_the_tiling_and_others_work_too():
    q, k, v = make_qkv(1, 2, 1, 40, 70, 32, dtype=F32, seed=2)
    mask = masks.sliding_window(9)
    want = attnlab.attention(q, k, v, mask=mask, backend="flash")
    for block in ((16, 64), (128, 512), (24, 40)):  # Triton-sized, flash-sized, not powers of two
        bm = mask.block_mask(1, 2, 40, 70, block=block)
        out = attnlab.attention(q, k, v, mask=bm, backend="triton")
        assert (out - want).abs().max() < 1e-5, block
    from attnlab.ops.triton.autograd import _Problem

    pb = _Problem(q, k, v, mask.block_mask(1, 2, 40, 70, block=(16, 64)), lower_score_mod(None), 0.1, 30, 0, None)
    assert set(pb.tiles.values()) == {(16, 64)}
    pb = _Problem(q, k, v, mask.block_mask(1, 2, 40, 70, block=(128, 512)), lower_score_mod(None), 0.1, 30, 0, None)
    assert set(pb.tiles.values()) == {config.INTERPRET_TILES}


def test_score_mod_lowering():
    s = torch.ones(3, requires_grad=True)
    t = torch.zeros(3, 5, requires_grad=True)
    spec = lower_score_mod(scores.compose(scores.alibi(s), scores.relative_bias(t), scores.softcap(4.0)))
    assert (spec.alibi, spec.relbias, spec.softcap, spec.cap) == (1, True, 2, 4.0)
    assert spec.params[0] is s and spec.params[1] is t
    spec = lower_score_mod(scores.compose(scores.softcap(2.0), scores.alibi(torch.ones(3), symmetric=True)))
    assert (spec.alibi, spec.softcap, spec.params) == (2, 1, [])
    assert "no Triton lowering" in lower_score_mod(scores.custom(lambda s_, b, h, q, kv: s_))


def test_kernel_tiles():
    bf = torch.bfloat16
    assert config.kernel_tiles(64, 64, 4096, 4096, interpret=False, dtype=bf)["fwd"] == (128, 64)
    assert config.kernel_tiles(128, 128, 1, 4096, interpret=False, dtype=bf)["fwd"] == (16, 64)  # decode: 16-row tiles
    assert config.kernel_tiles(256, 256, 4096, 4096, interpret=False, dtype=bf)["dkdv"] == (32, 64)
    assert config.kernel_tiles(40, 24, 97, 97, interpret=True, dtype=bf) == {k: (32, 32) for k in ("fwd", "dq", "dkdv")}
    with pytest.raises(ValueError, match="powers of two"):
        config.kernel_tiles(64, 64, 100, 100, interpret=True, block=(24, 32), dtype=bf)
    assert config.head_block(40) == 64 and config.head_block(8) == 16 and config.head_block(256) == 256
    # float32 has tiles of its own (its IEEE dots run as FMA loops: smaller tiles to stay spill-free)
    for D in (40, 64, 128, 256):
        got = config.kernel_tiles(D, D, 4096, 4096, interpret=False, dtype=torch.float32)
        assert got == config.GPU_TILES["float32"][config.bucket(config.head_block(D))]
        assert got == config.gpu_tiles(config.head_block(D), "float32")
    assert config.kernel_tiles(128, 128, 4096, 4096, interpret=False, dtype=torch.float16) == config.gpu_tiles(128, bf)
    assert config.candidates("fwd", 128, torch.float32) == config.AUTOTUNE["float32"][128]["fwd"]
    with pytest.raises(ValueError, match="float64"):
        config.candidates("fwd", 64, torch.float64)


# ------------------------------------------------------------------------------- dispatch
def test_backend_is_registered_and_matches_flash():
    assert "triton" in attnlab.ops.BACKENDS
    q, k, v = make_qkv(1, 4, 2, 20, 33, 40, 24, dtype=F32, seed=1)
    a, la = attnlab.attention(q, k, v, mask=masks.causal(), return_lse=True, backend="triton")
    b, lb = attnlab.attention(q, k, v, mask=masks.causal(), return_lse=True, backend="flash")
    assert a.shape == (1, 4, 20, 24) and la.dtype == torch.float32
    assert (a - b).abs().max() < 1e-5 and (la - lb).abs().max() < 1e-5


@pytest.mark.parametrize(
    "case, match",
    [
        ("float64", "float64|dtype"),
        ("d300", "head dims up to 256"),
        ("custom-mod", "no Triton lowering"),
        ("offset", "2\\^30"),
    ],
)
def test_clear_errors(case, match):
    D, dtype, kw = 16, torch.float32, {}
    if case == "float64":
        dtype = torch.float64
    if case == "d300":
        D = 300
    if case == "custom-mod":
        kw["score_mod"] = scores.custom(lambda s, b, h, q, kv: s)
    if case == "offset":
        kw["kv_offset"] = 2**31
    q, k, v = (torch.randn(1, 2, 5, D, dtype=dtype) for _ in range(3))
    with pytest.raises(ValueError, match=f"backend='triton'.*({match})"):
        attnlab.attention(q, k, v, backend="triton", **kw)


def test_auto_never_picks_triton_on_cpu():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    for mask, mod, lse in (
        (None, None, False),
        (masks.sliding_window(3), None, True),
        (masks.causal(), scores.softcap(5.0), True),
    ):
        assert _auto(q, k, mask, mod, 0, 0, lse, v=k) in ("flash", "sdpa", "native")  # the CPU backends


def test_empty_problems_go_to_flash():
    q = torch.randn(1, 2, 0, 16, requires_grad=True)
    k = v = torch.randn(1, 2, 5, 16)
    out, lse = attnlab.attention(q, k, v, return_lse=True, backend="triton")
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


_SUBPROCESS = textwrap.dedent("""
    import sys, importlib.abc
    mode = sys.argv[1]
    if mode == "absent":
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Block())
    import torch, attnlab
    from attnlab import masks
    from attnlab.ops import triton as T
    assert "triton" not in sys.modules, "importing attnlab must not import triton"
    q = k = v = torch.randn(1, 2, 8, 16)
    out = attnlab.attention(q, k, v, mask=masks.causal())  # the rest works
    try:
        attnlab.attention(q, k, v, backend="triton")
    except ValueError as e:
        print("ERR", e)
    print("AVAILABLE", T.available())
""")


@pytest.mark.parametrize("mode", ["absent", "no-interpreter"])
def test_without_triton_or_interpreter(mode):
    """Without triton the package imports and runs, and backend='triton' says why not;
    with triton but no TRITON_INTERPRET, CPU tensors get a clear error (not a crash)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    r = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, mode], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=120
    )
    assert r.returncode == 0, r.stderr
    if mode == "absent":
        assert "triton package is not installed" in r.stdout and "AVAILABLE False" in r.stdout
    else:
        assert "need CUDA tensors" in r.stdout and "TRITON_INTERPRET=1" in r.stdout


def test_gpu_benchmark_script_runs_its_checks_here():
    """The benchmark needs a GPU for timing; its correctness grid, verdict and table run
    on the interpreter here with small cases, so the script does not rot untested."""
    from attnlab.bench import triton as bench

    cases = [
        ("causal gqa", (1, 4, 2, 20, 33, 40, 24), torch.bfloat16, masks.causal(), None),
        (
            "alibi table",
            (1, 2, 2, 17, 17, 16, 16),
            torch.float32,
            masks.custom(lambda b, h, q, kv: kv <= q),
            (lambda p: scores.alibi(p), torch.tensor([0.1, 0.2])),
        ),
    ]
    rows, ok = bench.check_correctness(cases, device="cpu")
    assert ok and [r[3] for r in rows] == ["ok", "ok"]
    assert bench.PARAM_SLACK_EPS == PARAM_GRAD_SLACK_EPS  # the GPU check applies the suite's rule
    table = [(128, 8192, "causal", "attnlab-triton", 300.0, 250.0), (128, 8192, "causal", "sdpa-flash", 320.0, 280.0)]
    lines = bench.verdict(table, 700.0)
    assert lines[0].startswith("forward 0.94x") and "met" in lines[0] and "MISSED" not in lines[1]
    md = bench.markdown(rows, table, 700.0, lines, ["--quick"], "a GPU")
    assert "| 128 | 8192 | causal | attnlab-triton | 300.0 | 250.0 |" in md and "--quick" in md
    assert bench.main() == 2  # no GPU here: says so and exits 2
