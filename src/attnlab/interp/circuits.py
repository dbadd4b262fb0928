"""QK and OV circuits, full circuits, copying and composition scores (Elhage et al., 2021).

Conventions (row vectors, as in :class:`attnlab.nn.MultiHeadAttention` and TransformerLens)::

    scores_h[i, j] = (x_i W_Q[h]) · (x_j W_K[g])  =  x_i  W_QK[h]  x_jᵀ     W_QK[h] = W_Q[h] W_K[g]ᵀ
    out_h[i]       = Σ_j A_h[i, j] (x_j W_V[g]) W_O[h]  =  Σ_j A_h[i, j] x_j W_OV[h]
                                                                           W_OV[h] = W_V[g] W_O[h]

with ``g = h // (H // Hkv)`` the kv head that query head ``h`` reads (GQA/MQA: the query
heads of one group share ``W_K[g]``, ``W_V[g]``).  Both circuits are
:class:`FactoredMatrix` ``[H, d_model, d_model]`` with inner dimension ``d_head``: the
rank bottleneck, ``rank ≤ d_head``.  ``W_QK`` is the bilinear form *before* the softmax
scale (``1/sqrt(d_head)`` unless the module says otherwise), without biases, ALiBi, or
RoPE (``qk_circuit(..., query_pos=i, key_pos=j)`` inserts RoPE's rotations).  Only the
products are meaningful: ``W_Q M``, ``W_K M⁻ᵀ`` (and ``W_V M``, ``M⁻¹ W_O``) give the same
circuits and the same module for any invertible ``M`` (the gauge freedom; with RoPE only
for ``M`` that commute with its rotations).

Every function that takes a model reads it through :func:`attnlab.interp.weights.model_weights`:
attnlab ``Decoder`` and ``Encoder``, transformers GPT-2, Llama / Mistral (GQA) and BERT models.
Full circuits go through the token embedding ``W_E`` ``[vocab, d]`` (``model.embed.weight``)
and the unembedding ``W_U`` ``[d, vocab]`` (``model.lm_head.weight.T``; for an encoder,
which has no LM head, the tied ``W_Eᵀ`` of BERT's MLM decoder)::

    full QK = W_E W_QK W_Eᵀ   [H, vocab, vocab]      full OV = W_E W_OV W_U   [H, vocab, vocab]

Positional embeddings and all biases are ignored.  Norms: ``attn_only`` models have none.
Otherwise, for pre-norm models, ``fold_ln=True`` (default) folds everything *linear* about
the norm in front of the head into its reading matrices (``W_Q``, ``W_K``, ``W_V``), and the
final norm into ``W_U``: LayerNorm reads through ``(I - 11ᵀ/d) diag(γ)`` (centring and
weight), RMSNorm through ``diag(γ)``.  What remains ignored is the per-token ``1/σ`` (a
positive scalar per token) and the shift ``β``: with those, ``x_i W_QK x_jᵀ`` becomes
``x_i W_QK x_jᵀ / (σ_i σ_j)``.  ``fold_ln=False`` ignores norms altogether.  Post-norm
models put their norms on the residual stream, not on a head's read: nothing is folded.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.interp.circuits import qk_circuit, ov_circuit, composition_scores, copying_score
>>> model = Decoder(DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
...                               attn_only=True, positions="rope"))
>>> qk_circuit(model.blocks[0].attn).shape, ov_circuit(model, 1).rank.tolist()
(torch.Size([4, 32, 32]), [8, 8, 8, 8])
>>> composition_scores(model, "K").shape, copying_score(model, 0).shape
(torch.Size([2, 4, 2, 4]), torch.Size([4]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from attnlab.interp.factored import FactoredMatrix, qr_r
from attnlab.interp.weights import LayerWeights, ModelWeights, model_weights
from attnlab.nn.attention import MultiHeadAttention

__all__ = [
    "FactoredMatrix",
    "kv_head_index",
    "qk_circuit",
    "ov_circuit",
    "RankReport",
    "rank_report",
    "full_qk_circuit",
    "full_ov_circuit",
    "copying_score",
    "eigenvalue_copying_score",
    "composition_score",
    "head_composition_scores",
    "composition_scores",
    "composition_baseline",
    "Baseline",
    "COMPOSITION_KINDS",
]

COMPOSITION_KINDS = ("Q", "K", "V")


# -- validation ---------------------------------------------------------------------
def _check_attn(attn, name="attn") -> MultiHeadAttention:
    if not isinstance(attn, MultiHeadAttention):
        raise TypeError(f"{name}: expected an attnlab.nn.MultiHeadAttention, got {type(attn).__name__}")
    return attn


def _weights(model, fold_ln=True) -> ModelWeights:
    return model_weights(model, fold_ln=fold_ln)


def _check_kind(kind) -> str:
    k = kind.upper() if isinstance(kind, str) else kind
    if k not in COMPOSITION_KINDS:
        raise ValueError(f"kind: expected one of {COMPOSITION_KINDS} (query-, key- or value-composition), got {kind!r}")
    return k


def kv_head_index(attn) -> torch.Tensor:
    """``(H,)`` LongTensor: the kv head ``h // (H // Hkv)`` that each query head reads
    (of a :class:`MultiHeadAttention` or a :class:`~attnlab.interp.weights.LayerWeights`)."""
    if isinstance(attn, LayerWeights):
        return attn.kv_index
    attn = _check_attn(attn)
    G = attn.n_heads // attn.n_kv_heads
    return torch.arange(attn.n_heads, device=attn.qkv_weight.device) // G


def _embed(w: ModelWeights) -> torch.Tensor:
    if w.W_E is None:
        raise ValueError(f"model: this {w.source} has no token embedding W_E; full circuits need one")
    return w.W_E


def _int_at_least(v, name: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    return v


def _unembed(w: ModelWeights) -> torch.Tensor:
    if w.W_U is None:
        raise ValueError(f"model: this {w.source} has no unembedding W_U; full OV circuits need one")
    return w.W_U if w.final_norm is None else w.final_norm.fold(w.W_U)


def _rope_rotations(rope, query_pos, key_pos, dtype, device, d):
    """``R_i``, ``R_j`` ``[d_head, d_head]`` with ``rope(q, i) = q R_i`` (row vectors), from one
    call so a dynamic scaling sees one sequence whose last position is ``max(i, j)``."""
    for name, p in (("query_pos", query_pos), ("key_pos", key_pos)):
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"{name}: expected a non-negative int position, got {p!r}")
    eye = torch.eye(d, dtype=dtype, device=device)
    pos = torch.tensor([query_pos] * d + [key_pos] * d, device=device)
    R = rope(torch.cat([eye, eye])[None, None], pos)[0, 0]
    return R[:d], R[d:]


# -- per-layer circuits -----------------------------------------------------------------
def _fold(norm, W):
    return W if norm is None else norm.fold(W)


def _qk(lw: LayerWeights, query_pos=None, key_pos=None) -> FactoredMatrix:
    norm = lw.read_norm
    WQ = _fold(norm, lw.W_Q)
    WK = _fold(norm, lw.W_K)[lw.kv_index]
    if query_pos is not None or key_pos is not None:
        if not hasattr(lw.positions, "cos_sin"):
            raise ValueError(
                "query_pos/key_pos: only RoPE makes W_QK depend on positions; this attention has "
                f"positions={type(lw.positions).__name__}; leave them None"
            )
        if query_pos is None or key_pos is None:
            raise ValueError(
                f"query_pos/key_pos: give both or neither, got query_pos={query_pos!r}, key_pos={key_pos!r}"
            )
        Ri, Rj = _rope_rotations(lw.positions, query_pos, key_pos, WQ.dtype, WQ.device, lw.d_head)
        WQ, WK = WQ @ Ri, WK @ Rj
    return FactoredMatrix(WQ.clone() if norm is None else WQ, WK.mT)


def _ov(lw: LayerWeights) -> FactoredMatrix:
    WV = _fold(lw.read_norm, lw.W_V)[lw.kv_index]
    return FactoredMatrix(WV, lw.W_O.clone())


def _circuit(fn, obj, layer, fold_ln, **kw):
    if isinstance(obj, (MultiHeadAttention, LayerWeights)):
        if layer is not None:
            raise ValueError(f"layer: a {type(obj).__name__} is one layer; got layer={layer!r}")
        return fn(LayerWeights.of(obj) if isinstance(obj, MultiHeadAttention) else obj, **kw)
    try:
        w = model_weights(obj, fold_ln=fold_ln)
    except TypeError as e:
        if not str(e).startswith("model: expected"):
            raise
        raise TypeError(
            f"attn: expected an attnlab.nn.MultiHeadAttention, or a model (attnlab Decoder / Encoder, "
            f"transformers GPT-2 / Llama / Mistral / BERT) with layer, got {type(obj).__name__}"
        ) from None
    if layer is None:
        per = [fn(lw, **kw) for lw in w.layers]
        return FactoredMatrix(torch.stack([c.A for c in per]), torch.stack([c.B for c in per]))
    return fn(w.layer(layer), **kw)


def qk_circuit(
    attn, layer: int | None = None, *, fold_ln: bool = True, query_pos: int | None = None, key_pos: int | None = None
) -> FactoredMatrix:
    """``W_QK[h] = W_Q[h] W_K[g(h)]ᵀ`` as a :class:`FactoredMatrix` ``[H, d_model, d_model]``.

    ``scores[h, i, j] = scale · x_i W_QK[h] x_jᵀ`` (plus bias terms, score mods) — the
    circuit excludes the softmax scale ``attn.scale`` and all biases.

    Args:
        attn: a :class:`MultiHeadAttention`, or a model with ``layer`` (an int, negative
            counting from the end: ``[H, d, d]``; ``None``: every layer stacked,
            ``[n_layers, H, d, d]``).  Models: attnlab ``Decoder`` / ``Encoder``,
            transformers GPT-2 / Llama / Mistral / BERT, or a
            :class:`~attnlab.interp.weights.ModelWeights` (see :mod:`attnlab.interp.weights`).
        fold_ln: for a pre-norm model, fold the norm in front of the attention into the
            reads (see the module docstring).
        query_pos, key_pos: with RoPE, the circuit between a query at absolute position
            ``query_pos`` and a key at ``key_pos``: ``W_Q R_i R_jᵀ W_Kᵀ`` (depends on
            ``i - j`` only for plain RoPE).  Without them RoPE is ignored, which is the
            ``i == j`` circuit.
    """
    return _circuit(_qk, attn, layer, fold_ln, query_pos=query_pos, key_pos=key_pos)


def ov_circuit(attn, layer: int | None = None, *, fold_ln: bool = True) -> FactoredMatrix:
    """``W_OV[h] = W_V[g(h)] W_O[h]`` as a :class:`FactoredMatrix` ``[H, d_model, d_model]``:
    head ``h`` adds ``Σ_j A[i, j] x_j W_OV[h]`` to the residual stream (biases excluded).
    ``attn``/``layer``/``fold_ln`` as in :func:`qk_circuit`."""
    return _circuit(_ov, attn, layer, fold_ln)


@dataclass
class RankReport:
    """Numerical ranks of the QK and OV circuits (``[H]`` or ``[n_layers, H]``) against the
    bound ``d_head`` (``rank ≤ min(d_head, d_model)`` always holds mathematically;
    ``full`` says whether every circuit reaches it)."""

    qk: torch.Tensor
    ov: torch.Tensor
    d_head: int
    d_model: int

    @property
    def bound(self) -> int:
        return min(self.d_head, self.d_model)

    @property
    def ok(self) -> bool:
        """``rank ≤ d_head`` for every circuit."""
        return bool((self.qk <= self.bound).all() and (self.ov <= self.bound).all())

    @property
    def full(self) -> bool:
        """Every circuit has rank exactly ``min(d_head, d_model)``."""
        return bool((self.qk == self.bound).all() and (self.ov == self.bound).all())

    def __str__(self) -> str:
        def low(r):
            return [tuple(i.tolist()) if i.dim() else () for i in (r < self.bound).nonzero()]

        return (
            f"RankReport(bound d_head={self.d_head}, ok={self.ok}, qk max={int(self.qk.max())}, "
            f"ov max={int(self.ov.max())}, rank-deficient qk heads={low(self.qk)}, ov heads={low(self.ov)})"
        )


def rank_report(
    attn, layer: int | None = None, *, fold_ln: bool = True, atol: float | None = None, rtol: float | None = None
) -> RankReport:
    """Check the rank bottleneck: numerical ranks of ``W_QK`` and ``W_OV`` per head (tolerance as
    :meth:`FactoredMatrix.matrix_rank`).  Arguments as in :func:`qk_circuit`."""
    qk, ov = qk_circuit(attn, layer, fold_ln=fold_ln), ov_circuit(attn, layer, fold_ln=fold_ln)
    a = attn if isinstance(attn, (MultiHeadAttention, LayerWeights)) else _weights(attn, fold_ln).layers[0]
    with torch.no_grad():
        return RankReport(
            qk.matrix_rank(atol=atol, rtol=rtol), ov.matrix_rank(atol=atol, rtol=rtol), a.d_head, a.d_model
        )


# -- full circuits through the embeddings ----------------------------------------------
def full_qk_circuit(model, layer: int, *, fold_ln: bool = True) -> FactoredMatrix:
    """``W_E W_QK[h] W_Eᵀ`` ``[H, vocab, vocab]`` (factored, inner ``d_head``): entry
    ``[h, s, t]`` is the (unscaled) score a query token ``s`` gives a key token ``t``
    through the direct path (token embeddings only; positions and biases ignored)."""
    w = _weights(model, fold_ln)
    c = qk_circuit(w, layer)
    W_E = _embed(w)
    return FactoredMatrix(W_E @ c.A, c.B @ W_E.T)


def full_ov_circuit(model, layer: int, *, fold_ln: bool = True) -> FactoredMatrix:
    """``W_E W_OV[h] W_U`` ``[H, vocab, vocab]`` (factored, inner ``d_head``): row ``s`` is what
    attending to a token ``s`` adds to the logits through the direct path."""
    w = _weights(model, fold_ln)
    c = ov_circuit(w, layer)
    return FactoredMatrix(_embed(w) @ c.A, c.B @ _unembed(w))


def eigenvalue_copying_score(circuit: FactoredMatrix) -> torch.Tensor:
    """``Re(Σ λ) / Σ |λ|`` over the eigenvalues of a square circuit (Elhage et al., 2021;
    TransformerLens' ``full_OV_circuit.eigenvalues``): +1 when all eigenvalues are positive
    (copying), −1 when all are negative; NaN for the zero matrix.  The eigenvalues come
    from the small ``B A`` (see :attr:`FactoredMatrix.eigenvalues`)."""
    if not isinstance(circuit, FactoredMatrix):
        raise TypeError(f"circuit: expected a FactoredMatrix, got {type(circuit).__name__}")
    lam = circuit.eigenvalues
    return lam.sum(-1).real / lam.abs().sum(-1)


def copying_score(model, layer: int, *, fold_ln: bool = True) -> torch.Tensor:
    """``(H,)`` copying scores of ``layer``'s heads: :func:`eigenvalue_copying_score` of the
    full OV circuit ``W_E W_OV W_U`` (its ``d_head`` eigenvalues via ``W_O W_U W_E W_V``)."""
    return eigenvalue_copying_score(full_ov_circuit(model, layer, fold_ln=fold_ln))


# -- composition ----------------------------------------------------------------------------
def composition_score(left: FactoredMatrix, right: FactoredMatrix) -> torch.Tensor:
    """``‖left · right‖_F / (‖left‖_F ‖right‖_F)``, broadcasting over leading dims; all three
    norms from the factors (QR of ``left.A`` and ``right.Bᵀ`` and the ``r × r`` cores).  In
    ``[0, 1]``; NaN where a factor is zero."""
    for name, f in (("left", left), ("right", right)):
        if not isinstance(f, FactoredMatrix):
            raise TypeError(f"{name}: expected a FactoredMatrix, got {type(f).__name__}")
    if left.rdim != right.ldim:
        raise ValueError(
            f"composition_score: left {tuple(left.shape)} and right {tuple(right.shape)} do not "
            f"chain (need left n == right m)"
        )
    RA, RB = qr_r(left.A), qr_r(right.B.mT)
    nl = torch.linalg.matrix_norm(RA @ qr_r(left.B.mT).mT)
    nr = torch.linalg.matrix_norm(qr_r(right.A) @ RB.mT)
    nlr = torch.linalg.matrix_norm(RA @ (left.B @ right.A) @ RB.mT)
    return nlr / (nl * nr)


def _right(qk, ov, kind):
    return {"Q": qk, "K": qk.T, "V": ov}[kind]


def head_composition_scores(earlier: MultiHeadAttention, later: MultiHeadAttention, kind: str) -> torch.Tensor:
    """``[H_earlier, H_later]`` composition scores of the heads of two attentions (the
    ``earlier`` one writes into the residual stream that the ``later`` one reads).

    With ``W_QK``, ``W_OV`` in this module's row-vector convention (TransformerLens)::

        Q:  ‖W_OV^e W_QK^l‖   / (‖W_OV^e‖ ‖W_QK^l‖)     (the query reads what e wrote)
        K:  ‖W_OV^e W_QK^lᵀ‖  / (‖W_OV^e‖ ‖W_QK^l‖)     (the key reads what e wrote)
        V:  ‖W_OV^e W_OV^l‖   / (‖W_OV^e‖ ‖W_OV^l‖)     (the value reads what e wrote)

    (Frobenius norms.)  These are Elhage et al.'s ``‖W_QKᵀ W_OV‖``, ``‖W_QK W_OV‖``,
    ``‖W_OV^l W_OV^e‖`` written for column vectors, where ``W_OV`` is the transpose of ours.
    Compare with :func:`composition_baseline`.
    """
    k = _check_kind(kind)
    e, l = (
        x if isinstance(x, LayerWeights) else _check_attn(x, n) for x, n in ((earlier, "earlier"), (later, "later"))
    )
    if e.d_model != l.d_model:
        raise ValueError(f"earlier/later: d_model differs ({e.d_model} vs {l.d_model})")
    left = ov_circuit(e)[:, None]
    return composition_score(left, _right(qk_circuit(l), ov_circuit(l), k)[None])


def composition_scores(model, kind: str, *, fold_ln: bool = True, fill: float = 0.0) -> torch.Tensor:
    """``[n_layers, H, n_layers, H]``: ``[l1, h1, l2, h2]`` is the ``kind``-composition score
    of head ``h1`` of layer ``l1`` (writing) into head ``h2`` of layer ``l2`` (reading),
    formulas in :func:`head_composition_scores`; TransformerLens' ``all_composition_scores``
    layout.  Entries with ``l1 >= l2`` (no composition possible) are ``fill`` (0, as in
    TransformerLens; pass ``float('nan')`` to mark them undefined)."""
    k = _check_kind(kind)
    w = _weights(model, fold_ln)
    qk, ov = qk_circuit(w), ov_circuit(w)
    s = composition_score(ov[:, :, None, None], _right(qk, ov, k)[None, None])
    L = w.n_layers
    ar = torch.arange(L, device=s.device)
    ok = (ar[:, None] < ar[None, :])[:, None, :, None]
    return torch.where(ok, s, torch.full((), fill, dtype=s.dtype, device=s.device))


class Baseline(NamedTuple):
    mean: float
    std: float
    n: int


def composition_baseline(
    d_model, d_head: int | None = None, *, n: int = 200, seed: int = 0, dtype: torch.dtype = torch.float64
) -> Baseline:
    """Mean and std of the composition score for random heads of the same shapes: ``W_Q``,
    ``W_K``, ``W_V`` ``[d_model, d_head]`` and ``W_O`` ``[d_head, d_model]`` with i.i.d.
    Gaussian entries (any scale: the score is scale-free).  Since Gaussian matrices are
    invariant in law under transposition, the Q, K and V scores share this one
    distribution.  ``n`` samples from ``torch.Generator().manual_seed(seed)`` (CPU).

    The mean comes out close to ``1/sqrt(d_model)`` (independent random subspaces), e.g.
    0.124 for ``(64, 8)`` and 0.036 for ``(768, 64)``; the std shrinks as ``d_head`` grows.

    ``composition_baseline(model)`` (any model :func:`composition_scores` takes, ``d_head``
    left out) reads both sizes from the model's first layer."""
    if not isinstance(d_model, int) and d_head is None:
        lw = _weights(d_model).layers[0]
        d_model, d_head = lw.d_model, lw.d_head
    d_model, d_head, n = (
        _int_at_least(d_model, "d_model", 1),
        _int_at_least(d_head, "d_head", 1),
        _int_at_least(n, "n", 2),
    )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating dtype, got {dtype}")
    g = torch.Generator().manual_seed(seed)
    out = []
    chunk = max(1, min(n, (1 << 22) // (4 * d_model * d_head)))
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        WV, WQ, WK = (torch.randn(m, d_model, d_head, generator=g, dtype=dtype) for _ in range(3))
        WO = torch.randn(m, d_head, d_model, generator=g, dtype=dtype)
        out.append(composition_score(FactoredMatrix(WV, WO), FactoredMatrix(WQ, WK.mT)))
    s = torch.cat(out)
    return Baseline(float(s.mean()), float(s.std()), n)
