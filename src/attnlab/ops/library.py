"""The flash kernel as PyTorch operators: ``torch.ops.attnlab.flash_fwd`` / ``flash_bwd``.

Registered with :func:`torch.library.custom_op` (as flash-attn's interface does), each
with a fake (meta) implementation, the backward tied on with ``register_autograd`` /
``setup_context``, and a vmap rule.  So ``torch.compile(fullgraph=True)`` and
``torch.export`` see one opaque node per call, where the eager kernel's Python (tile
planning, finiteness checks, the choice of fused path) would graph-break, and
``torch.func.grad`` / ``vmap`` compose with it.

Masks and score mods are objects; an operator takes tensors, ints, floats and strings.
A built-in is passed by its *structural key* (:func:`attnlab.masks.mask_key`,
:func:`attnlab.scores.mod_key`): a spec string such as ``and(causal,sliding_window(i0))``,
the tensors it reads (document ids, ALiBi slopes, bias tables: op inputs, so learnable
ones get gradients) and its ints (op inputs too: SymInts under dynamic shapes).  The
kernel rebuilds the mask from the key (cached per key, so classified tiles are reused).

Schema (``ints`` are the mask's; a mod's floats are written into its spec)::

    flash_fwd(q, k, v, mask_spec, mask_tensors, mod_spec, mod_tensors, ints,
              scale, q_offset, kv_offset, block, dropout_p, dropout_seed, seed_tensor?) -> (out, lse)
    flash_bwd(dout, dlse?, q, k, v, out, lse, <same>) -> (dq, dk, dv, dmod_tensors)

``seed_tensor`` (0-d int64, replaces ``dropout_seed``) is a seed drawn inside a compiled
graph (``dropout_seed=None`` under torch.compile), where ``int()`` of it would graph-break.

Double backward (``create_graph=True`` through ``flash_bwd``) is refused with an error
that names ``backend="reference"`` (docs/compile.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.masks import BlockMask, cache as mask_cache, mask_from_key, mask_key
from attnlab.ops import flops
from attnlab.ops.flash import (
    DOUBLE_BACKWARD,
    DoubleBackwardError,
    flash_backward,
    flash_forward,
    make_problem,
    refuse_double_backward,
)
from attnlab.ops.reference import acc_dtype


def _tensor_id(t: Tensor):
    return (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def _mask(spec: str, tensors, ints):
    if not spec:
        return None
    key = (spec, tuple(int(i) for i in ints), tuple(_tensor_id(t) for t in tensors))
    hit = mask_cache.rebuilt.get(key)
    if hit is not None:
        return hit[0]
    m = mask_from_key(spec, list(tensors), [int(i) for i in ints])
    mask_cache.rebuilt.put(key, (m, list(tensors)))  # the tensors stay alive while their key is cached
    return m


def _mod(spec: str, tensors):
    if not spec:
        return None
    from attnlab.scores import mod_from_key

    return mod_from_key(spec, list(tensors), [])


def op_problem(q, k, mask_spec, mask_tensors, ints, mod, scale, q_offset, kv_offset, block, params):
    """The flash kernel's problem of an op call: the mask and mod rebuilt from their keys
    (:func:`attnlab.ops.flash.make_problem`; ``block`` a ``(bq, bk)`` pair or empty)."""
    mask = _mask(mask_spec, mask_tensors, ints)
    if block:
        bq, bk = int(block[0]), int(block[1])
        if mask is not None and q.shape[2] > 0 and k.shape[2] > 0:
            mask = mask.block_mask(
                q.shape[0],
                q.shape[1],
                q.shape[2],
                k.shape[2],
                q_offset=int(q_offset),
                kv_offset=int(kv_offset),
                block=(bq, bk),
            )
        block = (bq, bk)
    pb, _ = make_problem(
        q,
        k,
        mask=mask,
        score_mod=mod,
        scale=scale,
        q_offset=int(q_offset),
        kv_offset=int(kv_offset),
        block=block or None,
        params=params,
    )
    pb.check_graph = None  # the mod was rebuilt from its key: it reads only its own tensors
    return pb


def _signed64(seed: int) -> int:
    """A seed in ``[-2**63, 2**64)`` as the int64 with the same value mod 2**64 (the hash reads
    only the seed's 64 bits)."""
    seed = int(seed) & ((1 << 64) - 1)
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _dropout(p: float, seed: int, seed_tensor=None):
    if not p:
        return None
    from attnlab.ops.dropout import Dropout

    if seed_tensor is not None:  # drawn inside a compiled graph (dropout_seed=None): a 0-d int64 tensor
        seed = int(seed_tensor)
    return Dropout(p, int(seed) & ((1 << 64) - 1))


class _autograd_inside:
    """Autograd recording inside an operator's kernel: the dispatcher runs a custom op's
    implementation below the autograd keys, but the tiled backward differentiates the score
    mod tile by tile with ``torch.autograd.grad`` (:mod:`attnlab.ops.modparams`)."""

    _KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")

    def __enter__(self):
        self.prev = []
        for name in self._KEYS:
            key = getattr(torch._C.DispatchKey, name, None)
            if key is not None:
                self.prev.append((key, torch._C._dispatch_tls_is_dispatch_key_excluded(key)))
                torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        return self

    def __exit__(self, *exc):
        for key, was in self.prev:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)
        return False


@torch.library.custom_op("attnlab::flash_fwd", mutates_args=())
def flash_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_spec: str,
    mask_tensors: list[Tensor],
    mod_spec: str,
    mod_tensors: list[Tensor],
    ints: list[int],
    scale: float,
    q_offset: int,
    kv_offset: int,
    block: list[int],
    dropout_p: float,
    dropout_seed: int,
    seed_tensor: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Tiled forward: ``(out (B, H, Nq, Dv), lse (B, H, Nq) float32/64)``."""
    with torch.no_grad():
        pb = op_problem(
            q, k, mask_spec, mask_tensors, ints, _mod(mod_spec, mod_tensors), scale, q_offset, kv_offset, block, []
        )
        pb.dropout = _dropout(dropout_p, dropout_seed, seed_tensor)
        out, lse = flash_forward(pb, q, k, v)
        return out.contiguous(), lse.contiguous()


@flash_fwd.register_fake
def _flash_fwd_fake(
    q,
    k,
    v,
    mask_spec,
    mask_tensors,
    mod_spec,
    mod_tensors,
    ints,
    scale,
    q_offset,
    kv_offset,
    block,
    dropout_p,
    dropout_seed,
    seed_tensor=None,
):
    B, H, Nq, _ = q.shape
    return q.new_empty((B, H, Nq, v.shape[-1])), q.new_empty((B, H, Nq), dtype=acc_dtype(q.dtype))


@torch.library.custom_op("attnlab::flash_bwd", mutates_args=())
def flash_bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask_spec: str,
    mask_tensors: list[Tensor],
    mod_spec: str,
    mod_tensors: list[Tensor],
    ints: list[int],
    scale: float,
    q_offset: int,
    kv_offset: int,
    block: list[int],
    dropout_p: float,
    dropout_seed: int,
    seed_tensor: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Tiled backward: ``(dq, dk, dv, [d mod_tensors[i]])`` (zeros for a tensor the mod
    does not differentiate)."""
    leaves = [t.detach().requires_grad_(t.dtype.is_floating_point) for t in mod_tensors]
    params = [t for t in leaves if t.requires_grad]
    with torch.no_grad():
        pb = op_problem(
            q, k, mask_spec, mask_tensors, ints, _mod(mod_spec, leaves), scale, q_offset, kv_offset, block, params
        )
        pb.dropout = _dropout(dropout_p, dropout_seed, seed_tensor)
    q, k, v, out, lse, dout = (t.detach() for t in (q, k, v, out, lse, dout))
    dlse = None if dlse is None else dlse.detach()
    with _autograd_inside():  # only the mod's leaves require grad: nothing else records a graph
        dq, dk, dv, dparams = flash_backward(pb, q, k, v, out, lse, dout, dlse, params)
    it = iter(dparams)
    dmod = [next(it).detach().contiguous() if t.requires_grad else t.new_zeros(t.shape) for t in leaves]
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dmod


@flash_bwd.register_fake
def _flash_bwd_fake(
    dout,
    dlse,
    q,
    k,
    v,
    out,
    lse,
    mask_spec,
    mask_tensors,
    mod_spec,
    mod_tensors,
    ints,
    scale,
    q_offset,
    kv_offset,
    block,
    dropout_p,
    dropout_seed,
    seed_tensor=None,
):
    # contiguous, as the kernel returns them (inductor checks the strides against the fake's)
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        [t.new_empty(t.shape) for t in mod_tensors],
    )


def _setup_context(ctx, inputs, output):
    (
        q,
        k,
        v,
        mask_spec,
        mask_tensors,
        mod_spec,
        mod_tensors,
        ints,
        scale,
        q_offset,
        kv_offset,
        block,
        dropout_p,
        dropout_seed,
        *seed,
    ) = inputs
    out, lse = output
    seed = [t for t in seed if t is not None]
    ctx.save_for_backward(q, k, v, out, lse, *mask_tensors, *mod_tensors, *seed)
    # the dispatcher drops an argument equal to its default (seed_tensor=None) from the inputs
    # whose gradients the backward returns (setup_context sees it filled back in)
    ctx.n_mask, ctx.n_seed, ctx.n_inputs = len(mask_tensors), len(seed), len(inputs) - 1 + len(seed)
    ctx.args = (mask_spec, mod_spec, ints, scale, q_offset, kv_offset, block, dropout_p, dropout_seed)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    seed = rest[len(rest) - ctx.n_seed :] if ctx.n_seed else []
    rest = rest[: len(rest) - ctx.n_seed]
    mask_tensors, mod_tensors = rest[: ctx.n_mask], rest[ctx.n_mask :]
    mask_spec, mod_spec, ints, scale, q_offset, kv_offset, block, dropout_p, dropout_seed = ctx.args
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dout, dlse, q, k, v, *mod_tensors)):
        raise DoubleBackwardError(DOUBLE_BACKWARD.format("flash backend"))
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dmod = torch.ops.attnlab.flash_bwd(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        mask_spec,
        list(mask_tensors),
        mod_spec,
        list(mod_tensors),
        ints,
        scale,
        q_offset,
        kv_offset,
        block,
        dropout_p,
        dropout_seed,
        *seed,
    )
    grads = (
        dq,
        dk,
        dv,
        None,
        [None] * len(mask_tensors),
        None,
        list(dmod),
        _no_grad(ints),
        None,
        None,
        None,
        _no_grad(block),
        None,
        None,
        None,
    )
    return grads[: ctx.n_inputs]


def _no_grad(xs):
    """The backward's "no gradient" for a list input: autograd reads an empty list as a
    list of tensors (wants ``[]``), a list of ints as one leaf (wants None)."""
    return [] if len(xs) == 0 else None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- FLOPs
flops.install()  # the ops' formulas for torch.utils.flop_counter (attnlab.ops.flops)


# ----------------------------------------------------------------------------- vmap
def _loop_rule(op):
    """vmap by a loop over the mapped dimension (masks read the batch index ``b``, so the
    mapped dimension cannot simply be folded into B)."""

    def rule(info, in_dims, *args):
        outs = []
        for i in range(info.batch_size):
            sl: list = []
            for a, d in zip(args, in_dims, strict=True):
                if isinstance(a, (list, tuple)) and isinstance(d, (list, tuple)):
                    sl.append([x if dx is None else x.select(dx, i) for x, dx in zip(a, d, strict=True)])
                elif d is not None and isinstance(a, Tensor):
                    sl.append(a.select(d, i))
                else:
                    sl.append(a)
            outs.append(op(*sl))
        res: list = []
        dims: list = []
        for j in range(len(outs[0])):
            col = [o[j] for o in outs]
            if isinstance(col[0], (list, tuple)):
                res.append([torch.stack([c[n] for c in col]) for n in range(len(col[0]))])
                dims.append([0] * len(col[0]))
            else:
                res.append(torch.stack(col))
                dims.append(0)
        return tuple(res), tuple(dims)

    return rule


torch.library.register_vmap("attnlab::flash_fwd", _loop_rule(torch.ops.attnlab.flash_fwd))
torch.library.register_vmap("attnlab::flash_bwd", _loop_rule(torch.ops.attnlab.flash_bwd))


# ----------------------------------------------------------------------------- entry
def op_args(q, k, mask, score_mod, q_offset, kv_offset, block=None):
    """The operator's non-``q/k/v`` arguments for ``mask``/``score_mod``, or None when one
    has no structural key (``custom``)."""
    if isinstance(mask, BlockMask):  # a BlockMask: its mask and tile sizes
        block = (mask.block_q, mask.block_k)
        mask = mask.mask
    mk = ("", [], []) if mask is None else mask_key(mask)
    sk: tuple | None = ("", [], []) if score_mod is None else (score_mod.key() if hasattr(score_mod, "key") else None)
    if mk is None or sk is None:
        return None
    return (
        mk[0],
        list(mk[1]),
        sk[0],
        list(sk[1]),
        list(mk[2]),
        q_offset,
        kv_offset,
        [] if block is None else [int(block[0]), int(block[1])],
    )


class _FlashOp(torch.autograd.Function):
    """The two operators as one autograd.Function (``setup_context``, generated vmap rule:
    it runs the forward under vmap, where the operators' own vmap rules apply), so
    ``torch.func.grad``/``vmap`` compose with it: a custom op's ``register_autograd`` alone
    is not seen by torch.func.  ``meta`` holds the non-tensor arguments; the tensors are
    ``q, k, v, *mask_tensors, *mod_tensors``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(meta, q, k, v, *tensors):
        mask_spec, mod_spec, n_mask, ints, scale, q_offset, kv_offset, block, dp, ds, n_seed = meta
        tensors, seed = _split_seed(tensors, n_seed)
        with torch.no_grad():  # this Function is the autograd (torch.func sees it, not the op's)
            return torch.ops.attnlab.flash_fwd(
                q,
                k,
                v,
                mask_spec,
                list(tensors[:n_mask]),
                mod_spec,
                list(tensors[n_mask:]),
                ints,
                scale,
                q_offset,
                kv_offset,
                block,
                dp,
                ds,
                *seed,
            )

    @staticmethod
    def setup_context(ctx, inputs, output):
        meta, q, k, v, *tensors = inputs
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, *output, *tensors)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        mask_spec, mod_spec, n_mask, ints, scale, q_offset, kv_offset, block, dp, ds, n_seed = ctx.meta
        tensors, seed = _split_seed(tensors, n_seed)
        if dout is None:
            dout = torch.zeros_like(out)
        with torch.no_grad():
            dq, dk, dv, dmod = torch.ops.attnlab.flash_bwd(
                dout,
                dlse,
                q,
                k,
                v,
                out,
                lse,
                mask_spec,
                list(tensors[:n_mask]),
                mod_spec,
                list(tensors[n_mask:]),
                ints,
                scale,
                q_offset,
                kv_offset,
                block,
                dp,
                ds,
                *seed,
            )
        grads = refuse_double_backward("flash backend", (q, k, v, dout, dlse, *tensors), [dq, dk, dv, *dmod])
        return (None, *grads[:3], *([None] * n_mask), *grads[3:], *([None] * n_seed))


def _split_seed(tensors, n_seed):
    """``(tensors, [seed tensor])``: a seed drawn in a compiled graph rides last among the tensors."""
    if not n_seed:
        return tensors, []
    return tensors[:-1], [tensors[-1]]


def flash_op(q, k, v, args, scale, dropout=None):
    """``(out, lse)`` through ``torch.ops.attnlab.flash_fwd``; ``args`` from :func:`op_args`;
    ``dropout`` an :class:`attnlab.ops.dropout.Dropout` (its p and seed travel as op inputs)."""
    mask_spec, mask_tensors, mod_spec, mod_tensors, ints, q_offset, kv_offset, block = args
    seed = []
    if dropout is None:
        dp, ds = 0.0, 0
    elif isinstance(dropout.seed, Tensor):  # drawn in a compiled graph: an op input, not an int
        dp, ds, seed = float(dropout.p), 0, [dropout.seed]
    else:
        dp, ds = float(dropout.p), _signed64(dropout.seed)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *mod_tensors))):
        # no gradient wanted: the operator itself (dynamo mis-inlines a setup_context-style
        # Function whose inputs need no grad)
        return torch.ops.attnlab.flash_fwd(
            q,
            k,
            v,
            mask_spec,
            mask_tensors,
            mod_spec,
            mod_tensors,
            ints,
            float(scale),
            q_offset,
            kv_offset,
            block,
            dp,
            ds,
            *seed,
        )
    meta = (mask_spec, mod_spec, len(mask_tensors), ints, float(scale), q_offset, kv_offset, block, dp, ds, len(seed))
    ts = [q, k, v, *mask_tensors, *mod_tensors, *seed]
    for i in range(1, len(ts)):  # one tensor passed twice (q, q, q): distinct views (dynamo refuses duplicates)
        if any(ts[i] is t for t in ts[:i]):
            ts[i] = ts[i].view_as(ts[i])
    return _FlashOp.apply(meta, *ts)


__all__ = ["flash_fwd", "flash_bwd", "flash_op", "op_args", "DoubleBackwardError"]
