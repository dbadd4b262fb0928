"""A selective state-space mixer (Mamba-style) and its scan, chunked and sequential.

The recurrence, per batch row, head ``h`` (``P`` channels) and time ``t``::

    a_t  = Δ_t[h] · A[h]                       (≤ 0: A < 0, Δ > 0)
    h_t  = exp(a_t) · h_{t-1}  +  Δ_t[h] · x_t[h] ⊗ B_t        h_t[h] ∈ R^{P × S}
    y_t  = h_t[h] · C_t  +  D[h] · x_t[h]                       y_t[h] ∈ R^P

``A_bar = exp(ΔA)`` is the zero-order-hold discretisation of ``dh/dt = A h + B x``;
``B_bar ≈ Δ·B`` its first-order (Euler) input term, as in Mamba.  Δ, B and C are
functions of the input ("selective"); A is learned, negative, stored as ``log(-A)``.

**Simplification relative to Mamba's S6.**  S6 has one decay per (channel, state
entry), ``A (E, S)``.  Here A is one negative scalar per *head* of ``P`` channels
(Mamba-2's "scalar times identity"; ``P = 1`` is one per channel).  That is what
lets the chunked scan run as matrix products: within a chunk of ``L`` steps,

    y = (exp(segsum(a)) ⊙ C Bᵀ) · (Δ x)  +  exp(cumsum(a)) ⊙ (C · h_in)

where ``segsum(a)[t, τ] = Σ_{τ<k≤t} a_k`` (``-inf`` above the diagonal) is the
difference of the chunk's cumulative sums of ``log A_bar = a``, taken in float64 (so no
cancellation error even when a chunk decays by a lot); every exponent is ≤ 0, so
nothing overflows, whatever Δ is.  Across chunks the state is carried:
``h_out = exp(Σ a) h_in + Σ_τ exp(Σ_{k>τ} a_k) Δ_τ x_τ ⊗ B_τ``.  With S6's
per-entry decay no such factorisation exists: a vectorised log-space scan does the same
elementwise work as the loop, and measured on CPU it was slower than the loop.  B and C
are shared by all heads (Mamba-2 with one group).

Shapes (``b`` batch, ``N`` time, ``H`` heads, ``P`` channels per head, ``S`` state)::

    x  (b, N, H, P)     dt (b, N, H)     A (H,)     B, C (b, N, S)     D (H,) or None
    state (b, H, P, S)  ->  y (b, N, H, P)  [, final state (b, H, P, S)]

Functions:

* :func:`selective_scan_reference` — the recurrence as a Python loop over time (the math).
* :func:`selective_scan` — the chunked form above (same signature, same result).
* :func:`selective_scan_step` — one token, state in, state out (decoding).
* :class:`SSMMixer` — the module: projections, short causal conv, the scan, gate, W_out.

>>> import torch
>>> b, N, H, P, S = 2, 37, 3, 4, 5
>>> g = torch.Generator().manual_seed(0)
>>> x = torch.randn(b, N, H, P, generator=g, dtype=torch.float64)
>>> dt = torch.rand(b, N, H, generator=g, dtype=torch.float64)
>>> A = -torch.rand(H, generator=g, dtype=torch.float64) - 0.5
>>> B, C = torch.randn(2, b, N, S, generator=g, dtype=torch.float64)
>>> torch.allclose(selective_scan(x, dt, A, B, C, chunk_size=8),
...                selective_scan_reference(x, dt, A, B, C))
True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.nn.norms import RMSNorm
from attnlab.ops.sdpa import is_causal_mask
from attnlab.validate import integer, nonneg_int, positive_int

__all__ = ["selective_scan", "selective_scan_reference", "selective_scan_step", "SSMMixer", "RecurrentCache"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_scan(x, dt, A, B, C, D, state, chunk_size, *, step=False):
    """Validate the scan's arguments; return (b, N, H, P, S) (N = 1 for a step)."""
    names = (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)) + ((("D", D),) if D is not None else ())
    for name, t in names:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: expected x's device {x.device}, got {t.device}")
    if step:
        if x.dim() != 3:
            raise ValueError(f"x: expected one token (b, H, P), got {_shape(x)}")
        b, H, P = x.shape
        want: dict[str, tuple[int | None, ...]] = {"dt": (b, H), "B": (b, None), "C": (b, None)}
        N = 1
    else:
        if x.dim() != 4:
            raise ValueError(f"x: expected (b, N, H, P), got {_shape(x)}")
        b, N, H, P = x.shape
        want = {"dt": (b, N, H), "B": (b, N, None), "C": (b, N, None)}
    for name, t in (("dt", dt), ("B", B), ("C", C)):
        w = want[name]
        if t.dim() != len(w) or any(e is not None and s != e for s, e in zip(t.shape, w, strict=True)):
            shown = tuple("S" if e is None else e for e in w)
            raise ValueError(f"{name}: expected {shown} for x {_shape(x)}, got {_shape(t)}")
    S = B.shape[-1]
    if C.shape[-1] != S:
        raise ValueError(f"C: expected the state size S={S} of B {_shape(B)}, got {_shape(C)}")
    if A.shape != (H,):
        raise ValueError(f"A: expected one decay per head, (H={H},), got {_shape(A)}")
    if not bool(torch.isfinite(A).all()) or bool((A > 0).any()):
        raise ValueError(
            f"A: expected finite values <= 0 (a decay; A = -exp(A_log)), got {A.detach().flatten()[:4].tolist()}"
        )
    if bool((dt < 0).any()) or not bool(torch.isfinite(dt).all()):
        raise ValueError("dt: expected finite step sizes >= 0 (e.g. softplus of a projection)")
    if D is not None and D.shape != (H,):
        raise ValueError(f"D: expected None or one skip weight per head, (H={H},), got {_shape(D)}")
    if state is not None:
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state: expected None or a tensor (b, H, P, S), got {type(state).__name__}")
        if tuple(state.shape) != (b, H, P, S):
            raise ValueError(f"state: expected (b, H, P, S) = {(b, H, P, S)}, got {_shape(state)}")
    if chunk_size is not None:
        integer(chunk_size, "chunk_size", lo=1)
    return b, N, H, P, S


def selective_scan_step(x, dt, A, B, C, D=None, state=None):
    """One step of the recurrence: ``(y, new_state)``.

    ``x (b, H, P)``, ``dt (b, H)``, ``A (H,)``, ``B, C (b, S)``, ``D (H,)`` or None,
    ``state (b, H, P, S)`` (None: zeros).  Returns ``y (b, H, P)`` in x's dtype and the
    new state in float32 (float64 for float64 x).  ``state`` is not modified.

    >>> import torch
    >>> x = torch.ones(1, 1, 1); dt = torch.ones(1, 1); A = torch.tensor([-math.log(2)])
    >>> B = C = torch.ones(1, 1)
    >>> y, s = selective_scan_step(x, dt, A, B, C)           # h = 0/2 + 1
    >>> y, s = selective_scan_step(x, dt, A, B, C, state=s)  # h = 1/2 + 1
    >>> y.item()
    1.5
    """
    b, _, H, P, S = _check_scan(x, dt, A, B, C, D, state, None, step=True)
    acc = _acc(x.dtype)
    h = x.new_zeros(b, H, P, S, dtype=acc) if state is None else state.to(acc)
    h, y = _step(h, x.to(acc), dt.to(acc), A.to(acc), B.to(acc), C.to(acc))
    if D is not None:
        y = y + D.to(acc)[:, None] * x.to(acc)
    return y.to(x.dtype), h


def _step(h, x, dt, A, B, C):
    """h (b,H,P,S), x (b,H,P), dt (b,H), A (H,), B, C (b,S) -> (h', y (b,H,P))."""
    h = torch.exp(dt * A)[..., None, None] * h + (dt[..., None] * x)[..., None] * B[:, None, None, :]
    return h, (h @ C[:, None, :, None]).squeeze(-1)


def selective_scan_reference(x, dt, A, B, C, D=None, *, state=None, chunk_size=32, return_state=False):
    """The recurrence as a plain loop over time (see the module docstring); the oracle.

    Args:
        x: ``(b, N, H, P)`` inputs.
        dt: ``(b, N, H)`` step sizes Δ ≥ 0 (already positive: the scan applies no softplus).
        A: ``(H,)`` decays ≤ 0.
        B, C: ``(b, N, S)`` input and readout vectors (shared by the heads).
        D: ``(H,)`` skip weights, or None.
        state: ``(b, H, P, S)`` state before the first token (None: zeros).
        chunk_size: unused here (the signature is :func:`selective_scan`'s).
        return_state: also return the state after the last token.

    Returns ``y (b, N, H, P)`` in x's dtype (sums in float32; float64 stays float64),
    and with ``return_state`` the final state ``(b, H, P, S)`` in that precision.

    >>> import torch
    >>> x = torch.ones(1, 3, 1, 1); dt = torch.ones(1, 3, 1); B = C = torch.ones(1, 3, 1)
    >>> selective_scan_reference(x, dt, torch.zeros(1), B, C).flatten().tolist()   # A = 0: a running sum
    [1.0, 2.0, 3.0]
    """
    b, N, H, P, S = _check_scan(x, dt, A, B, C, D, state, chunk_size)
    acc = _acc(x.dtype)
    xs, dts, As, Bs, Cs = (t.to(acc) for t in (x, dt, A, B, C))
    h = x.new_zeros(b, H, P, S, dtype=acc) if state is None else state.to(acc)
    ys = []
    for t in range(N):
        h, y = _step(h, xs[:, t], dts[:, t], As, Bs[:, t], Cs[:, t])
        ys.append(y)
    y = torch.stack(ys, 1) if ys else xs.new_zeros(b, 0, H, P)
    if D is not None:
        y = y + D.to(acc)[:, None] * xs
    y = y.to(x.dtype)
    return (y, h) if return_state else y


def _segsum(a):
    """``a (..., L)`` -> ``(..., L, L)``: ``[t, τ] = Σ_{τ<k≤t} a_k`` for ``τ ≤ t``, ``-inf`` above;
    also the inclusive prefix sums ``(..., L)`` (float64).

    The segment sums are differences of prefix sums taken in float64, so their error is
    ~1e-16 of the chunk's total decay (exact enough even when that total is large and the
    segment small), then cast back to ``a``'s dtype."""
    L = a.shape[-1]
    cum = a.to(torch.float64).cumsum(-1)
    upper = torch.ones(L, L, dtype=torch.bool, device=a.device).triu(1)
    seg = (cum[..., :, None] - cum[..., None, :]).to(a.dtype).masked_fill(upper, -math.inf)
    return seg, cum


def selective_scan(x, dt, A, B, C, D=None, *, state=None, chunk_size=32, return_state=False):
    """The scan of :func:`selective_scan_reference`, chunked: matmuls inside each chunk of
    ``chunk_size`` steps, the state carried across chunks (module docstring).

    Same arguments and result as the reference.  Work: ``O(N·L·H·(P + S))`` in matmuls
    plus ``O(N·L·H)`` elementwise, for ``L = chunk_size``; nothing larger than
    ``(b, N/L, H, L, L)`` is materialised.  The sequence is zero-padded to a multiple
    of ``L`` with ``dt = 0`` steps, which leave the state unchanged.

    >>> import torch
    >>> x = torch.ones(1, 3, 1, 1); dt = torch.ones(1, 3, 1); B = C = torch.ones(1, 3, 1)
    >>> y, h = selective_scan(x, dt, torch.zeros(1), B, C, chunk_size=2, return_state=True)
    >>> y.flatten().tolist(), h.item()
    ([1.0, 2.0, 3.0], 3.0)
    """
    b, N, H, P, S = _check_scan(x, dt, A, B, C, D, state, chunk_size)
    acc = _acc(x.dtype)
    xs, dts, As, Bs, Cs = (t.to(acc) for t in (x, dt, A, B, C))
    h = xs.new_zeros(b, H, P, S) if state is None else state.to(acc)
    if N == 0:
        y = x.new_zeros(b, 0, H, P)
        return (y, h) if return_state else y
    L = min(int(chunk_size), N)
    nC = -(-N // L)
    pad = nC * L - N
    if pad:  # dt = 0 and x = 0: identity steps
        xs, dts = F.pad(xs, (0, 0, 0, 0, 0, pad)), F.pad(dts, (0, 0, 0, pad))
        Bs, Cs = F.pad(Bs, (0, 0, 0, pad)), F.pad(Cs, (0, 0, 0, pad))
    a = (dts * As).view(b, nC, L, H).transpose(2, 3)  # (b, nC, H, L), ≤ 0
    seg, cum = _segsum(a)
    decay = torch.exp(seg)  # (b, nC, H, L, L)
    Bc, Cc = Bs.view(b, nC, L, S), Cs.view(b, nC, L, S)
    xd = (xs * dts[..., None]).view(b, nC, L, H, P).transpose(2, 3).contiguous()  # (b, nC, H, L, P): Δ·x
    # inside each chunk: y_t = Σ_{τ≤t} exp(segsum[t, τ]) (C_t·B_τ) Δ_τ x_τ
    y = (decay * (Cc @ Bc.transpose(-1, -2))[:, :, None]) @ xd  # (b, nC, H, L, P)
    # what each chunk adds to the state: Σ_τ exp(Σ_{k>τ} a_k) Δ_τ x_τ ⊗ B_τ
    w = decay[..., -1, :]  # (b, nC, H, L)
    U = (xd * w[..., None]).transpose(-1, -2) @ Bc[:, :, None]  # (b, nC, H, P, S)
    cum = torch.exp(cum.to(acc))  # (b, nC, H, L): decay since chunk start
    total = cum[..., -1, None, None]  # (b, nC, H, 1, 1)
    entering = []
    for c in range(nC):
        entering.append(h)
        h = total[:, c] * h + U[:, c]
    h_in = torch.stack(entering, 1)  # (b, nC, H, P, S)
    # the entering state, decayed to each step and read out: exp(cum_t) C_t · h_in
    y = y + cum[..., None] * (Cc[:, :, None] @ h_in.transpose(-1, -2))
    y = y.transpose(2, 3).reshape(b, nC * L, H, P)[:, :N]
    if D is not None:
        y = y + D.to(acc)[:, None] * xs[:, :N]
    y = y.to(x.dtype)
    return (y, h) if return_state else y


class RecurrentCache:
    """Decoding state of one layer whose mixer is recurrent (:class:`SSMMixer`, or
    :class:`attnlab.nn.mixers.LinearAttentionMixer`): ``seen`` tokens so far and the
    mixer's ``state`` (None before the first call).  Pass one per layer, as a list, where
    a KV cache would go: ``model(ids, cache=RecurrentCache.for_layers(n_layers))``.

    Softmax attention cannot use it (it needs every past key): :meth:`update` raises.

    >>> caches = RecurrentCache.for_layers(2)
    >>> len(caches), caches[0].seen, caches[0].state
    (2, 0, None)
    """

    rotates_keys = False

    def __init__(self):
        self.seen = 0
        self.state = None

    @classmethod
    def for_layers(cls, n_layers: int) -> list:
        return [cls() for _ in range(positive_int(n_layers, "n_layers"))]

    def advance(self, n: int, state) -> None:
        self.seen += int(n)
        self.state = state

    def update(self, k, v):
        raise TypeError(
            "cache: a RecurrentCache holds the running state of a linear-attention or SSM mixer; "
            "softmax attention (mixer='attention') needs a KV cache from attnlab.cache"
        )

    def __repr__(self):
        return f"RecurrentCache(seen={self.seen}, state={'set' if self.state is not None else None})"


def check_recurrent_cache(cache, who: str):
    """``cache`` must be None or a :class:`RecurrentCache`; a clear TypeError otherwise."""
    if cache is not None and not isinstance(cache, RecurrentCache):
        raise TypeError(
            f"cache: {who} keeps a recurrent state, not keys and values; pass "
            f"attnlab.nn.ssm.RecurrentCache objects (RecurrentCache.for_layers(n_layers)), "
            f"got {type(cache).__name__}"
        )
    return cache


class SSMMixer(nn.Module):
    """A selective SSM sequence mixer (Mamba-2-style block without its MLP), a drop-in
    for :class:`~attnlab.nn.MultiHeadAttention` inside :class:`~attnlab.nn.Block`::

        x (B, N, d_model) --in_proj--> z (B,N,E)   u (B,N,E)   B, C (B,N,S)   Δ_raw (B,N,H)
        [u, B, C] --causal depthwise conv (kernel d_conv)--> SiLU          (Zoology: the short
                                                                           conv matters for recall)
        Δ = softplus(Δ_raw + dt_bias),  A = -exp(A_log)
        y = selective_scan(u as (B,N,H,P), Δ, A, B, C, D)                  E = H·P = expand·d_model
        out = W_out · RMSNorm(y ⊙ SiLU(z))                                 (B, N, d_model)

    Args:
        d_model: residual width.
        n_heads: heads ``H`` (one decay rate and one Δ each); ``expand·d_model % H == 0``.
        d_state: state size ``S`` per channel.
        expand: ``E = expand · d_model`` inner channels.  1 keeps the mixer's parameters
            close to attention's ``4·d_model²`` (Mamba uses 2 and drops the MLP).
        d_conv: kernel of the short causal conv (0: none).
        bias: biases of the input and output projections.
        chunk_size: of the chunked scan.
        dt_min, dt_max: Δ is initialised log-uniform in this range (Mamba's).

    ``forward(x, *, mask=None, pos=None, cache=None, need_weights=False)`` has
    :class:`~attnlab.nn.MultiHeadAttention`'s keywords: the scan is causal by
    construction, so ``mask`` must be None or ``masks.causal()`` (same meaning); ``pos``
    is ignored (the recurrence knows the order); ``cache`` is a :class:`RecurrentCache`
    (conv window and SSM state); ``need_weights`` raises (there is no attention pattern).

    >>> import torch
    >>> m = SSMMixer(32, n_heads=4, d_state=8)
    >>> x = torch.randn(2, 10, 32)
    >>> y = m(x)
    >>> y.shape
    torch.Size([2, 10, 32])
    >>> c = RecurrentCache()
    >>> steps = torch.cat([m(x[:, t:t + 1], cache=c) for t in range(10)], 1)   # token by token
    >>> torch.allclose(steps, y, atol=1e-5), c.seen
    (True, 10)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_state: int = 16,
        *,
        expand: int = 1,
        d_conv: int = 4,
        bias: bool = True,
        chunk_size: int = 32,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
    ):
        super().__init__()
        self.d_model = positive_int(d_model, "d_model")
        self.n_heads = positive_int(n_heads, "n_heads")
        self.d_state = positive_int(d_state, "d_state")
        self.expand = positive_int(expand, "expand")
        self.d_conv = nonneg_int(d_conv, "d_conv")
        self.chunk_size = positive_int(chunk_size, "chunk_size")
        E = self.expand * self.d_model
        if E % self.n_heads:
            raise ValueError(
                f"n_heads: expand·d_model = {E} inner channels must split into n_heads={n_heads} equal heads"
            )
        if not (0 < dt_min <= dt_max):
            raise ValueError(f"dt_min, dt_max: expected 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
        self.d_inner, self.head_dim = E, E // self.n_heads
        H, S = self.n_heads, self.d_state
        self.in_proj = nn.Linear(self.d_model, 2 * E + 2 * S + H, bias=bias)
        n_conv = E + 2 * S
        self.conv = nn.Conv1d(n_conv, n_conv, self.d_conv, groups=n_conv) if self.d_conv else None
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = RMSNorm(E)
        self.out_proj = nn.Linear(E, self.d_model, bias=bias)
        self.dt_range = (float(dt_min), float(dt_max))
        self.reset_ssm_parameters()

    def reset_ssm_parameters(self) -> None:
        """Mamba's initialisation of the SSM parameters: Δ log-uniform in ``dt_range``
        (stored through the inverse softplus), ``A = -U(1, 16)``, ``D = 1``."""
        lo, hi = self.dt_range
        with torch.no_grad():
            dt = torch.exp(torch.rand(self.n_heads) * (math.log(hi) - math.log(lo)) + math.log(lo))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            self.A_log.copy_(torch.log(torch.empty(self.n_heads).uniform_(1.0, 16.0)))
            self.D.fill_(1.0)

    @property
    def A(self) -> torch.Tensor:
        """The decays ``-exp(A_log)``, ``(n_heads,)``."""
        return -torch.exp(self.A_log)

    def forward(self, x, *, mask=None, pos=None, cache=None, need_weights: bool = False):
        """``x (B, N, d_model)`` -> ``(B, N, d_model)`` (see the class docstring)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected (B, N, d_model={self.d_model}), got {_shape(x)}")
        if need_weights:
            raise ValueError(
                "need_weights: an SSM mixer has no attention pattern (output_attentions needs "
                "mixer='attention' or 'linear')"
            )
        if mask is not None and not is_causal_mask(mask):
            raise ValueError(
                f"mask: the SSM scan is causal by construction and takes only None or "
                f"masks.causal(), got {mask!r}; padding, document or tree masks need "
                "mixer='attention'"
            )
        check_recurrent_cache(cache, "the SSM mixer")
        Bn, N, _ = x.shape
        E, S, H, P = self.d_inner, self.d_state, self.n_heads, self.head_dim
        z, xbc, dt = self.in_proj(x).split((E, E + 2 * S, H), dim=-1)
        st = None if cache is None else cache.state
        if st is not None and st["ssm"].shape[0] != Bn:
            raise ValueError(f"cache: holds a state for batch {st['ssm'].shape[0]}, got x {tuple(x.shape)}")
        conv_state = None
        if self.conv is not None:
            u = xbc.transpose(1, 2)  # (B, E+2S, N)
            K = self.d_conv
            if cache is not None:
                prev = u.new_zeros(Bn, u.shape[1], K - 1) if st is None else st["conv"].to(u.dtype)
                u = torch.cat([prev, u], -1)
                conv_state = u[..., u.shape[-1] - (K - 1) :] if K > 1 else u[..., :0]
                xbc = F.conv1d(u, self.conv.weight, self.conv.bias, groups=u.shape[1]).transpose(1, 2)
            else:
                xbc = F.conv1d(F.pad(u, (K - 1, 0)), self.conv.weight, self.conv.bias, groups=u.shape[1]).transpose(
                    1, 2
                )
        xbc = F.silu(xbc)
        u, Bm, Cm = xbc.split((E, S, S), dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        y, h = selective_scan(
            u.reshape(Bn, N, H, P),
            dt,
            self.A,
            Bm,
            Cm,
            self.D,
            state=None if st is None else st["ssm"],
            chunk_size=self.chunk_size,
            return_state=True,
        )
        if cache is not None:
            cache.advance(N, {"ssm": h.detach(), "conv": None if conv_state is None else conv_state.detach()})
        y = self.norm(y.reshape(Bn, N, E) * F.silu(z))
        return self.out_proj(y)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, d_state={self.d_state}, expand={self.expand}, "
            f"d_conv={self.d_conv}, chunk_size={self.chunk_size}"
        )
