"""Registers and spills of the Triton kernels, compiled for sm_80 / sm_90 without a GPU.

``triton.compile(src, target=GPUTarget("cuda", arch, 32))`` runs the whole pipeline
(TTIR → TTGIR → LLVM → PTX → ``ptxas``) on a machine with no GPU; the cubin it returns
is read with the ``cuobjdump`` that ships inside the triton package:

* ``cuobjdump --dump-resource-usage`` gives the registers per thread (``REG``), the
  stack frame (``STACK``, bytes per thread), the local arrays (``LOCAL``) and the static
  shared memory;
* ``cuobjdump -sass`` gives the spill traffic: every ``STL``/``LDL`` (store to / load
  from local memory) is a spill, since the kernels declare no local arrays (float32's
  FMA-lowered IEEE dots use local memory heavily: docs/triton.md); the bytes
  are summed from the access widths (``STL.64`` = 8 bytes, ...), the same figures as
  ``ptxas -v``'s "bytes spill stores / loads".  A kernel with no stack frame and no local
  arrays has no local memory for an ``STL``/``LDL`` to address, so its spill traffic is 0
  without the listing (0.3 s of ``cuobjdump -sass`` per kernel, against 2 ms for the
  resource line): the listing is read only where ``STACK`` or ``LOCAL`` is not 0, or when
  asked (``--list-sass``; the tests check the rule on a listed spill-free kernel).

Each kernel is specialised exactly as a launch would specialise it: the launch
arguments come from the real launchers (:func:`attnlab.ops.triton.autograd._forward`
and ``_backward``, with the launch itself intercepted) on contiguous CPU tensors of a
512-token problem, so strides of 1 become constants and 16-divisible pointers and
strides carry ``tt.divisibility`` as they would on a GPU.  Two mask variants cover the
kernel bodies: ``none`` (dense loop, no mask code) and ``causal`` (block lists: the
partial tiles with the compiled band mask, then the full tiles); ``document`` and
``table`` (the packed partial-tile table of custom masks) are available on request.

The kernels must have been defined for the GPU, i.e. without ``TRITON_INTERPRET=1``
(the tests set it for the interpreter, so they run this module in a subprocess).
Compiled kernels land in triton's own cache (``~/.triton/cache`` or
``TRITON_CACHE_DIR``): a second run reads the cubins back in well under a second each.

Command line (the table in docs/triton.md)::

    python -m attnlab.ops.triton.resources --mask causal --head-dim 64 128 256 --jobs 0  # the test's matrix
    python -m attnlab.ops.triton.resources --json out.json  # everything (~170 compiles)
    python -m attnlab.ops.triton.resources --kernel dkdv --arch 80 --head-dim 128 \
        --tile 32 64 --warps 8 --stages 2 --check            # try a config; exit 1 if it spills
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

ARCHS = (80, 90)
KERNELS = ("fwd", "dkdv", "dq")
DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (64, 128, 256)
MASKS = ("none", "causal", "document", "table")
DEFAULT_MASKS = ("none", "causal")

#: registers per thread the hardware allows (sm_80, sm_90); a kernel at this count has
#: nothing left to spare, one above it spills
REG_LIMIT = 255
#: the largest stack frame (bytes per thread) a spill-free kernel may have: the kernels
#: call no non-inlined functions and declare no local arrays, so any frame is spill space
STACK_LIMIT = 0
#: the shared memory (bytes per block, opt-in) a launch may use: A100 (sm_80) 163 KiB,
#: H100 (sm_90) 227 KiB; triton refuses a larger kernel at load (OutOfResources)
SHARED_LIMIT = {80: 166912, 90: 232448}

_N = 512  # tokens: more than the largest tile, so no tile is capped by the problem size


@dataclasses.dataclass(frozen=True)
class Variant:
    kernel: str  # "fwd" | "dkdv" | "dq"
    arch: int  # 80 | 90
    dtype: str  # "bfloat16" | "float16" | "float32"
    D: int  # head dim (D = Dv)
    mask: str = "causal"  # see MASKS
    tile: tuple | None = None  # (BM, BN); None = config.GPU_TILES of the dtype
    warps: int = 4
    stages: int = 2
    nq: int = 512  # queries: 1 = a decode step (the forward's rows capped to a 16-row tile)

    def fields(self) -> dict:
        """The variant as JSON fields (:meth:`from_fields` reads them back): what
        ``--variants`` takes."""
        return dataclasses.asdict(self) | {"tile": None if self.tile is None else list(self.tile)}

    @classmethod
    def from_fields(cls, d: dict) -> Variant:
        tile = d.get("tile")
        return cls(**(d | {"tile": None if tile is None else tuple(tile)}))

    def columns(self, tile: str) -> dict:
        """The variant's columns of a row (:meth:`Usage.row`, or a failed compile's), ``tile``
        as compiled (``"BMxBN"``, ``"?"`` when unknown)."""
        return {
            "kernel": self.kernel,
            "arch": f"sm_{self.arch}",
            "dtype": self.dtype,
            "D": self.D,
            "Nq": self.nq,
            "mask": self.mask,
            "tile": tile,
            "warps": self.warps,
            "stages": self.stages,
        }


@dataclasses.dataclass
class Usage:
    variant: Variant
    tile: tuple
    registers: int
    stack: int
    shared: int  # bytes per block: the kernel's dynamic shared memory (triton's metadata.shared)
    spill_stores: int  # bytes per thread (static count of STL widths)
    spill_loads: int
    local: int = 0  # bytes per thread of local arrays (cuobjdump's LOCAL)
    listed: bool = True  # the spill counts were read from the SASS listing (else: no stack, no local memory)

    @property
    def spill_free(self) -> bool:
        return self.spill_stores == 0 and self.spill_loads == 0 and self.stack <= STACK_LIMIT

    @property
    def fits(self) -> bool:
        """Within the arch's shared memory (a launch would not raise OutOfResources)."""
        return self.shared <= SHARED_LIMIT[self.variant.arch]

    def row(self) -> dict:
        return self.variant.columns(f"{self.tile[0]}x{self.tile[1]}") | {
            "registers": self.registers,
            "spill_stores": self.spill_stores,
            "spill_loads": self.spill_loads,
            "stack": self.stack,
            "shared": self.shared,
            "local": self.local,
            "listed": self.listed,
        }


def tool(name: str = "cuobjdump") -> str | None:
    """The path of a CUDA binary tool shipped inside the triton package, or None."""
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


# ----------------------------------------------------------------------------- launch arguments
class _Captured(Exception):
    pass


def _fake_plan(mask: str, device, nq: int = _N):
    """A stand-in for a mask's :class:`~.masking.Plan`: the launch arguments' types are all
    the compiler sees, so the values only need to be plausible."""
    import torch

    i32 = torch.int32
    lists = torch.zeros(1, 1, 4, 16, dtype=i32, device=device)
    spec = SimpleNamespace(band=None, sink=None, q_ids=None, kv_ids=None, keep=None, table=None, tile_id=None)
    if mask == "causal":
        spec.band = (0, 2**31 - 1)
    elif mask == "document":
        spec.q_ids = torch.zeros(1, nq, dtype=i32, device=device)
        spec.kv_ids = torch.zeros(1, _N, dtype=i32, device=device)
    elif mask == "table":
        spec.table = torch.zeros(4, 1, 1, 128, 4, dtype=i32, device=device)
        spec.tile_id = torch.zeros(16, 16, dtype=i32, device=device)
    else:
        raise ValueError(f"mask: expected one of {MASKS[1:]} for a planned mask, got {mask!r}")
    return SimpleNamespace(kv_lists=lists, q_lists=lists, spec=spec)


def launch_kwargs(kernel: str, dtype: str, D: int, mask: str, nq: int = _N) -> tuple[dict, tuple]:
    """``(kwargs, (BM, BN))``: what the launcher passes to ``kernel`` for a (1, 2, nq, D)
    query and (1, 2, 512, D) key/value problem of ``dtype`` with ``mask``, at the shipped
    tiles (capped to the problem as the launcher caps them: 16 rows for ``nq = 1``)."""
    import torch

    from attnlab.ops.triton import autograd as ag
    from attnlab.ops.triton.scoremods import lower_score_mod

    if ag.interpreting():
        raise RuntimeError(
            "the Triton kernels were defined under TRITON_INTERPRET=1: they cannot be "
            "compiled for a GPU in this process (run python -m attnlab.ops.triton.resources)"
        )
    dt = getattr(torch, dtype)
    q = torch.zeros(1, 2, nq, D, dtype=dt)
    k = torch.zeros(1, 2, _N, D, dtype=dt)
    v = torch.zeros(1, 2, _N, D, dtype=dt)
    pb = ag._Problem(q, k, v, None, lower_score_mod(None), D**-0.5, 0, 0, None)
    if mask != "none":
        plan = _fake_plan(mask, q.device, nq)
        setattr(pb, "plan", lambda name: plan)  # noqa: B010 - mypy refuses a method assignment
    got = {}

    def capture(name, grid, **kw):
        got[name] = kw
        if name == kernel:
            raise _Captured

    saved = ag._launch
    ag._launch = capture
    try:
        if kernel == "fwd":
            ag._forward(pb, q, k, v)
        else:
            out, lse = torch.zeros_like(q), torch.zeros(1, 2, nq)
            ag._backward(pb, q, k, v, out, lse, torch.zeros_like(q), None, [])
    except _Captured:
        pass
    finally:
        ag._launch = saved
    if kernel not in got:
        raise RuntimeError(f"the launcher did not launch {kernel!r}")
    return got[kernel], pb.tiles[kernel]


# ----------------------------------------------------------------------------- compile and read
_CACHE: dict = {}


def compile_variant(v: Variant):
    """The ``CompiledKernel`` for one variant (cubin in ``.asm["cubin"]``); raises what the
    compiler raises (e.g. out of shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from attnlab.ops.triton import autograd as ag

    kw, tile = launch_kwargs(v.kernel, v.dtype, v.D, v.mask, v.nq)
    if v.tile is not None:
        tile = tuple(v.tile)
        kw = dict(kw, BM=tile[0], BN=tile[1])
    fn = ag._KERNELS[v.kernel]
    target = GPUTarget("cuda", v.arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(**kw, num_warps=v.warps, num_stages=v.stages)
    options, signature, constexprs, attrs = fn._pack_args(backend, opts, bound, spec, opts)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__), tile


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_LOCAL = re.compile(r"\b(STL|LDL)(\.[A-Z0-9.]+)?\s")
_WIDTH = {"8": 1, "U8": 1, "S8": 1, "16": 2, "U16": 2, "S16": 2, "64": 8, "128": 16}


def read_cubin(cubin: bytes, listing: bool = False) -> dict:
    """``{"registers", "stack", "shared", "local", "spill_stores", "spill_loads", "listed"}`` of a
    one-kernel cubin.  The SASS listing is read where the kernel has a stack frame or local arrays,
    or with ``listing=True``; otherwise the spill counts are 0 (nothing to spill to) and
    ``listed`` is False."""
    exe = tool("cuobjdump")
    if exe is None:
        raise RuntimeError("cuobjdump not found in the triton package (triton/backends/nvidia/bin)")
    with tempfile.TemporaryDirectory(prefix="attnlab-res-") as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([exe, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
        m = _RES.search(res)
        if m is None:
            raise RuntimeError(f"cuobjdump printed no resource line:\n{res}")
        registers, stack, shared, local = (int(g) for g in m.groups())
        listed = listing or stack > 0 or local > 0
        stores = loads = 0
        if listed:
            sass = subprocess.run([exe, "-sass", path], capture_output=True, text=True, check=True).stdout
            stores, loads = spill_bytes(sass)
    return {
        "registers": registers,
        "stack": stack,
        "shared": shared,
        "local": local,
        "spill_stores": stores,
        "spill_loads": loads,
        "listed": listed,
    }


def spill_bytes(sass: str) -> tuple[int, int]:
    """``(store bytes, load bytes)`` of the local-memory instructions (``STL``/``LDL``) in a
    SASS listing: 4 bytes each unless the width suffix says otherwise (``.64``, ``.128``,
    ``.U8``...), as ``ptxas -v`` counts its "bytes spill stores / loads"."""
    spills = {"STL": 0, "LDL": 0}
    for op, mods in _LOCAL.findall(sass):
        width = 4
        for part in (mods or "").strip(".").split("."):
            width = _WIDTH.get(part, width)
        spills[op] += width
    return spills["STL"], spills["LDL"]


def measure(v: Variant, listing: bool = False) -> Usage:
    """Compile ``v`` and read its resources (cached per process); ``listing``: read the SASS
    listing whatever the stack frame (:func:`read_cubin`)."""
    if v not in _CACHE or (listing and not _CACHE[v].listed):
        ck, tile = compile_variant(v)
        got = read_cubin(ck.asm["cubin"], listing)
        got["shared"] = max(got["shared"], int(ck.metadata.shared))  # static (cuobjdump) or dynamic (launch)
        _CACHE[v] = Usage(v, tile, **got)
    return _CACHE[v]


# ----------------------------------------------------------------------------- the matrix
def default_variants(
    archs=ARCHS,
    kernels=KERNELS,
    dtypes=DTYPES,
    head_dims=HEAD_DIMS,
    masks=DEFAULT_MASKS,
    candidates: bool = True,
    decode: bool = False,
) -> list[Variant]:
    """Every shipped configuration: the tiles of ``config.GPU_TILES`` with every autotune
    candidate of ``config.candidates`` (``config.AUTOTUNE``), per dtype group
    (``candidates=False``: the first candidate only).  ``decode=True`` adds the forward of
    a decode step (one query: the launcher caps its rows to a 16-row tile)."""
    from attnlab.ops.triton import config

    out = []
    for kernel in kernels:
        for arch in archs:
            for dtype in dtypes:
                for D in head_dims:
                    cands = config.candidates(kernel, config.head_block(D), dtype)
                    cands = cands if candidates else cands[:1]
                    for nq in (_N, 1) if decode and kernel == "fwd" else (_N,):
                        for mask in masks:
                            for w, s in cands:
                                out.append(Variant(kernel, arch, dtype, D, mask, None, w, s, nq))
    return out


def _row(v: Variant, on_error: str = "record", listing: bool = False) -> dict:
    try:
        u = measure(v, listing)
        return u.row() | {"spill_free": u.spill_free, "fits": u.fits}
    except Exception as e:  # the compiler's own errors (e.g. shared memory) are part of the record
        if on_error == "raise":
            raise
        return v.columns("?") | {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def run(variants, on_error="record", jobs: int = 1, list_sass: int = 0) -> list[dict]:
    """Rows (see :meth:`Usage.row`) for ``variants``, in order; a failed compile gives a row
    with ``error`` (``on_error="raise"`` re-raises).  ``jobs > 1`` compiles in that many
    worker processes (spawned: each defines the kernels for the GPU afresh).  The first
    ``list_sass`` variants (-1: all) have their SASS listing read whatever their stack frame."""
    variants = list(variants)
    listing = [list_sass < 0 or i < list_sass for i in range(len(variants))]
    if jobs <= 1 or len(variants) <= 1:
        return [_row(v, on_error, lst) for v, lst in zip(variants, listing, strict=True)]
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(variants)), mp_context=ctx) as pool:
        return list(pool.map(_row, variants, [on_error] * len(variants), listing))


_COLS = (
    "kernel",
    "arch",
    "dtype",
    "D",
    "Nq",
    "mask",
    "tile",
    "warps",
    "stages",
    "registers",
    "spill_stores",
    "spill_loads",
    "stack",
    "shared",
)


def markdown(rows) -> str:
    head = "| " + " | ".join(_COLS) + " |\n|" + "---|" * len(_COLS) + "\n"
    body = []
    for r in rows:
        if "error" in r:
            cells = [str(r[c]) for c in _COLS[:9]] + [r["error"].splitlines()[0][:80]] + [""] * (len(_COLS) - 10)
        else:
            cells = [str(r[c]) for c in _COLS]
        body.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(body) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnlab.ops.triton.resources", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--kernel", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--mask", nargs="+", default=list(DEFAULT_MASKS), choices=MASKS)
    p.add_argument("--first-candidate", action="store_true", help="only the first autotune candidate per kernel")
    p.add_argument("--decode", action="store_true", help="add the forward of a decode step (one query, 16-row tiles)")
    p.add_argument("--tile", type=int, nargs=2, default=None, help="override (BM, BN) for every kernel")
    p.add_argument(
        "--warps", type=int, default=None, help="with --stages: one (warps, stages) instead of the candidates"
    )
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--json", default=None, help="write the rows as JSON to this file ('-' = stdout)")
    p.add_argument("--check", action="store_true", help="exit 1 unless every row compiled, spill-free and fitting")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes (0 = one per CPU)")
    p.add_argument(
        "--list-sass",
        type=int,
        default=0,
        metavar="N",
        help="read the SASS listing of the first N variants (-1 = all) even with no stack frame and no "
        "local arrays, where their spill counts are 0 without it",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="compile exactly these variants, a JSON list of Variant.fields() ('-' = stdin), in order; "
        "the selection options above are ignored",
    )
    a = p.parse_args(argv)
    if tool("cuobjdump") is None:
        print("cuobjdump not found: install triton (pip install 'attnlab[triton]')", file=sys.stderr)
        return 2
    if a.variants is not None:
        if a.variants == "-":
            listed = json.load(sys.stdin)
        else:
            with open(a.variants) as f:
                listed = json.load(f)
        vs = [Variant.from_fields(d) for d in listed]
    else:
        vs = default_variants(
            a.arch, a.kernel, a.dtype, a.head_dim, a.mask, candidates=not a.first_candidate, decode=a.decode
        )
    if a.variants is None and (a.tile is not None or a.warps is not None):
        vs = list(
            dict.fromkeys(
                dataclasses.replace(
                    v, tile=tuple(a.tile) if a.tile else v.tile, warps=a.warps or v.warps, stages=a.stages or v.stages
                )
                for v in vs
            )
        )
    rows = run(vs, jobs=a.jobs or os.cpu_count() or 1, list_sass=a.list_sass)
    if a.json == "-":
        json.dump(rows, sys.stdout)
    else:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        print(markdown(rows), end="")
    bad = [r for r in rows if "error" in r or not (r["spill_free"] and r["fits"])]
    return 1 if a.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
