"""The autograd.Function and the launchers of the Triton kernels.

Host work per call: lower the score mod (:mod:`.scoremods`), fetch the cached plan of
the mask at each kernel's tiling (:mod:`.masking`), and launch.  On a GPU each kernel
is wrapped in ``triton.autotune`` over :func:`.config.candidates` (per head-dim bucket and dtype group) and the pick is written
to :data:`.config.CHOSEN`; under the interpreter the kernels are called directly.
"""

from __future__ import annotations

import weakref

import torch
import triton

from attnlab.ops.finite import all_finite, traced
from attnlab.ops.flash import flash_backward, flash_forward, make_problem, tiled_function
from attnlab.ops.triton import config
from attnlab.ops.triton.backward import attn_bwd_delta, attn_bwd_dq
from attnlab.ops.triton.backward_dkdv import attn_bwd_dkdv
from attnlab.ops.triton.forward import attn_fwd
from attnlab.ops.triton.masking import plan_for
from attnlab.ops.triton.scoremods import lower_score_mod
from attnlab.ops.triton.support import unsupported

_KERNELS = {"fwd": attn_fwd, "dq": attn_bwd_dq, "dkdv": attn_bwd_dkdv, "delta": attn_bwd_delta}
_KEYS = {
    "fwd": ["BM", "BN", "BD", "BDV", "SPARSE", "MT", "ALIBI", "SOFTCAP", "RELBIAS", "DROPOUT"],
    "delta": ["BM", "BDV"],
}
_KEYS["dq"] = _KEYS["dkdv"] = _KEYS["fwd"]
_RESET = {"dq": ["DRTAB"]}  # accumulated with atomics: zeroed before every autotuning trial
_TUNED: dict = {}


def interpreting() -> bool:
    return type(attn_fwd).__name__ == "InterpretedFunction"


def _launch(name, grid, **kw):
    fn = _KERNELS[name]
    if interpreting():
        fn[grid](**kw)
        return
    bd = max(kw.get("BD", 0), kw["BDV"])  # the candidates depend on the head-dim bucket and dtype
    dtype = (kw["Q"] if "Q" in kw else kw["O"]).dtype
    slot = (name, config.bucket(bd), config.group(dtype))
    tuned = _TUNED.get(slot)
    if tuned is None:
        cfgs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in config.candidates(name, bd, dtype)]
        tuned = triton.autotune(cfgs, key=_KEYS[name], reset_to_zero=_RESET.get(name))(fn)
        _TUNED[slot] = tuned
    tuned[grid](**kw)
    key = (*(kw[k] for k in _KEYS[name]), str(dtype))
    config.CHOSEN[(name, key)] = str(tuned.best_config)


def _cdiv(a, b):
    return -(-a // b)


def _bstride(t, dim):
    """The stride of a broadcast dim: 0 when it has size 1 (the kernel reads index b or h)."""
    return t.stride(dim) if t.shape[dim] > 1 else 0


class _Problem:
    """Everything but the tensors: kept on ctx, out of autograd's inputs."""

    def __init__(self, q, k, v, mask, mod, scale, q_offset, kv_offset, block, dropout=None):
        B, H, Nq, D = q.shape
        self.B, self.H, self.Nq, self.D = B, H, Nq, D
        self.Hkv, self.Nk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.mask, self.mod, self.scale = mask, mod, float(scale)
        self.q_offset, self.kv_offset = int(q_offset), int(kv_offset)
        self.device = q.device
        interp = interpreting()
        if block is None and hasattr(mask, "states") and config.valid_tiles((mask.block_q, mask.block_k)):
            block = (mask.block_q, mask.block_k)  # a BlockMask at Triton-sized tiles fixes the tiling
        self.tiles = config.kernel_tiles(D, self.Dv, Nq, self.Nk, interp, block, dtype=q.dtype)
        self.BD, self.BDV = config.head_block(D), config.head_block(self.Dv)
        self.fix_bf16 = interp and q.dtype == torch.bfloat16
        # where the mod's learnable tensors sit among the Function's inputs (``mod.params``)
        self.i_slopes, self.i_table = (
            next((i for i, p in enumerate(mod.params) if p is t), None) for t in (mod.slopes, mod.table)
        )
        self.bind(mod.params)
        self.dropout = dropout  # an attnlab.ops.dropout.Dropout: the kernels hash its counters per tile
        d = dropout
        self.drop_kw = (
            dict(key_r=0, key_c=0, thr=0, inv_keep=1.0, DROPOUT=False)
            if d is None
            else dict(key_r=d.key_r, key_c=d.key_c, thr=d.threshold, inv_keep=d.inv_keep, DROPOUT=True)
        )
        self.score_mod, self._flash = None, None  # the mod itself, for the flash fallback

    def flash(self, q, k):
        """The flash kernel's plan for this problem: the fallback for non-finite inputs."""
        if self._flash is None:
            self._flash, _ = make_problem(
                q,
                k,
                mask=self.mask,
                score_mod=self.score_mod,
                scale=self.scale,
                q_offset=self.q_offset,
                kv_offset=self.kv_offset,
                params=[],
                dropout=self.dropout,
            )
        return self._flash

    def plan(self, kernel):
        if self.mask is None:
            return None
        return plan_for(
            self.mask, self.B, self.H, self.Nq, self.Nk, self.q_offset, self.kv_offset, self.tiles[kernel], self.device
        )

    def bind(self, params):
        """Make the tensors the launches read from the Function's own inputs ``params`` (the
        mod's learnable tensors) and fresh dummies.  Under ``torch.func.grad`` the Function's
        forward sees unwrapped tensors while anything built before ``apply`` (the mod's
        tensors, dummies) is a functorch wrapper, whose storage the kernels cannot read."""
        self.dummy_i = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.dummy_f = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.mod_kw = self._mod_args(params)

    def _mod_args(self, params):
        m, f32 = self.mod, torch.float32
        slopes = m.slopes if self.i_slopes is None else params[self.i_slopes]
        table = m.table if self.i_table is None else params[self.i_table]
        kw = dict(
            SLOPES=self.dummy_f,
            RTAB=self.dummy_f,
            s_rtab=0,
            R=0,
            cap=1.0,
            ALIBI=m.alibi,
            SOFTCAP=m.softcap,
            RELBIAS=m.relbias,
        )
        if m.alibi:
            kw["SLOPES"] = slopes.detach().to(device=self.device, dtype=f32).contiguous()
        if m.relbias:
            t = table.detach().to(device=self.device, dtype=f32).contiguous()
            kw.update(RTAB=t, s_rtab=t.stride(0), R=(t.shape[1] - 1) // 2)
        if m.softcap:
            kw["cap"] = float(m.cap)
        return kw

    def mask_args(self, plan, direction):
        """Launch arguments for the block lists (``direction`` "kv" or "q") and the mask spec."""
        di = self.dummy_i
        kw: dict[str, object] = {}
        kw.update(
            band_lo=0,
            band_hi=0,
            sink_n=0,
            sink_lo=0,
            QIDS=di,
            s_qids=0,
            KVIDS=di,
            s_kvids=0,
            KEEP=di,
            s_keep=0,
            TID=di,
            TAB=di,
            s_tab_t=0,
            s_tab_b=0,
            s_tab_h=0,
            MB=False,
            MS=False,
            MD=False,
            MK=False,
            MT=False,
            W=1,
            LISTS=di,
            slb=0,
            slh=0,
            slr=0,
            SPARSE=plan is not None,
        )
        if plan is None:
            return kw
        lists = plan.kv_lists if direction == "kv" else plan.q_lists
        kw.update(LISTS=lists, slb=_bstride(lists, 0), slh=_bstride(lists, 1), slr=lists.stride(2))
        spec = plan.spec
        if spec.band is not None:
            kw.update(band_lo=spec.band[0], band_hi=spec.band[1], MB=True)
            if spec.sink is not None:
                kw.update(sink_n=spec.sink[0], sink_lo=spec.sink[1], MS=True)
        if spec.q_ids is not None:
            kw.update(
                QIDS=spec.q_ids,
                s_qids=_bstride(spec.q_ids, 0),
                KVIDS=spec.kv_ids,
                s_kvids=_bstride(spec.kv_ids, 0),
                MD=True,
            )
        if spec.keep is not None:
            kw.update(KEEP=spec.keep, s_keep=_bstride(spec.keep, 0), MK=True)
        if spec.table is not None:
            t = spec.table
            kw.update(
                TID=spec.tile_id,
                TAB=t,
                s_tab_t=t.stride(0),
                s_tab_b=_bstride(t, 1),
                s_tab_h=_bstride(t, 2),
                W=t.shape[-1],
                MT=True,
            )
        return kw

    def common(self, kernel, direction):
        BM, BN = self.tiles[kernel]
        plan = self.plan(kernel)
        return (
            BM,
            BN,
            dict(
                H=self.H,
                G=self.H // self.Hkv,
                Nq=self.Nq,
                Nk=self.Nk,
                D=self.D,
                Dv=self.Dv,
                q_offset=self.q_offset,
                kv_offset=self.kv_offset,
                scale=self.scale,
                n_kv_blocks=_cdiv(self.Nk, BN),
                BM=BM,
                BN=BN,
                BD=self.BD,
                BDV=self.BDV,
                EVEN_N=self.Nk % BN == 0,
                UPCAST=self.fix_bf16,
                FIX_BF16=self.fix_bf16,
                **self.mask_args(plan, direction),
                **self.mod_kw,
                **self.drop_kw,
            ),
        )


def _forward(pb: _Problem, q, k, v, *params):
    pb.bind(params)
    B, H, Nq = pb.B, pb.H, pb.Nq
    out = torch.empty(B, H, Nq, pb.Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    BM, _, kw = pb.common("fwd", "kv")
    _launch(
        "fwd",
        (_cdiv(Nq, BM), B * H),
        Q=q,
        K=k,
        V=v,
        O=out,
        LSE=lse,
        **_strides("sq", q),
        **_strides("sk", k),
        **_strides("sv", v),
        **_strides("so", out),
        **kw,
    )
    if not bool(torch.isfinite(out).all()):
        # 0·NaN in P·V from a hidden key's value (or a visible NaN): the flash kernel's careful
        # path skips hidden entries exactly (attnlab.ops.finite); one check per call otherwise
        return flash_forward(pb.flash(q, k), q, k, v)
    return out, lse


def _strides(prefix, t):
    return {
        f"{prefix}{c}": s
        for c, s in zip("bhmd" if prefix in ("sq", "so", "sd", "sg") else "bhnd", t.stride(), strict=True)
    }


def _backward(pb: _Problem, q, k, v, out, lse, dout, dlse, params):
    B, H, Nq, Nk = pb.B, pb.H, pb.Nq, pb.Nk
    delta = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    BMd = 64 if not interpreting() else 32
    _launch(
        "delta",
        (_cdiv(Nq, BMd), B * H),
        O=out,
        DO=dout,
        DLSE=pb.dummy_f if dlse is None else dlse.to(torch.float32).contiguous(),
        DELTA=delta,
        sob=out.stride(0),
        soh=out.stride(1),
        som=out.stride(2),
        sod=out.stride(3),
        sdb=dout.stride(0),
        sdh=dout.stride(1),
        sdm=dout.stride(2),
        sdd=dout.stride(3),
        H=H,
        Nq=Nq,
        Dv=pb.Dv,
        BM=BMd,
        BDV=pb.BDV,
        HAS_DLSE=dlse is not None,
    )
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    m = pb.mod
    pb.bind(params)
    alibi_grad = bool(m.alibi) and pb.i_slopes is not None and pb.i_slopes < len(params)
    rel_grad = bool(m.relbias) and pb.i_table is not None and pb.i_table < len(params)
    table = m.table if not rel_grad else params[pb.i_table]

    BM, BN, kw = pb.common("dq", "kv")
    nqb = _cdiv(Nq, BM)
    dslope = torch.zeros(B * H, nqb, dtype=torch.float32, device=q.device) if alibi_grad else pb.dummy_f
    drtab = torch.zeros(table.shape, dtype=torch.float32, device=q.device) if rel_grad else pb.dummy_f
    _launch(
        "dq",
        (nqb, B * H),
        Q=q,
        K=k,
        V=v,
        DO=dout,
        DQ=dq,
        LSE=lse,
        DELTA=delta,
        **_strides("sq", q),
        **_strides("sk", k),
        **_strides("sv", v),
        **_strides("sd", dout),
        **_strides("sg", dq),
        n_q_blocks=nqb,
        DSLOPE=dslope,
        DRTAB=drtab,
        s_drtab=drtab.stride(0) if rel_grad else 0,
        ALIBI_GRAD=bool(alibi_grad),
        RELBIAS_GRAD=bool(rel_grad),
        **kw,
    )

    BM, BN, kw = pb.common("dkdv", "q")
    nkb = _cdiv(Nk, BN)
    _launch(
        "dkdv",
        (nkb, B * pb.Hkv),
        Q=q,
        K=k,
        V=v,
        DO=dout,
        DK=dk,
        DV=dv,
        LSE=lse,
        DELTA=delta,
        **_strides("sq", q),
        **_strides("sk", k),
        **_strides("sv", v),
        **_strides("sd", dout),
        skgb=dk.stride(0),
        skgh=dk.stride(1),
        skgn=dk.stride(2),
        skgd=dk.stride(3),
        svgb=dv.stride(0),
        svgh=dv.stride(1),
        svgn=dv.stride(2),
        svgd=dv.stride(3),
        Hkv=pb.Hkv,
        n_q_blocks=_cdiv(Nq, BM),
        **kw,
    )

    dparams = []
    for i, p in enumerate(params):
        if alibi_grad and i == pb.i_slopes:
            g = dslope.view(B, H, -1).sum((0, 2))
        elif rel_grad and i == pb.i_table:
            g = drtab
        else:
            g = torch.zeros_like(p)
        dparams.append(g.to(device=p.device, dtype=p.dtype))
    if not all_finite(dq, dk, dv, *dparams):
        return flash_backward(pb.flash(q, k), q, k, v, out, lse, dout, dlse, params)
    return dq, dk, dv, dparams


# ----------------------------------------------------------------------------- torch.func
# Under torch.func.grad the backward runs *inside* the transform, on functorch wrappers
# (GradTrackingTensor, BatchedTensor under vmap(grad)), whose storage a Triton kernel cannot
# read.  There the backward goes through an operator: the dispatcher unwraps its inputs
# (and a vmap rule loops over the mapped dimension), as for attnlab::flash_bwd.  The plan
# ``pb`` is not a tensor: it travels as a handle into ``_HANDLES`` (held while ctx holds it).
_HANDLES: weakref.WeakValueDictionary[int, _Problem] = weakref.WeakValueDictionary()


@torch.library.custom_op("attnlab::triton_bwd", mutates_args=())
def triton_bwd(
    handle: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    params: list[torch.Tensor],
) -> list[torch.Tensor]:
    """The Triton backward as an operator: ``[dq, dk, dv, *dparams]``."""
    pb = _HANDLES[handle]
    dq, dk, dv, dparams = _backward(pb, q, k, v, out, lse, dout, dlse, list(params))
    return [t.contiguous() for t in (dq, dk, dv, *dparams)]


@triton_bwd.register_fake
def _triton_bwd_fake(handle, q, k, v, out, lse, dout, dlse, params):
    return [t.new_empty(t.shape) for t in (q, k, v, *params)]


def _triton_bwd_vmap(info, in_dims, handle, *args):
    res = []
    for i in range(info.batch_size):
        sl = []
        for a, d in zip(args, in_dims[1:], strict=True):
            if isinstance(a, (list, tuple)):
                sl.append([x if dx is None else x.select(dx, i) for x, dx in zip(a, d or [None] * len(a), strict=True)])
            else:
                sl.append(a if d is None or a is None else a.select(d, i))
        res.append(torch.ops.attnlab.triton_bwd(handle, *sl))
    return [torch.stack([r[j] for r in res]) for j in range(len(res[0]))], [0] * len(res[0])


torch.library.register_vmap("attnlab::triton_bwd", _triton_bwd_vmap)


def _backward_any_level(pb, q, k, v, out, lse, dout, dlse, params):
    if not traced(q, k, v, out, lse, dout, *([] if dlse is None else [dlse]), *params):
        return _backward(pb, q, k, v, out, lse, dout, dlse, params)
    _HANDLES[id(pb)] = pb
    dq, dk, dv, *dparams = torch.ops.attnlab.triton_bwd(id(pb), q, k, v, out, lse, dout, dlse, list(params))
    return dq, dk, dv, dparams


_TritonAttention = tiled_function(_forward, _backward_any_level, "_TritonAttention")


def triton_attention(q, k, v, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0, block=None, dropout=None):
    """Attention on the Triton kernels, forward and backward.  Returns ``(out, lse)``.

    Inputs as validated by :func:`attnlab.attention`; ``mask`` is a Mask, a BlockMask
    or None.  ``block=(BM, BN)`` (powers of two, 16..256) sets every kernel's tiles; a
    BlockMask built at such tiles sets them too (and is used as is), any other
    BlockMask is re-classified at the kernels' own tiles.  ``dropout`` (an
    :class:`attnlab.ops.dropout.Dropout` or None): the kernels regenerate its keep-mask
    per tile from the counters, the same bits as the reference and the flash path.
    Raises ``ValueError`` when the kernels cannot serve the request (see
    :func:`attnlab.ops.triton.unsupported`).
    """
    why = unsupported(q, k, v, mask, score_mod, q_offset, kv_offset)
    if why is not None:
        raise ValueError(f"backend='triton': {why}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        from attnlab.ops.flash import flash_attention

        return flash_attention(
            q,
            k,
            v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            dropout=dropout,
        )
    mod = lower_score_mod(score_mod)
    if isinstance(mod, str):  # (unsupported() above has said so already)
        raise ValueError(f"backend='triton': {mod}")
    pb = _Problem(q, k, v, mask, mod, scale, q_offset, kv_offset, block, dropout)
    pb.score_mod = score_mod
    return _TritonAttention.apply(pb, q, k, v, *mod.params)
