"""The native kernel as PyTorch operators: ``torch.ops.attnlab.native_fwd`` / ``native_bwd``.

Registered with :func:`torch.library.custom_op` (like :mod:`attnlab.ops.library`'s
``attnlab::flash_*``), with fake implementations and the backward tied on with
``register_autograd``, so ``torch.compile(fullgraph=True)`` sees one opaque node.
The mask travels as its structure (:mod:`attnlab.ops.native.structure`) or, for a mask with
none the kernel reads, as a BlockMask's tiles and partial-tile bits; a built-in score mod as its
terms (:meth:`attnlab.scores.ScoreMod.lower`, ``scoremods.h``)::

    native_fwd(q, k, v, kv_len?, q_ids?, kv_ids?, key_keep?, slopes?, table?,
               qpos?, kpos?, tile_states?, tile_id?, tile_bits?, scale, q_offset, kv_offset,
               band=[has_left, left, has_right, right, has_sinks_right, sinks_right], sinks,
               block=[bq, bk] (+ [tbq, tbk]: the BlockMask's tiles), mods=[term kinds], caps=[softcap values])
        -> (out (B, H, Nq, Dv) q.dtype, lse (B, H, Nq) float32)
    native_bwd(dout, dlse?, q, k, v, out, lse, <same>) -> (dq, dk, dv, dslopes, dtable)

``q_ids (B|1, Nq)`` / ``kv_ids (B|1, Nk)`` int64 and ``key_keep (B|1, Nk)`` bool are the
structure's vectors sliced to this problem's rows and columns (:func:`native_attention`);
``qpos (B|1, Nq)`` / ``kpos (Nk,)`` int64 the band positions of rows and columns (varlen's
``q_pos``/``kv_pos``, per-batch shifts); ``tile_states`` / ``tile_id`` / ``tile_bits`` a
BlockMask's states, tile ids and :meth:`~attnlab.masks.BlockMask.partial_bits` (``mask_args.h``);
``slopes (B|1, H)`` (ALiBi) and ``table (H, 2R+1)`` (relative bias) float32, their gradients
``dslopes``/``dtable`` (empty when absent).  Double backward is refused
(:class:`attnlab.ops.flash.DoubleBackwardError`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.masks import BlockMask, MaskStructure, describe
from attnlab.ops.flash import DOUBLE_BACKWARD, DoubleBackwardError
from attnlab.ops.native import build
from attnlab.ops.native.structure import IMPLEMENTED, band_of, structure_of
from attnlab.scores import ScoreMod

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BQ = 64
# scoremods.h's ScoreMods::Kind
_SOFTCAP, _ALIBI, _ALIBI_SYMMETRIC, _RELATIVE_BIAS = 1, 2, 3, 4
_MAX_TERMS = 8


def blocks(D: int) -> list[int]:
    """``[bq, bk]``: a K tile of ``D × bk`` floats stays within 32 KiB of L1."""
    return [_BQ, max(16, min(128, 8192 // max(D, 1)) // 16 * 16)]


def bwd_blocks(D: int) -> list[int]:
    """``[bq, bk]`` of the backward (its own: it only reads the forward's LSE).  Narrower kv
    blocks than the forward's: the fused pass keeps five D × bk panels (Kᵀ, Vᵀ, K, dK, dV)
    per kv block, and a window's band wastes fewer columns; 64 × 64 measured fastest at
    D = 64 (causal and window256, float32, one thread)."""
    return [_BQ, max(16, min(64, 4096 // max(D, 1)) // 16 * 16)]


def _ext():
    mod = build.load()
    if mod is None:
        raise RuntimeError("attnlab native kernel is not available (attnlab.ops.native.build.status())")
    return mod


_NONE = torch.empty(0)


def _extras(*ts):
    """masking.h's mask extras ``[qpos, kpos, states, tile_id, bits]`` (mask_args.h), empty where absent."""
    return [_NONE if t is None else t for t in ts]


def _tile_block(block):
    """The BlockMask's tiles ``[tbq, tbk]``: ``block[2:4]`` when given, else the kernel's ``block[:2]``."""
    return [int(x) for x in (block[2:4] if len(block) >= 4 else block[:2])]


def _mask_args(band, sinks):
    return (bool(band[0]), int(band[1]), bool(band[2]), int(band[3]), int(sinks), bool(band[4]), int(band[5]))


@torch.library.custom_op("attnlab::native_fwd", mutates_args=())
def native_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_len: Tensor | None,
    q_ids: Tensor | None,
    kv_ids: Tensor | None,
    key_keep: Tensor | None,
    slopes: Tensor | None,
    table: Tensor | None,
    qpos: Tensor | None,
    kpos: Tensor | None,
    tile_states: Tensor | None,
    tile_id: Tensor | None,
    tile_bits: Tensor | None,
    scale: float,
    q_offset: int,
    kv_offset: int,
    band: list[int],
    sinks: int,
    block: list[int],
    mods: list[int],
    caps: list[float],
) -> tuple[Tensor, Tensor]:
    """Forward: ``(out, lse)``."""
    out, lse = _ext().fwd(
        q,
        k,
        v,
        float(scale),
        int(q_offset),
        int(kv_offset),
        *_mask_args(band, sinks),
        kv_len,
        q_ids,
        kv_ids,
        key_keep,
        slopes,
        table,
        int(block[0]),
        int(block[1]),
        [int(x) for x in mods],
        [float(x) for x in caps],
        _extras(qpos, kpos, tile_states, tile_id, tile_bits),
        _tile_block(block),
    )
    return out, lse


@native_fwd.register_fake
def _native_fwd_fake(q, k, v, *args):
    B, H, Nq, _ = q.shape
    return q.new_empty((B, H, Nq, v.shape[-1])), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("attnlab::native_bwd", mutates_args=())
def native_bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kv_len: Tensor | None,
    q_ids: Tensor | None,
    kv_ids: Tensor | None,
    key_keep: Tensor | None,
    slopes: Tensor | None,
    table: Tensor | None,
    qpos: Tensor | None,
    kpos: Tensor | None,
    tile_states: Tensor | None,
    tile_id: Tensor | None,
    tile_bits: Tensor | None,
    scale: float,
    q_offset: int,
    kv_offset: int,
    band: list[int],
    sinks: int,
    block: list[int],
    mods: list[int],
    caps: list[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv, dslopes, dtable)`` (dq/dk/dv contiguous in the inputs' dtype;
    the parameter gradients float32, empty when the parameter is absent)."""
    dq, dk, dv, dslopes, dtable = _ext().bwd(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        float(scale),
        int(q_offset),
        int(kv_offset),
        *_mask_args(band, sinks),
        kv_len,
        q_ids,
        kv_ids,
        key_keep,
        slopes,
        table,
        int(block[0]),
        int(block[1]),
        [int(x) for x in mods],
        [float(x) for x in caps],
        _extras(qpos, kpos, tile_states, tile_id, tile_bits),
        _tile_block(block),
    )
    return dq, dk, dv, dslopes, dtable


@native_bwd.register_fake
def _native_bwd_fake(dout, dlse, q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table, *args):
    f32 = dict(dtype=torch.float32)
    ds = q.new_empty(slopes.shape, **f32) if slopes is not None else q.new_empty((0,), **f32)
    dt = q.new_empty(table.shape, **f32) if table is not None else q.new_empty((0,), **f32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), ds, dt


def _setup_context(ctx, inputs, output):
    q, k, v, kv_len, q_ids, kv_ids, key_keep, slopes, table, *rest = inputs
    extras, args = rest[:5], rest[5:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table, *extras)
    ctx.args = tuple(args)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table, *extras = ctx.saved_tensors
    params = (slopes, table)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dout, dlse, q, k, v, *params)):
        raise DoubleBackwardError(DOUBLE_BACKWARD.format("native backend"))
    if dout is None:
        dout = torch.zeros_like(out)
    scale, q_offset, kv_offset, band, sinks, block, mods, caps = ctx.args
    if all(t is None for t in extras):  # a BlockMask's tiles are the kernel's: keep them
        block = bwd_blocks(q.shape[-1])
    dq, dk, dv, dslopes, dtable = torch.ops.attnlab.native_bwd(
        dout, dlse, q, k, v, out, lse, kv_len, q_ids, kv_ids, key_keep, slopes, table, *extras,
        scale, q_offset, kv_offset, band, sinks, block, mods, caps,
    )  # fmt: skip
    dslopes = None if slopes is None else dslopes
    dtable = None if table is None else dtable
    return (dq, dk, dv, None, None, None, None, dslopes, dtable, *([None] * (len(extras) + len(ctx.args))))


native_fwd.register_autograd(_backward, setup_context=_setup_context)


def _functorch(*ts) -> bool:
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts)


def plan(q, k, v, mask, score_mod, q_offset, kv_offset):
    """``(mask plan, None)`` when the native kernel runs this problem, else ``(None, why)``: the
    plan is the mask's structure where the kernel implements every field of it, else a
    BlockMask at the kernel's tiles (a mask with no structure: its partial tiles' bits).
    Inputs are already validated by :func:`attnlab.attention`."""
    if build.disabled():
        return None, "disabled by ATTNLAB_NATIVE=0"
    if q.device.type != "cpu":
        return None, f"tensors on {q.device} (the native kernel is CPU only)"
    if q.dtype not in _DTYPES:
        return None, f"dtype {q.dtype} (float32, bfloat16, float16 only)"
    terms = score_terms(score_mod)
    if isinstance(terms, str):
        return None, terms
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return None, "per-batch offsets"
    compiling = torch.compiler.is_compiling()
    if not compiling and _functorch(q, k, v, *(t for t in terms[2:] if t is not None)):
        return None, "torch.func transform (the flash path's autograd.Function composes with it)"
    s = structure_of(mask)
    if s is not None and s.fields() <= IMPLEMENTED:
        if compiling and s.q_shift is not None:  # its range is read as Python ints
            return None, "per-batch query shifts under torch.compile"
        why = _structure_unsupported(s, q.shape[0], q.shape[2], k.shape[2], q_offset, kv_offset)
        if why is not None:
            return None, why
        out: MaskStructure | BlockMask = s
    elif compiling:
        # classifying tiles and evaluating a predicate do not trace: a BlockMask whose partial
        # tiles are evaluated already (partial_bits() called before compiling) is read as it is,
        # at its own tiles (the kernel reads any); anything else runs the flash op
        if not (isinstance(mask, BlockMask) and mask.has_partial_bits):
            return None, (
                f"mask {describe(mask)} under torch.compile: build its BlockMask and call its partial_bits() "
                "before compiling to run the native kernel"
            )
        out = mask
    else:
        B, H, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        out = tiles_for(mask, B, H, Nq, Nk, q_offset, kv_offset, blocks(q.shape[-1]))
    if not (build.loaded() if compiling else build.load() is not None):
        return None, "the extension could not be built"
    return out, None


def tiles_for(mask, B, H, Nq, Nk, q_offset, kv_offset, block) -> BlockMask:
    """``mask`` (a Mask or a BlockMask) as a BlockMask at the kernel's tiles ``block``: a
    BlockMask built at other tiles is re-classified from its mask (cached per mask and shape)."""
    if isinstance(mask, BlockMask):
        if (mask.block_q, mask.block_k) == tuple(block):
            return mask
        mask = mask.mask
    return mask.block_mask(B, H, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, block=tuple(block))


def _structure_unsupported(s: MaskStructure, B: int, Nq: int, Nk: int, q_offset: int, kv_offset: int) -> str | None:
    """Why the kernel cannot read structure ``s`` for this problem (tensors it cannot index), or None."""
    if s.kv_len is not None and (s.kv_len.device.type != "cpu" or s.kv_len.shape != (B,)):
        return "kv_len not a (B,) CPU tensor"
    if s.q_shift is not None and (s.q_shift.device.type != "cpu" or s.q_shift.shape != (B,)):
        return "q_shift not a (B,) CPU tensor"
    qlo, qhi = _query_span(s, Nq, q_offset)
    for name, t, lo, hi in (
        ("q_ids", s.q_ids, qlo, qhi),
        ("kv_ids", s.kv_ids, kv_offset, kv_offset + Nk),
        ("key_keep", s.key_keep, kv_offset, kv_offset + Nk),
    ):
        if t is not None and not _covers(t, B, lo, hi):
            return f"{name} of shape {tuple(t.shape)} does not cover positions [{lo}, {hi}) of B={B}"
    for name, t, lo, hi in (("q_pos", s.q_pos, qlo, qhi), ("kv_pos", s.kv_pos, kv_offset, kv_offset + Nk)):
        if t is not None and not (t.device.type == "cpu" and t.dim() == 1 and 0 <= lo and hi <= t.shape[0]):
            return f"{name} of shape {tuple(t.shape)} does not cover positions [{lo}, {hi})"
    if (s.q_ids is None) != (s.kv_ids is None):
        return "q_ids without kv_ids"
    return None


def _query_span(s: MaskStructure, Nq: int, q_offset: int) -> tuple[int, int]:
    """The absolute query positions ``[lo, hi)`` the structure reads (shifted per batch)."""
    if s.q_shift is None or s.q_shift.numel() == 0:
        return q_offset, q_offset + Nq
    return q_offset + int(s.q_shift.min()), q_offset + Nq + int(s.q_shift.max())


def score_terms(score_mod) -> tuple[list[int], list[float], Tensor | None, Tensor | None] | str:
    """``(mods, caps, slopes, table)``: the kernel's description of a built-in score mod from its
    :meth:`~attnlab.scores.ScoreMod.lower` (at most one ALiBi and one relative-bias term, any
    softcaps), or why it stays on the flash path."""
    if score_mod is None:
        return [], [], None, None
    terms = score_mod.lower() if isinstance(score_mod, ScoreMod) else None
    if terms is None:
        return f"score mod {score_mod!r} has no structure the kernel implements (the flash path runs it)"
    if len(terms) > _MAX_TERMS:
        return f"score mod {score_mod!r}: more than {_MAX_TERMS} terms"
    mods: list[int] = []
    caps: list[float] = []
    slopes = table = None
    for t in terms:
        if t.kind == "softcap":
            mods.append(_SOFTCAP)
            caps.append(float(t.value))
        elif t.kind == "alibi" and slopes is None:
            slopes = t.tensor
            mods.append(_ALIBI_SYMMETRIC if t.symmetric else _ALIBI)
        elif t.kind == "relative_bias" and table is None:
            table = t.tensor
            mods.append(_RELATIVE_BIAS)
        else:
            return f"score term {t.kind!r} (or a second one of its kind) is not implemented natively"
    for x in (slopes, table):
        if x is not None and x.device.type != "cpu":
            return f"score mod tensor on {x.device} (the native kernel is CPU only)"
    return mods, caps, slopes, table


def _covers(t: Tensor, B: int, lo: int, hi: int) -> bool:
    """A ``(B|1, L)`` CPU vector by absolute position that holds positions ``[lo, hi)``."""
    return t.device.type == "cpu" and t.dim() == 2 and t.shape[0] in (1, B) and 0 <= lo and hi <= t.shape[1]


def _rows(t: Tensor | None, off: int, n: int, dtype: torch.dtype) -> Tensor | None:
    """Positions ``[off, off + n)`` of a ``(B|1, L)`` vector, contiguous, in ``dtype``."""
    return None if t is None else t[:, off : off + n].to(dtype).contiguous()


def _query_positions(s: MaskStructure, Nq: int, q_offset: int) -> Tensor:
    """int64 ``(B|1, Nq)``: the absolute position each row reads, ``q_offset + i (+ q_shift[b])``."""
    pos = (torch.arange(Nq) + q_offset).view(1, Nq)
    return pos if s.q_shift is None else pos + s.q_shift.to(torch.long).view(-1, 1)


def _band_positions(s: MaskStructure, Nq: int, Nk: int, q_offset: int, kv_offset: int):
    """``(qpos (B|1, Nq) or None, kpos (Nk,) or None, q_ids rows (B|1, Nq) or None)``: the band
    positions of the rows (q_pos at the shifted query positions, or those positions; None when
    they are ``q_offset + i``) and of the columns, and the rows' document ids."""
    if s.q_shift is None:
        qpos = None if s.q_pos is None else s.q_pos[q_offset : q_offset + Nq].to(torch.long).view(1, Nq)
        q_ids = _rows(s.q_ids, q_offset, Nq, torch.long)
    else:
        pos = _query_positions(s, Nq, q_offset)
        qpos = pos if s.q_pos is None else s.q_pos.to(torch.long)[pos]
        q_ids = None
        if s.q_ids is not None:
            ids = s.q_ids.to(torch.long)
            rows = max(ids.shape[0], pos.shape[0])
            q_ids = torch.gather(ids.expand(rows, -1), 1, pos.expand(rows, -1))
    kpos = None if s.kv_pos is None else s.kv_pos[kv_offset : kv_offset + Nk].to(torch.long)
    contig = (None if t is None else t.contiguous() for t in (qpos, kpos, q_ids))
    return tuple(contig)


def native_attention(q, k, v, structure, *, scale, q_offset, kv_offset, score_mod=None):
    """``(out, lse)`` through ``torch.ops.attnlab.native_fwd`` for a mask plan from :func:`plan`
    (a structure, or a BlockMask at the kernel's tiles) and the score mod :func:`plan` accepted.
    ALiBi slopes and bias tables enter as float32 views of the mod's own tensors, so their
    gradients reach them."""
    terms = score_terms(score_mod)
    if isinstance(terms, str):
        raise ValueError(f"native_attention: {terms}")
    mods, caps, slopes, table = terms
    if slopes is not None:
        slopes = slopes.to(torch.float32).reshape(-1, q.shape[1]).contiguous()  # (H,) -> (1, H)
    if table is not None:
        table = table.to(torch.float32).contiguous()
    block = blocks(q.shape[-1])
    Nq, Nk = q.shape[2], k.shape[2]
    if isinstance(structure, BlockMask):
        bm = structure  # at any tiles; the kernel's own (plan's tiles_for) make a kernel tile one BlockMask tile
        bm.check_shape(q.shape[0], q.shape[1], Nq, Nk, q_offset, kv_offset)
        block = [*block, bm.block_q, bm.block_k]
        bits, tile_id = bm.partial_bits()
        tensors = [None] * 6 + [bm.states.contiguous(), tile_id, bits]
        band, sinks = [0] * 6, 0
    else:
        s = structure
        band = band_of(s)
        sinks = int(s.sinks)
        kv_len = None if s.kv_len is None else s.kv_len.to(torch.long).contiguous()
        qpos, kpos, q_ids = _band_positions(s, Nq, Nk, q_offset, kv_offset)
        kv_ids = _rows(s.kv_ids, kv_offset, Nk, torch.long)
        keep = _rows(s.key_keep, kv_offset, Nk, torch.bool)
        tensors = [kv_len, q_ids, kv_ids, keep, qpos, kpos, None, None, None]
    kv_len, q_ids, kv_ids, keep, *extras = tensors
    return torch.ops.attnlab.native_fwd(
        q,
        k,
        v,
        kv_len,
        q_ids,
        kv_ids,
        keep,
        slopes,
        table,
        *extras,
        float(scale),
        int(q_offset),
        int(kv_offset),
        band,
        sinks,
        block,
        mods,
        caps,
    )


__all__ = ["blocks", "bwd_blocks", "native_attention", "native_bwd", "native_fwd", "plan", "score_terms", "tiles_for"]
