"""The native decode kernel (``decode.cpp``) as PyTorch operators.

``torch.ops.attnlab.native_paged_decode`` attends a batch of ragged sequences over a
:class:`attnlab.cache.paged.PagedCache`'s pools through their block tables, and
``torch.ops.attnlab.native_quantized_decode`` over a
:class:`attnlab.cache.quantized.QuantizedCache`'s packed int8/int4/int2 groups and float
window; both read the caches in place (no dense copy) and return ``(out (B, H, Nq, Dv) q.dtype,
lse (B, H, Nq) float32)``.  They are inference operators (no autograd): the caches'
``attend`` takes them only when no gradient is wanted (:func:`plan`).

The mask travels as the native kernel's structure (:mod:`attnlab.ops.native.structure`:
band, sinks, ``kv_len``) at absolute positions; anything else (score mods, other mask
fields) keeps the caches' split-KV path.  ``SPLIT`` (keys per work item; 0 = chosen from
the problem size and the thread count) is a knob for the tests, which force small splits
to exercise the LSE merge.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.masks import describe
from attnlab.ops.native import build
from attnlab.ops.native.structure import DECODE_IMPLEMENTED, band_of, structure_of

__all__ = ["SPLIT", "band_of", "native_paged_decode", "native_quantized_decode", "paged_op", "plan"]

SPLIT = 0
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _lib():
    if build.load() is None:
        raise RuntimeError("attnlab native decode kernel is not available (attnlab.ops.native.build.status())")
    return torch.ops.attnlab_decode


def paged_op():
    """The paged decode operator itself (``torch.ops.attnlab_decode.paged``, same arguments as
    :func:`native_paged_decode`), for callers that have ruled out gradients and tracing."""
    return _lib().paged


@torch.library.custom_op("attnlab::native_paged_decode", mutates_args=())
def native_paged_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    tables: Tensor,
    lens: Tensor,
    kv_start: Tensor,
    q_pos: Tensor,
    kv_len: Tensor | None,
    scale: float,
    band: list[int],
    sinks: int,
    split: int,
) -> tuple[Tensor, Tensor]:
    """``q (B, H, Nq, D)`` over pools ``(Hkv, n_blocks, bs, D)``: row ``b`` holds ``lens[b]`` keys
    in blocks ``tables[b]``, key 0 at absolute ``kv_start[b]``, query 0 at ``q_pos[b]``."""
    out, lse = _lib().paged(
        q, k_pool, v_pool, tables, lens, kv_start, q_pos, kv_len, float(scale), list(band), int(sinks), int(split)
    )
    return out, lse


@native_paged_decode.register_fake
def _paged_fake(q, k_pool, v_pool, tables, lens, kv_start, q_pos, kv_len, scale, band, sinks, split):
    B, H, Nq, _ = q.shape
    return q.new_empty((B, H, Nq, v_pool.shape[-1])), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("attnlab::native_quantized_decode", mutates_args=())
def native_quantized_decode(
    q: Tensor,
    kc: Tensor,
    ks: Tensor,
    kz: Tensor,
    vc: Tensor,
    vs: Tensor,
    vz: Tensor,
    k_tail: Tensor,
    v_tail: Tensor,
    n_groups: int,
    group: int,
    value_group: int,
    bits: int,
    q_offset: int,
    kv_len: Tensor | None,
    scale: float,
    band: list[int],
    sinks: int,
    split: int,
) -> tuple[Tensor, Tensor]:
    """``q (B, H, Nq, D)`` over ``n_groups`` quantized groups of ``group`` tokens (codes
    ``kc``/``vc``, key scales/zeros ``ks``/``kz`` per channel and group, value ones ``vs``/``vz``
    per token and ``value_group`` channels), then the float tail; keys at 0, 1, ...;
    query 0 at ``q_offset``."""
    out, lse = _lib().quantized(
        q,
        kc,
        ks,
        kz,
        vc,
        vs,
        vz,
        k_tail,
        v_tail,
        int(n_groups),
        int(group),
        int(value_group),
        int(bits),
        int(q_offset),
        kv_len,
        float(scale),
        list(band),
        int(sinks),
        int(split),
    )
    return out, lse


@native_quantized_decode.register_fake
def _quantized_fake(q, kc, ks, kz, vc, vs, vz, k_tail, v_tail, *args):
    B, H, Nq, _ = q.shape
    return q.new_empty((B, H, Nq, v_tail.shape[-1])), q.new_empty((B, H, Nq), dtype=torch.float32)


def plan(q, store_dtype, mask, score_mod, backend, B, grads=(), scale=None):
    """``(structure, None)`` when the native decode kernel runs this cache read, else
    ``(None, why)`` (the cache's split-KV path runs)."""
    if backend not in ("auto", "native"):
        return None, f"backend={backend!r}"
    if build.disabled():
        return None, "disabled by ATTNLAB_NATIVE=0"
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[2] == 0:
        return None, "no queries"
    if q.device.type != "cpu":
        return None, f"tensors on {q.device} (the native kernel is CPU only)"
    if q.dtype not in _DTYPES or q.dtype != store_dtype:
        return None, f"q {q.dtype} with a {store_dtype} cache (float32, bfloat16, float16, one dtype)"
    if score_mod is not None:
        return None, "score mods run on the split-KV path"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, *grads)):
        return None, "a gradient is wanted (the decode kernel is inference only)"
    if isinstance(scale, Tensor):
        return None, "a tensor scale (the split-KV path differentiates it)"
    if torch.compiler.is_compiling():
        return None, "inside torch.compile (the split-KV path traces)"
    if torch._C._functorch.is_functorch_wrapped_tensor(q):
        return None, "torch.func transform"
    s = structure_of(mask)
    if s is None:
        return None, f"mask {describe(mask)} has no structure the kernel implements"
    if not s.fields() <= DECODE_IMPLEMENTED:
        return None, f"mask fields {sorted(s.fields() - DECODE_IMPLEMENTED)} are not implemented by the decode kernel"
    if s.kv_len is not None and (
        not isinstance(s.kv_len, Tensor) or s.kv_len.device.type != "cpu" or tuple(s.kv_len.shape) != (B,)
    ):
        return None, "kv_len not a (B,) CPU tensor"
    if build.load() is None:
        return None, "the extension could not be built"
    return s, None
