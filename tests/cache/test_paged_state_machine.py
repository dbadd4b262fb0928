"""The paged allocator under random add / append / fork / free / evict / truncate / prefix
reuse, against a shadow model of what each sequence holds.

Keys and values encode what was written: ``k = [token, position, layer]`` and
``v = [-token, position + 0.5 + layer]``, so a sequence's dense view says exactly which
tokens it holds, and a leak between sequences, a lost copy-on-write or a wrong prefix
block shows at once.  Prompt tokens come from a few shared prefixes (so prefix reuse
happens); generated tokens are unique ids.
"""

from __future__ import annotations

import torch
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from attnlab.cache.blocks import CacheFullError
from attnlab.cache.paged import PagedCache
from tests.helpers import F64_TOKEN_MEAN

BS, N_BLOCKS, LAYERS = 2, 9, 2
PROMPTS = ([1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 3, 2, 1, 0], [3, 3, 3, 3, 3, 3, 3])


class Shadow:
    def __init__(self, start=0, toks=(), pending=(), known=0):
        self.start, self.toks, self.pending, self.known = start, list(toks), list(pending), known

    def copy(self):
        return Shadow(self.start, self.toks, self.pending, self.known)

    @property
    def seen(self):
        return self.start + len(self.toks)


class PagedMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = PagedCache(LAYERS, N_BLOCKS, 1, 3, d_v=2, block_size=BS, dtype=torch.float64)
        self.shadow: dict[int, Shadow] = {}
        self.next_token = 100

    # -- helpers ---------------------------------------------------------------------------
    def snapshot(self):
        c = self.cache
        return (
            [t.clone() for t in c.k_pool + c.v_pool],
            list(c.allocator.refcount),
            {s: (c.block_table(s), c.seq_len(s)) for s in c.sequences},
            c.allocator.free_blocks(),
            c.allocator.cached_blocks(),
        )

    def assert_unchanged(self, before):
        after = self.snapshot()
        assert all(torch.equal(x, y) for x, y in zip(before[0], after[0], strict=True))
        assert before[1:] == after[1:]

    def blocks_needed(self, seqs, n):
        """The spec of a write's cost: blocks to grow, plus a copy for each (row, block it writes
        into that is shared or registered), except that the last writer of an unregistered block
        whose holders are all writing keeps it.  Returns (grow, grow + copies)."""
        A, grow, writers = self.cache.allocator, 0, {}
        for s in seqs:
            L, t = len(self.shadow[s].toks), self.cache.block_table(s)
            end = -(-(L + n) // BS)
            grow += max(0, end - len(t))
            for b in t[L // BS : end]:
                if A.refcount[b] > 1 or A.is_registered(b):
                    writers[b] = writers.get(b, 0) + 1
        return grow, grow + sum(w - (A.refcount[b] == w and not A.is_registered(b)) for b, w in writers.items())

    def pick(self, data, label):
        return data.draw(st.sampled_from(sorted(self.shadow)), label=label)

    # -- rules -------------------------------------------------------------------------------
    @initialize(i=st.integers(0, len(PROMPTS) - 1), cut=st.integers(1, 7))
    def first_prompt(self, i, cut):
        self.prefill_prompt(i, cut)

    @rule(i=st.integers(0, len(PROMPTS) - 1), cut=st.integers(1, 7))
    def prefill_prompt(self, i, cut):
        """Add a prompt and write its uncached tokens at once (so its blocks become reusable)."""
        seq = self._add(i, cut)
        self.write([seq], len(self.shadow[seq].pending), False)

    @rule(i=st.integers(0, len(PROMPTS) - 1), cut=st.integers(1, 7))
    def add_prompt(self, i, cut):
        self._add(i, cut)

    def _add(self, i, cut):
        tokens = PROMPTS[i][:cut]
        seq, n = self.cache.add_sequence(tokens)
        assert n % BS == 0 and n < len(tokens)
        if n:
            event("prefix blocks reused")
        self.shadow[seq] = Shadow(0, tokens[:n], tokens[n:], len(tokens))
        return seq

    @rule()
    def add_empty(self):
        seq, n = self.cache.add_sequence()
        assert n == 0
        self.shadow[seq] = Shadow()

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(1, 3), record=st.booleans())
    def append(self, data, n, record):
        seqs = data.draw(
            st.lists(st.sampled_from(sorted(self.shadow)), min_size=1, max_size=4, unique=True), label="seqs"
        )
        self.write(seqs, n, record)

    def write(self, seqs, n, record):
        rows = []
        for s in seqs:
            sh = self.shadow[s]
            toks = sh.pending[:n]
            fresh = list(range(self.next_token, self.next_token + n - len(toks)))
            self.next_token += len(fresh)
            rows.append((toks + fresh, fresh))
        c = self.cache
        grow, need = self.blocks_needed(seqs, n)
        available = c.allocator.n_available
        if grow <= available < need:
            event("append: copy-on-write decides whether it fits")
        before = self.snapshot()
        c.select(seqs)
        pos = torch.tensor([[self.shadow[s].seen + i for i in range(n)] for s in seqs], dtype=torch.float64)
        tok = torch.tensor([r[0] for r in rows], dtype=torch.float64)
        try:
            for layer in range(LAYERS):
                k = torch.stack([tok, pos, torch.full_like(pos, layer)], -1)[:, None]
                v = torch.stack([-tok, pos + 0.5 + layer], -1)[:, None]
                kv = c.update(layer, k, v)
        except CacheFullError as e:
            event("append: cache full")
            assert need > available and "Nothing was written" in str(e)  # refused up front, not half way
            self.assert_unchanged(before)
            return
        assert need <= available
        old = before[2]
        if any(c.block_table(s)[: len(old[s][0])][-1:] != old[s][0][-1:] for s in seqs if old[s][0]):
            event("append: copy-on-write")
        if len(c.allocator.cached_blocks()) < len(before[4]):
            event("append: LRU prefix block evicted")
        for r, s in enumerate(seqs):
            sh = self.shadow[s]
            toks, fresh = rows[r]
            sh.toks += toks
            del sh.pending[:n]
            if record and fresh and sh.known == sh.seen - len(fresh):
                c.extend_tokens(s, fresh)
                sh.known += len(fresh)
            assert kv.q_offsets[r] == sh.seen - n
        # one decode-style attention over the last layer: a row sees exactly its own tokens
        q = torch.zeros(len(seqs), 2, n, 3, dtype=torch.float64)
        out = kv.attend(q, scale=1.0)  # zero queries: the mean of the held values
        for r, s in enumerate(seqs):
            sh = self.shadow[s]
            mean_tok = -torch.tensor(sh.toks, dtype=torch.float64).mean()
            torch.testing.assert_close(out[r, :, :, 0], mean_tok.expand(2, n), **F64_TOKEN_MEAN)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(1, 3), record=st.booleans())
    def append_more(self, data, n, record):  # appends are the common operation: twice the weight
        self.append(data, n, record)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def fork(self, data):
        s = self.pick(data, "seq")
        self.shadow[self.cache.fork(s)] = self.shadow[s].copy()

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(1, 2))
    def sample_in_parallel(self, data, n):
        """Fork a sequence and write n tokens to both (parallel sampling): copy-on-write."""
        s = self.pick(data, "seq")
        f = self.cache.fork(s)
        self.shadow[f] = self.shadow[s].copy()
        self.write([s, f], n, False)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def free(self, data):
        s = self.pick(data, "seq")
        self.cache.free(s)
        del self.shadow[s]

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), k=st.integers(0, 3))
    def evict_oldest(self, data, k):
        s = self.pick(data, "seq")
        sh = self.shadow[s]
        k = min(k, len(sh.toks) // BS)
        self.cache.evict(s, k)
        sh.start += k * BS
        del sh.toks[: k * BS]

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), back=st.integers(0, 3))
    def truncate(self, data, back):
        s = self.pick(data, "seq")
        sh = self.shadow[s]
        back = min(back, len(sh.toks))
        length = sh.seen - back
        self.cache.truncate(s, length)
        del sh.toks[len(sh.toks) - back :]
        sh.pending, sh.known = [], min(sh.known, length)

    @rule(n=st.integers(0, 3))
    def evict_cached(self, n):
        had = self.cache.allocator.n_cached
        assert self.cache.evict_cached(n) == min(n, had)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), n=st.integers(1, 4))
    def reserve(self, data, n):
        s = self.pick(data, "seq")
        before = self.snapshot()
        try:
            self.cache.select([s]).reserve(n)
        except CacheFullError:
            event("reserve: cache full")
            self.assert_unchanged(before)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def blocks_are_accounted_for(self):
        c, A = self.cache, self.cache.allocator
        assert sorted(c.sequences) == sorted(self.shadow)
        counts = [0] * N_BLOCKS
        for s in c.sequences:
            t = c.block_table(s)
            assert len(set(t)) == len(t)
            for b in t:
                counts[b] += 1
        assert counts == A.refcount  # refcount = tables holding the block
        used = {b for b in range(N_BLOCKS) if counts[b]}
        free, cached = A.free_blocks(), set(A.cached_blocks())
        assert not (free & used) and not (cached & used) and not (free & cached)
        assert free | used | cached == set(range(N_BLOCKS))  # nothing leaks
        assert all(A.is_registered(b) for b in cached)
        assert A.n_used == len(used)

    @invariant()
    def every_sequence_holds_exactly_its_tokens(self):
        c = self.cache
        for s, sh in self.shadow.items():
            assert c.seq_len(s) == sh.seen
            pos = torch.arange(sh.start, sh.seen, dtype=torch.float64)
            tok = torch.tensor(sh.toks, dtype=torch.float64)
            for layer in range(LAYERS):
                k, v, start = c.sequence_kv(s, layer)
                assert start == sh.start and k.shape == (1, len(sh.toks), 3)
                assert torch.equal(k[0, :, 0], tok) and torch.equal(k[0, :, 1], pos)
                assert bool((k[0, :, 2] == layer).all())
                assert torch.equal(v[0, :, 0], -tok) and torch.equal(v[0, :, 1], pos + 0.5 + layer)

    @invariant()
    def waste_is_allocated_minus_used_slots(self):
        c = self.cache
        slots = set()
        for s, sh in self.shadow.items():
            t = c.block_table(s)
            assert c.waste(s) == len(t) * BS - len(sh.toks) >= 0
            slots |= {(t[i // BS], i % BS) for i in range(len(sh.toks))}
        assert c.waste() == c.allocator.n_used * BS - len(slots)


PagedMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, derandomize=True, deadline=None)
TestPagedAllocator = PagedMachine.TestCase
