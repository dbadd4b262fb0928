"""Masks: predicates against brute-force definitions, tile classification, BlockMask caching, errors.

Every built-in mask is re-defined here as a plain Python function of integer
positions, written from the docstrings and DESIGN.md (not from the implementation),
and the library's vectorised predicate must agree with it element by element --
with non-zero offsets and Nq != Nk.  Tile classification is checked against the
dense predicate: EMPTY / FULL must always be right, and for the built-ins that
promise an exact classifier, PARTIAL must mean the tile really is mixed.
"""

from __future__ import annotations

import doctest

import pytest
import torch

import attnlab
import helpers
from attnlab import masks
from attnlab.masks import EMPTY, FULL, PARTIAL, BlockMask

B, H = 2, 2
ID_LEN = 20  # document ids / tree nodes cover absolute positions 0..19

# (Nq, Nk, q_offset, kv_offset); q_offset None = the bottom-right default kv_offset + Nk - Nq
SHAPES = [
    (9, 9, None, 0),
    (3, 10, None, 0),  # few queries, newest tokens (q positions 7..9)
    (10, 4, 0, 2),  # more queries than keys, top-left, keys shifted
    (5, 7, 4, 3),
    (1, 13, None, 3),  # single decode query at position 15
    (6, 11, 13, 0),  # queries far past the keys
    (10, 4, None, 0),  # default q_offset = -6: negative query positions
    (7, 1, 2, 5),
]


def q_off(shape):
    Nq, Nk, qo, ko = shape
    return ko + Nk - Nq if qo is None else qo


def pos_range(shape):
    Nq, Nk, _, ko = shape
    qo = q_off(shape)
    lo = min(qo if Nq else 0, ko)
    hi = max(qo + Nq, ko + Nk)
    return lo, hi


# ----------------------------------------------------------------------------- brute force
def b_causal(b, h, q, k):
    return k <= q


def b_window(w):
    return lambda b, h, q, k: k <= q and q - k < w


def b_prefix(n):
    return lambda b, h, q, k: k < n or k <= q


def b_sink(s, w):
    return lambda b, h, q, k: k <= q and (k < s or q - k < w)


def b_document(q_ids, kv_ids):
    def row(ids, b):
        return ids[b] if isinstance(ids[0], list) else ids

    return lambda b, h, q, k: row(q_ids, b)[q] == row(kv_ids, b)[k]


def b_padding(lengths):
    return lambda b, h, q, k: k < lengths[b]


def b_tree(parents, prefix_len):
    def ancestors(t):
        out = set()
        while t != -1:
            out.add(t)
            t = parents[t]
        return out

    def f(b, h, q, k):
        if q >= prefix_len and k >= prefix_len:
            return (k - prefix_len) in ancestors(q - prefix_len)
        return k <= q

    return f


def b_and(f, g):
    return lambda *a: f(*a) and g(*a)


def b_or(f, g):
    return lambda *a: f(*a) or g(*a)


def b_not(f):
    return lambda *a: not f(*a)


def hash_pred_torch(b, h, q, kv):
    return ((q * 7 + kv * 3 + h * 2 + b) % 5) < 2


def hash_pred_py(b, h, q, k):
    return ((q * 7 + k * 3 + h * 2 + b) % 5) < 2


def kv_only_torch(b, h, q, kv):
    return (kv % 3) != 1


def kv_only_py(b, h, q, k):
    return (k % 3) != 1


# sorted, contiguous documents (every id between the first and last one is present)
DOC_SORTED = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 4, 4, 4, 5, 5, 5, 5, 6, 6]
DOC_SORTED_B = [DOC_SORTED, [0] * 6 + [1] * 9 + [2] * 5]
DOC_KV = [0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 4, 5, 5, 5, 6, 6, 6, 6]
DOC_SCATTER = [(i * 5 + i // 3) % 3 for i in range(ID_LEN)]  # ids not contiguous
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, -1, 6, 3, 8, 9, 9, 11, 4, 13]  # 15 nodes at positions 5..19
TREE_PARENTS0 = [-1, 0, 1, 1, 2, 0, 5, -1, 7, 7, 8, 9, 3, 12, 6, 14, 14, 10, 17, 18]  # 20 nodes at 0..19


def case_list():
    """(id, make(shape) -> (mask, brute, exact), needs_nonneg_positions)."""

    def fixed(mask_fn, brute, exact):
        return lambda shape: (mask_fn(), brute, exact)

    def pad(lengths_of):
        def make(shape):
            Nk, ko = shape[1], shape[3]
            L = lengths_of(ko + Nk)
            return masks.padding(L), b_padding(L), True

        return make

    cs = [
        ("causal", fixed(masks.causal, b_causal, True), False),
        ("window1", fixed(lambda: masks.sliding_window(1), b_window(1), True), False),
        ("window3", fixed(lambda: masks.sliding_window(3), b_window(3), True), False),
        ("prefix0", fixed(lambda: masks.prefix_lm(0), b_prefix(0), True), False),
        ("prefix4", fixed(lambda: masks.prefix_lm(4), b_prefix(4), True), False),
        (
            "doc_sorted",
            fixed(lambda: masks.document(torch.tensor(DOC_SORTED)), b_document(DOC_SORTED, DOC_SORTED), True),
            True,
        ),
        (
            "doc_sorted_batched",
            fixed(lambda: masks.document(torch.tensor(DOC_SORTED_B)), b_document(DOC_SORTED_B, DOC_SORTED_B), True),
            True,
        ),
        (
            "doc_cross",
            fixed(
                lambda: masks.document(torch.tensor(DOC_SORTED), torch.tensor(DOC_KV)),
                b_document(DOC_SORTED, DOC_KV),
                True,
            ),
            True,
        ),
        (
            "doc_cross_batched_q",
            fixed(
                lambda: masks.document(torch.tensor(DOC_SORTED_B), torch.tensor(DOC_KV)),
                b_document(DOC_SORTED_B, DOC_KV),
                True,
            ),
            True,
        ),
        (
            "doc_scattered",
            fixed(
                lambda: masks.document(DOC_SCATTER),  # a plain list is accepted
                b_document(DOC_SCATTER, DOC_SCATTER),
                False,
            ),
            True,
        ),
        ("padding", pad(lambda n: [n // 2, n]), False),
        ("padding_zero", pad(lambda n: [0, max(n - 1, 0)]), False),
        (
            "tree_prefix5",
            fixed(lambda: masks.tree(torch.tensor(TREE_PARENTS), prefix_len=5), b_tree(TREE_PARENTS, 5), True),
            False,
        ),
        ("tree_prefix0", fixed(lambda: masks.tree(TREE_PARENTS0), b_tree(TREE_PARENTS0, 0), True), False),
        ("sink2_3", fixed(lambda: masks.sink_window(2, 3), b_sink(2, 3), False), False),
        ("sink0_4", fixed(lambda: masks.sink_window(0, 4), b_sink(0, 4), False), False),
        ("sink3_0", fixed(lambda: masks.sink_window(3, 0), b_sink(3, 0), False), False),
        ("custom_bh", fixed(lambda: masks.custom(hash_pred_torch), hash_pred_py, True), False),
        ("custom_kv", fixed(lambda: masks.custom(kv_only_torch), kv_only_py, True), False),
        # combinations
        (
            "causal_and_not_window",
            fixed(lambda: masks.causal() & ~masks.sliding_window(2), b_and(b_causal, b_not(b_window(2))), False),
            False,
        ),
        (
            "doc_and_causal",
            fixed(
                lambda: masks.document(torch.tensor(DOC_SORTED)) & masks.causal(),
                b_and(b_document(DOC_SORTED, DOC_SORTED), b_causal),
                False,
            ),
            True,
        ),
        (
            "prefix_or_window",
            fixed(lambda: masks.prefix_lm(3) | masks.sliding_window(2), b_or(b_prefix(3), b_window(2)), False),
            False,
        ),
        (
            "not_causal_or_custom",
            fixed(lambda: ~(masks.causal() | masks.custom(kv_only_torch)), b_not(b_or(b_causal, kv_only_py)), False),
            False,
        ),
        (
            "sink_and_doc_batched",
            fixed(
                lambda: masks.sink_window(1, 3) & masks.document(torch.tensor(DOC_SORTED_B)),
                b_and(b_sink(1, 3), b_document(DOC_SORTED_B, DOC_SORTED_B)),
                False,
            ),
            True,
        ),
        (
            "nested",
            fixed(
                lambda: (
                    ((masks.causal() & masks.custom(hash_pred_torch)) | ~masks.prefix_lm(5)) & masks.sliding_window(6)
                ),
                b_and(b_or(b_and(b_causal, hash_pred_py), b_not(b_prefix(5))), b_window(6)),
                False,
            ),
            False,
        ),
        ("double_not", fixed(lambda: ~~masks.causal(), b_causal, True), False),
        ("not_window_exact", fixed(lambda: ~masks.sliding_window(3), b_not(b_window(3)), True), False),
        (
            "tree_and_custom",
            fixed(
                lambda: masks.tree(torch.tensor(TREE_PARENTS), prefix_len=5) & masks.custom(kv_only_torch),
                b_and(b_tree(TREE_PARENTS, 5), kv_only_py),
                False,
            ),
            False,
        ),
    ]

    def not_padding(shape):
        m, f, _ = pad(lambda n: [n // 3, n])(shape)
        return ~m, b_not(f), True

    def padding_or_tree(shape):
        m, f, _ = pad(lambda n: [1, n])(shape)
        return m | masks.tree(TREE_PARENTS0), b_or(f, b_tree(TREE_PARENTS0, 0)), False

    cs += [("not_padding", not_padding, False), ("padding_or_tree", padding_or_tree, False)]
    return cs


CASES = case_list()
PARAMS = [
    pytest.param(make, shape, id=f"{name}-{shape[0]}x{shape[1]}@{shape[2]},{shape[3]}")
    for name, make, nonneg in CASES
    for shape in SHAPES
    if not (nonneg and pos_range(shape)[0] < 0)
]


def brute_dense(f, Nq, Nk, qo, ko):
    return torch.tensor(
        [[[[bool(f(b, h, qo + i, ko + j)) for j in range(Nk)] for i in range(Nq)] for h in range(H)] for b in range(B)],
        dtype=torch.bool,
    ).view(B, H, Nq, Nk)


def mask_dense(m, Nq, Nk, qo, ko):
    return helpers.mask_dense(m, B, H, Nq, Nk, qo, ko)


tile_truth = helpers.tile_truth


BLOCKS = [(1, 1), (2, 3), (3, 2), (4, 4), (5, 7), (16, 16), (128, 512)]


@pytest.mark.parametrize("make, shape", PARAMS)
def test_predicate_matches_brute_force(make, shape):
    Nq, Nk, _, ko = shape
    qo = q_off(shape)
    m, brute, _ = make(shape)
    got = mask_dense(m, Nq, Nk, qo, ko)
    want = brute_dense(brute, Nq, Nk, qo, ko)
    bad = torch.nonzero(got != want)
    assert bad.numel() == 0, f"{m!r}: first mismatches (b, h, row, col) {bad[:5].tolist()}"


@pytest.mark.parametrize("make, shape", PARAMS)
def test_block_mask_is_correct_and_exact(make, shape):
    Nq, Nk, qo_arg, ko = shape
    qo = q_off(shape)
    m, brute, exact = make(shape)
    dense = brute_dense(brute, Nq, Nk, qo, ko)
    for bq, bk in BLOCKS:
        bm = m.block_mask(B, H, Nq, Nk, q_offset=qo_arg, kv_offset=ko, block=(bq, bk))
        assert isinstance(bm, BlockMask)
        assert (bm.B, bm.H, bm.Nq, bm.Nk, bm.q_offset, bm.kv_offset, bm.block_q, bm.block_k) == (
            B,
            H,
            Nq,
            Nk,
            qo,
            ko,
            bq,
            bk,
        )
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        s = bm.states
        assert s.dtype == torch.int8 and s.dim() == 4 and s.shape[-2:] == (nqb, nkb)
        assert s.shape[0] in (1, B) and s.shape[1] in (1, H)
        assert ((s == EMPTY) | (s == PARTIAL) | (s == FULL)).all()
        s = s.expand(B, H, nqb, nkb)
        where = f"{m!r} block=({bq},{bk})"
        helpers.assert_tiles_sound(s, dense, bq, bk, where, exact)
        anyt, allt = tile_truth(dense, bq, bk)
        # the plan a kernel reads: visit every tile non-empty for some (b, h); mask unless all FULL
        plan = bm.plan()
        assert len(plan) == nqb
        for i, row in enumerate(plan):
            visited = {j: needs for j, needs in row}
            for j in range(nkb):
                if anyt[:, :, i, j].any():
                    assert j in visited, f"{where}: tile ({i},{j}) has allowed pairs but is skipped"
                if j in visited and not visited[j]:
                    assert allt[:, :, i, j].all(), f"{where}: tile ({i},{j}) run unmasked but is not full"


# ----------------------------------------------------------------------------- examples
def test_docstring_picture_causal_bottom_right():
    # masks.py: causal() with 2 queries over 5 keys, default bottom-right alignment
    got = mask_dense(masks.causal(), 2, 5, 3, 0)[0, 0].int().tolist()
    assert got == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    bm = masks.causal().block_mask(1, 1, 2, 5, block=(1, 1))
    assert bm.q_offset == 3
    assert bm.states[0, 0].tolist() == [[FULL, FULL, FULL, FULL, EMPTY], [FULL] * 5]


def test_module_doctests():
    res = doctest.testmod(masks, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


def test_predicate_accepts_lower_dim_position_tensors():
    # the docstring example calls the predicate with 0-d b/h, (1,1) q and (5,) kv
    m = masks.causal() & ~masks.sliding_window(2)
    out = m(torch.tensor(0), torch.tensor(0), torch.tensor([[4]]), torch.arange(5))
    assert out.int().tolist() == [[1, 1, 1, 0, 0]]


# ----------------------------------------------------------------------------- per-batch / per-head states
def test_state_shapes_keep_singleton_batch_and_head_dims():
    assert masks.causal().block_mask(2, 3, 8, 8, block=(2, 2)).states.shape == (1, 1, 4, 4)
    assert masks.padding([3, 8]).block_mask(2, 3, 8, 8, block=(2, 2)).states.shape == (2, 1, 4, 4)
    ids = torch.tensor([[0] * 4 + [1] * 4, [0] * 2 + [1] * 6])
    assert masks.document(ids).block_mask(2, 3, 8, 8, block=(2, 2)).states.shape == (2, 1, 4, 4)
    per_head = masks.custom(lambda b, h, q, kv: kv <= q + h)
    assert per_head.block_mask(2, 3, 8, 8, block=(2, 2)).states.shape[1] == 3


def test_padding_gives_per_batch_states():
    bm = masks.padding([2, 7]).block_mask(2, 1, 4, 8, block=(2, 2))
    s = bm.states[:, 0]
    assert s[0].tolist() == [[FULL, EMPTY, EMPTY, EMPTY]] * 2
    assert s[1].tolist() == [[FULL, FULL, FULL, PARTIAL]] * 2


def test_document_batched_ids_give_per_batch_states():
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]])
    bm = masks.document(ids).block_mask(2, 1, 8, 8, block=(4, 4))
    s = bm.states[:, 0]
    assert s[0].tolist() == [[FULL, EMPTY], [EMPTY, FULL]]
    assert s[1].tolist() == [[PARTIAL, PARTIAL], [PARTIAL, FULL]]


def test_batch_dependent_mask_in_attention_matches_per_batch_runs():
    torch.manual_seed(0)
    q = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    k = torch.randn(2, 1, 7, 4, dtype=torch.float64)
    v = torch.randn(2, 1, 7, 3, dtype=torch.float64)
    lengths = [3, 7]
    for backend in ("flash", "reference"):
        out = attnlab.attention(q, k, v, mask=masks.padding(lengths), backend=backend)
        for b, L in enumerate(lengths):
            want = attnlab.attention(
                q[b : b + 1], k[b : b + 1, :, :L], v[b : b + 1, :, :L], q_offset=2, backend="reference"
            )
            torch.testing.assert_close(out[b : b + 1], want, **helpers.F64_FLOOR)


# ----------------------------------------------------------------------------- caching and shape checks
def test_block_mask_is_cached_per_shape():
    m = masks.sliding_window(3)
    a = m.block_mask(1, 2, 10, 12, block=(4, 4))
    assert m.block_mask(1, 2, 10, 12, block=(4, 4)) is a
    assert m.block_mask(1, 2, 10, 12, q_offset=2, block=(4, 4)) is a  # default q_offset = 12 - 10
    assert m.block_mask(1, 2, 10, 12, block=(4, 8)) is not a
    assert m.block_mask(1, 2, 10, 13, block=(4, 4)) is not a
    assert m.block_mask(1, 2, 10, 12, kv_offset=1, block=(4, 4)) is not a
    assert m.block_mask(1, 2, 10, 12, block=(4, 4)) is a  # still cached after other shapes
    c = masks.custom(kv_only_torch)
    assert c.block_mask(1, 1, 5, 5) is c.block_mask(1, 1, 5, 5)
    assert a.plan() is a.plan()


def test_block_mask_passed_to_attention_matches_mask():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 9, 5, dtype=torch.float64)
    k = torch.randn(1, 2, 11, 5, dtype=torch.float64)
    v = torch.randn(1, 2, 11, 3, dtype=torch.float64)
    m = masks.sink_window(2, 3) | masks.custom(kv_only_torch)
    bm = m.block_mask(1, 2, 9, 11, block=(2, 3))
    want = attnlab.attention(q, k, v, mask=m, backend="reference")
    for backend in ("flash", "reference", "auto"):
        torch.testing.assert_close(attnlab.attention(q, k, v, mask=bm, backend=backend), want, **helpers.F64_FLOOR)


@pytest.mark.parametrize("backend", ["auto", "flash", "reference"])
@pytest.mark.parametrize("change", ["B", "H", "Nq", "Nk", "q_offset", "kv_offset"])
def test_block_mask_for_another_shape_is_rejected(backend, change):
    dims = dict(B=1, H=2, Nq=6, Nk=8)
    bm = masks.causal().block_mask(1, 2, 6, 8, block=(4, 4))
    kw = {}
    if change in dims:
        dims[change] += 1
    elif change == "q_offset":
        kw["q_offset"] = 0
    else:
        kw["kv_offset"] = 3
    q = torch.randn(dims["B"], dims["H"], dims["Nq"], 4)
    k = torch.randn(dims["B"], 1, dims["Nk"], 4)
    with pytest.raises(ValueError, match=r"BlockMask was built for .*\(1, 2, 6, 8, 2, 0\)"):
        attnlab.attention(q, k, k, mask=bm, backend=backend, **kw)
    with pytest.raises(ValueError, match="BlockMask"):
        bm.check_shape(dims["B"], dims["H"], dims["Nq"], dims["Nk"], kw.get("q_offset", 2), kw.get("kv_offset", 0))


# ----------------------------------------------------------------------------- constructor errors
@pytest.mark.parametrize(
    "build, exc, words",
    [
        (lambda: masks.sliding_window(0), ValueError, "sliding_window(w)"),
        (lambda: masks.sliding_window(-2), ValueError, "sliding_window(w)"),
        (lambda: masks.sliding_window(2.0), TypeError, "sliding_window(w)"),
        (lambda: masks.sliding_window(True), TypeError, "sliding_window(w)"),
        (lambda: masks.prefix_lm(-1), ValueError, "prefix_lm(n)"),
        (lambda: masks.prefix_lm(1.5), TypeError, "prefix_lm(n)"),
        (lambda: masks.sink_window(-1, 3), ValueError, "sink_window(sinks)"),
        (lambda: masks.sink_window(2, -3), ValueError, "sink_window(window)"),
        (lambda: masks.sink_window(0, 0), ValueError, "sink_window"),
        (lambda: masks.document(torch.tensor([0.0, 1.0])), TypeError, "document(ids)"),
        (lambda: masks.document([0.5, 1.5]), TypeError, "document(ids)"),
        (lambda: masks.document(torch.tensor([True, False])), TypeError, "document(ids)"),
        (lambda: masks.document(torch.zeros(1, 2, 3, dtype=torch.long)), ValueError, "document(ids)"),
        (lambda: masks.document(torch.arange(4), torch.tensor([0.0, 1.0])), TypeError, "document(kv_ids)"),
        (lambda: masks.padding([1.0, 2.0]), TypeError, "padding(kv_lengths)"),
        (lambda: masks.padding([[1, 2]]), ValueError, "padding(kv_lengths)"),
        (lambda: masks.padding([3, -1]), ValueError, "padding(kv_lengths)"),
        (lambda: masks.tree([-1, 2, 0]), ValueError, "tree(parents)"),  # points forward
        (lambda: masks.tree([-1, 1]), ValueError, "tree(parents)"),  # points at itself
        (lambda: masks.tree([-1, -2]), ValueError, "tree(parents)"),
        (lambda: masks.tree(torch.tensor([-1.0, 0.0])), (ValueError, TypeError), "tree(parents)"),
        (lambda: masks.tree([[-1, 0]]), ValueError, "tree(parents)"),
        (lambda: masks.tree([-1, 0], prefix_len=-1), ValueError, "tree(prefix_len)"),
        (lambda: masks.custom(3), TypeError, "custom(fn)"),
        (lambda: masks.causal() & (lambda b, h, q, kv: kv <= q), TypeError, "&"),
        (lambda: masks.causal() | torch.ones(3, 3, dtype=torch.bool), TypeError, "|"),
    ],
)
def test_constructor_errors_name_the_argument(build, exc, words):
    with pytest.raises(exc) as e:
        build()
    assert words in str(e.value)


def test_tree_error_names_the_bad_parent():
    with pytest.raises(ValueError, match=r"parents\[2\]=5"):
        masks.tree([-1, 0, 5, 1])


@pytest.mark.parametrize(
    "mask, Nq, Nk, kw, words",
    [
        (lambda: masks.padding([3]), 4, 8, {}, "padding(kv_lengths)"),  # B=2 needs 2 lengths
        (lambda: masks.padding([3, 4, 5]), 4, 8, {}, "padding(kv_lengths)"),
        (lambda: masks.document(torch.arange(6)), 4, 8, {}, "document("),  # ids too short
        (lambda: masks.document(torch.arange(8)), 4, 8, {"kv_offset": 1}, "document("),
        (lambda: masks.document(torch.arange(20)), 9, 4, {}, "document("),  # q positions < 0
        (lambda: masks.document(torch.arange(10), torch.arange(5)), 4, 8, {}, "document(kv_ids)"),
        (lambda: masks.document(torch.zeros(3, 8, dtype=torch.long)), 4, 8, {}, "document("),  # batch 3 vs 2
        (lambda: masks.tree([-1, 0, 1], prefix_len=2), 4, 8, {}, "tree"),  # covers only 0..4
        (lambda: masks.causal() & masks.padding([1, 2, 3]), 4, 8, {}, "padding(kv_lengths)"),  # through &
        (lambda: ~masks.document(torch.arange(3)), 4, 8, {}, "document("),  # through ~
    ],
)
def test_shape_dependent_errors_at_attention_and_block_mask(mask, Nq, Nk, kw, words):
    q = torch.randn(2, 1, Nq, 4)
    k = torch.randn(2, 1, Nk, 4)
    for backend in ("flash", "reference"):
        with pytest.raises(ValueError) as e:
            attnlab.attention(q, k, k, mask=mask(), backend=backend, **kw)
        assert words in str(e.value)
    with pytest.raises(ValueError) as e:
        mask().block_mask(2, 1, Nq, Nk, **kw)
    assert words in str(e.value)


def test_block_sizes_must_be_positive():
    with pytest.raises(ValueError, match="block"):
        masks.causal().block_mask(1, 1, 4, 4, block=(0, 4))


def test_custom_mask_must_return_bool():
    m = masks.custom(lambda b, h, q, kv: (kv <= q).int())
    q = torch.randn(1, 1, 3, 2)
    for backend in ("flash", "reference"):
        with pytest.raises(TypeError, match="bool"):
            attnlab.attention(q, q, q, mask=m, backend=backend)


# ----------------------------------------------------------------------------- known src issues
def test_document_unsorted_contiguous_ids_are_classified_conservatively():
    # documented: exact for non-decreasing ids; otherwise PARTIAL where min/max ranges
    # overlap, which is still correct (the predicate decides) but not a skip
    ids = torch.tensor([1, 1, 0, 0, 2, 2])
    bm = masks.document(ids).block_mask(1, 1, 6, 6, block=(3, 2))
    # q-block 1 holds ids {0, 2}; kv-block 0 holds {1}: no pair attends, ranges overlap
    assert bm.states[0, 0, 1, 0] == PARTIAL
    sorted_bm = masks.document(torch.tensor([0, 0, 1, 1, 2, 2])).block_mask(1, 1, 6, 6, block=(3, 2))
    assert sorted_bm.states[0, 0, 1, 0] == EMPTY  # q ids {1, 2} vs kv ids {0}


def test_padding_length_may_exceed_the_keys_of_one_call():
    # a KV shard sees part of a longer sequence: lengths beyond it mean "all visible"
    m = masks.padding([3, 9])
    m.validate(2, 1, 4, 8, 4, 0)
    bm = m.block_mask(2, 1, 4, 8, block=(2, 4))
    assert (bm.states[1] == FULL).all()


def test_tree_with_no_nodes_is_causal_over_the_prefix():
    m = masks.tree(torch.empty(0, dtype=torch.long), prefix_len=4)
    got = mask_dense(m, 4, 4, 0, 0)
    assert torch.equal(got, mask_dense(masks.causal(), 4, 4, 0, 0))
