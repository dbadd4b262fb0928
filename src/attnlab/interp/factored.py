"""``FactoredMatrix``: the product ``A @ B`` kept as its two factors.

A head's circuits are low rank: ``W_QK = W_Q W_Kᵀ`` and ``W_OV = W_V W_O`` are
``d_model × d_model`` but factor through ``d_head``.  Kept factored, products with
embeddings (``vocab × vocab`` circuits), SVDs, eigenvalues and norms cost
``O(d · d_head²)`` instead of ``O(d²)`` or ``O(vocab²)``, and the rank bottleneck is
visible in the shapes.  Conventions follow TransformerLens' ``FactoredMatrix``.

Shapes: ``A (..., m, r)``, ``B (..., r, n)``; the leading dims (layers, heads)
broadcast as in ``torch.matmul``.  ``m`` is ``ldim``, ``n`` ``rdim``, ``r`` ``mdim``
(the inner, bottleneck dimension).

>>> import torch
>>> from attnlab.interp.factored import FactoredMatrix
>>> A, B = torch.randn(4, 64, 8, dtype=torch.float64), torch.randn(4, 8, 64, dtype=torch.float64)
>>> fm = FactoredMatrix(A, B)                       # 4 heads, 64 × 64, inner 8
>>> fm.shape, fm.mdim
(torch.Size([4, 64, 64]), 8)
>>> fm.rank.tolist()                                # the rank bottleneck
[8, 8, 8, 8]
>>> E = torch.randn(1000, 64, dtype=torch.float64)
>>> full = E @ fm @ E.T                             # 4 × (1000 × 1000), never formed
>>> full.shape, full.mdim
(torch.Size([4, 1000, 1000]), 8)
>>> bool(torch.allclose(full.norm(), torch.linalg.matrix_norm(E @ A @ B @ E.T)))
True
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["FactoredMatrix"]


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, (torch.Tensor, FactoredMatrix)) else type(x).__name__


def qr_r(X: torch.Tensor) -> torch.Tensor:
    """The R of a reduced QR of ``X`` (Q is not formed unless autograd needs it: several
    times cheaper, and ``mode='r'`` has no backward)."""
    if torch.is_grad_enabled() and X.requires_grad:
        return torch.linalg.qr(X)[1]
    return torch.linalg.qr(X, mode="r")[1]


class FactoredMatrix:
    """The lazy matrix product ``A @ B`` with ``A (..., m, r)`` and ``B (..., r, n)``.

    Operations work on the factors and never form the ``m × n`` product unless asked
    (``.AB``):

    * ``fm @ X``, ``X @ fm`` (``X`` a tensor) and ``fm1 @ fm2`` stay factored.  The result
      keeps the smaller inner dimension of the two possible associations (so its
      ``mdim`` is never above ``min(r, shared dim)``); a 1-D ``X`` gives a dense vector.
    * ``.T`` transposes (``Bᵀ Aᵀ``); ``fm[i]`` / ``fm[:, j]`` index the *leading* dims only.
    * ``.svd()``, ``.svdvals()``, ``.norm()`` and ``.rank`` go through the QR factors of
      ``A`` and ``Bᵀ`` and the small core ``R_A R_Bᵀ`` (at most ``r × r``):
      ``A B = Q_A (R_A R_Bᵀ) Q_Bᵀ``.
    * ``.eigenvalues`` (square only) are those of ``B A`` (``r × r``) when ``r ≤ m``: all
      the nonzero eigenvalues of ``A B``.

    Gradients flow through all of it (the factors are used as given, not copied).
    """

    __slots__ = ("A", "B", "_lead")

    def __init__(self, A: torch.Tensor, B: torch.Tensor):
        if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
            raise TypeError(f"FactoredMatrix: A and B must be tensors, got A={type(A).__name__}, B={type(B).__name__}")
        if A.dim() < 2 or B.dim() < 2:
            raise ValueError(
                f"FactoredMatrix: A must be (..., m, r) and B (..., r, n) with at least 2 dims, "
                f"got A {tuple(A.shape)}, B {tuple(B.shape)}"
            )
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(
                f"FactoredMatrix: inner dimensions differ: A {tuple(A.shape)} is "
                f"(..., m, r={A.shape[-1]}) but B {tuple(B.shape)} is (..., r={B.shape[-2]}, n); "
                f"need A.shape[-1] == B.shape[-2]"
            )
        if A.dtype != B.dtype:
            raise TypeError(f"FactoredMatrix: A and B must share a dtype, got A {A.dtype}, B {B.dtype}")
        if not (A.dtype.is_floating_point or A.dtype.is_complex):
            raise TypeError(f"FactoredMatrix: expected floating-point or complex factors, got {A.dtype}")
        if A.device != B.device:
            raise ValueError(f"FactoredMatrix: A is on {A.device}, B on {B.device}; put them on one device")
        try:
            lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise ValueError(
                f"FactoredMatrix: leading dims of A {tuple(A.shape)} and B {tuple(B.shape)} do not broadcast"
            ) from None
        self.A, self.B, self._lead = A, B, torch.Size(lead)

    # -- shape ----------------------------------------------------------------------
    @property
    def ldim(self) -> int:
        return self.A.shape[-2]

    @property
    def mdim(self) -> int:
        return self.A.shape[-1]

    @property
    def rdim(self) -> int:
        return self.B.shape[-1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self._lead, self.ldim, self.rdim))

    @property
    def ndim(self) -> int:
        return len(self._lead) + 2

    @property
    def dtype(self) -> torch.dtype:
        return self.A.dtype

    @property
    def device(self) -> torch.device:
        return self.A.device

    def __len__(self) -> int:
        if not self._lead:
            raise TypeError(f"len() of a FactoredMatrix without leading dims (shape {tuple(self.shape)})")
        return self._lead[0]

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, mdim={self.mdim}, dtype={self.dtype})"

    # -- products -------------------------------------------------------------------
    @property
    def AB(self) -> torch.Tensor:
        """The dense product ``(..., m, n)``."""
        return self.A @ self.B

    @property
    def BA(self) -> torch.Tensor:
        """``B @ A`` ``(..., r, r)``; needs a square matrix (``m == n``)."""
        if self.ldim != self.rdim:
            raise ValueError(
                f"FactoredMatrix.BA: B {tuple(self.B.shape)} @ A {tuple(self.A.shape)} needs a square "
                f"matrix (m == n), got shape {tuple(self.shape)}"
            )
        return self.B @ self.A

    @property
    def T(self) -> FactoredMatrix:
        """The transpose ``Bᵀ Aᵀ`` (leading dims untouched)."""
        return FactoredMatrix(self.B.mT, self.A.mT)

    def _other(self, other, side):
        if isinstance(other, torch.Tensor):
            if other.dtype != self.dtype:
                raise TypeError(f"FactoredMatrix {side}: dtypes differ ({self.dtype} and {other.dtype}); cast first")
            if other.dim() == 0:
                raise ValueError(f"FactoredMatrix {side}: cannot matmul with a 0-dim tensor (use * for scalars)")
            return other
        raise TypeError(f"FactoredMatrix {side}: expected a tensor or FactoredMatrix, got {type(other).__name__}")

    def _lead_check(self, other, side):
        lo = other.shape[:-2] if other.dim() >= 2 else ()
        try:
            torch.broadcast_shapes(self._lead, lo)
        except RuntimeError:
            raise ValueError(
                f"FactoredMatrix {side}: leading dims of {tuple(self.shape)} and {tuple(other.shape)} do not broadcast"
            ) from None

    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):
            if other.ldim != self.rdim:
                raise ValueError(
                    f"FactoredMatrix @ FactoredMatrix: inner dimensions differ: {tuple(self.shape)} "
                    f"@ {tuple(other.shape)} (need {self.rdim} == {other.ldim})"
                )
            if other.dtype != self.dtype:
                raise TypeError(f"FactoredMatrix @: dtypes differ ({self.dtype} and {other.dtype}); cast first")
            try:
                torch.broadcast_shapes(self._lead, other._lead)
            except RuntimeError:
                raise ValueError(
                    f"FactoredMatrix @: leading dims of {tuple(self.shape)} and {tuple(other.shape)} do not broadcast"
                ) from None
            core = self.B @ other.A  # (..., r1, r2): the only shared work
            if self.mdim <= other.mdim:
                return FactoredMatrix(self.A, core @ other.B)
            return FactoredMatrix(self.A @ core, other.B)
        other = self._other(other, "@")
        k = other.shape[0] if other.dim() == 1 else other.shape[-2]
        if k != self.rdim:
            raise ValueError(
                f"FactoredMatrix @ tensor: inner dimensions differ: {tuple(self.shape)} @ "
                f"{tuple(other.shape)} (need {self.rdim} == {k})"
            )
        if other.dim() == 1:  # a vector: dense (..., m)
            return (self.A @ (self.B @ other.unsqueeze(-1))).squeeze(-1)
        self._lead_check(other, "@")
        if self.mdim <= self.rdim:
            return FactoredMatrix(self.A, self.B @ other)
        return FactoredMatrix(self.AB, other)  # n < r: the product's rank is ≤ n

    def __rmatmul__(self, other):
        other = self._other(other, "@ (left)")
        if other.shape[-1] != self.ldim:
            raise ValueError(
                f"tensor @ FactoredMatrix: inner dimensions differ: {tuple(other.shape)} @ "
                f"{tuple(self.shape)} (need {other.shape[-1]} == {self.ldim})"
            )
        if other.dim() == 1:  # a vector: dense (..., n)
            return ((other.unsqueeze(-2) @ self.A) @ self.B).squeeze(-2)
        self._lead_check(other, "@ (left)")
        if self.mdim <= self.ldim:
            return FactoredMatrix(other @ self.A, self.B)
        return FactoredMatrix(other, self.AB)

    def __mul__(self, s):
        if isinstance(s, torch.Tensor) and s.dim() == 0:
            s = s.to(self.dtype)
        elif not isinstance(s, numbers.Number) or isinstance(s, bool):
            raise TypeError(f"FactoredMatrix *: expected a scalar, got {_shape(s)}")
        return FactoredMatrix(self.A * s, self.B)

    __rmul__ = __mul__

    def __neg__(self) -> FactoredMatrix:
        return FactoredMatrix(-self.A, self.B)

    # -- indexing over leading dims -------------------------------------------------
    def __getitem__(self, idx) -> FactoredMatrix:
        """Index the leading dims (layers, heads) as a tensor of shape ``(...)`` would be;
        the last two dims are never indexed, so ``...`` spans leading dims only
        (``fm[..., 0]`` is the first head, not a column)."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        L = len(self._lead)

        def width(i):
            if i is None:
                return 0
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                return i.dim()
            return 1

        if sum(i is Ellipsis for i in idx) > 1:
            raise IndexError("FactoredMatrix: an index can only have a single ellipsis")
        used = sum(width(i) for i in idx if i is not Ellipsis)
        if used > L:
            raise IndexError(
                f"FactoredMatrix: index {idx!r} uses {used} dims but shape {tuple(self.shape)} has "
                f"{L} leading dims (the last two, (m, n), cannot be indexed; use .AB)"
            )
        if Ellipsis in idx:
            at = next(k for k, i in enumerate(idx) if i is Ellipsis)
            idx = idx[:at] + (slice(None),) * (L - used) + idx[at + 1 :]
        A = self.A.expand(*self._lead, *self.A.shape[-2:])
        B = self.B.expand(*self._lead, *self.B.shape[-2:])
        return FactoredMatrix(A[idx], B[idx])

    # -- spectra and norms ----------------------------------------------------------
    def _core(self):
        """``Q_A, C, Q_B`` with ``A B = Q_A C Q_Bᵀ``, ``Q_A``, ``Q_B`` orthonormal columns and
        ``C = R_A R_Bᵀ`` of size ``min(m, r) × min(n, r)``."""
        QA, RA = torch.linalg.qr(self.A)
        QB, RB = torch.linalg.qr(self.B.mT)
        return QA, RA @ RB.mT, QB

    def _small_core(self) -> torch.Tensor:
        """``C = R_A R_Bᵀ`` alone (same singular values as ``A B``)."""
        return qr_r(self.A) @ qr_r(self.B.mT).mT

    def svd(self):
        """``U (..., m, q)``, ``S (..., q)``, ``Vh (..., q, n)`` with ``q = min(m, r, n)``,
        ``A B = U diag(S) Vh``, ``S`` descending, from the factors (QR of ``A`` and ``Bᵀ``,
        SVD of the small core); the ``m × n`` product is never formed."""
        QA, C, QB = self._core()
        Uc, S, Vhc = torch.linalg.svd(C, full_matrices=False)
        return QA @ Uc, S, Vhc @ QB.mT

    def svdvals(self) -> torch.Tensor:
        """The singular values ``(..., min(m, r, n))``, descending (as ``torch.linalg.svdvals(AB)``)."""
        return torch.linalg.svdvals(self._small_core())

    def norm(self) -> torch.Tensor:
        """Frobenius norm ``(...)`` of ``A B``, as ``‖R_A R_Bᵀ‖_F`` (orthogonal invariance)."""
        return torch.linalg.matrix_norm(self._small_core())

    def matrix_rank(self, *, atol: float | None = None, rtol: float | None = None) -> torch.Tensor:
        """Numerical rank ``(...)`` (int64): the number of singular values above
        ``max(atol, rtol · σ_max)``; defaults ``atol = 0``, ``rtol = max(m, n, r) · eps(dtype)``
        (``torch.linalg.matrix_rank``'s rule, with ``r`` added for the error of the factors)."""
        S = self.svdvals()
        if rtol is None:
            rtol = max(self.ldim, self.rdim, self.mdim) * torch.finfo(S.dtype).eps
        tol = rtol * (S[..., :1] if S.shape[-1] else S.new_zeros((*S.shape[:-1], 1)))
        if atol is not None:
            tol = tol.clamp_min(float(atol))
        return (S > tol).sum(-1)

    @property
    def rank(self) -> torch.Tensor:
        """Numerical rank ``(...)`` with the default tolerance of :meth:`matrix_rank`."""
        return self.matrix_rank()

    @property
    def eigenvalues(self) -> torch.Tensor:
        """Eigenvalues (complex) of the square ``A B``: those of ``B A`` ``(..., r)`` when
        ``r ≤ m`` (every nonzero eigenvalue of ``A B``, the rest being its zeros), else of
        ``A B`` itself ``(..., m)``; ``min(m, r)`` values either way."""
        if self.ldim != self.rdim:
            raise ValueError(
                f"FactoredMatrix.eigenvalues: needs a square matrix (m == n), got shape {tuple(self.shape)}"
            )
        return torch.linalg.eigvals(self.BA if self.mdim <= self.ldim else self.AB)

    # -- conversions ----------------------------------------------------------------
    def to(self, *args, **kwargs) -> FactoredMatrix:
        return FactoredMatrix(self.A.to(*args, **kwargs), self.B.to(*args, **kwargs))

    def detach(self) -> FactoredMatrix:
        return FactoredMatrix(self.A.detach(), self.B.detach())
