"""``MultiHeadAttention``: projections, heads, positions and W_O around the attention op.

Shapes (B batch, N tokens, d_model, H = n_heads, Hkv = n_kv_heads, d_head)::

    x (B, N, d_model) --W_Q--> q (B, H,   N, d_head) --RoPE--\\
                      --W_K--> k (B, Hkv, N, d_head) --RoPE----> attention() -> z (B, H, N, d_head)
                      --W_V--> v (B, Hkv, N, d_head) ----------/
    z --concat heads--> (B, N, H·d_head) --W_O--> (B, N, d_model)

The output projection is ``out = Σ_h z_h W_O[h] (+ b_O)`` with
``W_O [H, d_head, d_model]``, i.e. one ``(H·d_head) × d_model`` matrix applied to the
concatenated heads with **no extra scaling**.  (One of the seed texts scales the
concatenation by ``1/sqrt(h)`` and gives ``W_O`` the shape ``(D·h) × D``; neither is
standard: the only scale is ``1/sqrt(d_head)`` inside the softmax, and ``W_O`` maps
``H·d_head`` back to ``d_model``.)

Weights are stored fused, as ``torch.nn.Linear`` would store them (one
``((H + 2·Hkv)·d_head, d_model)`` matrix for Q, K and V: one GEMM per call), and are
exposed per head under their mathematical names as *views* that share storage:

    W_Q [H, d_model, d_head]   W_K, W_V [Hkv, d_model, d_head]   W_O [H, d_head, d_model]
    b_Q [H, d_head]            b_K, b_V [Hkv, d_head]            b_O [d_model]

so ``q[b, h, i] = x[b, i] @ W_Q[h] + b_Q[h]``; writing into a view writes the weight.

KV cache protocol (``cache[i]`` of any :class:`attnlab.cache.Cache`)::

    cache.seen                      -> absolute position of the first new token (int, or (B,))
    cache.update(k, v)              -> a KV view: kv.attend(q, mask=..., ...) attends the cached
                                       keys plus the new ones; kv.dense() gives tensors

>>> import torch
>>> from attnlab import masks
>>> from attnlab.nn import MultiHeadAttention
>>> from attnlab.positions import RoPE
>>> mha = MultiHeadAttention(64, n_heads=8, n_kv_heads=2, positions=RoPE(8))   # GQA 8:2
>>> mha(torch.randn(2, 10, 64), mask=masks.causal()).shape
torch.Size([2, 10, 64])
>>> mha.W_Q.shape, mha.W_K.shape, mha.W_O.shape
(torch.Size([8, 64, 8]), torch.Size([2, 64, 8]), torch.Size([8, 8, 64]))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnlab import masks
from attnlab.nn.hooks import AttentionPoints
from attnlab.ops.dispatch import BACKENDS, attention, attention_probs
from attnlab.ops.reference import index_grids
from attnlab.scores import compose
from attnlab.validate import head_shape, nonzero_real, probability


def _head_independent(mask) -> bool:
    """True when ``mask`` says by its structure that it reads no head index (every built-in but a dense
    per-head tensor): a pattern of some heads may then evaluate it as it is, keeping its tile structure."""
    s = mask.lower()
    return s is not None and s.dense is None


@dataclass
class AttentionCall:
    """What one attention call saw, handed to each of a module's ``hooks``.

    ``q (B, H, Nq, d_head)`` and ``k``/``v (B, Hkv, Nk, d_head)`` are the tensors the op
    attended (after RoPE; with a cache, every cached key); ``z (B, H, Nq, d_head)`` is the
    per-head output before ``W_O``.  ``mask``, ``score_mod``, ``scale``, ``q_offset`` and
    ``kv_offset`` are the op's arguments, so :meth:`pattern` recomputes the exact
    attention pattern for any subset of heads.  ``layer`` is the index of the layer
    when the hook's installer knows it (:func:`attnlab.interp.capture` does).
    """

    module: object
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None  # None where the installer keeps no values (interp.capture's keep=)
    z: torch.Tensor | None
    mask: masks.Mask | masks.BlockMask | None = None
    score_mod: Callable[..., torch.Tensor] | None = None
    scale: float | None = None
    q_offset: int | None = None
    kv_offset: int = 0
    layer: int | None = None  # filled in by whoever installed the hook (e.g. interp.capture)

    def pattern(self, heads=None) -> torch.Tensor:
        """The attention pattern ``(B, len(heads), Nq, Nk)`` (float32), recomputed from q and k
        for the query heads asked (default all; negative indices count from the end); GQA-correct, head-dependent masks and
        score mods (ALiBi) see the original head indices."""
        H, Hkv = self.q.shape[1], self.k.shape[1]
        idx = torch.arange(H) if heads is None else torch.as_tensor(heads, dtype=torch.long).reshape(-1)
        if idx.numel() and (int(idx.min()) < -H or int(idx.max()) >= H):
            raise ValueError(
                f"heads: expected query-head indices in [-{H}, {H}) (negative: from the end), got {idx.tolist()}"
            )
        idx = idx % H  # Python's meaning of negative indices
        kv = idx // (H // Hkv)  # the kv head each chosen query head reads
        mask, mod = self.mask, self.score_mod
        if isinstance(mask, masks.BlockMask):  # a BlockMask: its predicate
            mask = mask.mask
        if heads is not None:  # masks and score mods must see the original head indices
            dev = idx.to(self.q.device)
            if mask is not None and not _head_independent(mask):
                mask = masks.custom(lambda b, h, qp, kp, m=mask: m(b, dev[h], qp, kp))
            mod = None if mod is None else (lambda s, b, h, qp, kp, f=mod: f(s, b, dev[h], qp, kp))
        return attention_probs(
            self.q[:, idx],
            self.k[:, kv],
            mask=mask,
            score_mod=mod,
            scale=self.scale,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
        )

    def scores(self) -> torch.Tensor:
        """The scores ``scale·q kᵀ + score mods`` ``(B, H, Nq, Nk)`` in float32 (float64 for float64),
        ``-inf`` where the mask hides a key: the pattern is their softmax (TransformerLens'
        ``hook_attn_scores``).  GQA-correct; positions as the op saw them."""
        q, k = self.q, self.k
        B, H, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        kr = k.repeat_interleave(H // Hkv, dim=1) if H != Hkv else k
        scale = 1.0 / math.sqrt(D) if self.scale is None else self.scale
        s = torch.matmul(q.to(acc), kr.to(acc).transpose(-1, -2)) * scale
        q_off = self.kv_offset + Nk - Nq if self.q_offset is None else self.q_offset
        b, h, qp, kp = index_grids(B, H, Nq, Nk, q_off, self.kv_offset, q.device)
        if self.score_mod is not None:
            s = self.score_mod(s, b, h, qp, kp)
        mask = self.mask.mask if isinstance(self.mask, masks.BlockMask) else self.mask
        if mask is not None:
            s = s.masked_fill(~torch.as_tensor(mask(b, h, qp, kp), device=q.device), float("-inf"))
        return s


def run_hooks(hooks, call: AttentionCall) -> torch.Tensor:
    """Call each hook in order; a returned tensor replaces ``call.z``.  Returns the final z."""
    z = call.z
    if z is None:
        raise TypeError("run_hooks: the call holds no z (the op's output) to hand to the hooks")
    for hook in list(hooks):
        r = hook(call)
        if r is not None:
            if not isinstance(r, torch.Tensor) or r.shape != z.shape:
                raise ValueError(
                    f"hook {hook!r}: must return None or z of shape {tuple(z.shape)}, got "
                    f"{tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}"
                )
            call.z = z = r
    return z


def _positions(seen, N):
    """Positions of N new tokens after ``seen`` (an int, or ``(B,)`` per sequence)."""
    if isinstance(seen, torch.Tensor):
        return seen.view(-1, 1) + torch.arange(N, device=seen.device)
    return int(seen)


class FusedQKV(nn.Module):
    """The fused ``qkv_weight (n_qkv, d_model)`` / ``out_weight`` parameters shared by
    :class:`MultiHeadAttention` and :class:`attnlab.nn.mixers.LinearAttentionMixer`: their
    initialisation, per-head views (``W_Q (n_heads, d_model, d_head)`` ...) and the
    projection to q ``(B, H, N, d_head)``, k and v ``(B, Hkv, M, d_head)``.  A subclass sets
    the attributes below in its ``__init__``."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    qkv_weight: nn.Parameter
    qkv_bias: nn.Parameter | None
    out_weight: nn.Parameter
    out_bias: nn.Parameter | None

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.qkv_weight)
        nn.init.xavier_uniform_(self.out_weight)
        for b in (self.qkv_bias, self.out_bias):
            if b is not None:
                nn.init.zeros_(b)

    # -- per-head views of the fused weights --------------------------------------
    def _rows(self, which):
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        lo = {"Q": 0, "K": H * dh, "V": (H + Hkv) * dh}[which]
        return lo, lo + (H if which == "Q" else Hkv) * dh, (H if which == "Q" else Hkv)

    def _w(self, which):
        lo, hi, n = self._rows(which)
        return self.qkv_weight[lo:hi].view(n, self.d_head, self.d_model).transpose(1, 2)

    def _b(self, which):
        if self.qkv_bias is None:
            return None
        lo, hi, n = self._rows(which)
        return self.qkv_bias[lo:hi].view(n, self.d_head)

    W_Q = property(lambda self: self._w("Q"), doc="[n_heads, d_model, d_head] view")
    W_K = property(lambda self: self._w("K"), doc="[n_kv_heads, d_model, d_head] view")
    W_V = property(lambda self: self._w("V"), doc="[n_kv_heads, d_model, d_head] view")
    b_Q = property(lambda self: self._b("Q"))
    b_K = property(lambda self: self._b("K"))
    b_V = property(lambda self: self._b("V"))
    b_O = property(lambda self: self.out_bias)

    @property
    def W_O(self) -> torch.Tensor:
        """``[n_heads, d_head, d_model]`` view of the output projection."""
        return self.out_weight.view(self.d_model, self.n_heads, self.d_head).permute(1, 2, 0)

    # -- forward ------------------------------------------------------------------
    def project(self, x, context=None):
        """q ``(B, H, N, d_head)``, k and v ``(B, Hkv, M, d_head)`` (before positions)."""
        B, N, _ = x.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        if context is None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(B, N, H + 2 * Hkv, dh).transpose(1, 2)
            return qkv.split((H, Hkv, Hkv), dim=1)
        nq = H * dh
        bq = bkv = None
        if self.qkv_bias is not None:
            bq, bkv = self.qkv_bias[:nq], self.qkv_bias[nq:]
        q = F.linear(x, self.qkv_weight[:nq], bq).view(B, N, H, dh).transpose(1, 2)
        M = context.shape[1]
        kv = F.linear(context, self.qkv_weight[nq:], bkv).view(B, M, 2 * Hkv, dh).transpose(1, 2)
        k, v = kv.split((Hkv, Hkv), dim=1)
        return q, k, v


class MultiHeadAttention(FusedQKV):
    """Multi-head attention (MHA; GQA with ``n_kv_heads < n_heads``; MQA with 1).

    Args:
        d_model: width of the residual stream.
        n_heads: query heads ``H``.
        n_kv_heads: key/value heads ``Hkv`` (default ``H``); ``H % Hkv == 0``.
        d_head: per-head width (default ``d_model // n_heads``).
        bias: biases on Q, K, V and O.
        dropout: attention-probability dropout while training: the op's
            ``dropout_p`` (:mod:`attnlab.ops.dropout`: a counter-based keep-mask that the
            flash backward regenerates per tile, any mask or score mod), with the seed
            drawn from torch's default generator per call (``torch.manual_seed`` makes a
            training run reproducible).  Off in eval mode.  With dropout, ``backend``
            ``"sdpa"`` is refused by the op; ``"auto"`` runs the flash path.
            ``need_weights`` returns the undropped pattern.
        positions: ``None``, a :class:`attnlab.positions.RoPE` (rotates q and k at their
            absolute positions) or an :class:`attnlab.positions.ALiBi` (a score mod).
        backend: passed to :func:`attnlab.attention`.
        scale: softmax scale, default ``1/sqrt(d_head)``.
        context_parallel: ``None`` (default), or an
            :class:`attnlab.distributed.ContextParallel`: ``x`` is then this rank's shard
            of a sequence split over a process group and attention runs across the
            group (ring or Ulysses); RoPE uses the shard's global positions.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        positions=None,
        backend: str = "auto",
        scale: float | None = None,
        context_parallel=None,
    ):
        super().__init__()
        d_model, n_heads, n_kv_heads, d_head = head_shape(d_model, n_heads, n_kv_heads, d_head)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if positions is not None and not (hasattr(positions, "cos_sin") or hasattr(positions, "score_mod")):
            raise TypeError(
                f"positions: expected None, a positions.RoPE or a positions.ALiBi, got {type(positions).__name__}"
            )
        if hasattr(positions, "cos_sin") and positions.d_head != d_head:
            raise ValueError(f"positions: RoPE built for d_head={positions.d_head}, attention has d_head={d_head}")
        if hasattr(positions, "slopes") and positions.slopes.shape[0] != n_heads:
            raise ValueError(f"positions: ALiBi has {positions.slopes.shape[0]} slopes for n_heads={n_heads}")
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = d_model, n_heads, n_kv_heads, d_head
        self.dropout = probability(dropout, "dropout")
        self.backend = backend
        self.scale = (
            1.0 / math.sqrt(d_head) if scale is None else nonzero_real(scale, "scale", hint="default 1/sqrt(d_head)")
        )
        self.positions = positions  # a RoPE is a Module (buffers); ALiBi is not
        self._alibi = positions.score_mod() if hasattr(positions, "score_mod") else None
        self.context_parallel = context_parallel  # duck-typed: .positions(n, device), .attend(q, k, v, ...)
        n_qkv = (n_heads + 2 * n_kv_heads) * d_head
        self.qkv_weight = nn.Parameter(torch.empty(n_qkv, d_model))
        self.qkv_bias = nn.Parameter(torch.zeros(n_qkv)) if bias else None
        self.out_weight = nn.Parameter(torch.empty(d_model, n_heads * d_head))
        self.out_bias = nn.Parameter(torch.zeros(d_model)) if bias else None
        #: callables ``hook(call: AttentionCall) -> None | z`` run after the op, before W_O;
        #: a returned tensor ``(B, H, Nq, d_head)`` replaces z (ablation, patching).
        #: See :mod:`attnlab.interp`.  Not part of the state dict.
        self.hooks: list = []
        #: TransformerLens-style hook points (hook_q ... hook_result), empty unless
        #: :mod:`attnlab.interp` installs functions; see :mod:`attnlab.nn.hooks`.
        self.attnlab_points = AttentionPoints()
        self.reset_parameters()

    def forward(self, x, context=None, *, mask=None, score_mod=None, pos=None, cache=None, need_weights: bool = False):
        """Attend ``x (B, N, d_model)`` to itself (or to ``context (B, M, d_model)``).

        Args:
            mask: an :mod:`attnlab.masks` mask in the op's absolute positions (causal
                self-attention: ``masks.causal()``).  ``None`` attends everything.
            score_mod: an extra score mod (composed after ALiBi, if any).
            pos: absolute positions of ``x``'s tokens for RoPE: ``None`` (``cache.seen``
                onwards, or 0), an int offset, or a LongTensor ``(N,)`` / ``(B, N)``.
            cache: a per-layer KV cache (see the module docstring); new k/v are appended.
            need_weights: also return the attention pattern ``(B, H, N, M)`` (float32,
                materialized; for inspection).

        Returns ``(B, N, d_model)``, or ``(out, pattern)`` with ``need_weights``.
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x: expected (B, N, d_model={self.d_model}), got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
        if context is not None:
            if context.dim() != 3 or context.shape[0] != x.shape[0] or context.shape[-1] != self.d_model:
                raise ValueError(
                    f"context: expected (B={x.shape[0]}, M, d_model={self.d_model}), got {tuple(context.shape)}"
                )
            if hasattr(self.positions, "cos_sin"):
                raise ValueError(
                    "cross-attention (context=...) with RoPE positions is not defined: "
                    "build the module with positions=None or ALiBi"
                )
        B, N, _ = x.shape
        q, k, v = self.project(x, context)
        pts = self.attnlab_points
        if pts.qkv_active():
            q, k, v = pts.qkv(q, k, v)
        rope = self.positions if hasattr(self.positions, "cos_sin") else None
        mod = self._alibi
        if score_mod is not None:
            mod = score_mod if mod is None else compose(mod, score_mod)
        if self.context_parallel is not None:
            return self._forward_context_parallel(q, k, v, B, N, mask, mod, pos, rope, cache, context, need_weights)
        if cache is not None:
            return self._forward_cached(q, k, v, B, N, mask, mod, pos, rope, cache, context, need_weights)
        return self._forward_plain(q, k, v, B, N, mask, mod, pos, rope, context, need_weights)

    def _forward_context_parallel(self, q, k, v, B, N, mask, mod, pos, rope, cache, context, need_weights):
        """The sequence is sharded over ``self.context_parallel``'s group: ring/Ulysses
        attention of this rank's ``(B, H, N, d_head)`` shard (self-attention only)."""
        cp = self.context_parallel
        if (
            cache is not None
            or context is not None
            or need_weights
            or self.hooks
            or self.attnlab_points.active()
            or (self.training and self.dropout > 0)
        ):
            raise ValueError(
                "context_parallel: runs self-attention only, without cache, context, need_weights, "
                "hooks or attention dropout"
            )
        if rope is not None:
            p = cp.positions(N, q.device) if pos is None else pos
            q, k = rope(q, p), rope(k, p)
        return self._out(cp.attend(q, k, v, mask=mask, score_mod=mod, scale=self.scale), B, N)

    def _forward_cached(self, q, k, v, B, N, mask, mod, pos, rope, cache, context, need_weights):
        """Self-attention over a KV cache: the new ``(B, Hkv, N, d_head)`` k/v are appended and
        the queries attend every cached key (the cache's own ``attend``, unless dropout, the
        pattern, hooks or hook points need the dense keys)."""
        pts = self.attnlab_points
        if context is not None:
            raise ValueError("cache: a KV cache serves self-attention; cross-attention keys do not grow")
        if rope is not None and not getattr(cache, "rotates_keys", False):
            p = _positions(cache.seen, N) if pos is None else pos
            q, k = rope(q, p), rope(k, p)
            if pts.rot_active():
                q, k = pts.rot(q, k)
        kv = cache.update(k, v)
        if rope is not None and getattr(cache, "rotates_keys", False):
            q = rope(q, kv.q_positions)  # the cache stores keys unrotated and rotates them at read
        if not ((self.training and self.dropout > 0) or need_weights or self.hooks or pts.active()):
            z = kv.attend(q, mask=mask, score_mod=mod, scale=self.scale, backend=self.backend)
            return self._out(z, B, N)
        kv = kv.dense()
        kw = dict(mask=mask, score_mod=mod, scale=self.scale, q_offset=kv.q_offset, kv_offset=kv.kv_offset)
        return self._attend(q, kv.k, kv.v, B, N, kw, need_weights)

    def _forward_plain(self, q, k, v, B, N, mask, mod, pos, rope, context, need_weights):
        """Self-attention of ``x`` (positions from 0, or ``pos``) or cross-attention to
        ``context`` (top-left: ``q_offset = 0``)."""
        pts = self.attnlab_points
        if rope is not None:
            p = 0 if pos is None else pos
            q, k = rope(q, p), rope(k, p)
            if pts.rot_active():
                q, k = pts.rot(q, k)
        q_offset = 0 if context is not None else None
        kw = dict(mask=mask, score_mod=mod, scale=self.scale, q_offset=q_offset, kv_offset=0)
        return self._attend(q, k, v, B, N, kw, need_weights)

    def _attend(self, q, k, v, B, N, kw, need_weights):
        """The op on ``q (B, H, N, d_head)``, ``k, v (B, Hkv, M, d_head)`` with ``kw`` (mask,
        score mod, scale, offsets), then hook points, hooks and ``W_O``."""
        pts = self.attnlab_points
        if self.training and self.dropout > 0:
            z = attention(q, k, v, backend=self.backend, dropout_p=self.dropout, **kw)
        else:
            z = attention(q, k, v, backend=self.backend, **kw)
        if pts.post_active():  # scores / pattern asked for: recomputed from q and k
            z = pts.scores_and_pattern(AttentionCall(self, q, k, v, z, **kw))
        if self.hooks:
            z = run_hooks(self.hooks, AttentionCall(self, q, k, v, z, **kw))
        z = pts.z(z)
        out = pts.result(z, self.W_O, self.out_bias) if pts.hook_result.fns else None
        if out is None:
            out = self._out(z, B, N)
        if need_weights:
            return out, attention_probs(q, k, **kw)
        return out

    def _out(self, z, B, N):
        return F.linear(z.transpose(1, 2).reshape(B, N, self.n_heads * self.d_head), self.out_weight, self.out_bias)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"d_head={self.d_head}, bias={self.qkv_bias is not None}, dropout={self.dropout}, "
            f"backend={self.backend!r}"
        )
