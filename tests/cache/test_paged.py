"""PagedCache: decode attention over block tables against the reference op, and cached
decoding (paged, forked, prefix-shared, ragged batches) against full recomputation."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from attnlab import masks, scores
from attnlab.cache import paged_kv
from attnlab.cache.blocks import BlockAllocator, CacheFullError, token_list
from attnlab.cache.paged import PagedCache, PagedKV
from attnlab.nn import Decoder, DecoderConfig
from attnlab.ops.decode import split_kv_attention
from attnlab.ops.dispatch import attention
from tests.helpers import F32_PROBS, F32_RECOMPUTE, F64_FLOOR

TOL = dict(**F32_RECOMPUTE)  # the bar for float32 logits, cached vs recomputed


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def write(cache, seqs, n, seed, layers=None):
    """Append n random tokens to each of ``seqs`` (all layers); returns the last layer's view."""
    cache.select(seqs)
    Hkv, _, _, D = cache.k_pool[0].shape
    Dv = cache.v_pool[0].shape[3]
    kv = None
    for layer in range(cache.n_layers if layers is None else layers):
        kv = cache.update(
            layer,
            rand(len(seqs), Hkv, n, D, seed=seed + 100 * layer, dtype=cache.k_pool[0].dtype),
            rand(len(seqs), Hkv, n, Dv, seed=seed + 100 * layer + 1, dtype=cache.k_pool[0].dtype),
        )
    return kv


def model(positions="rope", n_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=29, d_model=16, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, positions=positions)
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(10)  # sharp attention: changing the first token moves the logits by ~1 (float32 noise ~1e-6)
    return m


def recompute(m, tokens):
    return m(torch.tensor([tokens])).logits[0, -1]


# --------------------------------------------------------------------------- decode attention
def ragged_cache():
    """Four sequences of lengths 10, 10 (a fork, diverged), 3 and 9 (sharing a prefix block)."""
    c = PagedCache(1, 32, 2, 8, d_v=5, block_size=4, dtype=torch.float64)
    a, _ = c.add_sequence(list(range(10)))
    write(c, [a], 10, seed=1)
    b = c.fork(a)
    z, _ = c.add_sequence()
    write(c, [z], 3, seed=2)
    d, n = c.add_sequence([*range(6), 7, 7, 7])
    assert n == 4 and c.block_table(d) == c.block_table(a)[:1]
    write(c, [d], 5, seed=3)
    return c, [a, b, z, d]


def batch_dependent_masks(B, M):
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(B, M, generator=g) > 0.3
    return {
        "none": None,
        "causal": masks.causal(),
        "window": masks.causal() & masks.sliding_window(5),
        "key_padding": masks.causal() & masks.key_padding(keep),
        "custom_b": masks.custom(lambda b, h, q, kv: (kv + b) % 3 != 0) & masks.causal(),
        "padding": masks.padding(torch.tensor([12, 3, 9, 11])),
        "padding_empty_rows": masks.padding(torch.tensor([0, 3, 0, 11])),  # rows 0, 2: no visible key
    }


@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize(
    "mask_name", ["none", "causal", "window", "key_padding", "custom_b", "padding", "padding_empty_rows"]
)
def test_attend_equals_the_op_on_the_dense_equivalent(nq, mask_name):
    c, seqs = ragged_cache()
    kv = write(c, seqs, nq, seed=9)
    B, H = len(seqs), 4
    q = rand(B, H, nq, 8, seed=11)
    mask = batch_dependent_masks(B, 20)[mask_name]
    mod = scores.custom(lambda s, b, h, qp, kp: s + 0.1 * b - 0.05 * h + 0.01 * (qp - kp))
    out, lse = kv.attend(q, mask=mask, score_mod=mod, return_lse=True)
    assert out.shape == (B, H, nq, 5) and lse.shape == (B, H, nq) and lse.dtype == torch.float64
    for r, s in enumerate(seqs):
        k, v, start = c.sequence_kv(s, 0)
        q_off = c.seq_len(s) - nq
        assert kv.q_offsets[r] == q_off
        # the oracle: row r repeated B times, so batch-dependent masks see batch index r
        rep = lambda t: t.unsqueeze(0).expand(B, *t.shape)  # noqa: E731
        o_ref, l_ref = attention(
            q[r : r + 1].expand(B, -1, -1, -1),
            rep(k),
            rep(v),
            mask=mask,
            score_mod=mod,
            q_offset=q_off,
            kv_offset=start,
            return_lse=True,
            backend="reference",
        )
        torch.testing.assert_close(out[r], o_ref[r], **F64_FLOOR)
        torch.testing.assert_close(lse[r], l_ref[r], **F64_FLOOR)


def test_attend_of_equal_length_rows_equals_one_batched_call():
    c = PagedCache(1, 32, 1, 8, block_size=4, dtype=torch.float64)  # MQA: 4 query heads over 1 kv head
    a, _ = c.add_sequence()
    write(c, [a], 7, seed=1)
    b = c.fork(a)
    write(c, [b], 2, seed=2)
    d, _ = c.add_sequence()
    write(c, [d], 9, seed=3)
    kv = write(c, [b, d], 3, seed=4)  # both hold 12 tokens: one q_offset for the batch
    q = rand(2, 4, 3, 8, seed=5)
    keep = torch.rand(2, 12, generator=torch.Generator().manual_seed(0)) > 0.4
    mask = masks.causal() & masks.key_padding(keep)
    dense = kv.dense()
    assert dense.k.shape == (2, 1, 12, 8) and dense.q_offset == 9 and kv.q_offset == 9
    ref = attention(q, dense.k, dense.v, mask=mask, q_offset=9, backend="reference")
    torch.testing.assert_close(kv.attend(q, mask=mask), ref, **F64_FLOOR)
    torch.testing.assert_close(kv.attend(q, mask=mask.block_mask(2, 4, 3, 12, q_offset=9)), ref, **F64_FLOOR)


def test_pieces_are_views_of_the_pool_one_per_run_of_adjacent_blocks(monkeypatch):
    c, seqs = ragged_cache()
    kv = write(c, seqs, 1, seed=4)
    pool_ptr = c.k_pool[0].untyped_storage().data_ptr()
    for r, s in enumerate(seqs):
        table = c.block_table(s)
        runs = 1 + sum(1 for x, y in itertools.pairwise(table) if y != x + 1)
        pieces = kv.pieces(r)
        assert len(pieces) == runs
        assert sum(p[0].shape[2] for p in pieces) == c.seq_len(s)
        for k, v, _ in pieces:
            assert k.untyped_storage().data_ptr() == pool_ptr  # a view, not a copy
            assert v.untyped_storage().data_ptr() == c.v_pool[0].untyped_storage().data_ptr()
    # pieces a mask shows whole are attended without it; pieces it hides are not attended
    calls = []

    def spy(q, pieces, *, mask=None, **kw):
        calls.append(([p[2] for p in pieces], mask))
        return split_kv_attention(q, pieces, mask=mask, **kw)

    monkeypatch.setattr(paged_kv, "split_kv_attention", spy)
    q = rand(len(seqs), 4, 1, 8, seed=3)
    kv.attend(q, mask=masks.causal())
    assert len(calls) == len(seqs) and all(m is None for _, m in calls)
    calls.clear()
    kv.attend(q, mask=masks.sliding_window(3))
    visible = [
        p[2] for r in range(len(seqs)) for p in kv.pieces(r) if p[2] + p[0].shape[2] > kv.q_offsets[r] - 2
    ]  # pieces holding one of keys q-2 .. q
    assert sorted(o for offs, _ in calls for o in offs) == sorted(visible)

    # a fresh sequence written in one go is one run: one piece
    e, _ = c.add_sequence()
    kv = write(c, [e], 12, seed=6)
    assert len(kv.pieces(0)) == 1 and c.block_table(e) == list(range(c.block_table(e)[0], c.block_table(e)[0] + 3))


def test_rows_attend_only_their_own_blocks():
    c = PagedCache(1, 16, 1, 2, block_size=2, dtype=torch.float64)
    a, _ = c.add_sequence()
    b, _ = c.add_sequence()
    c.select([a, b])
    k = torch.zeros(2, 1, 3, 2, dtype=torch.float64)
    v = torch.stack([torch.full((1, 3, 2), 1.0), torch.full((1, 3, 2), 2.0)]).double()
    out = c.update(0, k, v).attend(torch.zeros(2, 1, 3, 2, dtype=torch.float64), mask=masks.causal())
    assert out[0].eq(1).all() and out[1].eq(2).all()


# --------------------------------------------------------------------------- decoding with a model
@pytest.mark.parametrize("positions, n_kv_heads", [("rope", 2), ("learned", 4), ("alibi", 1)])
def test_ragged_batched_decode_equals_recomputation(positions, n_kv_heads):
    m = model(positions, n_kv_heads)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 29, (n,), generator=g).tolist() for n in (3, 11, 6)]
    c = PagedCache.for_model(m, 40, block_size=4)
    with torch.no_grad():
        # prefill in chunks (n > 1 over a non-empty cache: causal within the chunk)
        seqs = [c.add_sequence()[0] for _ in prompts]
        last = []
        for s, p in zip(seqs, prompts, strict=True):
            c.select([s])
            for i in range(0, len(p), 4):
                logits = m(torch.tensor([p[i : i + 4]]), cache=c).logits[0, -1]
            last.append(logits)
            torch.testing.assert_close(logits, recompute(m, p), **TOL)
        logits = torch.stack(last)
        c.select(seqs)
        toks = [list(p) for p in prompts]
        for _ in range(6):
            nxt = logits.argmax(-1)
            for t, x in zip(toks, nxt.tolist(), strict=True):
                t.append(x)
            logits = m(nxt[:, None], cache=c).logits[:, -1]
            for r, t in enumerate(toks):
                torch.testing.assert_close(logits[r], recompute(m, t), **TOL)
    assert c.seen.tolist() == [len(t) for t in toks] and c.waste() == sum(-len(t) % 4 for t in toks)


def test_forked_sequences_share_blocks_copy_on_write_and_equal_recomputation():
    m = model()
    prompt = torch.randint(0, 29, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    c = PagedCache.for_model(m, 24, block_size=4)
    with torch.no_grad():
        logits = c.prefill(m, [prompt])[0]
        root = c.selection[0]
        forks = [root] + [c.fork(root) for _ in range(3)]
        full, partial = c.block_table(root)[:2], c.block_table(root)[2]
        assert all(c.allocator.refcount[b] == 4 for b in [*full, partial])
        toks = [[*prompt, t] for t in (1, 2, 3, int(logits.argmax()))]  # parallel samples diverge at once
        c.select(forks)
        logits = m(torch.tensor([[t[-1]] for t in toks]), cache=c).logits[:, -1]
        tables = [c.block_table(s) for s in forks]
        assert all(t[:2] == full for t in tables)  # full blocks stay shared
        assert len({t[2] for t in tables}) == 4 and partial in {t[2] for t in tables}  # the last writer kept it
        assert c.allocator.refcount[full[0]] == 4 and c.allocator.refcount[partial] == 1
        for _ in range(4):
            for r, t in enumerate(toks):
                torch.testing.assert_close(logits[r], recompute(m, t), **TOL)
            nxt = logits.argmax(-1)
            for t, x in zip(toks, nxt.tolist(), strict=True):
                t.append(x)
            logits = m(nxt[:, None], cache=c).logits[:, -1]
        c.free(forks[0])
        assert c.allocator.refcount[full[0]] == 3 and c.selection == []


def test_prefix_shared_prompts_reuse_blocks_and_equal_recomputation():
    m = model(seed=1)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 29, (9,), generator=g).tolist()
    p1 = prefix + torch.randint(0, 29, (4,), generator=g).tolist()
    p2 = prefix + torch.randint(0, 29, (7,), generator=g).tolist()
    c = PagedCache.for_model(m, 12, block_size=4)
    with torch.no_grad():
        s1, n1 = c.add_sequence(p1)
        assert n1 == 0
        c.select([s1])
        torch.testing.assert_close(m(torch.tensor([p1]), cache=c).logits[0, -1], recompute(m, p1), **TOL)
        s2, n2 = c.add_sequence(p2)
        assert n2 == 8 and c.block_table(s2) == c.block_table(s1)[:2]
        c.select([s2])
        logits2 = m(torch.tensor([p2[n2:]]), cache=c).logits[0, -1]
        torch.testing.assert_close(logits2, recompute(m, p2), **TOL)
        # decode both together: a ragged batch over shared blocks
        c.select([s1, s2])
        toks = [[*p1, 5], [*p2, 6]]
        logits = m(torch.tensor([[5], [6]]), cache=c).logits[:, -1]
        for r, t in enumerate(toks):
            torch.testing.assert_close(logits[r], recompute(m, t), **TOL)
        # freed prompts stay in the prefix cache (LRU) and are reused later
        shared = c.block_table(s1)[:2]
        c.free(s1)
        c.free(s2)
        assert c.allocator.n_used == 0 and set(c.allocator.cached_blocks()) >= set(shared)
        s3, n3 = c.add_sequence(p1)
        assert n3 == 12 and c.block_table(s3)[:2] == shared
        c.select([s3])
        torch.testing.assert_close(m(torch.tensor([p1[n3:]]), cache=c).logits[0, -1], recompute(m, p1), **TOL)


def test_prefix_hash_covers_all_previous_tokens_and_leaves_the_last_token_to_compute():
    c = PagedCache(1, 16, 1, 2, block_size=2)
    a, _ = c.add_sequence([1, 2, 3, 4, 5])
    write(c, [a], 5, seed=0)
    assert c.add_sequence([9, 9, 3, 4, 5])[1] == 0  # same second block, other first block: no hit
    assert c.add_sequence([1, 2, 3, 4, 5])[1] == 4  # the block holding the last token is computed
    assert c.add_sequence([1, 2, 3, 4])[1] == 2
    assert c.add_sequence([1, 2, 3, 9, 9, 9])[1] == 2
    assert c.add_sequence([1])[1] == 0


def test_lru_prefix_blocks_are_evicted_when_allocation_needs_them():
    c = PagedCache(1, 4, 1, 2, block_size=2)
    a, _ = c.add_sequence([1, 2, 3, 4, 5, 6])
    write(c, [a], 6, seed=0)
    b, _ = c.add_sequence([7, 8, 9])
    write(c, [b], 1, seed=1)
    c.free(b)  # unregistered: plain free
    table = c.block_table(a)
    c.free(a)  # its 3 registered blocks go to the LRU, oldest first
    assert c.allocator.n_free == 1 and c.allocator.cached_blocks() == table
    d, _ = c.add_sequence()
    write(c, [d], 4, seed=2)  # needs 2 blocks: the free one, then the LRU's oldest (block of [1, 2])
    assert c.allocator.n_cached == 2
    assert c.add_sequence([1, 2, 3, 4, 5, 6, 0])[1] == 0  # the chain is broken at its first block
    assert c.evict_cached() == 2 and c.allocator.n_cached == 0


def test_cache_full_raises_before_writing_anything():
    m = model()
    p1, p2 = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13]
    c = PagedCache.for_model(m, 5, block_size=4)
    with torch.no_grad():
        logits = c.prefill(m, [p1, p2])  # 2 + 2 blocks, 1 free
        a, b = c.selection
        b2 = c.fork(b)

        def state():
            return (
                [t.clone() for t in c.k_pool + c.v_pool],
                list(c.allocator.refcount),
                [c.block_table(s) for s in (a, b, b2)],
                [c.seq_len(s) for s in (a, b, b2)],
            )

        before = state()
        c.select([a, b, b2])  # a needs a new block; b and b2 share a partial block: one copies
        with pytest.raises(
            CacheFullError,
            match=r"needs 2 block\(s\) \(1 new, 1 copy-on-write\) but 1 of 5 are "
            r"available \(1 free, 0 cached prefix blocks\)",
        ):
            m(torch.tensor([[1], [2], [3]]), cache=c)
        after = state()
        assert all(torch.equal(x, y) for x, y in zip(before[0], after[0], strict=True)) and before[1:] == after[1:]
        with pytest.raises(CacheFullError):
            c.select([a]).reserve(7)  # 8 + 7 tokens need 2 more blocks
        assert state()[1:] == before[1:]
        # the cache still works once b2 is gone
        c.free(b2)
        c.select([a, b])
        out = m(logits.argmax(-1)[:, None], cache=c).logits[:, -1]
        for r, p in enumerate((p1, p2)):
            torch.testing.assert_close(out[r], recompute(m, [*p, int(logits[r].argmax())]), **TOL)
        assert c.allocator.n_available == 0


def test_copy_on_write_counts_exactly_when_the_last_holder_writes_in_place():
    c = PagedCache(1, 3, 1, 2, block_size=4)
    a, _ = c.add_sequence()
    write(c, [a], 6, seed=0)  # blocks 0, 1 (1 holds 2 tokens)
    b = c.fork(a)
    write(c, [a, b], 1, seed=1)  # one copy (the other writer keeps block 1): fits in the 1 free block
    assert c.allocator.n_free == 0 and sorted([c.block_table(a)[1], c.block_table(b)[1]]) == [1, 2]


def test_registered_prefix_blocks_are_immutable():
    def tok(c, seq):
        return c.sequence_kv(seq, 0)[0][0, :, 0].tolist()

    c = PagedCache(1, 2, 1, 1, block_size=2, dtype=torch.float64)
    a, _ = c.add_sequence([1, 2, 3, 4])
    c.select([a]).update(0, torch.tensor([1.0, 2, 3, 4]).view(1, 1, 4, 1).double(), torch.zeros(1, 1, 4, 1).double())
    c.truncate(a, 3)  # into block 1, which names the prefix [1, 2, 3, 4]
    x = torch.full((1, 1, 1, 1), 9.0, dtype=torch.float64)
    with pytest.raises(CacheFullError, match=r"1 copy-on-write.*Nothing was written"):
        c.update(0, x, x)  # writing needs a copy of block 1, and the pool is full
    assert tok(c, a) == [1, 2, 3]
    c = PagedCache(1, 3, 1, 1, block_size=2, dtype=torch.float64)
    a, _ = c.add_sequence([1, 2, 3, 4])
    c.select([a]).update(0, torch.tensor([1.0, 2, 3, 4]).view(1, 1, 4, 1).double(), torch.zeros(1, 1, 4, 1).double())
    c.truncate(a, 3)
    c.update(0, x, x)
    assert tok(c, a) == [1, 2, 3, 9] and c.block_table(a) == [0, 2] and c.allocator.cached_blocks() == [1]
    b, n = c.add_sequence([1, 2, 3, 4, 5])
    assert n == 4 and tok(c, b) == [1, 2, 3, 4]


def test_attention_mask_with_equal_length_rows_and_need_weights():
    m = model()
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    keep = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    c = PagedCache.for_model(m, 16, block_size=2)
    with torch.no_grad():
        c.select([c.add_sequence()[0], c.add_sequence()[0]])
        out = m(ids, attention_mask=keep, cache=c, output_attentions=True)
        ref = m(ids, attention_mask=keep, output_attentions=True)
        torch.testing.assert_close(out.logits[keep], ref.logits[keep], **TOL)
        for w, wr in zip(out.attentions, ref.attentions, strict=True):
            torch.testing.assert_close(w, wr, **F32_PROBS)
        keep2 = torch.cat([keep, torch.ones(2, 1, dtype=torch.bool)], 1)
        ids2 = torch.cat([ids, torch.tensor([[8], [9]])], 1)
        step = m(ids2[:, -1:], attention_mask=keep2, cache=c).logits[:, -1]
        torch.testing.assert_close(step, m(ids2, attention_mask=keep2).logits[:, -1], **TOL)
        # a ragged selection has no single dense view
        s = c.fork(c.selection[0])
        c.select([s])
        m(torch.tensor([[3]]), cache=c)
        c.select([s, c.sequences[1]])
        with pytest.raises(ValueError, match="ragged"):
            m(torch.tensor([[3], [4]]), cache=c, output_attentions=True)


def test_evict_oldest_blocks_keeps_positions_and_attends_what_is_held():
    c = PagedCache(1, 8, 2, 4, block_size=2, dtype=torch.float64)
    a, _ = c.add_sequence()
    write(c, [a], 7, seed=0)
    k_all, _v_all, _ = c.sequence_kv(a, 0)
    c.evict(a, 2)
    assert c.seq_len(a) == 7 and c.length.tolist() == [3] and c.allocator.n_free == 6
    kv = write(c, [a], 1, seed=1)
    k, v, start = c.sequence_kv(a, 0)
    assert start == 4 and torch.equal(k[:, :3], k_all[:, 4:])
    q = rand(1, 4, 1, 4, seed=2)
    ref = attention(q, k[None], v[None], mask=masks.causal(), kv_offset=4, q_offset=7, backend="reference")
    torch.testing.assert_close(kv.attend(q, mask=masks.causal()), ref, **F64_FLOOR)
    with pytest.raises(ValueError, match=r"n_blocks: expected an int in \[0, 2\]"):
        c.evict(a, 3)


def test_truncate_rolls_back_draft_tokens_and_recovers_a_failed_forward():
    m = model()
    p = [3, 1, 4, 1, 5, 9, 2]
    c = PagedCache.for_model(m, 16, block_size=4)
    with torch.no_grad():
        c.prefill(m, [p])
        s = c.selection[0]
        m(torch.tensor([[6, 5, 3]]), cache=c)  # three draft tokens
        c.truncate(s, 8)  # keep one
        out = m(torch.tensor([[7]]), cache=c).logits[0, -1]
        torch.testing.assert_close(out, recompute(m, [*p, 6, 7]), **TOL)
        # a forward that fails between layers leaves the layers out of step
        c.update(0, *[torch.zeros(1, 2, 1, 4)] * 2)
        with pytest.raises(ValueError, match=r"half way through a forward.*truncate\(0, 9\)"):
            m(torch.tensor([[1]]), cache=c)
        c.truncate(s, c.seq_len(s))
        out = m(torch.tensor([[1]]), cache=c).logits[0, -1]
        torch.testing.assert_close(out, recompute(m, [*p, 6, 7, 1]), **TOL)


def test_waste_of_a_realistic_batch_is_below_one_block_per_sequence():
    rng = random.Random(0)
    lengths = [rng.randint(50, 500) for _ in range(16)]
    c = PagedCache(1, sum(-(-n // 16) for n in lengths) + 16, 1, 1, block_size=16)
    seqs = [c.add_sequence()[0] for _ in lengths]
    for s, n in zip(seqs, lengths, strict=True):
        c.select([s]).update(0, torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1))
    c.select(seqs).update(0, torch.zeros(16, 1, 1, 1), torch.zeros(16, 1, 1, 1))  # one decode step
    st = c.stats()
    expected = [-(n + 1) % 16 for n in lengths]
    assert st["waste_per_sequence"] == dict(zip(seqs, expected, strict=True)) and st["waste"] == sum(expected)
    assert max(expected) < 16  # less than one block per sequence
    assert st["allocated_slots"] - st["used_slots"] == st["waste"] and st["tokens_held"] == sum(lengths) + 16
    assert c.nbytes() == 2 * c.n_blocks * 16 * 4 and st["bytes_per_block"] == 2 * 16 * 4
    # a fork shares everything: no new waste until it writes
    c.fork(seqs[0])
    assert c.waste() == st["waste"] and c.stats()["saved_by_sharing"] == lengths[0] + 1


def test_prefill_frees_its_sequences_on_error():
    m = model()
    c = PagedCache.for_model(m, 3, block_size=4)
    with torch.no_grad(), pytest.raises(CacheFullError):
        c.prefill(m, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    assert c.sequences == [] and c.allocator.n_free + c.allocator.n_cached == 3


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: BlockAllocator(0), "BlockAllocator: n_blocks: expected an int >= 1, got 0"),
        (lambda: BlockAllocator(2.0), "BlockAllocator: n_blocks: expected an int, got float 2.0"),
        (
            lambda: PagedCache(1, 4, 1, 4).add_sequence([1, 2, -3]),
            "add_sequence(tokens)[2]: expected an int in [0, 2**62] (token ids are hashed as int64), got -3",
        ),
        (
            lambda: token_list([2**62 + 1], "tokens"),
            f"tokens[0]: expected an int in [0, 2**62] (token ids are hashed as int64), got {2**62 + 1}",
        ),
    ],
)
def test_block_errors_name_the_argument_the_bound_and_the_value(build, message):
    with pytest.raises(ValueError) as e:
        build()
    assert str(e.value) == message


def test_errors_name_the_problem():
    c = PagedCache(2, 8, 2, 4, block_size=4)
    a, _ = c.add_sequence()
    k = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match=r"no sequences selected; call cache.select"):
        c.update(0, k, k)
    with pytest.raises(ValueError, match="no sequence 7"):
        c.select([7])
    with pytest.raises(ValueError, match="distinct sequence ids"):
        c.select([a, a])
    c.select([a])
    with pytest.raises(ValueError, match=r"do not fit 1 selected sequences"):
        c.update(0, torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(TypeError, match="dtypes"):
        c.update(0, k.double(), k.double())
    with pytest.raises(ValueError, match="update layer 0 first"):
        c.update(1, k, k)
    with pytest.raises(TypeError, match=r"fork\(seq\)"):
        c.fork()
    with pytest.raises(TypeError, match="token ids"):
        c.add_sequence([1.5])
    with pytest.raises(ValueError, match=r"truncate: length: expected an int in \[0, 0\]"):
        c.truncate(a, 1)
    with pytest.raises(ValueError, match="n_blocks: expected an int >= 1"):
        PagedCache(1, 0, 1, 1)
    kv = c.update(0, k, k)
    assert isinstance(kv, PagedKV)
    with pytest.raises(ValueError, match=r"expected q \(B=1, H, Nq, D\)"):
        kv.attend(torch.zeros(2, 2, 1, 4))
    c.free()
    assert c.sequences == [] and c.allocator.n_free == 8
