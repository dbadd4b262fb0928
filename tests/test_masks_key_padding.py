"""masks.key_padding(keep): predicate and tile classifier against brute force, the SDPA mapping
against the float64 reference, and sequences with no real token (zeros, never NaN).

Follows tests/test_masks.py: the mask is re-defined here as a plain Python function
(``keep[b][kv_pos]``, looked up by absolute key position), the library's predicate must agree
element by element, and its block classifier must be exact (key padding does not depend on the
query, so every tile is decidable from the keep pattern alone).
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from tests import helpers
from tests.helpers import F64_FLOOR, assert_close_rule

B, H, L = 3, 2, 24  # keep covers absolute key positions 0..23


def random_keep(seed, density):
    g = torch.Generator().manual_seed(seed)
    if density == "left":  # left padding: a random number of leading pads per row
        n = torch.randint(0, L + 1, (B,), generator=g)
        return torch.arange(L)[None] >= n[:, None]
    if density == "right":
        n = torch.randint(0, L + 1, (B,), generator=g)
        return torch.arange(L)[None] < n[:, None]
    keep = torch.rand(B, L, generator=g) < density
    return keep


KEEPS = [(s, d) for s, d in [(0, 0.5), (1, 0.9), (2, 0.1), (3, "left"), (4, "right"), (5, 0.0), (6, 1.0), (7, 0.3)]]
# (Nq, Nk, q_offset, kv_offset); q_offset None = bottom-right default
SHAPES = [(24, 24, None, 0), (5, 24, None, 0), (7, 13, 0, 4), (1, 9, None, 15), (30, 11, 2, 13), (3, 1, None, 23)]
BLOCKS = [(1, 1), (2, 3), (4, 4), (5, 7), (3, 16), (128, 512)]


def q_off(shape):
    Nq, Nk, qo, ko = shape
    return ko + Nk - Nq if qo is None else qo


def brute_dense(keep, Nq, Nk, qo, ko, pred=None):
    kl = keep.tolist()
    pred = pred or (lambda b, h, q, k: kl[b][k])
    return torch.tensor(
        [
            [[[bool(pred(b, h, qo + i, ko + j)) for j in range(Nk)] for i in range(Nq)] for h in range(H)]
            for b in range(B)
        ],
        dtype=torch.bool,
    ).view(B, H, Nq, Nk)


def mask_dense(m, Nq, Nk, qo, ko):
    return helpers.mask_dense(m, B, H, Nq, Nk, qo, ko)


tile_truth = helpers.tile_truth


def check_states(m, dense, shape, exact):
    Nq, Nk, qo_arg, ko = shape
    for bq, bk in BLOCKS:
        bm = m.block_mask(B, H, Nq, Nk, q_offset=qo_arg, kv_offset=ko, block=(bq, bk))
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        s = bm.states
        assert s.dtype == torch.int8 and s.shape[-2:] == (nqb, nkb) and s.shape[0] in (1, B)
        s = s.expand(B, H, nqb, nkb)
        helpers.assert_tiles_sound(s, dense, bq, bk, f"{m!r} shape={shape} block=({bq},{bk})", exact)


CASES = [
    pytest.param(seed, dens, shape, id=f"keep{seed}-{dens}-{shape[0]}x{shape[1]}@{shape[2]},{shape[3]}")
    for seed, dens in KEEPS
    for shape in SHAPES
]


@pytest.mark.parametrize("seed, density, shape", CASES)
def test_predicate_and_classifier_match_brute_force(seed, density, shape):
    keep = random_keep(seed, density)
    Nq, Nk, _, ko = shape
    qo = q_off(shape)
    m = masks.key_padding(keep)
    dense = brute_dense(keep, Nq, Nk, qo, ko)
    bad = torch.nonzero(mask_dense(m, Nq, Nk, qo, ko) != dense)
    assert bad.numel() == 0, f"predicate mismatches (b, h, row, col) {bad[:5].tolist()}"
    check_states(m, dense, shape, exact=True)
    assert m.cheap_classify


@pytest.mark.parametrize("seed, density, shape", CASES[::3])
def test_combinations_classify_correctly(seed, density, shape):
    keep = random_keep(seed, density)
    Nq, Nk, _, ko = shape
    qo = q_off(shape)
    kl = keep.tolist()
    # ~key_padding is still exact; & causal is correct (EMPTY/FULL never wrong)
    check_states(
        ~masks.key_padding(keep), brute_dense(keep, Nq, Nk, qo, ko, lambda b, h, q, k: not kl[b][k]), shape, exact=True
    )
    dense = brute_dense(keep, Nq, Nk, qo, ko, lambda b, h, q, k: kl[b][k] and k <= q)
    m = masks.causal() & masks.key_padding(keep)
    assert torch.equal(mask_dense(m, Nq, Nk, qo, ko), dense)
    check_states(m, dense, shape, exact=False)


def test_classifier_does_not_evaluate_the_predicate(monkeypatch):
    keep = random_keep(0, 0.5)
    m = masks.key_padding(keep)

    def boom(*a):
        raise AssertionError("block_mask evaluated the predicate")

    monkeypatch.setattr(type(m), "predicate", boom)
    bm = m.block_mask(B, H, 24, 24, block=(4, 4))
    assert bm.states.shape == (B, 1, 6, 6)


def test_docstring_example_left_padding():
    m = masks.key_padding(torch.tensor([[False, True, True]]))
    assert m(torch.tensor(0), torch.tensor(0), torch.tensor([[2]]), torch.arange(3)).tolist() == [
        [[[False, True, True]]]
    ]
    # integer 0/1 masks are accepted
    mi = masks.key_padding(torch.tensor([[0, 1, 1]]))
    assert torch.equal(mi.keep, m.keep)


# ----------------------------------------------------------------------------- attention
def make_qkv(Bq, Hq, Hkv, Nq, Nk, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Bq, Hq, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(Bq, Hkv, Nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(Bq, Hkv, Nk, D + 3, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run(q, k, v, backend, mask, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = attnlab.attention(q, k, v, mask=mask, backend=backend, **kw)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
    return [out.detach(), *grads]


SDPA_CASES = [
    pytest.param(4, 4, 9, 9, 0, id="mha-square"),
    pytest.param(4, 2, 9, 9, 0, id="gqa"),
    pytest.param(4, 1, 3, 11, 0, id="mqa-Nq<Nk"),
    pytest.param(2, 2, 6, 8, 5, id="kv_offset5"),
]


@pytest.mark.parametrize("Hq, Hkv, Nq, Nk, ko", SDPA_CASES)
def test_sdpa_mapping_matches_reference(Hq, Hkv, Nq, Nk, ko):
    keep = torch.ones(2, ko + Nk, dtype=torch.bool)
    keep[0, ko : ko + 2] = False  # left padding
    keep[1, ko + Nk - 3 :] = False  # right padding
    keep[1, ko + 1] = False  # a hole
    keep[:, :ko] = False  # outside this call's keys: must be ignored
    m = masks.key_padding(keep)
    q, k, v = make_qkv(2, Hq, Hkv, Nq, Nk, 8)
    oracle = run(q.double(), k.double(), v.double(), "reference", m, kv_offset=ko)
    ref = run(q, k, v, "reference", m, kv_offset=ko)
    # an independent oracle for the output: masked softmax by hand
    G = Hq // Hkv
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(G, 1)) / 8**0.5
    s = s.masked_fill(~keep[:, None, None, ko:], float("-inf"))
    want = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v.double().repeat_interleave(G, 1))
    torch.testing.assert_close(oracle[0], want, **F64_FLOOR)
    for backend in ("sdpa", "auto", "flash"):
        fast = run(q, k, v, backend, m, kv_offset=ko)
        for name, f, r, o in zip(("out", "dq", "dk", "dv"), fast, ref, oracle, strict=True):
            assert_close_rule(f, r, o, torch.float32, factor=2.0 if name == "out" else 3.0, what=f"{backend} {name}")


def test_sdpa_bool_mask_is_the_keep_slice():
    from attnlab.ops.sdpa import key_keep_slice

    keep = random_keep(3, "left")
    m = masks.key_padding(keep)
    assert m.lower().fields() == {"key_keep"} and m.lower().key_keep is keep
    got = key_keep_slice(m, 10, 7)
    assert got.shape == (B, 10) and got.dtype == torch.bool
    assert torch.equal(got, keep[:, 7:17])


@pytest.mark.parametrize("backend", ["auto", "flash", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequence_with_no_kept_key_gives_zeros_not_nan(backend, dtype):
    keep = torch.tensor([[True, False, True, True, False], [False] * 5])
    q, k, v = make_qkv(2, 4, 2, 5, 5, 8, dtype=dtype)
    out, dq, dk, dv = run(q, k, v, backend, masks.key_padding(keep))
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (out[1] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert out[0].abs().amax((-1, -2)).min() > 0
    # the LSE of an empty row is -inf; the other sequence is unaffected
    _, lse = attnlab.attention(q, k, v, mask=masks.key_padding(keep), backend=backend, return_lse=True)
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    alone = attnlab.attention(q[:1], k[:1], v[:1], mask=masks.key_padding(keep[:1]), backend="reference")
    torch.testing.assert_close(out[:1], alone)
    # the probabilities: rows of zeros, not a uniform average
    p = attnlab.attention_probs(q, k, mask=masks.key_padding(keep))
    assert (p[1] == 0).all()
    torch.testing.assert_close(p[0].sum(-1), torch.ones(4, 5, dtype=p.dtype))
    assert (p[0][..., ~keep[0]] == 0).all()


def test_sdpa_backend_refuses_a_sequence_with_no_kept_key():
    keep = torch.tensor([[True, True], [False, False]])
    q, k, v = make_qkv(2, 2, 2, 2, 2, 4)
    with pytest.raises(ValueError, match="no visible key"):
        attnlab.attention(q, k, v, mask=masks.key_padding(keep), backend="sdpa")


@pytest.mark.parametrize("block", [(1, 1), (2, 3), (4, 8)])
def test_flash_with_block_mask_tiles_matches_reference(block):
    keep = random_keep(7, 0.3)[:, :11]
    keep[:, 0] = True
    m = masks.key_padding(keep)
    q, k, v = make_qkv(B, 2, 1, 11, 11, 8, dtype=torch.float64)
    bm = m.block_mask(B, 2, 11, 11, block=block)
    want = attnlab.attention(q, k, v, mask=m, backend="reference")
    got = attnlab.attention(q, k, v, mask=bm, backend="flash")
    torch.testing.assert_close(got, want, **F64_FLOOR)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "keep, exc, words",
    [
        (torch.tensor([[1.0, 0.0]]), TypeError, "key_padding(keep): expected a bool or 0/1 integer tensor"),
        (torch.tensor([[0, 2]]), ValueError, "integer masks must hold only 0 and 1"),
        (torch.tensor([True, False]), ValueError, "key_padding(keep): expected shape (B, N), got (2,)"),
        (torch.ones(1, 2, 3, dtype=torch.bool), ValueError, "expected shape (B, N)"),
    ],
)
def test_constructor_errors(keep, exc, words):
    with pytest.raises(exc) as e:
        masks.key_padding(keep)
    assert words in str(e.value)


@pytest.mark.parametrize(
    "keep_shape, Nk, kw, words",
    [
        ((3, 8), 8, {}, "key_padding(keep): got 3 rows for batch size B=2"),
        ((2, 6), 8, {}, "keep covers key positions 0..5 but the problem has keys at 0..7"),
        ((2, 8), 8, {"kv_offset": 1}, "keys at 1..8"),
    ],
)
def test_shape_errors_at_attention_and_block_mask(keep_shape, Nk, kw, words):
    m = masks.key_padding(torch.ones(keep_shape, dtype=torch.bool))
    q = torch.randn(2, 1, 4, 4)
    k = torch.randn(2, 1, Nk, 4)
    for backend in ("auto", "flash", "reference", "sdpa"):
        with pytest.raises(ValueError) as e:
            attnlab.attention(q, k, k, mask=m, backend=backend, **kw)
        assert words in str(e.value), backend
    with pytest.raises(ValueError) as e:
        m.block_mask(2, 1, 4, Nk, **kw)
    assert words in str(e.value)
