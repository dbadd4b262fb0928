"""The masks the native kernel evaluates beyond bands, lengths, ids and key keep (issue 16):
varlen's band positions (q_pos/kv_pos), per-batch query offsets (q_shift), and masks with no
structure (custom, tree, |, ~, dense) through a BlockMask's tiles and the bits of its partial
tiles -- against the float64 oracle under DESIGN.md's rule, forward and backward, float32 and
bfloat16; fully masked rows, Nq != Nk, GQA, partial tiles (97, 1025), hidden NaN; and that the
kernel really ran (the flash path is made to raise)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.masks import BlockMask, MaskStructure
from attnlab.ops import dispatch
from attnlab.ops.native.ops import blocks, plan
from tests.helpers import F32_AGAINST_F64, F32_FEW_ULPS
from tests.ops.conftest import compare_backend, make_qkv


def _varlen(lens_q, lens_k, window):
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()]) for x in (lens_q, lens_k)]
    return masks.varlen(cu[0], cu[1], window=window)


def _tree(n, prefix):
    g = torch.Generator().manual_seed(n)
    parents = [-1] + [int(torch.randint(0, t, (1,), generator=g)) for t in range(1, n)]
    return masks.tree(parents, prefix_len=prefix)


def _dense(B, H, Nq, Nk, qo):
    g = torch.Generator().manual_seed(Nq * Nk)
    return masks.dense(torch.rand(B, H, Nq, Nk, generator=g) > 0.4, q_offset=qo)


MOD7 = masks.custom(lambda b, h, q, kv: (q - kv) % 7 != 3)
HEADS = masks.custom(lambda b, h, q, kv: (q + 3 * h + 5 * b - kv) % 4 != 0)  # depends on (b, h)
# rows q % 5 == 0 see nothing: fully masked rows among visible ones
ROWS = masks.custom(lambda b, h, q, kv: (q % 5 != 0) & (kv <= q))

#         B  H  Hkv  Nq    Nk    D   mask factory (B, H, Nq, Nk, qo) -> mask, q_offset
CASES = {
    "varlen-causal": (1, 4, 2, 97, 97, 64, lambda *a: (_varlen([30, 1, 41, 25], [30, 1, 41, 25], (None, 0)), 0)),
    "varlen-window-qk": (1, 2, 1, 97, 130, 40, lambda *a: (_varlen([20, 37, 40], [40, 50, 40], (6, 2)), 0)),
    "varlen-1025": (
        1,
        2,
        2,
        1025,
        1025,
        64,
        lambda *a: (_varlen([300, 125, 400, 200], [300, 125, 400, 200], (None, 0)), 0),
    ),
    "shift-causal": (2, 4, 2, 97, 130, 64, lambda *a: (masks.causal(), torch.tensor([33, 7]))),
    "shift-window&doc": (
        2,
        2,
        1,
        50,
        200,
        40,
        lambda *a: (
            masks.sliding_window(30) & masks.document(torch.tensor([0] * 70 + [1] * 90 + [2] * 40)),
            torch.tensor([100, 20]),
        ),
    ),
    # RowMask::hide's interval fills: sorted ids (a row's document is a run of columns, met by
    # both the sinks and the window), unsorted ids (the per-column path), ids absent from kv
    "doc-sinks": (
        1,
        2,
        1,
        97,
        97,
        64,
        lambda *a: (masks.sink_window(4, 20) & masks.document(torch.tensor([0] * 40 + [1] * 33 + [2] * 24)), None),
    ),
    "doc-unsorted": (
        2,
        2,
        1,
        97,
        97,
        40,
        lambda *a: (
            masks.sliding_window(50) & masks.document(torch.tensor([1] * 20 + [0] * 30 + [2] * 17 + [1] * 30)),
            None,
        ),
    ),
    "doc-prefix-qk": (
        1,
        2,
        2,
        60,
        130,
        64,
        lambda *a: (
            masks.prefix_lm(10)
            & masks.document(
                torch.tensor([0] * 50 + [3] * 40 + [2] * 40), torch.tensor([0] * 50 + [1] * 40 + [2] * 40)
            ),
            None,
        ),
    ),
    "custom-mod7": (2, 4, 2, 97, 130, 64, lambda *a: (MOD7, None)),
    "custom-mod7-1025": (1, 2, 1, 1025, 1025, 64, lambda *a: (MOD7, None)),
    "custom-heads": (2, 4, 1, 97, 97, 59, lambda *a: (HEADS, None)),
    "custom-empty-rows": (2, 2, 1, 97, 97, 64, lambda *a: (ROWS, 0)),
    "tree": (1, 2, 1, 40, 97, 64, lambda *a: (_tree(40, 57), None)),
    "or": (2, 2, 2, 97, 97, 64, lambda *a: (masks.sliding_window(5) | masks.prefix_lm(9), None)),
    "not": (1, 4, 2, 97, 200, 64, lambda *a: (~masks.sliding_window(40), None)),
    "or&padding": (
        2,
        2,
        1,
        97,
        97,
        64,
        lambda *a: ((masks.causal() | MOD7) & masks.padding(torch.tensor([50, 0])), None),
    ),
    "dense": (2, 2, 1, 97, 130, 40, lambda B, H, Nq, Nk, qo: (_dense(B, H, Nq, Nk, 33), 33)),
}


def _case(name, dtype=torch.float32):
    B, H, Hkv, Nq, Nk, D, make = CASES[name]
    mask, qo = make(B, H, Nq, Nk, None)
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, dtype=dtype)
    return q, k, v, mask, qo


@pytest.fixture
def no_flash(monkeypatch):
    """The torch-ops flash path raises: a test that passes ran the native kernel."""

    def refuse(*a, **kw):
        raise AssertionError("the flash path ran, not the native kernel")

    monkeypatch.setattr(dispatch, "_flash", refuse)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_masks_match_oracle(name, dtype, native_ext, no_flash):
    q, k, v, mask, qo = _case(name, dtype)
    p, why = plan(
        q, k, v, mask, None, 0 if isinstance(qo, torch.Tensor) else (k.shape[2] - q.shape[2] if qo is None else qo), 0
    )
    assert p is not None, why
    want = BlockMask if name.split("-")[0] in ("custom", "tree", "or", "not", "or&padding", "dense") else MaskStructure
    assert isinstance(p, want), type(p)
    compare_backend(q, k, v, backend="native", mask=mask, q_offset=qo, what=name)


def _grads(q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attnlab.attention(q, k, v, return_lse=True, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fully_masked_rows(dtype, native_ext, no_flash):
    """Rows a custom mask hides entirely: output 0, LSE -inf, zero gradients, no NaN; batch 1 of
    a padding & custom combination sees nothing at all."""
    q, k, v, mask, qo = _case("custom-empty-rows", dtype)
    out, lse, dq, dk, dv = _grads(q, k, v, mask=mask, q_offset=qo, backend="native")
    hidden = torch.arange(q.shape[2]) % 5 == 0
    assert torch.count_nonzero(out[:, :, hidden]) == 0 and torch.isneginf(lse[:, :, hidden]).all()
    assert torch.count_nonzero(dq[:, :, hidden]) == 0
    assert torch.isfinite(lse[:, :, ~hidden]).all() and torch.count_nonzero(dq[:, :, ~hidden]) > 0
    q, k, v, mask, qo = _case("or&padding", dtype)
    out, lse, dq, dk, dv = _grads(q, k, v, mask=mask, q_offset=qo, backend="native")
    assert torch.count_nonzero(out[1]) == 0 and torch.isneginf(lse[1]).all()
    assert torch.count_nonzero(dq[1]) == 0 and torch.count_nonzero(dk[1]) == 0 and torch.count_nonzero(dv[1]) == 0
    for t in (out, dq, dk, dv):
        assert not t.isnan().any()


@pytest.mark.parametrize("name", ["custom-mod7", "varlen-window-qk", "shift-window&doc"])
def test_hidden_nan_has_no_effect(name, native_ext, no_flash):
    """NaN/inf in the last key, which no row may see, change nothing: bit for bit where the tile
    holding it has no visible column past the row's band (a hidden NaN reruns its q block on
    the careful path, whose sums can differ from the fast path's in the last bit -- as for
    every mask kind, key_padding included), else within a few ulp; never a NaN."""
    q, k, v, mask, qo = _case(name)
    col = k.shape[2] - 1
    if name == "custom-mod7":  # mod7 & (kv != last)
        mask = mask & masks.custom(lambda b, h, qp, kp: kp != col)
    elif name == "varlen-window-qk":  # a last sequence of one key and no query
        mask = _varlen([20, 37, 40, 0], [40, 50, 39, 1], (6, 2))
    # shift-window&doc: the last key is in document 2, which no query of either batch is in
    ref = _grads(q, k, v, mask=mask, q_offset=qo, backend="native")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, col] = float("nan")
    v2[:, :, col] = float("inf")
    got = _grads(q, k2, v2, mask=mask, q_offset=qo, backend="native")
    keep = torch.arange(k.shape[2]) != col
    pairs = [*zip(got[:3], ref[:3], strict=True), (got[3][:, :, keep], ref[3][:, :, keep])]
    pairs.append((got[4][:, :, keep], ref[4][:, :, keep]))
    for a, b in pairs:
        assert torch.isfinite(a).all() or torch.equal(torch.isfinite(a), torch.isfinite(b))
        if name == "shift-window&doc":
            torch.testing.assert_close(a, b, **F32_FEW_ULPS)
        else:
            assert torch.equal(a, b)
    assert torch.count_nonzero(got[3][:, :, col]) == 0 and torch.count_nonzero(got[4][:, :, col]) == 0


def test_partial_tiles_only_get_bits(native_ext):
    """The BlockMask at the kernel's tiles holds bits for its partial tiles only: a causal-like
    custom mask over 1025 keys stores the diagonal tiles, not N x N."""
    q, k, v = make_qkv(1, 2, 1, 1025, 1025, 64)
    m = masks.custom(lambda b, h, qp, kp: kp <= qp)
    bm, _ = plan(q, k, v, m, None, 0, 0)
    bq, bk = blocks(64)
    assert isinstance(bm, BlockMask) and (bm.block_q, bm.block_k) == (bq, bk)
    bits, tile_id = bm.partial_bits()
    nqb, nkb = -(-1025 // bq), -(-1025 // bk)
    assert bits.shape[0] == int((bm.states == 1).flatten(0, 1).any(0).sum()) < nqb * nkb // 2
    assert bits.shape[1:] == (1, 1, bq, bk // 32) and tile_id.shape == (nqb, nkb)
    assert bm.partial_bits()[0] is bits  # cached with the BlockMask
    # a BlockMask built at other tiles is re-classified at the kernel's
    other = m.block_mask(1, 2, 1025, 1025, q_offset=0, block=(32, 64))
    p, _ = plan(q, k, v, other, None, 0, 0)
    assert isinstance(p, BlockMask) and (p.block_q, p.block_k) == (bq, bk)


def test_varlen_attention_runs_native(native_ext, no_flash):
    """varlen_attention(backend="native"): packed causal sequences on the kernel, forward and
    backward, against the float64 oracle (the packed problem through attention's rule)."""
    from attnlab.ops.varlen import varlen_attention

    lens = [30, 1, 41, 25]
    cu = torch.tensor([0, *lens]).cumsum(0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(97, 4, 32, generator=g) for _ in range(3))
    got = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*got, cu, cu, causal=True, backend="native")
    out.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = varlen_attention(*ref, cu, cu, causal=True, backend="reference")
    want.sum().backward()
    torch.testing.assert_close(out.double(), want, **F32_AGAINST_F64)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **F32_AGAINST_F64)


@pytest.mark.parametrize("tiles", [(32, 80), (96, 48), (128, 512)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_blockmask_at_other_tiles(tiles, native_ext):
    """The kernel reads a BlockMask at tiles other than its own correctly (a kernel tile meets
    several BlockMask tiles, or starts inside one): the same values as at its own tiles,
    forward and backward."""
    from attnlab.ops.native.ops import native_attention

    B, H, Nq, Nk, D = 2, 4, 97, 130, 64  # kernel tiles 64 x 128: the second starts mid-tile of 80 or 48
    q, k, v = make_qkv(B, H, 2, Nq, Nk, D)
    m = masks.custom(lambda b, h, qp, kp: (5 * qp + kp * kp + 3 * h + b) % 7 != 0)  # a 16-column shift changes it
    own = m.block_mask(B, H, Nq, Nk, q_offset=33, block=tuple(blocks(D)))
    other = m.block_mask(B, H, Nq, Nk, q_offset=33, block=tiles)
    res = []
    for bm in (own, other):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = native_attention(*x, bm, scale=0.125, q_offset=33, kv_offset=0)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        res.append((out, lse, *torch.autograd.grad(out, x, g)))
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, **F32_FEW_ULPS)
