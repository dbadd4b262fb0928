"""The Triton kernels compiled for sm_80 and sm_90 here, with no GPU: registers and spills.

Every shipped default configuration (the tiles of ``config.GPU_TILES`` with each of
the autotune candidates of ``config.AUTOTUNE``) of the forward, dK/dV and dQ kernels,
for every dtype (bfloat16, float16, float32: each dtype group has its own tiles) and
every head-dim bucket of ``config`` (D = 64, 128, 256), causal (block lists: the masked
partial-tile loop and the unmasked full-tile loop in one kernel), must compile for both
archs with no spill: no local-memory stores or loads, a stack frame of at most
``resources.STACK_LIMIT`` bytes, registers within ``resources.REG_LIMIT`` and shared
memory within the arch's ``resources.SHARED_LIMIT``.  The unmasked variants are
recorded in docs/triton.md (``python -m attnlab.ops.triton.resources --mask none``)
rather than compiled on every test run.

This session's kernels are defined for the interpreter (conftest.py), so the compiles
run in one subprocess for the whole module (its rows cached for the run), without
``TRITON_INTERPRET``, on ``--jobs`` worker processes; triton's on-disk cache keeps the
cubins, so a second run takes seconds (cold: about 1-1.5 CPU s per kernel, plus about
0.25 s of ``cuobjdump -sass`` per kernel, cached or not).  That one subprocess compiles
every selected test's variants (the shipped configurations, the decode steps and the old
spilling dK/dV), each once: a subprocess and its workers cost a few CPU seconds to start
(torch, triton), and each variant compiled twice would pay its ``cuobjdump`` again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from attnlab.ops.triton import config, resources
from tests.ops.triton.conftest import TRITON

pytestmark = [
    TRITON,
    pytest.mark.skipif(
        resources.tool("cuobjdump") is None,
        reason="cuobjdump not found in the triton package (triton/backends/nvidia/bin)",
    ),
]
ROOT = Path(__file__).resolve().parents[3]
HEAD_DIMS = tuple(sorted(next(iter(config.GPU_TILES.values()))))  # every head-dim bucket config ships
CASES = [
    (k, a, dt, d) for k in resources.KERNELS for a in resources.ARCHS for dt in resources.DTYPES for d in HEAD_DIMS
]
COMPILE_TIMEOUT_S = 3600  # the cold compile of the whole matrix on a loaded 2-core machine
JOBS = max(1, min(4, os.cpu_count() or 1))


def _compile(*args, variants=None) -> list[dict]:
    """The rows of ``python -m attnlab.ops.triton.resources --json - *args``; with ``variants``
    (a list of :class:`resources.Variant`), exactly those, in order (``--variants -``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated (silences its warning)
    listed = None if variants is None else json.dumps([v.fields() for v in variants])
    r = subprocess.run(
        [sys.executable, "-m", "attnlab.ops.triton.resources", "--json", "-", *args]
        + ([] if listed is None else ["--variants", "-"]),
        check=False,
        capture_output=True,
        text=True,
        input=listed,
        env=env,
        cwd=str(ROOT),
        timeout=COMPILE_TIMEOUT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _shipped_variants(kernel, arch, dtype, D) -> list:
    """Every autotune candidate of one shipped configuration, causal (what ``--mask causal``
    with these axes compiles)."""
    return resources.default_variants((arch,), (kernel,), (dtype,), (D,), ("causal",))


def _decode_variants(arch, dtype, D) -> list:
    """The decode steps (one query) of the forward's candidates at one configuration (what
    ``--kernel fwd --decode --mask causal`` adds to the 512-query forward)."""
    vs = resources.default_variants((arch,), ("fwd",), (dtype,), (D,), ("causal",), decode=True)
    return [v for v in vs if v.nq == 1]


#: the old dK/dV default at D = 128 (32×128, 4 warps, 2 stages) for sm_90, bfloat16
SPILLING = resources.Variant("dkdv", 90, "bfloat16", 128, "causal", (32, 128), 4, 2)
#: a shipped spill-free kernel whose SASS listing is read anyway (``--list-sass``): the rule that
#: skips the listing of a kernel with no stack frame and no local arrays, checked on a real cubin
LISTED = resources.default_variants((90,), ("dkdv",), ("bfloat16",), (128,), ("causal",))[0]


@pytest.fixture(scope="module")
def compiled(request) -> dict:
    """The rows of every selected test's variants, compiled once for the run in one subprocess
    (``-k`` narrows it): ``("shipped", kernel, arch, dtype, D)``, ``("decode", arch, dtype, D)``
    and ``("spilling",)`` -> rows, grouped by the compiled rows' own columns."""
    groups: list = []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        name, p = getattr(item, "originalname", None), getattr(getattr(item, "callspec", None), "params", {})
        if name == "test_shipped_config_compiles_spill_free":
            groups.append(("shipped", _shipped_variants(p["kernel"], p["arch"], p["dtype"], p["D"])))
        elif name == "test_decode_step_compiles_spill_free":
            groups.append(("decode", _decode_variants(p["arch"], p["dtype"], p["D"])))
        elif name == "test_a_spilling_config_is_reported":
            groups.append(("spilling", [SPILLING]))
        elif name == "test_a_kernel_with_no_stack_frame_lists_no_spill":
            groups.insert(0, ("listed", [LISTED]))  # first: `--list-sass 1` reads its listing
    variants = [v for _, vs in groups for v in vs]
    listed = str(int(bool(groups) and groups[0][0] == "listed"))
    rows = iter(_compile("--jobs", str(JOBS), "--list-sass", listed, variants=variants) if variants else [])
    out: dict = {}
    for tag, vs in groups:
        for _ in vs:
            r = next(rows)
            key = (
                (tag,) if tag in ("spilling", "listed") else (tag, r["kernel"], int(r["arch"][3:]), r["dtype"], r["D"])
            )
            if tag == "decode":
                key = key[:1] + key[2:]
            out.setdefault(key, []).append(r)
    assert next(rows, None) is None
    return out


def test_every_head_dim_bucket_and_dtype_is_compiled():
    assert set(HEAD_DIMS) == {config.bucket(config.head_block(d)) for d in range(1, config.MAX_HEAD_DIM + 1)}
    assert all(set(t) == set(HEAD_DIMS) for t in config.GPU_TILES.values())
    assert {config.group(dt) for dt in resources.DTYPES} == set(config.GROUPS) == set(config.AUTOTUNE)


@pytest.mark.parametrize("kernel,arch,dtype,D", CASES, ids=[f"{k}-sm{a}-{dt}-D{d}" for k, a, dt, d in CASES])
def test_shipped_config_compiles_spill_free(compiled, kernel, arch, dtype, D):
    rows = compiled[("shipped", kernel, arch, dtype, D)]
    want = config.candidates(kernel, config.head_block(D), dtype)
    assert sorted((r["warps"], r["stages"]) for r in rows) == sorted(want)  # every autotune candidate
    tile = config.gpu_tiles(config.head_block(D), dtype)[kernel]
    for r in rows:
        assert "error" not in r, r
        assert r["tile"] == f"{tile[0]}x{tile[1]}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["stack"] <= resources.STACK_LIMIT, r
        assert 0 < r["registers"] <= resources.REG_LIMIT, r
        assert 0 < r["shared"] <= resources.SHARED_LIMIT[arch], r


# A decode step (one query) runs the forward with its rows capped to a 16-row tile: a
# configuration of its own.  float32 is checked here; bfloat16/float16 decode steps are
# recorded in docs/triton.md (python -m attnlab.ops.triton.resources --decode).
DECODE_DTYPES = ("float32",)
DECODE_CASES = [(a, dt, d) for a in resources.ARCHS for dt in DECODE_DTYPES for d in HEAD_DIMS]


@pytest.mark.parametrize("arch,dtype,D", DECODE_CASES, ids=[f"sm{a}-{dt}-D{d}" for a, dt, d in DECODE_CASES])
def test_decode_step_compiles_spill_free(compiled, arch, dtype, D):
    rows = compiled[("decode", arch, dtype, D)]
    assert sorted((r["warps"], r["stages"]) for r in rows) == sorted(
        config.candidates("fwd", config.head_block(D), dtype)
    )
    bn = config.gpu_tiles(config.head_block(D), dtype)["fwd"][1]
    for r in rows:
        assert "error" not in r, r
        assert r["Nq"] == 1 and r["tile"] == f"16x{bn}"  # the rows capped to one power of two above Nq = 1
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] <= resources.STACK_LIMIT, r
        assert 0 < r["registers"] <= resources.REG_LIMIT and 0 < r["shared"] <= resources.SHARED_LIMIT[arch], r


def test_a_spilling_config_is_reported(compiled):
    """The old dK/dV default at D = 128 (32×128, 4 warps) spills on sm_90: the reader sees it."""
    (r,) = compiled[("spilling",)]
    ident = [r[c] for c in ("kernel", "arch", "dtype", "D", "Nq", "mask", "tile", "warps", "stages")]
    assert ident == ["dkdv", "sm_90", "bfloat16", 128, 512, "causal", "32x128", 4, 2]
    assert r["registers"] == resources.REG_LIMIT and r["stack"] > 0 and r["spill_stores"] > 0 and r["spill_loads"] > 0
    assert r["listed"] and not r["spill_free"]  # a stack frame: the listing was read


def test_a_kernel_with_no_stack_frame_lists_no_spill(compiled):
    """The listing of a shipped kernel with no stack frame and no local arrays, read anyway, holds
    no local-memory access: what the other rows assume without reading it."""
    (r,) = compiled[("listed",)]
    assert [r[c] for c in ("kernel", "arch", "dtype", "D", "mask")] == ["dkdv", "sm_90", "bfloat16", 128, "causal"]
    assert r["listed"] and r["stack"] == 0 and r["local"] == 0 and r["registers"] > 0
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0


_RESOURCE_LINE = """
Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:8
 Function attn_fwd:
  REG:{reg} STACK:{stack} SHARED:0 LOCAL:{local} CONSTANT[0]:896 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


@pytest.mark.parametrize("stack,local,listing", [(0, 0, False), (0, 0, True), (176, 0, False), (0, 16, False)])
def test_the_listing_is_read_only_where_local_memory_exists_or_asked(monkeypatch, stack, local, listing):
    """``read_cubin`` runs ``cuobjdump -sass`` (0.3 s a kernel) only for a stack frame, local arrays
    or ``listing=True``, and counts its spills from it; otherwise the counts are 0, unlisted."""
    calls: list = []

    def fake_run(cmd, **kw):
        calls.append(cmd[1])
        out = _RESOURCE_LINE.format(reg=255, stack=stack, local=local) if cmd[1] == "--dump-resource-usage" else ""
        out = out or "  STL.64 [R1+0x8], R4 ;\n  LDL [R1], R2 ;\n"
        return SimpleNamespace(stdout=out, returncode=0)

    monkeypatch.setattr(resources.subprocess, "run", fake_run)
    got = resources.read_cubin(b"\0", listing=listing)
    want_listed = listing or stack > 0 or local > 0
    assert calls == ["--dump-resource-usage", "-sass"] if want_listed else calls == ["--dump-resource-usage"]
    assert got["listed"] == want_listed and (got["stack"], got["local"], got["registers"]) == (stack, local, 255)
    assert (got["spill_stores"], got["spill_loads"]) == ((8, 4) if want_listed else (0, 0))


def test_the_command_line_overrides_the_tile_and_config(monkeypatch, capsys):
    """``--tile`` / ``--warps`` / ``--stages`` replace the shipped tile and candidates: this command
    line compiles exactly the spilling variant above (the fixture compiles it through ``--variants``)."""
    seen: list = []
    monkeypatch.setattr(resources, "run", lambda vs, **kw: seen.extend(vs) or [])
    argv = "--kernel dkdv --arch 90 --dtype bfloat16 --head-dim 128 --mask causal --tile 32 128 --warps 4 --stages 2"
    assert resources.main([*argv.split(), "--json", "-"]) == 0
    assert seen == [SPILLING] and capsys.readouterr().out == "[]"
    assert [resources.Variant.from_fields(json.loads(json.dumps(v.fields()))) for v in seen] == seen


def test_spill_bytes_count_local_memory_widths():
    sass = """
        /*0a30*/                   STL.64 [R1+0x8], R4 ;
        /*0a40*/                   STL [R1], R2 ;
        /*0a50*/                   LDL.LU.128 R8, [R1+0x10] ;
        /*0a60*/                   LDL.U8 R3, [R1+0x20] ;
        /*0a70*/                   STG.E.64 desc[UR4][R2.64], R6 ;
        /*0a80*/                   LDS.128 R12, [R0] ;
    """
    assert resources.spill_bytes(sass) == (12, 17)
    assert resources.spill_bytes("LDG.E R2, desc[UR4][R4.64] ;") == (0, 0)


def test_rows_name_the_variant_compiled_or_failed(monkeypatch):
    v = resources.Variant("dq", 90, "float16", 128, mask="none", warps=8, stages=3, nq=1)
    ident = ["kernel", "arch", "dtype", "D", "Nq", "mask", "tile", "warps", "stages"]
    u = resources.Usage(v, (64, 32), registers=168, stack=0, shared=4096, spill_stores=0, spill_loads=0)
    row = u.row()
    assert list(row)[: len(ident)] == ident and list(row)[len(ident) :] == [
        "registers",
        "spill_stores",
        "spill_loads",
        "stack",
        "shared",
        "local",
        "listed",
    ]
    assert [row[k] for k in ident] == ["dq", "sm_90", "float16", 128, 1, "none", "64x32", 8, 3]

    def fail(variant, listing=False):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(resources, "measure", fail)
    err = resources._row(v)
    assert list(err) == [*ident, "error"] and err["tile"] == "?" and err["error"] == "RuntimeError: out of resources"
    assert {k: err[k] for k in ident if k != "tile"} == {k: row[k] for k in ident if k != "tile"}


def test_refuses_interpreted_kernels_in_process():
    """Here the kernels are defined for the interpreter: no silent compile of something else."""
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resources.launch_kwargs("fwd", "bfloat16", 64, "causal")
