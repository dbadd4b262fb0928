"""Hook points: named places in a forward pass where a function may read or replace a tensor.

A :class:`HookPoint` is a plain object (not a module: no parameters, nothing in the state
dict or the module tree) holding a list of functions ``fn(tensor) -> None | tensor``.
With the list empty — always, unless :mod:`attnlab.interp` installed something — calling
it returns its argument: no tensor is kept, no kernel is changed, no pattern is formed.
The names (``blocks.0.attn.hook_z`` ...) are given by :func:`attnlab.interp.hook_names`;
this module only holds the mechanics.

Layouts follow TransformerLens: ``hook_q (B, N, H, d_head)``, ``hook_k``/``hook_v
(B, N, Hkv, d_head)``, ``hook_z (B, N, H, d_head)``, ``hook_attn_scores``/``hook_pattern
(B, H, Nq, Nk)``, ``hook_result (B, N, H, d_model)``.  attnlab's attention works in
``(B, H, N, d)``; the transposes are views.

:class:`AttentionPoints` runs an attention layer's points.  Its ``scores``, ``pattern``
and ``result`` points are *lazy*: nothing is computed for them unless a function is
installed on them; then the pattern is recomputed from q and k (the fast op still ran),
and an edited pattern (or edited scores) recomputes that layer's ``z = pattern · v``.

>>> import torch
>>> hp = HookPoint()
>>> x = torch.ones(2)
>>> hp(x) is x
True
>>> hp.fns.append(lambda t: t * 3)
>>> hp(x).tolist()
[3.0, 3.0]
"""

from __future__ import annotations

import torch

__all__ = ["HookPoint", "AttentionPoints", "NormPoints"]


class HookPoint:
    """A list of functions run on one tensor; each may return a replacement of the same shape."""

    __slots__ = ("fns",)

    def __init__(self):
        self.fns: list = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fns:
            return x
        for fn in tuple(self.fns):
            r = fn(x)
            if r is not None:
                if not isinstance(r, torch.Tensor) or r.shape != x.shape:
                    got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                    raise ValueError(f"hook {fn!r}: must return None or a tensor of shape {tuple(x.shape)}, got {got}")
                x = r
        return x

    def __reduce__(self):  # a copied or pickled model starts without hooks
        return (HookPoint, ())

    def __repr__(self):
        return f"HookPoint({len(self.fns)} fns)"


def _bhnd(hp: HookPoint, t: torch.Tensor) -> torch.Tensor:
    """Run ``hp`` on ``t (B, H, N, d)`` seen as ``(B, N, H, d)``; back to ``(B, H, N, d)``."""
    return hp(t.transpose(1, 2)).transpose(1, 2) if hp.fns else t


def pattern_times_v(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``z = p · v`` for ``p (B, H, Nq, Nk)`` and ``v (B, Hkv, Nk, d)`` (GQA: query head h reads kv head
    ``h // (H // Hkv)``), in ``v``'s dtype."""
    G = p.shape[1] // v.shape[1]
    vr = v.repeat_interleave(G, dim=1) if G > 1 else v
    return torch.matmul(p.to(v.dtype), vr)


class AttentionPoints:
    """The hook points of one attention layer (attnlab's :class:`MultiHeadAttention`, or a
    transformers attention module through :mod:`attnlab.models.bridge`).

    ``hook_q``/``hook_k``/``hook_v``: the projections, before positions (RoPE);
    ``hook_rot_q``/``hook_rot_k``: after RoPE (models with RoPE only);
    ``hook_attn_scores``: ``scale·q kᵀ + score mods``, masked entries ``-inf`` (float32);
    ``hook_pattern``: the softmax of the scores (float32; fully masked rows 0);
    ``hook_z``: per-head outputs before W_O; ``hook_result``: per-head outputs through W_O.
    """

    NAMES = (
        "hook_q",
        "hook_k",
        "hook_v",
        "hook_rot_q",
        "hook_rot_k",
        "hook_attn_scores",
        "hook_pattern",
        "hook_z",
        "hook_result",
    )
    __slots__ = (*NAMES, "bridge_stage")
    hook_q: HookPoint
    hook_k: HookPoint
    hook_v: HookPoint
    hook_rot_q: HookPoint
    hook_rot_k: HookPoint
    hook_attn_scores: HookPoint
    hook_pattern: HookPoint
    hook_z: HookPoint
    hook_result: HookPoint

    def __init__(self):
        for n in self.NAMES:
            setattr(self, n, HookPoint())
        #: transformers models: which of q/k/v ("qkv", no RoPE) or rot_q/rot_k ("rot") the bridge's
        #: attention function runs (see attnlab.models.hf_points)
        self.bridge_stage = "qkv"

    def __reduce__(self):  # a copied or pickled model starts without hooks
        return (AttentionPoints, ())

    def qkv_active(self) -> bool:
        return bool(self.hook_q.fns or self.hook_k.fns or self.hook_v.fns)

    def rot_active(self) -> bool:
        return bool(self.hook_rot_q.fns or self.hook_rot_k.fns)

    def post_active(self) -> bool:
        return bool(self.hook_attn_scores.fns or self.hook_pattern.fns)

    def active(self) -> bool:
        return bool(
            self.qkv_active() or self.rot_active() or self.post_active() or self.hook_z.fns or self.hook_result.fns
        )

    def qkv(self, q, k, v):
        """q ``(B, H, N, d)``, k/v ``(B, Hkv, N, d)`` through hook_q/k/v."""
        return _bhnd(self.hook_q, q), _bhnd(self.hook_k, k), _bhnd(self.hook_v, v)

    def rot(self, q, k):
        return _bhnd(self.hook_rot_q, q), _bhnd(self.hook_rot_k, k)

    def scores_and_pattern(self, call) -> torch.Tensor:
        """Run hook_attn_scores then hook_pattern on ``call`` (an AttentionCall); returns z,
        recomputed as ``pattern · v`` when either was edited, else ``call.z``."""
        edited = False
        if self.hook_attn_scores.fns:
            s = call.scores()
            v0 = s._version
            s2 = self.hook_attn_scores(s)
            edited = s2 is not s or s._version != v0  # replaced, or edited in place
            p = torch.softmax(s2, dim=-1).nan_to_num(0.0)  # fully masked rows: 0
        elif self.hook_pattern.fns:
            p = call.pattern()
        else:
            return call.z
        if self.hook_pattern.fns:
            v0 = p._version
            p2 = self.hook_pattern(p)
            edited = edited or p2 is not p or p._version != v0
            p = p2
        if not edited:
            return call.z
        return pattern_times_v(p, call.v).to(call.z.dtype)

    def z(self, z):
        """``z (B, H, N, d)`` through hook_z."""
        return _bhnd(self.hook_z, z)

    def result(self, z, W_O, b_O):
        """Run hook_result (``(B, N, H, d_model)``, the per-head terms ``z_h W_O[h]``) on ``z (B, H, N, d)``
        with ``W_O [H, d, d_model]``; returns ``out = Σ_h result + b_O (B, N, d_model)`` if a hook edited the
        result (returned a tensor or wrote into it), else ``None`` (the caller's usual projection stands)."""
        r = torch.einsum("bhnd,hdm->bnhm", z, W_O.to(z.dtype))
        v0 = r._version
        r2 = self.hook_result(r)
        if r2 is r and r._version == v0:
            return None
        out = r2.sum(2)
        return out if b_O is None else out + b_O


class NormPoints:
    """``hook_scale (B, N, 1)`` and ``hook_normalized (B, N, d_model)`` of one norm (TransformerLens'
    LayerNorm convention: ``scale = sqrt(mean((x − mean x)²) + eps)`` — for RMSNorm
    ``sqrt(mean(x²) + eps)`` — and ``normalized`` is the norm's output, weight and bias applied).

    :meth:`__call__` runs the norm module unchanged; when ``hook_scale`` has functions it computes the
    scale for them, and if one edits it, the norm by hand from the edited scale."""

    __slots__ = ("hook_normalized", "hook_scale")

    def __init__(self):
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def __reduce__(self):  # a copied or pickled model starts without hooks
        return (NormPoints, ())

    def __call__(self, norm, x):
        if not self.hook_scale.fns:
            return self.hook_normalized(norm(x))
        return self.hook_normalized(scaled_norm(norm, x, self.hook_scale))


def _eps(norm) -> float:
    eps = getattr(norm, "eps", None)
    return norm.variance_epsilon if eps is None else eps  # transformers' RMSNorms


def _is_layer_norm(norm) -> bool:
    return hasattr(norm, "normalized_shape")  # torch LayerNorm (centres); RMSNorms do not


def norm_scale(norm, x):
    """The scale ``(..., 1)`` the norm divides its (centred, for LayerNorm) input by, in float32 (float64
    stays), for a torch LayerNorm, attnlab's RMSNorm or transformers' RMSNorms: one fused reduction."""
    h = x if x.dtype == torch.float64 else x.float()
    if _is_layer_norm(norm):
        ms = torch.var(h, dim=-1, correction=0, keepdim=True)
    else:
        ms = torch.linalg.vector_norm(h, 2, dim=-1, keepdim=True).square_().div_(h.shape[-1])
    return (ms + _eps(norm)).sqrt_()


def normalize(norm, x, scale=None):
    """``norm(x)`` by hand from the scale (default: its own, :func:`norm_scale`)."""
    h = x if x.dtype == torch.float64 else x.float()
    if _is_layer_norm(norm):
        h = h - h.mean(-1, keepdim=True)
    y = (h / (norm_scale(norm, x) if scale is None else scale)).to(x.dtype)
    if getattr(norm, "weight", None) is not None:
        y = norm.weight * y
    if getattr(norm, "bias", None) is not None:
        y = y + norm.bias
    return y


def _fused_layer_norm(norm, x):
    """``(norm(x), scale)`` from one ``torch.native_layer_norm`` call (it returns ``rstd``), for a
    torch LayerNorm outside autograd (its ``rstd`` output has no gradient); else None."""
    if not _is_layer_norm(norm) or x.dtype == torch.float64 or torch.is_grad_enabled():
        return None
    out, _, rstd = torch.native_layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return out, rstd.float().reciprocal_()


def edited_norm(norm, x, point, fused=None):
    """Run ``point`` (a hook point, or any ``fn(scale) -> scale``) on the scale of ``norm`` at ``x``; returns
    ``None`` when the scale was only read (the module's own output stands, bit for bit), else the norm
    recomputed from the edited scale (a returned tensor, or the scale written in place).  ``fused``:
    :func:`_fused_layer_norm`'s result, when the caller has it."""
    scale = norm_scale(norm, x) if fused is None else fused[1]
    v0 = scale._version
    s2 = point(scale)
    if s2 is scale and scale._version == v0:
        return None
    return normalize(norm, x, s2)


def scaled_norm(norm, x, point):
    """:func:`edited_norm`, or ``norm(x)`` itself when the scale was only read (for a torch LayerNorm
    outside autograd, the output and the scale come from one fused call: the same kernel as ``norm(x)``)."""
    fused = _fused_layer_norm(norm, x)
    r = edited_norm(norm, x, point, fused)
    if r is not None:
        return r
    return norm(x) if fused is None else fused[0]
