"""Linear attention: ``φ(Q)(φ(K)ᵀV) / φ(Q)(φ(K)ᵀ1)`` with a feature map φ.

Three feature maps:

* ``"elu"`` — ``elu(x) + 1`` (Katharopoulos et al. 2020);
* :class:`FavorFeatures` — positive (orthogonal) random features of FAVOR+ (Performer,
  Choromanski et al. 2021), an unbiased estimator of the softmax kernel
  ``exp(q·k / sqrt(D))``;
* any callable ``x (..., N, D) -> (..., N, F)`` with non-negative values.

Three ways to compute the same thing:

* :func:`linear_attention` — the fast path.  Non-causal: two small matmuls, O(N·F·Dv).
  Causal: chunked — a masked quadratic product inside each chunk plus a running state
  ``S = Σ φ(k) vᵀ (F, Dv)``, ``z = Σ φ(k) (F)`` carried across chunks; nothing larger
  than one ``chunk × chunk`` tile per head is materialised.
* :func:`linear_attention_step` — the recurrence for decoding, one (or a few) tokens at
  a time over a :class:`LinearState`.
* :func:`naive_linear_attention` — the quadratic reference: materialises
  ``φ(Q)φ(K)ᵀ (Nq, Nk)``, masks, normalises.  The math beside the fast path.

Shapes follow the library contract: ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``,
``v (B, Hkv, Nk, Dv)`` → ``(B, H, Nq, Dv)``; query head ``h`` reads kv head
``h // (H // Hkv)`` (GQA; MQA is ``Hkv = 1``), and K/V are never repeated per query
head (the query heads of a group are batched against their shared kv head).  Features,
states and sums are float32 (float64 for float64 inputs); the output has q's dtype.

Normalisation: ``out = num / max(den, eps)`` where ``den = φ(q)·Σ φ(k)``; a row with no
keys (or all-zero features) gives 0, never NaN.

FAVOR+ stabilisers: query features subtract their own row maximum (a per-query
constant, cancels in the ratio); key features subtract one maximum shared by all keys
of a (batch, kv head) (a common constant, cancels too).  So the normalised output is
the unbiased-numerator/unbiased-denominator estimator, but with ``normalize=False`` the
FAVOR+ numerator is only defined up to these positive factors; pass
``FavorFeatures(..., stabilize=False)`` for the raw estimator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab.ops.args import check_qkv
from attnlab.validate import integer, positive_float

__all__ = [
    "elu_feature",
    "FavorFeatures",
    "LinearState",
    "linear_attention",
    "linear_attention_step",
    "naive_linear_attention",
]


def elu_feature(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1``: a positive feature map with ``F = D`` (Katharopoulos et al. 2020).

    >>> elu_feature(torch.tensor([-1.0, 0.0, 2.0])).tolist()
    [0.3678794503211975, 1.0, 3.0]
    """
    return F.elu(x) + 1


class FavorFeatures:
    """Positive random features of FAVOR+: ``φ(x) = exp(w·x' − |x'|²/2) / sqrt(m)``.

    ``x' = x · D^{-1/4}`` so that ``E[φ(q)·φ(k)] = exp(q·k / sqrt(D))``, the softmax
    kernel at the default scale.  ``w`` are the ``m = n_features`` rows of
    :attr:`weights` ``(m, D)``: with ``orthogonal=True`` stacked blocks of ``D``
    orthonormal rows (QR of a Gaussian matrix) each rescaled by an independent
    chi(D)-distributed norm, so every row is marginally ``N(0, I)`` but rows in a block
    are exactly orthogonal (lower variance); with ``orthogonal=False`` iid Gaussian rows.

    The draw is deterministic in ``seed`` (a CPU ``torch.Generator``); :meth:`redraw`
    draws a fresh set.  Calling the object, ``phi(x)``, gives the raw (unstabilised)
    features; :func:`linear_attention` uses :meth:`query` and :meth:`key`, which
    subtract a maximum in the exponent (per row for queries, one shared over all keys
    of a head for keys) unless ``stabilize=False``.

    >>> phi = FavorFeatures(8, 64, seed=0)
    >>> phi.weights.shape, phi(torch.randn(2, 5, 8)).shape
    (torch.Size([64, 8]), torch.Size([2, 5, 64]))
    """

    seed: int
    weights: torch.Tensor  # (n_features, d_head) float64
    _cache: dict[tuple[torch.device, torch.dtype], torch.Tensor]  # weights per (device, dtype)

    def __init__(self, d_head: int, n_features: int, *, seed: int, orthogonal: bool = True, stabilize: bool = True):
        self.d_head = integer(d_head, "d_head", lo=1)
        self.n_features = integer(n_features, "n_features", lo=1)
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal: expected a bool, got {type(orthogonal).__name__}")
        if not isinstance(stabilize, bool):
            raise TypeError(f"stabilize: expected a bool, got {type(stabilize).__name__}")
        self.orthogonal = orthogonal
        self.stabilize = stabilize
        self.redraw(seed)

    def redraw(self, seed: int) -> FavorFeatures:
        """Draw new random features from ``seed`` (same seed, same features); returns self."""
        self.seed = integer(seed, "seed", hi=None)
        g = torch.Generator().manual_seed(self.seed)
        m, d = self.n_features, self.d_head
        if self.orthogonal:
            blocks = []
            for _ in range(-(-m // d)):
                qmat, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
                qmat = qmat * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)  # Haar
                blocks.append(qmat.T)
            w = torch.cat(blocks)[:m]
            w = w * torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=1, keepdim=True)
        else:
            w = torch.randn(m, d, generator=g, dtype=torch.float64)
        self.weights = w
        self._cache = {}
        return self

    def __repr__(self):
        return (
            f"FavorFeatures(d_head={self.d_head}, n_features={self.n_features}, seed={self.seed}, "
            f"orthogonal={self.orthogonal}, stabilize={self.stabilize})"
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The exponent ``w·x' − |x'|²/2``, ``(..., D) -> (..., m)``, in float32 (float64 stays)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.shape[-1:] != (self.d_head,):
            raise ValueError(f"x: expected last dim d_head={self.d_head}, got shape {tuple(x.shape)}")
        acc = _acc_dtype(x.dtype)
        key = (x.device, acc)
        w = self._cache.get(key)
        if w is None:
            w = self._cache[key] = self.weights.to(device=x.device, dtype=acc)
        xs = x.to(acc) * self.d_head**-0.25
        return xs @ w.T - 0.5 * (xs * xs).sum(-1, keepdim=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Raw features ``exp(logits(x)) / sqrt(m)`` (no stabiliser): ``(..., D) -> (..., m)``."""
        return torch.exp(self.logits(x)) / math.sqrt(self.n_features)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Query features, each row's exponent shifted by its own maximum."""
        lg = self.logits(x)
        if self.stabilize and lg.shape[-1]:
            lg = lg - lg.amax(-1, keepdim=True).detach()
        return torch.exp(lg) / math.sqrt(self.n_features)

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """Key features ``(..., N, D) -> (..., N, m)``, shifted by one maximum over (N, m)."""
        lg = self.logits(x)
        if self.stabilize and lg.numel():
            lg = lg - _global_max(lg).detach()
        return torch.exp(lg) / math.sqrt(self.n_features)


@dataclass
class LinearState:
    """Running state of causal linear attention after some tokens.

    ``S (B, Hkv, F, Dv) = Σ φ(k) vᵀ``, ``z (B, Hkv, F) = Σ φ(k)``, and for stabilised
    FAVOR+ features ``m (B, Hkv)``, the exponent shift the sums are expressed in
    (``None`` otherwise).  float32 (float64 for float64 inputs).
    """

    S: torch.Tensor
    z: torch.Tensor
    m: torch.Tensor | None = None


def linear_attention(q, k, v, *, feature_map="elu", causal=False, normalize=True, chunk_size=64, eps=1e-6):
    """Linear attention ``φ(Q)(φ(K)ᵀV) / φ(Q)(φ(K)ᵀ1)``, chunked when causal.

    Shapes::

        q   (B, H,   Nq, D)     H % Hkv == 0; query head h reads kv head h // (H // Hkv)
        k   (B, Hkv, Nk, D)
        v   (B, Hkv, Nk, Dv)
        out (B, H,   Nq, Dv)    dtype of q; sums in float32 (float64 for float64)

    Causal (requires ``Nq == Nk``): row ``i`` sees keys ``0..i``.  Computed chunk by
    chunk: inside a chunk the masked ``(C, C)`` product, across chunks the state
    ``S = Σ φ(k)vᵀ (F, Dv)``, ``z = Σ φ(k) (F)``; O(N·C·(F+Dv) + N·F·Dv) time.

    Args:
        feature_map: ``"elu"`` (:func:`elu_feature`), a :class:`FavorFeatures`, or a
            callable ``(..., N, D) -> (..., N, F)`` giving non-negative features.
        normalize: ``False`` returns the numerator ``φ(Q)(φ(K)ᵀV)`` alone.
        chunk_size: rows per chunk on the causal path (any int ≥ 1; need not divide N).
        eps: the denominator is clamped below at ``eps``.

    >>> import torch
    >>> q = torch.randn(2, 8, 100, 32); k = torch.randn(2, 2, 100, 32); v = torch.randn(2, 2, 100, 16)
    >>> out = linear_attention(q, k, v, causal=True, chunk_size=32)
    >>> out.shape, torch.allclose(out, naive_linear_attention(q, k, v, causal=True), atol=1e-5)
    (torch.Size([2, 8, 100, 16]), True)
    """
    B, H, Hkv, Nq, _ = _check(q, k, v, feature_map, causal, normalize, chunk_size, eps)
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    pq, pk = _featurize(feature_map, q, k)
    pq = pq.reshape(B, Hkv, G, Nq, -1)
    vv = v.to(acc)
    if not causal:
        kv = pk.transpose(-1, -2) @ vv  # (B, Hkv, F, Dv)
        num = pq @ kv.unsqueeze(2)  # (B, Hkv, G, Nq, Dv)
        den = pq @ pk.sum(-2)[:, :, None, :, None]  # (B, Hkv, G, Nq, 1)
    else:
        Fdim = pk.shape[-1]
        S = pk.new_zeros(B, Hkv, Fdim, v.shape[-1])
        z = pk.new_zeros(B, Hkv, Fdim)
        num, den, _, _ = _causal_chunks(pq, pk, vv, S, z, chunk_size)
    return _finish(num, den, normalize, eps, q.dtype, B, H, Nq)


def linear_attention_step(q, k, v, state=None, *, feature_map="elu", normalize=True, eps=1e-6):
    """One decoding step of causal linear attention: ``(out, new_state)``.

    ``q (B, H, n, D)``, ``k (B, Hkv, n, D)``, ``v (B, Hkv, n, Dv)`` are the ``n ≥ 1``
    newest tokens (causal among themselves), ``state`` a :class:`LinearState` of every
    earlier token (``None`` = no earlier tokens).  Feeding a sequence token by token (or
    in pieces) gives the rows of ``linear_attention(..., causal=True)``; ``state`` is
    not modified.

    >>> import torch
    >>> q = torch.randn(1, 4, 6, 8); k = torch.randn(1, 2, 6, 8); v = torch.randn(1, 2, 6, 8)
    >>> st, outs = None, []
    >>> for t in range(6):
    ...     o, st = linear_attention_step(q[:, :, t:t+1], k[:, :, t:t+1], v[:, :, t:t+1], st)
    ...     outs.append(o)
    >>> torch.allclose(torch.cat(outs, 2), linear_attention(q, k, v, causal=True), atol=1e-5)
    True
    """
    B, H, Hkv, n, _ = _check(q, k, v, feature_map, True, normalize, 1, eps)
    if n == 0:
        raise ValueError(f"q, k, v: expected at least one new token, got q {tuple(q.shape)}")
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    favor = isinstance(feature_map, FavorFeatures) and feature_map.stabilize
    if favor:
        pq = feature_map.query(q)
        lg = feature_map.logits(k)
        m_new = lg.detach().amax(dim=(-2, -1))  # (B, Hkv)
    else:
        pq, pk = _featurize(feature_map, q, k)
    Dv = v.shape[-1]
    Fdim = pq.shape[-1]
    if state is None:
        S = torch.zeros(B, Hkv, Fdim, Dv, dtype=acc, device=q.device)
        z = torch.zeros(B, Hkv, Fdim, dtype=acc, device=q.device)
        m = None
    else:
        if not isinstance(state, LinearState):
            raise TypeError(f"state: expected a LinearState or None, got {type(state).__name__}")
        if tuple(state.S.shape) != (B, Hkv, Fdim, Dv) or tuple(state.z.shape) != (B, Hkv, Fdim):
            raise ValueError(
                f"state: expected S {(B, Hkv, Fdim, Dv)} and z {(B, Hkv, Fdim)} for these "
                f"inputs and feature_map, got S {tuple(state.S.shape)}, z {tuple(state.z.shape)}"
            )
        if favor != (state.m is not None):
            raise ValueError(
                "state: its stabiliser m must be present exactly when feature_map is a "
                "stabilised FavorFeatures (use the same feature_map for every step)"
            )
        S, z, m = state.S.to(acc), state.z.to(acc), state.m
    if favor:
        if m is not None:
            m_new = torch.maximum(m.to(acc), m_new)
            r = torch.exp(m.to(acc) - m_new)
            S, z = S * r[..., None, None], z * r[..., None]
        pk = torch.exp(lg - m_new[..., None, None]) / math.sqrt(feature_map.n_features)
        m = m_new
    pq = pq.reshape(B, Hkv, G, n, -1)
    num, den, S, z = _causal_chunks(pq, pk, v.to(acc), S, z, n)
    return _finish(num, den, normalize, eps, q.dtype, B, H, n), LinearState(S, z, m)


def naive_linear_attention(q, k, v, *, feature_map="elu", causal=False, normalize=True, chunk_size=64, eps=1e-6):
    """Quadratic reference for :func:`linear_attention` (same signature; ``chunk_size`` unused).

    Materialises ``A = φ(Q)φ(K)ᵀ (B, H, Nq, Nk)`` (K/V repeated per query head, for
    clarity), zeroes ``j > i`` when causal, and returns ``A V / max(A 1, eps)`` (or
    ``A V`` when ``normalize=False``).

    >>> import torch
    >>> q = k = v = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    >>> naive_linear_attention(q, k, v, causal=True)[0, 0, 0].allclose(v[0, 0, 0])
    True
    """
    _, H, Hkv, Nq, Nk = _check(q, k, v, feature_map, causal, normalize, chunk_size, eps)
    pq, pk = _featurize(feature_map, q, k)
    acc = pq.dtype
    pk = pk.repeat_interleave(H // Hkv, dim=1)
    vv = v.to(acc).repeat_interleave(H // Hkv, dim=1)
    a = pq @ pk.transpose(-1, -2)  # (B, H, Nq, Nk)
    if causal:
        a = a * torch.ones(Nq, Nk, dtype=torch.bool, device=a.device).tril()
    num = a @ vv
    if normalize:
        num = num / a.sum(-1, keepdim=True).clamp_min(eps)
    return num.to(q.dtype)


# ---------------------------------------------------------------------------------------


def _causal_chunks(pq, pk, v, S, z, chunk_size):
    """pq (B,Hkv,G,N,F), pk (B,Hkv,N,F), v (B,Hkv,N,Dv); S, z the state before row 0."""
    N = pk.shape[-2]
    nums, dens = [], []
    tri = None
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        qc, kc, vc = pq[..., s:e, :], pk[..., s:e, :], v[..., s:e, :]
        if tri is None or tri.shape[0] != e - s:
            tri = torch.ones(e - s, e - s, dtype=torch.bool, device=pk.device).tril()
        a = (qc @ kc.unsqueeze(2).transpose(-1, -2)) * tri  # (B,Hkv,G,C,C)
        nums.append(a @ vc.unsqueeze(2) + qc @ S.unsqueeze(2))
        dens.append(a.sum(-1, keepdim=True) + qc @ z[:, :, None, :, None])
        S = S + kc.transpose(-1, -2) @ vc
        z = z + kc.sum(-2)
    if not nums:
        shape = pq.shape[:-1]
        return pq.new_zeros(*shape, v.shape[-1]), pq.new_zeros(*shape, 1), S, z
    return torch.cat(nums, -2), torch.cat(dens, -2), S, z


def _finish(num, den, normalize, eps, dtype, B, H, Nq):
    out = num / den.clamp_min(eps) if normalize else num
    return out.reshape(B, H, Nq, -1).to(dtype)


def _featurize(fm, q, k):
    acc = _acc_dtype(q.dtype)
    if isinstance(fm, FavorFeatures):
        return fm.query(q), fm.key(k)
    fn = elu_feature if isinstance(fm, str) else fm
    pq, pk = fn(q.to(acc)), fn(k.to(acc))
    for name, x, p in (("q", q, pq), ("k", k, pk)):
        if not isinstance(p, torch.Tensor) or p.dim() != 4 or p.shape[:3] != x.shape[:3]:
            raise ValueError(
                f"feature_map: must map {name} {tuple(x.shape)} to (B, heads, N, F), got "
                f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}"
            )
    if pq.shape[-1] != pk.shape[-1]:
        raise ValueError(f"feature_map: gave F={pq.shape[-1]} features for q but F={pk.shape[-1]} for k")
    return pq.to(acc), pk.to(acc)


def _global_max(lg):
    """Max over the last two dims (N, F), keepdim; over F alone for a 1-d input."""
    if lg.dim() < 2:
        return lg.amax(-1, keepdim=True)
    return lg.amax(dim=(-2, -1), keepdim=True)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q, k, v, feature_map, causal, normalize, chunk_size, eps):
    check_qkv(q, k, v, positive_head_dim=False)
    B, H, Nq, D = q.shape
    _, Hkv, Nk, _ = k.shape
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize: expected a bool, got {type(normalize).__name__}")
    if causal and Nq != Nk:
        raise ValueError(
            f"causal: needs Nq == Nk (one sequence), got q {tuple(q.shape)}, k {tuple(k.shape)}; "
            "for new tokens after a prefix use linear_attention_step with the prefix's state"
        )
    integer(chunk_size, "chunk_size", lo=1)
    positive_float(eps, "eps")
    if isinstance(feature_map, str):
        if feature_map != "elu":
            raise ValueError(
                f"feature_map: unknown name {feature_map!r}; expected 'elu', a FavorFeatures, "
                "or a callable (..., N, D) -> (..., N, F)"
            )
    elif isinstance(feature_map, FavorFeatures):
        if feature_map.d_head != D:
            raise ValueError(f"feature_map: FavorFeatures built for d_head={feature_map.d_head}, but q has D={D}")
    elif not callable(feature_map):
        raise TypeError(
            f"feature_map: expected 'elu', a FavorFeatures, or a callable, got {type(feature_map).__name__}"
        )
    return B, H, Hkv, Nq, Nk
