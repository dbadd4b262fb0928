"""Masks lower to a MaskStructure (attnlab/masks/structure.py, issue 14): the lowering of
every built-in and of the combinations that lower, checked against the mask's own predicate
(property test), the exact fields of each built-in (the contract in MASK_STRUCTURE.md),
and the consumers that read the structure instead of class names."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnlab import masks
from attnlab.masks import MaskStructure

B, NQ, NK = 2, 5, 9
SETTINGS = settings(max_examples=60, deadline=None)  # ~5 s on this loaded machine


def _grid(m, B, Nq, Nk, q_offset, kv_offset, H=1):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = (torch.arange(Nq) + q_offset).view(1, 1, Nq, 1)
    kv = (torch.arange(Nk) + kv_offset).view(1, 1, 1, Nk)
    return torch.as_tensor(m(b, h, q, kv)).expand(B, H, Nq, Nk)


# --------------------------------------------------------------------------- strategies
small = st.integers(0, 6)
opt_small = st.one_of(st.none(), small)


@st.composite
def leaf(draw, total_q, total_k):
    """A built-in mask valid for absolute positions 0..total-1, batch B."""
    kind = draw(
        st.sampled_from(
            [
                "causal",
                "sliding_window",
                "prefix_lm",
                "sink_window",
                "band",
                "document",
                "padding",
                "key_padding",
                "tree",
                "custom",
            ]
        )
    )
    if kind == "causal":
        return masks.causal()
    if kind == "sliding_window":
        return masks.sliding_window(draw(st.integers(1, 6)), right=draw(small))
    if kind == "prefix_lm":
        return masks.prefix_lm(draw(small))
    if kind == "sink_window":
        s, w = draw(small), draw(small)
        return masks.sink_window(s, w if s or w else 1)
    if kind == "band":
        return masks.band(draw(opt_small), draw(opt_small))
    if kind == "document":
        ids = torch.tensor(sorted(draw(st.lists(st.integers(0, 3), min_size=total_q, max_size=total_q))))
        if draw(st.booleans()):
            kv = torch.tensor(sorted(draw(st.lists(st.integers(0, 3), min_size=total_k, max_size=total_k))))
            return masks.document(ids.expand(B, -1), kv)
        return masks.document(ids) if total_q == total_k else masks.causal()
    if kind == "padding":
        return masks.padding(torch.tensor(draw(st.lists(st.integers(0, total_k + 2), min_size=B, max_size=B))))
    if kind == "key_padding":
        return masks.key_padding(
            torch.tensor(
                draw(st.lists(st.lists(st.booleans(), min_size=total_k, max_size=total_k), min_size=B, max_size=B))
            )
        )
    if kind == "tree":
        return masks.tree([-1, 0, 0, 1], prefix_len=max(0, total_q - 4))
    return masks.custom(lambda b, h, q, kv: (q + kv) % 3 != 0)


def combos(total_q, total_k):
    return st.recursive(
        leaf(total_q, total_k),
        lambda inner: st.one_of(
            st.tuples(inner, inner).map(lambda ab: ab[0] & ab[1]),
            st.tuples(inner, inner).map(lambda ab: ab[0] | ab[1]),
            inner.map(lambda a: ~a),
        ),
        max_leaves=4,
    )


@SETTINGS
@given(data=st.data(), kv_offset=st.integers(0, 2), extra=st.integers(0, 3))
def test_lowered_structure_evaluates_to_the_masks_predicate(data, kv_offset, extra):
    # positions 0..total-1 exist in every tensor; the problem sits at (q_offset, kv_offset)
    q_offset = kv_offset + NK - NQ + data.draw(st.integers(-2, 0))
    total = kv_offset + NK + extra
    m = data.draw(combos(total, total))
    s = m.lower()
    if s is None:
        return
    assert isinstance(s, MaskStructure)
    want = _grid(m, B, NQ, NK, q_offset, kv_offset)
    got = s.evaluate(B, NQ, NK, q_offset, kv_offset)
    assert got.dtype == torch.bool and got.shape[1:] == (1, NQ, NK) and got.shape[0] in (1, B)
    assert torch.equal(got.expand(B, 1, NQ, NK), want), f"{m!r} lowered to {s!r}"


@SETTINGS
@given(data=st.data(), bq=st.integers(1, 4), bk=st.integers(1, 4))
def test_structure_tile_states_are_exact_where_they_say_so(data, bq, bk):
    q_offset, kv_offset, total = 4, 0, NK
    m = data.draw(combos(total, total))
    s = m.lower()
    if s is None:
        return
    nqb, nkb = -(-NQ // bq), -(-NK // bk)
    ql = (torch.arange(nqb) * bq + q_offset).view(-1, 1)
    qh = (torch.clamp(torch.arange(1, nqb + 1) * bq, max=NQ) - 1 + q_offset).view(-1, 1)
    kl = (torch.arange(nkb) * bk + kv_offset).view(1, -1)
    kh = (torch.clamp(torch.arange(1, nkb + 1) * bk, max=NK) - 1 + kv_offset).view(1, -1)
    states = s.classify(B, 1, ql, qh, kl, kh)
    if states is None:
        assert not s.fields() <= MaskStructure.CLASSIFIED
        return
    states = states.expand(B, 1, nqb, nkb)
    want = s.evaluate(B, NQ, NK, q_offset, kv_offset).expand(B, 1, NQ, NK)
    for i in range(nqb):
        for j in range(nkb):
            tile = want[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            for b in range(B):
                st_ = int(states[b, 0, i, j])
                assert st_ != masks.FULL or bool(tile[b].all()), (m, i, j)
                assert st_ != masks.EMPTY or not bool(tile[b].any()), (m, i, j)


def test_enough_combinations_lower():
    """The property test is not vacuous: `&` of bands, paddings and documents lowers."""
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2])
    cases = [
        masks.causal() & masks.document(ids),
        masks.padding(torch.tensor([3, 9])) & masks.sliding_window(3),
        masks.prefix_lm(3) & masks.causal(),
        masks.sink_window(2, 3) & masks.band(None, 0),
        masks.band(2, 1) & masks.causal() & masks.key_padding(torch.ones(2, 9, dtype=torch.bool)),
        ~~masks.causal(),
        masks.causal() | masks.band(None, None),
    ]
    for m in cases:
        s = m.lower()
        assert s is not None, m
        assert torch.equal(s.evaluate(B, NQ, NK, 4, 0).expand(B, 1, NQ, NK), _grid(m, B, NQ, NK, 4, 0)), m


# --------------------------------------------------------------------------- the contract's fields
def test_builtins_lower_to_the_contracts_fields():
    ids = torch.tensor([0, 0, 1])
    lens = torch.tensor([2, 3])
    keep = torch.ones(2, 3, dtype=torch.bool)

    def f(m):
        return {k: getattr(m.lower(), k) for k in m.lower().fields()}

    assert f(masks.causal()) == {"right": 0}
    assert f(masks.sliding_window(4)) == {"left": 3, "right": 0}
    assert f(masks.sliding_window(4, right=2)) == {"left": 3, "right": 2}
    assert f(masks.band(None, 5)) == {"right": 5}
    assert f(masks.band(None, None)) == {}
    assert f(masks.prefix_lm(3)) == {"right": 0, "sinks": 3}
    assert f(masks.sink_window(2, 4)) == {"left": 3, "right": 0, "sinks": 2, "sinks_right": 0}
    assert f(masks.sink_window(0, 4)) == {"left": 3, "right": 0}
    assert f(masks.padding(lens))["kv_len"] is not None and masks.padding(lens).lower().fields() == {"kv_len"}
    assert masks.document(ids).lower().fields() == {"q_ids", "kv_ids"}
    assert masks.key_padding(keep).lower().key_keep is keep
    assert masks.custom(lambda b, h, q, kv: q >= kv).lower() is None
    assert masks.tree([-1, 0]).lower() is None
    assert (~masks.causal()).lower() is None
    assert (masks.causal() | masks.sliding_window(2)).lower() is None
    # (band | sinks) & (band with a left bound) is not one band with sinks
    assert (masks.prefix_lm(2) & masks.sliding_window(2)).lower() is None


def test_varlen_dense_and_shifted_lower():
    cu = torch.tensor([0, 3, 7])
    v = masks.varlen(cu, window=(None, 0))
    s = v.lower()
    assert s.fields() == {"right", "q_ids", "kv_ids", "q_pos", "kv_pos"}
    assert torch.equal(s.evaluate(1, 7, 7, 0, 0), _grid(v, 1, 7, 7, 0, 0))
    assert masks.varlen(cu).lower().fields() == {"q_ids", "kv_ids"}
    t = torch.rand(2, 3, 4, 6) > 0.5
    d = masks.dense(t, q_offset=2, kv_offset=0)
    assert d.lower().fields() == {"dense", "dense_q_offset"}
    assert torch.equal(d.lower().evaluate(2, 4, 6, 2, 0, H=3), _grid(d, 2, 4, 6, 2, 0, H=3))
    qo = torch.tensor([3, 5])
    sh = masks.per_batch_q_offset(masks.sliding_window(3) & masks.padding(torch.tensor([5, 7])), qo)
    assert sh.lower().fields() == {"left", "right", "kv_len", "q_shift"}
    assert torch.equal(sh.lower().evaluate(2, 2, 8, 0, 0), _grid(sh, 2, 2, 8, 0, 0))


def test_all_true_and_replace():
    assert MaskStructure().fields() == frozenset()
    assert MaskStructure().evaluate(1, 2, 3, 0, 0).all()
    assert MaskStructure(right=0).replace(left=2).fields() == {"left", "right"}


# --------------------------------------------------------------------------- consumers
class _MyCausal(masks.Mask):
    """A mask class the library has never seen, lowering to causal()."""

    cheap_classify = True

    def predicate(self, b, h, q, kv):
        return kv <= q

    def classify(self, B, H, ql, qh, kl, kh):
        return masks.causal().classify(B, H, ql, qh, kl, kh)

    def lower(self):
        return MaskStructure(right=0)


def test_flash_tile_classifier_reads_the_structure_of_a_mask_without_classify():
    class Lowered(masks.Mask):  # no classify(): the structure classifies its tiles exactly
        def predicate(self, b, h, q, kv):
            return kv <= q

        def lower(self):
            return MaskStructure(right=0)

    got = Lowered().block_mask(1, 1, 64, 64, block=(16, 16)).states
    assert torch.equal(got, masks.causal().block_mask(1, 1, 64, 64, block=(16, 16)).states)
    assert (got == masks.EMPTY).sum() == 6 and (got == masks.PARTIAL).sum() == 4


def test_sdpa_recognises_a_new_mask_lowering_to_causal():
    from attnlab.ops.sdpa import is_causal_mask, sdpa_unsupported

    q = torch.randn(1, 2, 4, 8)
    assert is_causal_mask(_MyCausal()) and is_causal_mask(masks.band(None, 0))
    assert is_causal_mask(masks.causal() & masks.band(None, 3))
    assert not is_causal_mask(masks.sliding_window(3)) and not is_causal_mask(masks.custom(lambda *a: True))
    assert sdpa_unsupported(q, q, _MyCausal(), None, 0, 0, False) is None


def test_sdpa_key_padding_from_any_mask_lowering_to_key_keep():
    from attnlab.ops.sdpa import key_keep_slice

    keep = torch.tensor([[True, False, True], [True, True, False]])
    m = masks.key_padding(keep) & masks.band(None, None)  # not a key_padding object, same structure
    assert torch.equal(key_keep_slice(m, 2, 1), keep[:, 1:])


def test_triton_lowering_reads_the_structure_not_the_class():
    from attnlab.ops.triton.masking import INT_MAX, INT_MIN, lower_mask

    spec = lower_mask(_MyCausal(), 1, 4, 4, 0, 0, "cpu")
    assert spec is not None and spec.band == (0, INT_MAX) and spec.sink is None
    assert lower_mask(masks.causal(), 1, 4, 4, 0, 0, "cpu").band == (0, INT_MAX)
    assert lower_mask(masks.band(2, 1), 1, 4, 4, 0, 0, "cpu").band == (-1, 2)
    assert lower_mask(masks.prefix_lm(2), 1, 4, 4, 0, 0, "cpu").sink == (2, INT_MIN)
    assert lower_mask(masks.sink_window(2, 3), 1, 4, 4, 0, 0, "cpu").sink == (2, 0)
    assert lower_mask(masks.varlen(torch.tensor([0, 2, 4]), window=(None, 0)), 1, 4, 4, 0, 0, "cpu") is None
    assert lower_mask(masks.custom(lambda b, h, q, kv: kv <= q), 1, 4, 4, 0, 0, "cpu") is None


def test_fingerprint_names_masks_by_kind_not_class_name():
    from attnlab.distributed.fingerprint import leaves

    assert leaves(masks.band(2, None) & masks.causal(), "m") == {
        "m": "band & causal",
        "m.a": "band",
        "m.a.left": "2",
        "m.a.right": "None",
        "m.b": "causal",
    }
    assert leaves(~masks.varlen(torch.tensor([0, 2])), "m")["m"] == "~varlen"
    assert leaves(_MyCausal(), "m")["m"] == f"{__name__}._MyCausal"  # a user class: by its own name


def test_distributed_work_count_reads_the_structure():
    from attnlab.distributed.layouts import work_per_rank

    class Opaque(_MyCausal):  # counted in closed form: its predicate is never called
        def predicate(self, b, h, q, kv):
            raise AssertionError("evaluated")

    assert work_per_rank(8, 2, "zigzag", Opaque()) == work_per_rank(8, 2, "zigzag", masks.causal())


@pytest.mark.parametrize(
    "make",
    [
        lambda: masks.band(1, 2),
        lambda: masks.varlen(torch.tensor([0, 3, 8]), window=(2, 0)),
        lambda: masks.dense(torch.rand(1, 1, 8, 8) > 0.3, q_offset=0),
        lambda: masks.per_batch_q_offset(masks.causal(), torch.tensor([0, 2])),
    ],
)
def test_newer_kinds_have_keys_that_rebuild_them(make):
    m = make()
    k = m.key()
    assert k is not None
    r = masks.mask_from_key(*k)
    Bm = 2 if "shift" in k[0] else 1
    assert type(r) is type(m)
    assert torch.equal(_grid(r, Bm, 8, 8, 0, 0), _grid(m, Bm, 8, 8, 0, 0))


def test_structural_keys_round_trip_every_kind_and_refuse_subclasses():
    import torch

    from attnlab import masks

    ids = torch.tensor([[0, 0, 1, 1, 1]])
    every = [
        masks.causal(),
        masks.sliding_window(3),
        masks.prefix_lm(2),
        masks.sink_window(1, 2),
        masks.document(ids),
        masks.padding(torch.tensor([4])),
        masks.key_padding(torch.ones(1, 5, dtype=torch.bool)),
        masks.tree([-1, 0, 0]),
        masks.band(1, None),
        masks.varlen(torch.tensor([0, 2, 5])),
        masks.per_batch_q_offset(masks.causal(), torch.tensor([1])),
    ]
    for m in [*every, every[0] & ~every[1] | every[8]]:
        spec, ts, ints = m.key()
        again = masks.mask_from_key(spec, ts, ints)
        assert type(again) is type(m) and again.key()[0] == spec

    class Shifted(type(masks.causal())):  # may change the predicate: a key would rebuild the parent
        def predicate(self, b, h, q, kv):
            return kv < q

    assert Shifted().key() is None and (Shifted() & masks.causal()).key() is None
