"""MultiHeadAttention against a from-scratch float64 reference built from the per-head views.

The reference below is written from the module docstring's equations only:

    q[b, h, i] = x[b, i] @ W_Q[h] + b_Q[h]          (k, v likewise with the kv head h // G)
    p = softmax(q kᵀ / sqrt(d_head) + bias, masked)  (a row with no visible key is 0)
    z[b, h, i] = Σ_j p[b, h, i, j] v[b, h // G, j]
    out[b, i] = Σ_h z[b, h, i] @ W_O[h] + b_O

It never touches the fused weights, so it also checks that the views describe them.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from attnlab import masks
from attnlab.cache import DynamicCache
from attnlab.nn import MultiHeadAttention
from attnlab.positions import ALiBi, RoPE, alibi_slopes
from tests.helpers import F32_REORDER_UNIT, assert_close_rule

F64_TOL = 1e-10  # float64 module vs float64 reference: both exact to ~1e-15 at these sizes


# ----------------------------------------------------------------------------- the reference
def hand_rope(x, pos, base=10000.0):
    """Half-split RoPE written from its definition: channel i pairs with i + d/2, angle p·base^(-2i/d)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.as_tensor(pos, dtype=torch.float64)
    ang = pos[..., None] * inv  # (N, d/2) or (B, N, d/2)
    if ang.dim() == 3:
        ang = ang[:, None]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def reference_mha(mha, x, context=None, allowed=None, bias=None, rope_pos=None):
    """float64 (out (B, N, d_model), pattern (B, H, N, M)) from the per-head views.

    ``allowed``: bool, broadcastable to (B, H, N, M), True = may attend.
    ``bias``: float, broadcastable to (B, H, N, M), added to the scaled scores.
    ``rope_pos``: positions (N,) or (B, N) for a hand-written RoPE on q and k.
    """
    H, Hkv, dh = mha.n_heads, mha.n_kv_heads, mha.d_head
    G = H // Hkv
    x = x.detach().double()
    src = x if context is None else context.detach().double()
    WQ, WK, WV, WO = (w.detach().double() for w in (mha.W_Q, mha.W_K, mha.W_V, mha.W_O))
    has_bias = mha.b_Q is not None
    zq, zk = torch.zeros(H, dh, dtype=torch.float64), torch.zeros(Hkv, dh, dtype=torch.float64)
    bQ = mha.b_Q.detach().double() if has_bias else zq
    bK = mha.b_K.detach().double() if has_bias else zk
    bV = mha.b_V.detach().double() if has_bias else zk
    bO = mha.b_O.detach().double() if has_bias else torch.zeros(mha.d_model, dtype=torch.float64)
    q = torch.einsum("bnm,hme->bhne", x, WQ) + bQ[None, :, None, :]
    k = torch.einsum("bnm,hme->bhne", src, WK) + bK[None, :, None, :]
    v = torch.einsum("bnm,hme->bhne", src, WV) + bV[None, :, None, :]
    if rope_pos is not None:
        q, k = hand_rope(q, rope_pos), hand_rope(k, rope_pos)
    kv_head = torch.tensor([h // G for h in range(H)])
    k, v = k[:, kv_head], v[:, kv_head]
    s = torch.einsum("bhqe,bhke->bhqk", q, k) / math.sqrt(dh)
    if bias is not None:
        s = s + bias
    if allowed is None:
        allowed = torch.ones(s.shape, dtype=torch.bool)
    allowed = torch.broadcast_to(allowed, s.shape)
    empty = ~allowed.any(-1, keepdim=True)
    s = s.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s, -1).masked_fill(~allowed, 0.0)
    z = torch.einsum("bhqk,bhke->bhqe", p, v)
    out = torch.einsum("bhqe,hem->bqm", z, WO) + bO
    return out, p


def causal_allowed(Nq, Nk):
    i = torch.arange(Nq).view(-1, 1) + (Nk - Nq)
    return torch.arange(Nk).view(1, -1) <= i


def make_mha(d_model, H, Hkv=None, d_head=None, *, bias=True, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    m = MultiHeadAttention(d_model, H, Hkv, d_head, bias=bias, **kw)
    with torch.no_grad():  # non-zero biases, so that a misplaced bias is seen
        for b in (m.qkv_bias, m.out_bias):
            if b is not None:
                b.normal_(0.0, 0.5)
    return m.to(dtype).eval()


def randx(*shape, seed=1, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def assert_close(a, b, tol=F64_TOL, what=""):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert err <= tol, f"{what}: max abs error {err:.3e} > {tol:.1e}"


# (d_model, H, Hkv, d_head, bias)
CONFIGS = [
    pytest.param(32, 4, None, None, True, id="mha"),
    pytest.param(32, 8, 2, None, False, id="gqa8:2-nobias"),
    pytest.param(24, 4, 1, None, True, id="mqa4:1"),
    pytest.param(20, 4, 2, 7, True, id="dhead7!=5"),
    pytest.param(16, 3, 3, 11, False, id="dhead11-nobias"),
]
KEEP = torch.tensor([[True] * 9, [False, False, True, True, False, True, True, True, True]])


def mask_case(name, B, N):
    """(attnlab mask, allowed for the reference) for self-attention over N tokens."""
    keep = KEEP[:B, :N]
    if name == "none":
        return None, None
    if name == "causal":
        return masks.causal(), causal_allowed(N, N)
    if name == "key_padding":
        return masks.key_padding(keep), keep[:, None, None, :]
    if name == "causal&key_padding":
        return masks.causal() & masks.key_padding(keep), causal_allowed(N, N) & keep[:, None, None, :]
    raise AssertionError(name)


MASKS = ["none", "causal", "key_padding", "causal&key_padding"]


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("d_model, H, Hkv, d_head, bias", CONFIGS)
def test_matches_float64_reference(d_model, H, Hkv, d_head, bias, mask_name):
    mha = make_mha(d_model, H, Hkv, d_head, bias=bias)
    B, N = 2, 9
    x = randx(B, N, d_model)
    mask, allowed = mask_case(mask_name, B, N)
    want, _ = reference_mha(mha, x, allowed=allowed)
    for backend in ("auto", "flash", "reference"):
        mha.backend = backend
        assert_close(mha(x, mask=mask), want, what=f"{backend}")


def test_shapes_of_views_are_exact():
    mha = MultiHeadAttention(20, 4, 2, 7)
    assert mha.W_Q.shape == (4, 20, 7)
    assert mha.W_K.shape == (2, 20, 7) and mha.W_V.shape == (2, 20, 7)
    assert mha.W_O.shape == (4, 7, 20)
    assert mha.b_Q.shape == (4, 7) and mha.b_K.shape == (2, 7) and mha.b_V.shape == (2, 7)
    assert mha.b_O.shape == (20,)
    nb = MultiHeadAttention(20, 4, 2, 7, bias=False)
    assert nb.b_Q is None and nb.b_K is None and nb.b_V is None and nb.b_O is None
    assert sum(p.numel() for p in nb.parameters()) == (4 + 2 * 2) * 7 * 20 + 20 * 4 * 7


@pytest.mark.parametrize(
    "view, index", [("W_Q", 1), ("W_K", 0), ("W_V", 1), ("W_O", 2), ("b_Q", 3), ("b_K", 1), ("b_V", 0), ("b_O", None)]
)
def test_views_share_storage_with_the_weights(view, index):
    mha = make_mha(20, 4, 2, 7)
    x = randx(2, 5, 20)
    before = mha(x).detach().clone()
    k_before = mha.project(x)[1].detach().clone()
    fused_before = [p.detach().clone() for p in mha.parameters()]
    with torch.no_grad():
        t = getattr(mha, view)
        target = t if index is None else t[index]
        target.add_(torch.randn(target.shape, dtype=target.dtype, generator=torch.Generator().manual_seed(3)))
    changed = [not torch.equal(a, b) for a, b in zip(fused_before, mha.parameters(), strict=True)]
    assert sum(changed) == 1, f"writing {view} must change exactly one stored parameter"
    after = mha(x)
    if view == "b_K":  # a key bias adds q·b_K to a whole score row: softmax-invariant, so look at k
        assert (mha.project(x)[1] - k_before).abs().max() > 1e-3, "writing b_K did not change k"
    else:
        assert (after - before).abs().max() > 1e-3, f"writing {view} did not change the output"
    assert_close(after, reference_mha(mha, x)[0], what=f"after writing {view}")
    # the view is a view: the same storage, no copy
    t = getattr(mha, view)
    owner = {
        "W_Q": mha.qkv_weight,
        "W_K": mha.qkv_weight,
        "W_V": mha.qkv_weight,
        "W_O": mha.out_weight,
        "b_Q": mha.qkv_bias,
        "b_K": mha.qkv_bias,
        "b_V": mha.qkv_bias,
        "b_O": mha.out_bias,
    }[view]
    assert t.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()


def test_views_write_only_their_own_head():
    mha = make_mha(32, 8, 2)
    with torch.no_grad():
        mha.W_Q[5].zero_()
        mha.b_Q[5].zero_()
    q = torch.einsum("bnm,hme->bhne", randx(1, 4, 32), mha.W_Q.detach()) + mha.b_Q.detach()[None, :, None]
    assert q[:, 5].abs().max() == 0
    assert (q[:, [4, 6]].abs().amax((0, 2, 3)) > 0).all()
    # the fused rows of query head 5 are zero, the neighbours are not
    rows = mha.qkv_weight.detach()[5 * 4 : 6 * 4]
    assert rows.abs().max() == 0 and mha.qkv_weight.detach()[4 * 4 : 5 * 4].abs().max() > 0


# ----------------------------------------------------------------------------- cross attention
@pytest.mark.parametrize("d_model, H, Hkv, d_head, bias", CONFIGS)
@pytest.mark.parametrize("use_mask", [False, True])
def test_cross_attention_matches_reference(d_model, H, Hkv, d_head, bias, use_mask):
    mha = make_mha(d_model, H, Hkv, d_head, bias=bias)
    B, N, M = 2, 5, 8
    x, ctx = randx(B, N, d_model, seed=1), randx(B, M, d_model, seed=2)
    keep = torch.tensor([[True] * 8, [True, False, True, True, False, False, True, False]])
    mask = masks.key_padding(keep) if use_mask else None
    allowed = keep[:, None, None, :] if use_mask else None
    want, p = reference_mha(mha, x, context=ctx, allowed=allowed)
    out, w = mha(x, ctx, mask=mask, need_weights=True)
    assert_close(out, want)
    assert_close(w, p)
    assert w.shape == (B, H, N, M)


def test_cross_attention_uses_the_context_for_keys_and_values_only():
    mha = make_mha(16, 4)
    x, ctx = randx(1, 3, 16, seed=1), randx(1, 6, 16, seed=2)
    base = mha(x, ctx)
    ctx2 = ctx.clone()
    ctx2[:, 4] += 1.0
    assert (mha(x, ctx2) - base).abs().max() > 1e-3  # context matters
    # each query row depends on its own x row only
    x2 = x.clone()
    x2[:, 0] += 1.0
    out2 = mha(x2, ctx)
    assert (out2[:, 0] - base[:, 0]).abs().max() > 1e-3
    assert_close(out2[:, 1:], base[:, 1:])


# ----------------------------------------------------------------------------- positions
@pytest.mark.parametrize("Hkv", [4, 2, 1])
@pytest.mark.parametrize("mask_name", ["none", "causal", "causal&key_padding"])
def test_rope_matches_hand_written_rotation(Hkv, mask_name):
    mha = make_mha(32, 4, Hkv, positions=RoPE(8))
    B, N = 2, 7
    x = randx(B, N, 32)
    mask, allowed = mask_case(mask_name, B, N)
    want, _ = reference_mha(mha, x, allowed=allowed, rope_pos=torch.arange(N))
    assert_close(mha(x, mask=mask), want)
    # per-row positions (B, N)
    pos = torch.stack([torch.arange(N) + 3, torch.arange(N) * 2])
    want, _ = reference_mha(mha, x, allowed=allowed, rope_pos=pos)
    assert_close(mha(x, mask=mask, pos=pos), want)


@pytest.mark.parametrize("Hkv", [4, 2])
def test_rope_scores_depend_only_on_relative_position(Hkv):
    mha = make_mha(32, 4, Hkv, positions=RoPE(8))
    x = randx(2, 6, 32)
    base, wb = mha(x, mask=masks.causal(), need_weights=True)
    for shift in (1, 17, 1000):
        out, w = mha(x, mask=masks.causal(), pos=shift, need_weights=True)
        assert_close(out, base, tol=1e-9, what=f"shift {shift}")
        assert_close(w, wb, tol=1e-9, what=f"pattern, shift {shift}")
        out = mha(x, mask=masks.causal(), pos=torch.tensor([[shift] * 6, [2 * shift] * 6]) + torch.arange(6))
        assert_close(out, base, tol=1e-9, what=f"per-row shift {shift}")
    # ... but not on absolute-position *gaps*: positions that are not a shift change the output
    gapped = torch.tensor([0, 1, 2, 10, 11, 12])
    assert (mha(x, mask=masks.causal(), pos=gapped) - base).abs().max() > 1e-4


def test_alibi_matches_reference_bias():
    mha = make_mha(32, 4, 2, positions=ALiBi(4))
    B, N = 2, 7
    x = randx(B, N, 32)
    slopes = alibi_slopes(4).double().view(1, 4, 1, 1)
    i, j = torch.arange(N).view(-1, 1), torch.arange(N).view(1, -1)
    bias = slopes * (j - i).double()  # -m * distance to a past key
    want, p = reference_mha(mha, x, allowed=causal_allowed(N, N), bias=bias)
    out, w = mha(x, mask=masks.causal(), need_weights=True)
    assert_close(out, want)
    assert_close(w, p)


def test_alibi_biases_recent_keys_when_scores_are_flat():
    mha = make_mha(16, 4, positions=ALiBi(4), bias=False)
    with torch.no_grad():
        mha.W_Q.zero_()  # all scores 0: the pattern is the ALiBi prior alone
    _, w = mha(randx(1, 6, 16), mask=masks.causal(), need_weights=True)
    row = w[0, :, 5]  # last query, keys 0..5
    assert (row[:, 1:] > row[:, :-1]).all(), "ALiBi must favour nearer (later) keys"
    s = alibi_slopes(4).double()
    want = torch.softmax(-s[:, None] * torch.arange(5, -1, -1).double(), -1)
    assert_close(row.double(), want, tol=1e-6)


# ----------------------------------------------------------------------------- KV cache
POS_KINDS = [
    pytest.param(None, 4, id="none"),
    pytest.param("rope", 4, id="rope"),
    pytest.param("rope", 2, id="rope-gqa"),
    pytest.param("rope", 1, id="rope-mqa"),
    pytest.param("alibi", 4, id="alibi"),
    pytest.param("alibi", 2, id="alibi-gqa"),
]


def positions_for(kind, H, d_head):
    if kind == "rope":
        return RoPE(d_head)
    if kind == "alibi":
        return ALiBi(H)
    assert kind is None
    return None


@pytest.mark.parametrize("kind, Hkv", POS_KINDS)
@pytest.mark.parametrize("chunks", [(5, 1, 1, 1, 1), (1,) * 6 + (3,), (4, 3, 2)])
@pytest.mark.parametrize("with_pos", [False, True])
def test_cache_prefill_and_decode_equal_full_causal_forward(kind, Hkv, chunks, with_pos):
    mha = make_mha(32, 4, Hkv, positions=positions_for(kind, 4, 8))
    B, N = 2, sum(chunks)
    x = randx(B, N, 32)
    offsets = torch.tensor([[0], [5]])  # with_pos: row 1's positions start at 5 (RoPE only sees them)
    full_pos = (torch.arange(N) + offsets) if with_pos else None
    full, wfull = mha(x, mask=masks.causal(), pos=full_pos, need_weights=True)
    cache = DynamicCache(1)[0]
    start = 0
    for n in chunks:
        pos = full_pos[:, start : start + n] if with_pos else None
        out, w = mha(x[:, start : start + n], mask=masks.causal(), cache=cache, pos=pos, need_weights=True)
        assert cache.seen == start + n
        assert w.shape == (B, 4, n, start + n)
        assert_close(out, full[:, start : start + n], what=f"tokens {start}..{start + n - 1}")
        assert_close(w, wfull[:, :, start : start + n, : start + n], what="pattern")
        start += n


def test_cache_float32_matches_full_forward():
    mha = make_mha(32, 4, 2, positions=RoPE(8), dtype=torch.float32)
    x = randx(2, 8, 32, dtype=torch.float32)
    full = mha(x, mask=masks.causal())
    cache = DynamicCache(1)[0]
    outs = [mha(x[:, :5], mask=masks.causal(), cache=cache)]
    outs += [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(outs, 1), full, **F32_REORDER_UNIT)


def test_cache_stores_rotated_keys_of_kv_heads():
    mha = make_mha(32, 4, 2, positions=RoPE(8))
    x = randx(1, 5, 32)
    store = DynamicCache(1)
    mha(x, mask=masks.causal(), cache=store[0])
    assert store.k[0].shape == (1, 2, 5, 8) and store.v[0].shape == (1, 2, 5, 8)
    k = torch.einsum("bnm,hme->bhne", x, mha.W_K.detach()) + mha.b_K.detach()[None, :, None]
    assert_close(store.k[0], hand_rope(k, torch.arange(5)))


# ----------------------------------------------------------------------------- need_weights
@pytest.mark.parametrize("mask_name", MASKS)
def test_need_weights_is_the_reference_softmax(mask_name):
    mha = make_mha(32, 8, 2)
    B, N = 2, 9
    x = randx(B, N, 32)
    mask, allowed = mask_case(mask_name, B, N)
    want_out, p = reference_mha(mha, x, allowed=allowed)
    out, w = mha(x, mask=mask, need_weights=True)
    assert w.shape == (B, 8, N, N)
    assert_close(out, want_out)
    assert_close(w, p)
    rows = w.sum(-1)
    visible = torch.broadcast_to(allowed, w.shape).any(-1) if allowed is not None else torch.ones_like(rows).bool()
    assert_close(rows[visible], torch.ones_like(rows[visible]), tol=1e-12)
    assert (w.sum(-1)[~visible] == 0).all()
    assert not torch.isnan(w).any() and not torch.isnan(out).any()


def test_need_weights_fully_masked_rows_are_zero_and_output_is_bias():
    mha = make_mha(16, 4)
    keep = torch.tensor([[True, True, True], [False, False, False]])
    out, w = mha(randx(2, 3, 16), mask=masks.key_padding(keep), need_weights=True)
    assert (w[1] == 0).all() and torch.allclose(w[0].sum(-1), torch.ones(4, 3, dtype=w.dtype))
    assert_close(out[1], mha.b_O.detach().expand(3, 16))  # z = 0, out = b_O
    assert not torch.isnan(out).any()


def test_need_weights_causal_is_lower_triangular_float32():
    mha = make_mha(16, 4, dtype=torch.float32)
    _out, w = mha(randx(2, 6, 16, dtype=torch.float32), mask=masks.causal(), need_weights=True)
    assert w.dtype == torch.float32
    assert (torch.triu(w, diagonal=1) == 0).all()
    assert (w[..., causal_allowed(6, 6)] > 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
    torch.testing.assert_close(w[:, :, 0, 0], torch.ones(2, 4))


# ----------------------------------------------------------------------------- dropout
def test_dropout_eval_is_deterministic_and_equals_no_dropout():
    drop = make_mha(32, 4, 2, dropout=0.4, dtype=torch.float32)
    plain = make_mha(32, 4, 2, dropout=0.0, dtype=torch.float32)
    plain.load_state_dict(drop.state_dict())
    x = randx(2, 7, 32, dtype=torch.float32)
    for mask in (None, masks.causal(), masks.sliding_window(3)):
        a, b = drop(x, mask=mask), drop(x, mask=mask)
        assert torch.equal(a, b)
        torch.testing.assert_close(a, plain(x, mask=mask))
    # training mode with dropout=0 is the plain forward too
    plain.train()
    torch.testing.assert_close(plain(x, mask=masks.causal()), drop(x, mask=masks.causal()))


@pytest.mark.parametrize(
    "mask",
    [
        None,
        masks.causal(),
        masks.sliding_window(3),
        masks.key_padding(torch.tensor([[False, True, True, True, True, True]])),
    ],
    ids=["none", "causal", "window3", "key_padding"],
)
def test_dropout_train_changes_output_and_is_unbiased(mask):
    mha = make_mha(16, 4, 2, dropout=0.3, dtype=torch.float32)
    x = randx(1, 6, 16, dtype=torch.float32)
    want = mha(x, mask=mask).detach()
    mha.train()
    torch.manual_seed(0)
    n = 400
    with torch.no_grad():
        S = torch.stack([mha(x, mask=mask) for _ in range(n)])
    assert (S[0] - want).abs().max() > 1e-2, "dropout in training mode must change the output"
    assert not torch.equal(S[0], S[1]), "two training calls must draw different dropout masks"
    mean, sd = S.mean(0), S.std(0)
    # E[out] = out without dropout (inverted dropout); z-score of the sample mean, loose
    z = (mean - want).abs() / (sd / math.sqrt(n) + 1e-6)
    assert z.max() < 5.0, f"sample mean is {z.max():.1f} standard errors from the no-dropout output"


@pytest.mark.parametrize(
    "mask, dependent_rows",
    [(masks.sliding_window(2), slice(2, None)), (masks.causal(), slice(0, 0))],
    ids=["window2", "causal"],
)
def test_dropout_train_respects_the_mask(mask, dependent_rows):
    """With one seed, perturbing token 0 changes no row that may not see it (rows >= 2 under
    sliding_window(2)); and perturbing the last token changes no earlier row under causal()."""
    mha = make_mha(16, 4, 2, dropout=0.5, dtype=torch.float32).train()
    x = randx(1, 6, 16, dtype=torch.float32)
    torch.manual_seed(7)
    base = mha(x, mask=mask)
    x0, xl = x.clone(), x.clone()
    x0[:, 0] += 3.0
    xl[:, -1] += 3.0
    torch.manual_seed(7)
    out0 = mha(x0, mask=mask)
    torch.manual_seed(7)
    outl = mha(xl, mask=mask)
    torch.testing.assert_close(outl[:, :-1], base[:, :-1])  # causal: the last token is unseen
    if dependent_rows.start != dependent_rows.stop:
        torch.testing.assert_close(out0[:, dependent_rows], base[:, dependent_rows])


def test_dropout_train_need_weights_returns_undropped_pattern():
    mha = make_mha(16, 4, dropout=0.5, dtype=torch.float32).train()
    for mask in (masks.causal(), masks.sliding_window(2)):
        _, w = mha(randx(1, 5, 16, dtype=torch.float32), mask=mask, need_weights=True)
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 5))


# ----------------------------------------------------------------------------- backends
BACKEND_CASES = [
    pytest.param(dict(d_model=32, H=4, Hkv=2, positions="rope"), "causal", id="gqa-rope-causal"),
    pytest.param(dict(d_model=24, H=4, Hkv=1, positions="alibi"), "causal", id="mqa-alibi-causal"),
    pytest.param(dict(d_model=20, H=4, Hkv=4, d_head=7), "key_padding", id="dhead7-keypad"),
    pytest.param(dict(d_model=32, H=8, Hkv=2), "none", id="gqa-nomask"),
    pytest.param(dict(d_model=32, H=8, Hkv=2), "window", id="gqa-window"),
]


def _run_grads(mha, x, mask, w):
    x = x.detach().clone().requires_grad_(True)
    out = mha(x, mask=mask)
    loss = (out.double() * w).sum()
    params = [p for _, p in sorted(mha.named_parameters())]
    grads = torch.autograd.grad(loss, [x, *params])
    names = ["x"] + [n for n, _ in sorted(mha.named_parameters())]
    return out.detach(), dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("spec, mask_name", BACKEND_CASES)
def test_backends_agree_with_float64_oracle_including_gradients(spec, mask_name):
    spec = dict(spec)
    kind = spec.pop("positions", None)
    d_head = spec.get("d_head") or spec["d_model"] // spec["H"]
    base = make_mha(
        spec["d_model"],
        spec["H"],
        spec["Hkv"],
        spec.get("d_head"),
        dtype=torch.float32,
        positions=positions_for(kind, spec["H"], d_head),
    )
    B, N = 2, 11
    x = randx(B, N, spec["d_model"], dtype=torch.float32)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :3] = False
    keep[1, 7] = False
    mask = {
        "causal": masks.causal(),
        "none": None,
        "key_padding": masks.key_padding(keep),
        "window": masks.sliding_window(4),
    }[mask_name]
    w = torch.randn(B, N, spec["d_model"], generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def variant(backend, dtype):
        m = copy.deepcopy(base).to(dtype)
        m.backend = backend
        return _run_grads(m, x.to(dtype), mask, w)

    o_out, o_g = variant("reference", torch.float64)
    r_out, r_g = variant("reference", torch.float32)
    assert set(o_g) >= {"x", "qkv_weight", "out_weight"}
    for backend in ("flash", "auto", "sdpa") if mask_name in ("none", "key_padding") else ("flash", "auto"):
        f_out, f_g = variant(backend, torch.float32)
        assert f_out.dtype == torch.float32
        assert_close_rule(f_out, r_out, o_out, torch.float32, factor=2.0, what=f"{backend} out")
        for name in o_g:
            assert f_g[name].shape == o_g[name].shape
            assert_close_rule(f_g[name], r_g[name], o_g[name], torch.float32, factor=3.0, what=f"{backend} d{name}")
        assert all(g.abs().max() > 0 for g in f_g.values()), "every parameter must receive a gradient"
