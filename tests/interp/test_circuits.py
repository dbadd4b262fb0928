"""FactoredMatrix against dense algebra; QK/OV circuits against the module's own forward;
gauge freedom; composition and copying scores on hand-built heads (float64 throughout)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from attnlab import masks
from attnlab.interp.circuits import (
    Baseline,
    composition_baseline,
    composition_score,
    composition_scores,
    copying_score,
    eigenvalue_copying_score,
    full_ov_circuit,
    full_qk_circuit,
    head_composition_scores,
    kv_head_index,
    ov_circuit,
    qk_circuit,
    rank_report,
)
from attnlab.interp.factored import FactoredMatrix
from attnlab.nn import Decoder, DecoderConfig, MultiHeadAttention
from attnlab.positions import RoPE
from tests.helpers import F32_AGAINST_F64, F64_REORDER, F64_SUMMARY, MOVED, MOVED_SLIGHTLY

D = torch.float64
TOL = dict(**F64_REORDER)  # float64 algebra on O(1) numbers: roundoff is ~1e-14


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def close(a, b, **kw):
    a = a.AB if isinstance(a, FactoredMatrix) else a
    b = b.AB if isinstance(b, FactoredMatrix) else b
    torch.testing.assert_close(a, b, **(kw or TOL))


def setw(view, value):
    with torch.no_grad():
        view.copy_(value)


def mha(H, Hkv, d_model=16, d_head=4, *, bias=False, positions=None, seed=0):
    torch.manual_seed(seed)
    m = MultiHeadAttention(d_model, H, Hkv, d_head, bias=bias, positions=positions).double()
    with torch.no_grad():  # O(1) weights: sharp, non-uniform attention patterns
        m.qkv_weight.normal_(0, 0.5)
        m.out_weight.normal_(0, 0.5)
        if bias:
            m.qkv_bias.normal_(0, 0.5)
            m.out_bias.normal_(0, 0.5)
    return m


def decoder(seed=0, std=0.3, **kw):
    cfg = dict(
        vocab_size=11, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, attn_only=True, positions="none", bias=False
    )
    cfg.update(kw)
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(**cfg)).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    return model


def causal_softmax(scores, scale):
    N = scores.shape[-1]
    keep = torch.ones(N, N, dtype=torch.bool).tril()
    return torch.softmax((scale * scores).masked_fill(~keep, -math.inf), dim=-1)


def maxdiff(a, b):
    return float((a - b).detach().abs().max())


def same_multiset(a, b, tol=1e-9):
    d = (a[:, None] - b[None, :]).abs()
    assert float(d.min(1).values.max()) < tol and float(d.min(0).values.max()) < tol, (a, b)


# ==================================================================================
# FactoredMatrix
# ==================================================================================
def test_factored_matmul_chains_both_sides_and_broadcasting():
    A, B = rnd(2, 3, 6, 2, seed=1), rnd(3, 2, 5, seed=2)  # leading [L=2, H=3] broadcast with [3]
    fm, dense = FactoredMatrix(A, B), A @ B
    assert fm.shape == dense.shape == (2, 3, 6, 5) and fm.ndim == 4 and fm.mdim == 2 and len(fm) == 2
    close(fm.AB, dense)
    close(fm.T, dense.mT)
    C, Dl = rnd(5, 4, seed=3), rnd(7, 6, seed=4)
    right, left = fm @ C, Dl @ fm
    assert isinstance(right, FactoredMatrix) and isinstance(left, FactoredMatrix)
    assert right.mdim == 2 and left.mdim == 2  # stays at the bottleneck
    close(right, dense @ C)
    close(left, Dl @ dense)
    close(Dl @ fm @ C, Dl @ dense @ C)
    v, w = rnd(5, seed=5), rnd(6, seed=6)
    close(fm @ v, dense @ v)
    close(w @ fm, w @ dense)
    # FactoredMatrix @ FactoredMatrix, both associations
    for r2 in (1, 3):
        other = FactoredMatrix(rnd(5, r2, seed=7), rnd(r2, 4, seed=8))
        p = fm @ other
        assert isinstance(p, FactoredMatrix) and p.mdim == min(2, r2)
        close(p, dense @ other.AB)
        close(other.T @ fm.T, (dense @ other.AB).mT)
    # a wide inner dim (r > n, r > m): the product keeps the smaller shared dim
    W = FactoredMatrix(rnd(6, 8, seed=9), rnd(8, 5, seed=10))
    assert (W @ C).mdim == 5 and (Dl @ W).mdim == 6
    close(W @ C, W.AB @ C)
    close(Dl @ W, Dl @ W.AB)
    # per-layer right factor broadcasting against [L, H]
    Cl = rnd(2, 1, 5, 4, seed=11)
    assert (fm @ Cl).shape == (2, 3, 6, 4)
    close(fm @ Cl, dense @ Cl)
    close(-fm, -dense)
    close(2.5 * fm, 2.5 * dense)


@pytest.mark.parametrize("m,r,n", [(7, 3, 6), (4, 6, 5)])
def test_factored_svd_norm_rank_match_dense(m, r, n):
    fm = FactoredMatrix(rnd(2, 3, m, r, seed=m), rnd(2, 3, r, n, seed=n))
    dense = fm.AB
    q = min(m, r, n)
    U, S, Vh = fm.svd()
    assert U.shape == (2, 3, m, q) and S.shape == (2, 3, q) and Vh.shape == (2, 3, q, n)
    close(S, torch.linalg.svdvals(dense)[..., :q])
    close(fm.svdvals(), S)
    close(U @ torch.diag_embed(S) @ Vh, dense)
    close(U.mT @ U, torch.eye(q, dtype=D).expand(2, 3, q, q))
    close(Vh @ Vh.mT, torch.eye(q, dtype=D).expand(2, 3, q, q))
    close(fm.norm(), torch.linalg.matrix_norm(dense))
    assert fm.rank.shape == (2, 3)
    assert torch.equal(fm.rank, torch.linalg.matrix_rank(dense)) and bool((fm.rank == q).all())


def test_factored_rank_deficient_and_tolerance():
    A = rnd(3, 10, 4, seed=1)
    A[1, :, 3] = A[1, :, 0] - 2 * A[1, :, 1]  # head 1: rank 3
    A[2] = 0  # head 2: rank 0
    fm = FactoredMatrix(A, rnd(3, 4, 9, seed=2))
    assert fm.rank.tolist() == [4, 3, 0]
    assert fm.rank.tolist() == torch.linalg.matrix_rank(fm.AB).tolist()
    big = float(fm.svdvals()[0, 0]) * 2
    assert fm.matrix_rank(atol=big).tolist() == [0, 0, 0]
    assert FactoredMatrix(rnd(5, 2), rnd(2, 5)).rank.dim() == 0


def test_factored_eigenvalues_are_the_nonzero_eigenvalues_of_AB():
    fm = FactoredMatrix(rnd(3, 6, 2, seed=1), rnd(3, 2, 6, seed=2))
    lam = fm.eigenvalues
    assert lam.shape == (3, 2) and lam.is_complex()
    close(fm.BA, fm.B @ fm.A)
    full = torch.linalg.eigvals(fm.AB)
    for h in range(3):
        order = full[h].abs().argsort(descending=True)
        same_multiset(lam[h], full[h][order[:2]])
        assert float(full[h][order[2:]].abs().max()) < 1e-12  # the rest of AB's spectrum is zero
    wide = FactoredMatrix(rnd(3, 5, seed=3), rnd(5, 3, seed=4))  # r > m: eigenvalues of AB itself
    same_multiset(wide.eigenvalues, torch.linalg.eigvals(wide.AB))


def test_factored_getitem_over_leading_dims():
    A, B = rnd(2, 3, 5, 2, seed=1), rnd(3, 2, 4, seed=2)
    fm, dense = FactoredMatrix(A, B), A @ B
    close(fm[1], dense[1])
    close(fm[:, 2], dense[:, 2])
    close(fm[1, 0], dense[1, 0])
    close(fm[..., 0], dense[:, 0])  # ... spans leading dims only
    close(fm[torch.tensor([1, 0])], dense[torch.tensor([1, 0])])
    close(fm[:, torch.tensor([2, 0])], dense[:, [2, 0]])
    assert fm[None].shape == (1, 2, 3, 5, 4) and fm[:, None].shape == (2, 1, 3, 5, 4)
    with pytest.raises(IndexError, match="leading dims"):
        fm[0, 0, 0]
    with pytest.raises(IndexError, match="leading dims"):
        FactoredMatrix(rnd(5, 2), rnd(2, 4))[0]


def test_factored_gradient_of_norm_matches_dense():
    A, B = rnd(6, 3, seed=1).requires_grad_(), rnd(3, 5, seed=2).requires_grad_()
    FactoredMatrix(A, B).norm().backward()
    A2, B2 = A.detach().clone().requires_grad_(), B.detach().clone().requires_grad_()
    torch.linalg.matrix_norm(A2 @ B2).backward()
    close(A.grad, A2.grad)
    close(B.grad, B2.grad)


def test_factored_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"A \(3, 4\).*B \(5, 2\)"):
        FactoredMatrix(rnd(3, 4), rnd(5, 2))
    with pytest.raises(ValueError, match="at least 2 dims"):
        FactoredMatrix(rnd(3), rnd(3, 2))
    with pytest.raises(ValueError, match="do not broadcast"):
        FactoredMatrix(rnd(2, 3, 4), rnd(3, 4, 5))
    with pytest.raises(TypeError, match="tensors"):
        FactoredMatrix([[1.0]], rnd(1, 1))
    with pytest.raises(TypeError, match="dtype"):
        FactoredMatrix(rnd(3, 2), rnd(2, 3).float())
    with pytest.raises(TypeError, match="floating"):
        FactoredMatrix(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long))
    fm = FactoredMatrix(rnd(3, 2), rnd(2, 4))
    with pytest.raises(ValueError, match=r"\(3, 4\) @ \(3, 5\)"):
        fm @ rnd(3, 5)
    with pytest.raises(ValueError, match=r"\(2, 2\) @ \(3, 4\)"):
        rnd(2, 2) @ fm
    with pytest.raises(ValueError, match="inner dimensions"):
        fm @ fm
    with pytest.raises(TypeError, match="dtypes differ"):
        fm @ rnd(4, 2).float()
    with pytest.raises(TypeError):
        fm @ "x"
    with pytest.raises(ValueError, match="square"):
        _ = fm.BA
    with pytest.raises(ValueError, match="square"):
        _ = fm.eigenvalues


# ==================================================================================
# QK / OV circuits against the module's forward
# ==================================================================================
@pytest.mark.parametrize("H,Hkv", [(4, 4), (8, 2), (4, 1)])
def test_circuits_equal_forward_scores_and_outputs(H, Hkv):
    m = mha(H, Hkv)
    x = rnd(1, 7, 16, seed=3)
    q, k, _v = m.project(x)
    idx = kv_head_index(m)
    assert idx.tolist() == [h // (H // Hkv) for h in range(H)]
    qk, ov = qk_circuit(m), ov_circuit(m)
    assert qk.shape == ov.shape == (H, 16, 16) and qk.mdim == ov.mdim == 4
    scores = q[0] @ k[0, idx].mT  # (H, N, N), bias off
    close(x[0] @ qk @ x[0].T, scores)
    for h in range(H):
        close(qk[h], m.W_Q[h] @ m.W_K[h // (H // Hkv)].T)
        close(ov[h], m.W_V[h // (H // Hkv)] @ m.W_O[h])
    if Hkv not in (1, H):  # GQA: a modulo mapping (h % Hkv) would read the wrong kv head
        h = 1
        assert not torch.allclose(qk[h].AB, m.W_Q[h] @ m.W_K[h % Hkv].T)
    # the pattern is softmax(scale · x W_QK xᵀ), and the output is Σ_h A_h x W_OV[h]
    A = causal_softmax(scores, m.scale)
    out, w = m(x, mask=masks.causal(), need_weights=True)
    torch.testing.assert_close(w[0].double(), A, **F32_AGAINST_F64)  # the pattern is float32
    close(out[0], (A @ (x[0] @ ov).AB).sum(0))


def test_qk_circuit_with_rope_positions_gives_the_rotated_scores():
    m = mha(4, 2, d_head=8, positions=RoPE(8))
    x = rnd(1, 9, 16, seed=4)
    q, k, _ = m.project(x)
    qr, kr = m.positions(q, 0), m.positions(k, 0)
    idx = kv_head_index(m)
    plain = qk_circuit(m)
    for i, j in [(5, 2), (3, 3), (8, 0), (0, 6)]:
        c = qk_circuit(m, query_pos=i, key_pos=j)
        expect = (qr[0, :, i, None, :] * kr[0, idx, j, None, :]).sum(-1)[:, 0]
        close((x[0, i] @ c) @ x[0, j], expect)
        if i == j:
            close(c, plain)  # R_i R_iᵀ = I
        else:
            assert not torch.allclose(c.AB, plain.AB, **MOVED)
    close(qk_circuit(m, query_pos=7, key_pos=4), qk_circuit(m, query_pos=3, key_pos=0))  # relative
    with pytest.raises(ValueError, match="both or neither"):
        qk_circuit(m, query_pos=1)
    with pytest.raises(ValueError, match="RoPE"):
        qk_circuit(mha(4, 2), query_pos=1, key_pos=0)


def test_rank_bottleneck_report():
    m = mha(8, 2)
    rep = rank_report(m)
    assert rep.qk.tolist() == [4] * 8 and rep.ov.tolist() == [4] * 8 and rep.ok and rep.full
    with torch.no_grad():
        m.W_V[0][:, 1] = 0.0  # kv head 0 loses a value direction
    rep = rank_report(m)
    assert rep.ov.tolist() == [3] * 4 + [4] * 4  # its 4 query heads share it
    assert rep.qk.tolist() == [4] * 8 and rep.ok and not rep.full
    assert "ov heads=[(0,), (1,), (2,), (3,)]" in str(rep)
    wide = rank_report(mha(2, 2, d_model=6, d_head=8))  # d_head > d_model: bound is d_model
    assert wide.qk.tolist() == [6, 6] and wide.full
    model = decoder(n_layers=3)
    rep = rank_report(model)
    assert rep.qk.shape == (3, 4) and rep.full


# ==================================================================================
# Gauge freedom
# ==================================================================================
def well_conditioned(d, seed):
    M = torch.eye(d, dtype=D) + 0.5 * rnd(d, d, seed=seed)
    assert float(torch.linalg.cond(M)) < 100
    return M


def test_gauge_freedom_of_qk_no_rope_gqa():
    H, Hkv, dh = 8, 2, 4
    m = mha(H, Hkv, bias=True)
    x = rnd(2, 6, 16, seed=5)
    ref, qk0, WQ0 = m(x, mask=masks.causal()), qk_circuit(m).AB, m.W_Q.clone()
    Ms = [well_conditioned(dh, 10 + g) for g in range(Hkv)]
    G = H // Hkv
    with torch.no_grad():
        for g in range(Hkv):
            Minv_T = torch.linalg.inv(Ms[g]).T
            m.W_K[g].copy_(m.W_K[g] @ Minv_T)
            m.b_K[g].copy_(m.b_K[g] @ Minv_T)
        for h in range(H):
            m.W_Q[h].copy_(m.W_Q[h] @ Ms[h // G])
            m.b_Q[h].copy_(m.b_Q[h] @ Ms[h // G])
    assert maxdiff(m.W_Q, WQ0) > 0.1  # the factors did change
    close(qk_circuit(m), qk0)
    close(m(x, mask=masks.causal()), ref)
    # one M per *kv* head: using the M of the wrong group breaks it
    with torch.no_grad():
        m.W_Q[1].copy_(m.W_Q[1] @ torch.linalg.inv(Ms[0]) @ Ms[1])
    assert maxdiff(m(x, mask=masks.causal()), ref) > 1e-3


@pytest.mark.parametrize("interleaved", [False, True])
def test_gauge_freedom_under_rope_only_for_commuting_M(interleaved):
    H, Hkv, dh = 4, 2, 8
    x = rnd(1, 9, 16, seed=6)

    def transformed(M):
        m = mha(H, Hkv, d_head=dh, positions=RoPE(dh, interleaved=interleaved), seed=1)
        ref, circ = m(x, mask=masks.causal()), qk_circuit(m, query_pos=6, key_pos=2).AB
        Minv_T = torch.linalg.inv(M).T
        with torch.no_grad():
            for g in range(Hkv):
                m.W_K[g].copy_(m.W_K[g] @ Minv_T)
            for h in range(H):
                m.W_Q[h].copy_(m.W_Q[h] @ M)
        return ref, circ, m(x, mask=masks.causal()), qk_circuit(m, query_pos=6, key_pos=2).AB, m

    # a generic invertible M does not commute with the rotations: outputs change
    ref, circ, out, circ2, m = transformed(well_conditioned(dh, 3))
    assert maxdiff(out, ref) > 1e-3 and not torch.allclose(circ, circ2, **MOVED)
    # M = 2 R_3 + R_7 (a sum of RoPE rotations: a per-pair scaled rotation) commutes with every R_p
    rope = m.positions
    R = lambda p: rope(torch.eye(dh, dtype=D)[None, None], torch.full((dh,), p))[0, 0]  # noqa: E731
    M = 2 * R(3) + R(7)
    close(M @ R(5), R(5) @ M)
    assert not torch.allclose(M, M[0, 0] * torch.eye(dh, dtype=D))  # not a multiple of I
    ref, circ, out, circ2, _ = transformed(M)
    close(out, ref)
    close(circ2, circ)


def test_gauge_freedom_of_ov_gqa_with_rope():
    H, Hkv, dh = 8, 2, 4
    m = mha(H, Hkv, bias=True, positions=RoPE(dh))
    x = rnd(2, 6, 16, seed=7)
    ref, ov0, WO0 = m(x, mask=masks.causal()), ov_circuit(m).AB, m.W_O.clone()
    Ms = [well_conditioned(dh, 20 + g) for g in range(Hkv)]
    with torch.no_grad():
        for g in range(Hkv):
            m.W_V[g].copy_(m.W_V[g] @ Ms[g])
            m.b_V[g].copy_(m.b_V[g] @ Ms[g])
        for h in range(H):
            m.W_O[h].copy_(torch.linalg.inv(Ms[h // (H // Hkv)]) @ m.W_O[h])
    assert maxdiff(m.W_O, WO0) > 0.1
    close(ov_circuit(m), ov0)
    close(m(x, mask=masks.causal()), ref)


# ==================================================================================
# Full circuits, norms folded, copying scores
# ==================================================================================
def test_full_circuits_reproduce_a_one_layer_model():
    model = decoder(tie_embeddings=False)
    attn, G = model.blocks[0].attn, 2
    W_E, W_U = model.embed.weight, model.lm_head.weight.T
    fqk, fov = full_qk_circuit(model, 0), full_ov_circuit(model, 0)
    assert fqk.shape == fov.shape == (4, 11, 11) and fqk.mdim == fov.mdim == 4
    for h in range(4):
        close(fqk[h], W_E @ attn.W_Q[h] @ attn.W_K[h // G].T @ W_E.T)
        close(fov[h], W_E @ attn.W_V[h // G] @ attn.W_O[h] @ W_U)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    t = ids[0]
    q, k, _ = attn.project(model.embed(ids))
    scores = q[0] @ k[0, kv_head_index(attn)].mT
    close(fqk.AB[:, t][:, :, t], scores)
    # logits = direct path + Σ_h A_h · (full OV rows of the attended tokens)
    A = causal_softmax(scores, attn.scale)
    logits = model(ids).logits[0]
    close(logits, W_E[t] @ W_U + (A @ fov.AB[:, t]).sum(0))


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_fold_ln_is_exact_up_to_the_per_token_scale(norm):
    model = decoder(attn_only=False, norm=norm, seed=2)
    block, attn = model.blocks[0], model.blocks[0].attn
    with torch.no_grad():
        for nm in (block.norm1, model.norm):
            nm.weight.copy_(1 + 0.5 * rnd(16, seed=len(norm) + (nm is model.norm)))
    ids = torch.tensor([[2, 7, 1, 8, 2, 8]])
    t = ids[0]
    x = model.embed(ids)[0]
    xn = block.norm1(x)
    q, k, v = attn.project(xn[None])
    idx = kv_head_index(attn)
    scores = q[0] @ k[0, idx].mT
    eps = block.norm1.eps
    sigma = (x.var(-1, unbiased=False) if norm == "layernorm" else x.pow(2).mean(-1)).add(eps).sqrt()
    fqk = full_qk_circuit(model, 0)
    close(fqk.AB[:, t][:, :, t] / (sigma[:, None] * sigma[None, :]), scores)
    raw = full_qk_circuit(model, 0, fold_ln=False)
    close(raw[0], model.embed.weight @ attn.W_Q[0] @ attn.W_K[0].T @ model.embed.weight.T)
    assert not torch.allclose(raw.AB, fqk.AB, **MOVED)
    # OV: head h's write, through the linear part of the final norm and W_U
    A = causal_softmax(scores, attn.scale)
    fov = full_ov_circuit(model, 0)
    gf = model.norm.weight
    for h in range(4):
        z = A[h] @ v[0, idx[h]] @ attn.W_O[h]
        lin = (z - z.mean(-1, keepdim=True)) * gf if norm == "layernorm" else z * gf
        close(A[h] @ (fov.AB[h, t] / sigma[:, None]), lin @ model.lm_head.weight.T)


def test_copying_score_plus_and_minus_one_and_reference():
    model = decoder(vocab_size=20, n_heads=3, n_kv_heads=3, d_head=4, tie_embeddings=True)
    attn = model.blocks[0].attn
    E_S = torch.eye(16, dtype=D)[:, 2:6]
    setw(attn.W_V[0], E_S)
    setw(attn.W_O[0], E_S.T)  # W_OV = projection onto S: full OV = W_E P W_Eᵀ, PSD
    setw(attn.W_V[1], E_S)
    setw(attn.W_O[1], -E_S.T)  # its negative
    s = copying_score(model, 0).detach()
    assert s.shape == (3,)
    torch.testing.assert_close(s[:2], torch.tensor([1.0, -1.0], dtype=D), **F64_SUMMARY)
    lam = torch.linalg.eigvals(full_ov_circuit(model, 0).AB[2])  # dense 20 × 20 reference
    torch.testing.assert_close(s[2], lam.sum().real / lam.abs().sum(), **F64_SUMMARY)
    assert -1 + 1e-3 < float(s[2]) < 1 - 1e-3
    E = rnd(9, 4, seed=8)
    assert abs(float(eigenvalue_copying_score(FactoredMatrix(E, E.T))) - 1) < 1e-12


# ==================================================================================
# Composition
# ==================================================================================
@functools.lru_cache
def _baseline(d, dh):
    return composition_baseline(d, dh, n=200)


@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_composition_hand_built_subspaces(kind):
    d, dh = 64, 8
    model = decoder(vocab_size=10, d_model=d, n_layers=2, n_heads=2, n_kv_heads=2, d_head=dh, std=1.0, seed=3)
    eye = torch.eye(d, dtype=D)
    E_S, E_U = eye[:, :dh], eye[:, 32 : 32 + dh]
    a0, a1 = model.blocks[0].attn, model.blocks[1].attn
    setw(a0.W_O[0], E_S.T)  # head (0, 0) writes into S
    reader = {"Q": a1.W_Q, "K": a1.W_K, "V": a1.W_V}[kind]
    setw(reader[0], E_S)  # head (1, 0) reads S
    setw(reader[1], E_U)  # head (1, 1) reads U ⊥ S
    s = composition_scores(model, kind).detach()
    base = _baseline(d, dh)
    assert isinstance(base, Baseline) and abs(base.mean - 1 / math.sqrt(d)) < 0.02
    assert float(s[0, 0, 1, 0]) > max(base.mean + 8 * base.std, 2 * base.mean)
    assert float(s[0, 0, 1, 1]) < 1e-12
    close(head_composition_scores(a0, a1, kind), s[0, :, 1, :])
    zero = torch.zeros(2, 2, dtype=D)
    for l1, l2 in [(0, 0), (1, 1), (1, 0)]:
        close(s[l1, :, l2, :], zero)
    nan = composition_scores(model, kind, fill=float("nan"))
    assert bool(nan[1, :, 0, :].isnan().all()) and not bool(nan[0, :, 1, :].isnan().any())


@pytest.mark.parametrize("attn_only", [True, False])
def test_composition_scores_equal_dense_formulas_gqa(attn_only):
    model = decoder(n_layers=3, attn_only=attn_only, seed=4)
    if not attn_only:
        with torch.no_grad():
            for i, b in enumerate(model.blocks):
                b.norm1.weight.copy_(1 + 0.5 * rnd(16, seed=30 + i))

    def read(i, W):  # the pre-norm's linear part, by hand
        if attn_only:
            return W
        G = model.blocks[i].norm1.weight[:, None] * W
        return G - G.mean(-2, keepdim=True)

    QK, OV = [], []
    for i, b in enumerate(model.blocks):
        a = b.attn
        QK.append(torch.stack([read(i, a.W_Q[h]) @ read(i, a.W_K[h // 2]).T for h in range(4)]))
        OV.append(torch.stack([read(i, a.W_V[h // 2]) @ a.W_O[h] for h in range(4)]))
    QK, OV = torch.stack(QK), torch.stack(OV)  # [L, H, d, d]
    fro = torch.linalg.matrix_norm
    for kind, R in [("Q", QK), ("K", QK.mT), ("V", OV)]:
        prod = OV[:, :, None, None] @ R[None, None]
        ref = fro(prod) / (fro(OV)[:, :, None, None] * fro(R)[None, None])
        L = torch.arange(3)
        ref = torch.where((L[:, None] < L[None, :])[:, None, :, None], ref, torch.zeros((), dtype=D))
        close(composition_scores(model, kind), ref)
        if not attn_only:
            assert not torch.allclose(composition_scores(model, kind, fold_ln=False), ref, **MOVED_SLIGHTLY)
    I = torch.eye(16, dtype=D)
    close(
        composition_score(FactoredMatrix(OV[0, 1], I), FactoredMatrix(QK[2, 3], I)),
        fro(OV[0, 1] @ QK[2, 3]) / (fro(OV[0, 1]) * fro(QK[2, 3])),
    )


def test_composition_baseline_matches_an_independent_monte_carlo():
    d, dh, n = 32, 4, 200
    b = composition_baseline(d, dh, n=n, seed=1)
    assert b == composition_baseline(d, dh, n=n, seed=1) and b.n == n
    assert b != composition_baseline(d, dh, n=n, seed=2)
    g = torch.Generator().manual_seed(123)
    WV, WQ, WK = (torch.randn(n, d, dh, generator=g, dtype=D) for _ in range(3))
    WO = torch.randn(n, dh, d, generator=g, dtype=D)
    fro = torch.linalg.matrix_norm
    ov, qk = WV @ WO, WQ @ WK.mT
    mc = fro(ov @ qk) / (fro(ov) * fro(qk))
    se = math.sqrt((b.std**2 + float(mc.std()) ** 2) / n)
    assert abs(b.mean - float(mc.mean())) < 5 * se
    assert 0.75 < b.std / float(mc.std()) < 1.33


def test_circuit_argument_errors():
    model, m = decoder(n_layers=2), mha(4, 2)
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        qk_circuit("attn")
    with pytest.raises(ValueError, match=r"layer: expected an int in \[-2, 2\)"):
        ov_circuit(model, 2)
    with pytest.raises(ValueError, match="one layer"):
        qk_circuit(m, 0)
    with pytest.raises(TypeError, match="Decoder"):
        full_qk_circuit(m, 0)
    with pytest.raises(ValueError, match="kind"):
        composition_scores(model, "O")
    with pytest.raises(ValueError, match="d_head"):
        composition_baseline(16, 0)
    with pytest.raises(TypeError, match="FactoredMatrix"):
        eigenvalue_copying_score(torch.eye(3))
    close(qk_circuit(model, -1), qk_circuit(model)[1])  # negative layers, stacked form
    assert qk_circuit(model).shape == (2, 4, 16, 16)
