"""Layouts, sharding, shard masks, the ring's schedule and argument checks — no processes."""

from __future__ import annotations

import pytest
import torch

import attnlab.distributed as D
from attnlab import masks
from attnlab.distributed.args import check_call
from attnlab.distributed.ring import TAG_DKV, TAG_FINAL, TAG_KV, RingPlan
from attnlab.distributed.ulysses import kv_heads_for
from attnlab.distributed.views import HeadView, ShardMask, need_matrix
from attnlab.masks import EMPTY, FULL
from tests.helpers import mask_dense, tile_truth

LAYOUTS = D.LAYOUTS


def _masks(N, B=1):
    ids = torch.arange(N) * 3 // max(N, 1)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[:, :3] = False
    return {
        "none": None,
        "causal": masks.causal(),
        "window5": masks.sliding_window(5),
        "doc": masks.document(ids),
        "doc_causal": masks.document(ids) & masks.causal(),
        "prefix": masks.prefix_lm(N // 4),
        "keypad": masks.key_padding(keep) & masks.causal(),
        "custom": masks.custom(lambda b, h, q, kv: (q - kv) % 3 == 0),
        "not_window": masks.causal() & ~masks.sliding_window(4),
    }


# ------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("N,P", [(1, 1), (1, 3), (5, 2), (37, 4), (64, 4), (33, 3), (8, 8)])
def test_shards_partition_the_padded_sequence_in_increasing_order(layout, N, P):
    pos = [D.shard_positions(N, P, r, layout) for r in range(P)]
    C = D.shard_len(N, P, layout)
    assert all(p.numel() == C for p in pos)
    assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(D.padded_len(N, P, layout)))
    assert all(bool((p[1:] > p[:-1]).all()) for p in pos)
    assert D.padded_len(N, P, layout) % (2 * P if layout == "zigzag" else P) == 0
    assert D.padded_len(N, P, layout) - N < (2 * P if layout == "zigzag" else P)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("N,P", [(5, 2), (37, 4), (64, 3)])
def test_shard_then_unshard_is_the_identity(layout, N, P):
    x = torch.randn(2, 3, N, 5)
    parts = [D.shard_sequence(x, dim=2, layout=layout, rank=r, world_size=P) for r in range(P)]
    assert torch.equal(D.unshard_sequence(parts, dim=2, seq_len=N, layout=layout), x)
    for r, p in enumerate(parts):  # padding is zero, real slots hold their positions' values
        pos = D.shard_positions(N, P, r, layout)
        assert torch.equal(p[:, :, pos >= N], torch.zeros_like(p[:, :, pos >= N]))
        assert torch.equal(p[:, :, pos < N], x[:, :, pos[pos < N]])
    ids = torch.arange(N).view(1, N)  # integer tensors and dim=-1 / dim=1
    assert torch.equal(
        D.unshard_sequence(
            [D.shard_sequence(ids, dim=-1, layout=layout, rank=r, world_size=P) for r in range(P)],
            dim=1,
            seq_len=N,
            layout=layout,
        ),
        ids,
    )


def test_layout_examples():
    assert D.shard_positions(8, 2, 0, "contiguous").tolist() == [0, 1, 2, 3]
    assert D.shard_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert D.shard_positions(8, 2, 1, "striped").tolist() == [1, 3, 5, 7]
    assert D.shard_positions(5, 2, 1, "contiguous").tolist() == [3, 4, 5]  # 5 is padding


def test_sharding_arguments_are_checked():
    x = torch.zeros(1, 4)
    with pytest.raises(TypeError):
        D.shard_sequence(x, layout="zigzag", rank=0, world_size=2)  # dim is required
    with pytest.raises(ValueError, match="layout"):
        D.shard_sequence(x, dim=1, layout="spiral", rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        D.shard_sequence(x, dim=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="dim"):
        D.shard_sequence(x, dim=3, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank, world_size"):
        D.shard_sequence(x, dim=1)  # no process group to ask
    with pytest.raises(ValueError, match="shard 1"):
        D.unshard_sequence([torch.zeros(1, 2), torch.zeros(1, 3)], dim=1, seq_len=4)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_causal_work_balance_by_layout(P):
    N = 64 * P
    contiguous = D.work_per_rank(N, P, "contiguous", "causal")
    zigzag = D.work_per_rank(N, P, "zigzag", "causal")
    striped = D.work_per_rank(N, P, "striped", "causal")
    assert sum(contiguous) == sum(zigzag) == sum(striped) == N * (N + 1) // 2
    assert D.balance(contiguous) == pytest.approx(2 * P - 1, rel=0.05)  # the triangle's rows: 1 : 2P-1
    assert D.balance(zigzag) == 1.0
    assert D.balance(striped) < 1 + 2 * P / N
    # the closed form agrees with evaluating the mask
    assert D.work_per_rank(37, 3, "zigzag", masks.causal()) == D.work_per_rank(
        37, 3, "zigzag", masks.custom(lambda b, h, q, kv: kv <= q)
    )  # evaluated: no structure


# ------------------------------------------------------------------------ shard masks
def _truth_need(mask, pos, N, B=1, H=2):
    P = len(pos)
    out = [[False] * P for _ in range(P)]
    for r in range(P):
        for s in range(P):
            qp, kp = pos[r][pos[r] < N], pos[s][pos[s] < N]
            if qp.numel() == 0 or kp.numel() == 0:
                continue
            if mask is None:
                out[r][s] = True
                continue
            m = mask(
                torch.arange(B).view(B, 1, 1, 1),
                torch.arange(H).view(1, H, 1, 1),
                qp.view(1, 1, -1, 1),
                kp.view(1, 1, 1, -1),
            )
            out[r][s] = bool(m.any())
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P,N", [(2, 37), (4, 37), (4, 64), (5, 23)])
@pytest.mark.parametrize("name", ["none", "causal", "window5", "doc", "doc_causal", "prefix", "keypad", "custom"])
def test_need_matrix_never_misses_a_pair_and_is_exact_for_runs(layout, P, N, name):
    mask = _masks(N, B=1)[name]
    pos = [D.shard_positions(N, P, r, layout) for r in range(P)]
    need = need_matrix(mask, pos, N, 1, 2)
    truth = _truth_need(mask, pos, N)
    for r in range(P):
        for s in range(P):
            assert need[r][s] or not truth[r][s], f"pair ({r}, {s}) needed but skipped"
            if layout != "striped" and getattr(mask, "cheap_classify", True):
                assert need[r][s] == truth[r][s], f"pair ({r}, {s}): classifier not exact"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["none", "causal", "window5", "doc_causal", "keypad", "custom", "not_window"])
def test_shard_mask_predicate_and_tiles_agree_with_global_positions(layout, name):
    N, P, B, H = 37, 3, 1, 2
    mask = _masks(N, B)[name]
    for r in range(P):
        for s in range(P):
            qp, kp = D.shard_positions(N, P, r, layout), D.shard_positions(N, P, s, layout)
            sm = ShardMask(mask, qp, kp, N)
            C = qp.numel()
            got = mask_dense(sm, B, H, C, C, 0, 0)
            want = (qp.view(-1, 1) < N) & (kp.view(1, -1) < N)
            if mask is not None:
                want = (
                    want & mask_dense(mask, B, H, N, N, 0, 0)[:, :, qp.clamp(max=N - 1)][:, :, :, kp.clamp(max=N - 1)]
                )
            assert torch.equal(got, want.expand_as(got))
            for bq, bk in ((4, 4), (5, 3), (16, 16)):
                st = sm.block_mask(B, H, C, C, q_offset=0, kv_offset=0, block=(bq, bk)).states
                anyt, allt = tile_truth(got, bq, bk)
                st = st.expand_as(anyt)
                assert not ((st == EMPTY) & anyt).any(), "a tile with a visible pair was classified EMPTY"
                assert not ((st == FULL) & ~allt).any(), "a tile with a hidden pair was classified FULL"


def test_head_view_shifts_heads_for_predicate_and_classifier():
    m = masks.custom(lambda b, h, q, kv: (q - kv) % (h + 1) == 0)
    v = HeadView(m, 2, 2, 4)
    got = mask_dense(v, 1, 2, 8, 8, 0, 0)
    want = mask_dense(m, 1, 4, 8, 8, 0, 0)[:, 2:4]
    assert torch.equal(got, want)
    cw = HeadView(masks.causal(), 1, 1, 2)
    assert torch.equal(
        cw.block_mask(1, 1, 8, 8, block=(4, 4)).states.flatten(),
        masks.causal().block_mask(1, 1, 8, 8, block=(4, 4)).states.flatten(),
    )


# ------------------------------------------------------------------------- the schedule
def _simulate(P, N, layout, mask):
    """Play the forward and backward message schedule of every rank; check that each
    send meets a receive at the same boundary, that every needed pair is computed once,
    and that every rank ends with the dK/dV contributions of exactly the ranks that need
    its shard."""
    plans = [RingPlan(P, r, N, layout, mask, 1, 2) for r in range(P)]
    need = plans[0].need
    assert all(p.need == need for p in plans)
    # forward: kv of origin s travels; track which origin each rank holds
    held = {r: r for r in range(P)}
    computed = set()
    for t in range(P):
        sends, recvs = [], []
        for r, p in enumerate(plans):
            if p.holds(t):
                assert held[r] == p.origin(t)
                if p.computes(t):
                    computed.add((r, p.origin(t)))
            if p.sends_kv(t):
                sends.append((r, (r + 1) % P, TAG_KV, p.origin(t)))
            if p.recvs_kv(t):
                recvs.append(((r - 1) % P, r, TAG_KV))
        assert sorted(x[:3] for x in sends) == sorted(recvs), f"forward boundary {t}"
        held = {dst: origin for _, dst, _, origin in sends}
    assert computed == {(r, s) for r in range(P) for s in range(P) if need[r][s]}
    # backward: the accumulators carry sets of contributors
    pending = {r: None for r in range(P)}
    own = {r: None for r in range(P)}
    for t in range(P + 1):
        sends, recvs = [], []
        for r, p in enumerate(plans):
            if pending[r] is not None:
                (dst, tag), contrib = pending[r]
                sends.append((r, dst, tag, contrib))
            if t < P and p.sends_kv(t):
                sends.append((r, (r + 1) % P, TAG_KV, None))
            if p.recvs_kv(t):
                recvs.append(((r - 1) % P, r, TAG_KV))
            if t >= 1 and p.holds(t):
                recvs.append(((r - 1) % P, r, TAG_DKV))
            if p.final_from(t) is not None:
                recvs.append((p.final_from(t), r, TAG_FINAL))
        assert sorted(x[:3] for x in sends) == sorted(recvs), f"backward boundary {t}"
        arrived = {(dst, tag): c for _, dst, tag, c in sends if tag != TAG_KV}
        for r, p in enumerate(plans):
            pending[r] = None
            if p.final_from(t) is not None:
                own[r] = arrived[(r, TAG_FINAL)]
            if not p.holds(t):
                continue
            acc = set(arrived[(r, TAG_DKV)]) if t >= 1 else set()
            if p.computes(t):
                acc.add(r)
            dest = p.acc_to(t)
            if dest == "own":
                own[r] = acc
            else:
                pending[r] = (dest, acc)
    for s in range(P):
        assert (own[s] or set()) == {r for r in range(P) if need[r][s]}, f"dK/dV of rank {s}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P,N", [(1, 7), (2, 37), (3, 30), (4, 37), (5, 23), (4, 6)])
@pytest.mark.parametrize("name", ["none", "causal", "window5", "doc", "doc_causal", "keypad"])
def test_ring_schedule_matches_every_message_and_computes_every_needed_pair(layout, P, N, name):
    _simulate(P, N, layout, _masks(N)[name])


def test_masks_save_messages_where_they_can():
    N, P = 64, 4
    full = RingPlan(P, 0, N, "contiguous", None, 1, 1)
    assert full.sends_skipped() == 0
    causal = RingPlan(P, 0, N, "contiguous", masks.causal(), 1, 1)
    assert causal.reach == [3, 2, 1, 0] and causal.sends_skipped() == 6  # half of the 12 hops
    window = RingPlan(P, 0, N, "contiguous", masks.sliding_window(5), 1, 1)
    assert window.reach == [1, 1, 1, 0] and window.sends_skipped() == 9
    zig = RingPlan(P, 0, N, "zigzag", masks.causal(), 1, 1)
    assert zig.sends_skipped() == 0  # zigzag: every rank needs every shard (that is the balance)


# ------------------------------------------------------------------------ heads, args
def test_ulysses_kv_heads_per_rank():
    assert kv_heads_for(8, 8, 4, 1) == ([2, 3], 1)  # MHA: two heads each
    assert kv_heads_for(8, 4, 4, 3) == ([3], 2)  # GQA, one group per rank
    assert kv_heads_for(8, 2, 4, 1) == ([0], 2)  # fewer kv heads than ranks: replicated
    assert kv_heads_for(8, 2, 4, 2) == ([1], 2)
    assert kv_heads_for(8, 1, 2, 1) == ([0], 4)  # MQA
    assert kv_heads_for(12, 4, 2, 1) == ([2, 3], 3)  # whole groups
    assert kv_heads_for(6, 2, 3, 1) == ([0, 1], 1)  # a rank straddles two groups: one kv head per q head
    with pytest.raises(ValueError, match="H=6 query heads cannot be split over 4 ranks"):
        kv_heads_for(6, 2, 4, 0)


def test_call_arguments_are_checked_before_any_message():
    q = torch.zeros(1, 4, 8, 16)
    k = v = torch.zeros(1, 2, 8, 16)
    kw = dict(mask=None, score_mod=None, scale=None, layout="contiguous", seq_len=None, return_lse=False, world=2)
    assert check_call("op", q, k, v, **kw) == (0.25, 16)
    with pytest.raises(ValueError, match="same sequence"):
        check_call("op", q, k[:, :, :5], v[:, :, :5], **kw)
    with pytest.raises(ValueError, match="seq_len=40"):
        check_call("op", q, k, v, **{**kw, "seq_len": 40})
    assert check_call("op", q, k, v, **{**kw, "seq_len": 15})[1] == 15  # padded
    with pytest.raises(ValueError, match="even shard length"):
        check_call("op", q[:, :, :7], k[:, :, :7], v[:, :, :7], **{**kw, "layout": "zigzag"})
    with pytest.raises(TypeError, match="BlockMask"):
        check_call("op", q, k, v, **{**kw, "mask": masks.causal().block_mask(1, 4, 16, 16)})
    with pytest.raises(ValueError, match="document"):  # ids shorter than the whole sequence
        check_call("op", q, k, v, **{**kw, "mask": masks.document(torch.zeros(10, dtype=torch.long))})
    with pytest.raises(ValueError, match=r"H=4 must be a multiple|multiple of kv heads"):
        check_call("op", q, torch.zeros(1, 3, 8, 16), torch.zeros(1, 3, 8, 16), **kw)
    with pytest.raises(TypeError, match="return_lse"):
        check_call("op", q, k, v, **{**kw, "return_lse": 1})
