"""A paged KV cache: a pool of fixed-size blocks shared by many sequences (vLLM's
PagedAttention memory layout), with copy-on-write forks and prefix reuse.

Layout (one pool per layer, allocated up front; one block table per sequence, shared by
all layers)::

    k_pool[layer]  (Hkv, n_blocks, block_size, D)       v_pool[layer]  (Hkv, n_blocks, block_size, Dv)

    table[seq] = [7, 8, 9, 2]              block_size = 4, the sequence holds 14 tokens
                  |  |  |  '-- positions 12..13 (+2 free slots: the sequence's waste)
                  '--'--'----- positions 0..11: blocks 7, 8, 9 are adjacent -> one piece

    held token i (absolute position start + i) sits in block table[i // block_size],
    slot i % block_size, of every layer's pool.

The block axis comes after the head axis so that a run of physically adjacent blocks
``pool[:, b:b+m]`` is a *view* ``(Hkv, m·block_size, D)``: the decode attention reads
each sequence's keys as such runs ("pieces", a single block at worst), attends each with
``return_lse=True`` and merges them exactly (:func:`attnlab.ops.decode.split_kv_attention`
and :func:`attnlab.merge_states`).  On CPU with the native extension built (no score mod, a
mask the native kernel implements, no gradient wanted) :meth:`PagedKV.attend` is instead one
call of ``attnlab::native_paged_decode`` (:mod:`attnlab.ops.native.decode_ops`) that reads
every row's blocks through the block tables, split over keys with the same LSE merge;
:meth:`PagedKV.attend_split` is the pieces path, its reference.  The cache is never copied
into a dense tensor, except by :meth:`PagedKV.dense` (for ``need_weights``) and
:meth:`PagedCache.sequence_kv`.
Allocation prefers the block after a sequence's last one, so tables are mostly runs.

Sequences and batch rows.  Sequences have integer ids; ``select([a, b, ...])`` says which
sequences the rows of the next forward are (``B = len(selection)``).  ``seen_at(layer)``
is then a ``(B,)`` LongTensor (a ragged cache), so :class:`attnlab.nn.Decoder` and
:class:`attnlab.nn.MultiHeadAttention` give every row its own positions.  Each row attends
to its own blocks only, its queries at its own absolute positions (causal masks are right
for chunks of several new tokens).  Masks and score mods that depend on the batch index
(``key_padding``, ``padding``, ``document`` with per-row ids, custom ones) are called with
the row's index in the selection, as if the batch had been attended at once.
``PagedKV.dense()`` (``need_weights``; the view is in :mod:`attnlab.cache.paged_kv`) needs one ``q_offset`` for the batch and raises for
a ragged selection.

Writes.  ``update(layer, k, v)`` appends the same number ``n`` of tokens to every selected
sequence (a batched decode step; prompts of different lengths are prefilled one sequence
at a time: :meth:`PagedCache.prefill`).  The layer-0 update allocates for all layers: it
first counts the blocks the whole write needs (new blocks and copy-on-write copies) and
raises :class:`CacheFullError` before anything changes if they are not available.

Sharing.  ``fork(seq)`` gives a new sequence holding the same blocks (refcounts +1): a
shared block is copied only when one of its holders writes into it (copy-on-write; in
practice the last, partially filled block).  ``add_sequence(tokens)`` shares the full
blocks of a prompt prefix already in the pool: a full block whose tokens are known is
registered under a chain hash of *all* tokens up to its end
(:func:`attnlab.cache.blocks.chain_hash`), and a new prompt with the same prefix takes
those blocks (it returns how many tokens are cached; the model computes the rest).
Registered blocks are immutable; when their last holder is freed they stay in an LRU
prefix cache and are evicted only when an allocation finds no free block
(``evict_cached()`` drops them by hand).  The content of a shared block is exactly what
recomputing the prefix gives, because positions are absolute.  **The tokens passed to
``add_sequence``/``extend_tokens`` must be the tokens whose keys and values are written
at those positions.**  At least the last prompt token is always left to compute, so the
model produces its logits.

Other hooks: ``evict(seq, n)`` drops a sequence's ``n`` oldest full blocks (positions stay
absolute: later keys attend only what is held); ``truncate(seq, length)`` drops tokens
after ``length`` (rejected draft tokens, or recovery after a forward that failed between
layers); ``waste()``/``stats()`` measure allocated minus used slots; ``nbytes()``.

API: ``add_sequence(tokens=None) -> (seq, n_cached)``, ``fork(seq) -> seq``, ``free(seq)``,
``select(seqs)``, ``reserve(n)``, ``evict(seq, n_blocks)``, ``truncate(seq, length)``,
``extend_tokens(seq, ids)``, ``evict_cached(n)``, ``seq_len(seq)``, ``block_table(seq)``,
``sequence_kv(seq, layer)``, ``waste(seq=None)``, ``stats()``, ``nbytes()``,
``prefill(model, prompts) -> last logits``, ``for_model(model, n_blocks, block_size=16)``.

>>> import torch
>>> from attnlab.cache.paged import PagedCache
>>> c = PagedCache(n_layers=1, n_blocks=8, n_kv_heads=2, d_head=4, block_size=4)
>>> a, _ = c.add_sequence()
>>> kv = c.select([a]).update(0, torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
>>> c.block_table(a), c.seen.tolist(), c.waste()
([0, 1], [6], 2)
>>> b = c.fork(a)                               # shares blocks 0 and 1
>>> kv = c.select([a, b]).update(0, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
>>> c.block_table(a), c.block_table(b)          # a copied the shared partial block 1; b kept it
([0, 2], [0, 1])
"""

from __future__ import annotations

import torch

from attnlab.cache.base import Cache, check_write, float_dtype
from attnlab.cache.blocks import BlockAllocator, CacheFullError, SeqState, token_list
from attnlab.cache.paged_kv import PagedKV, StaleViewError
from attnlab.validate import int_in, nonneg_int, positive_int

__all__ = ["PagedCache", "PagedKV", "CacheFullError", "StaleViewError"]


class PagedCache(Cache):
    """A pool of ``n_blocks`` blocks of ``block_size`` tokens per layer, shared by sequences.

    Args:
        n_layers, n_kv_heads, d_head, d_v: shapes (``d_v`` defaults to ``d_head``).
        n_blocks: blocks in the pool (all layers share block ids: one table per sequence).
        block_size: tokens per block.
        dtype, device: of the pools.
    """

    def __init__(
        self,
        n_layers: int,
        n_blocks: int,
        n_kv_heads: int,
        d_head: int,
        *,
        block_size: int = 16,
        d_v: int | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__(n_layers)
        for name, x in (
            ("n_blocks", n_blocks),
            ("n_kv_heads", n_kv_heads),
            ("d_head", d_head),
            ("block_size", block_size),
        ):
            positive_int(x, f"PagedCache: {name}")
        d_v = d_head if d_v is None else positive_int(d_v, "PagedCache: d_v")
        float_dtype(dtype, "PagedCache")
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (n_kv_heads, n_blocks, block_size)
        self.k_pool = [torch.zeros(*shape, d_head, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v_pool = [torch.zeros(*shape, d_v, dtype=dtype, device=device) for _ in range(n_layers)]
        self.allocator = BlockAllocator(n_blocks)
        self._seqs: dict = {}
        self._next_id = 0
        self._sel: list = []
        self._wrapped: dict = {}

    @classmethod
    def for_model(
        cls, model, n_blocks: int | None = None, *, block_size: int = 16, max_tokens: int | None = None, dtype=None
    ) -> PagedCache:
        """A cache shaped for an :class:`attnlab.nn.Decoder`: ``n_blocks`` blocks, or enough
        for ``max_tokens`` tokens, or (neither given) for 4 sequences of ``cfg.max_positions``."""
        c = model.cfg
        p = next(model.parameters())
        if n_blocks is None:
            tokens = 4 * c.max_positions if max_tokens is None else positive_int(max_tokens, "PagedCache: max_tokens")
            n_blocks = -(-tokens // positive_int(block_size, "PagedCache: block_size"))
        return cls(
            c.n_layers, n_blocks, c.n_kv_heads, c.d_head, block_size=block_size, dtype=dtype or p.dtype, device=p.device
        )

    # -- sequences -----------------------------------------------------------------------
    def _get(self, seq, what="sequence"):
        if isinstance(seq, bool) or not isinstance(seq, int) or seq not in self._seqs:
            raise ValueError(f"PagedCache.{what}: no sequence {seq!r} (sequences: {sorted(self._seqs)[:16]})")
        return self._seqs[seq]

    def _new(self, s):
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = s
        return sid

    def _synced(self, seq, s, what):
        if min(s.lens) != max(s.lens):
            raise ValueError(
                f"PagedCache.{what}: sequence {seq} is half way through a forward (tokens held per "
                f"layer: {s.lens}); finish it, or call truncate({seq}, {s.start + min(s.lens)})"
            )

    @property
    def sequences(self) -> list:
        return list(self._seqs)

    def add_sequence(self, tokens=None) -> tuple:
        """A new, empty sequence; returns ``(seq, n_cached)``.  With the prompt's ``tokens``,
        the full blocks of its longest prefix already in the pool are shared, and
        ``n_cached`` (a multiple of ``block_size``, less than ``len(tokens)``) tokens are
        held from the start: feed ``tokens[n_cached:]`` to the model."""
        s = SeqState(self.n_layers)
        if tokens is not None:
            s.tokens = token_list(tokens, "add_sequence(tokens)")
            for j in range(max(0, (len(s.tokens) - 1) // self.block_size)):
                h = s.hash_at(j, self.block_size)
                b = None if h is None else self.allocator.lookup(h)
                if b is None:
                    break
                s.table.append(b)
            s.lens = [len(s.table) * self.block_size] * self.n_layers
            s.n_reg = len(s.table)
        return self._new(s), s.lens[0]

    def extend_tokens(self, seq: int, tokens) -> None:
        """Record the ids of the next tokens of ``seq`` (after those already known) so that
        its full blocks can be offered for prefix reuse."""
        s = self._get(seq, "extend_tokens")
        s.tokens.extend(token_list(tokens, "extend_tokens(tokens)"))
        self._register(s)

    def fork(self, seq: int | None = None) -> int:  # type: ignore[override]  # one sequence by id, not the cache
        """A new sequence holding the same tokens as ``seq``, sharing its blocks (copy-on-write)."""
        if seq is None:
            raise TypeError("PagedCache.fork(seq): fork one sequence by id (parallel sampling, beam search)")
        s = self._get(seq, "fork")
        self._synced(seq, s, "fork")
        for b in s.table:
            self.allocator.incref(b)
        return self._new(s.clone())

    def free(self, seq: int | None = None) -> None:
        """Release ``seq``'s blocks (registered ones stay in the prefix cache); ``free()``
        with no sequence releases everything (``reset()``).  A selection holding ``seq`` is cleared."""
        if seq is None:
            self.reset()
            return
        s = self._get(seq, "free")
        s.generation += 1
        del self._seqs[seq]
        for b in s.table:
            self.allocator.decref(b)
        if seq in self._sel:
            self._sel = []

    def evict(self, seq: int, n_blocks: int) -> None:
        """Drop the ``n_blocks`` oldest full blocks of ``seq``: it keeps its positions
        (``seen`` does not move) and later queries attend only what is held."""
        s = self._get(seq, "evict")
        self._synced(seq, s, "evict")
        full = s.lens[0] // self.block_size
        note = f" (the full blocks sequence {seq} holds)"
        n_blocks = int_in(n_blocks, "PagedCache.evict: n_blocks", 0, full, closed=True, note=note)
        s.generation += 1
        for b in s.table[:n_blocks]:
            self.allocator.decref(b)
        del s.table[:n_blocks]
        s.start += n_blocks * self.block_size
        s.lens = [L - n_blocks * self.block_size for L in s.lens]

    def truncate(self, seq: int, length: int) -> None:
        """Keep only the tokens of ``seq`` before absolute position ``length``."""
        s = self._get(seq, "truncate")
        hi = s.start + max(s.lens)
        length = int_in(length, "PagedCache.truncate: length", s.start, hi, closed=True, note=f" for sequence {seq}")
        bs = self.block_size
        s.generation += 1
        s.lens = [min(L, length - s.start) for L in s.lens]
        keep = -(-max(s.lens) // bs)
        for b in s.table[keep:]:
            self.allocator.decref(b)
        del s.table[keep:]
        del s.tokens[length:]
        del s.hashes[len(s.tokens) // bs :]
        s.n_reg = min(s.n_reg, (s.start + min(s.lens)) // bs)

    def reset(self) -> None:
        """Drop every sequence and the prefix cache; the pools are kept."""
        for s in getattr(self, "_seqs", {}).values():
            s.generation += 1
        self.allocator.reset()
        self._seqs, self._sel, self._wrapped = {}, [], {}

    def evict_cached(self, n: int | None = None) -> int:
        """Forget up to ``n`` (default all) unreferenced prefix blocks, least recently used first."""
        return self.allocator.evict_cached(n)

    # -- the batch ------------------------------------------------------------------------
    def select(self, seqs) -> PagedCache:
        """Make ``seqs`` the rows of the next forwards (row ``i`` is ``seqs[i]``); returns the cache."""
        ids = list(seqs)
        for q in ids:
            self._get(q, "select")
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"PagedCache.select: expected distinct sequence ids, at least one, got {ids}")
        self._sel = ids
        return self

    select_batch = select  # the name generate() looks for

    @property
    def selection(self) -> list:
        return list(self._sel)

    def _rows(self):
        if not self._sel:
            raise ValueError("PagedCache: no sequences selected; call cache.select([seq, ...]) before the forward")
        return [self._seqs[q] for q in self._sel]

    def seen_at(self, layer):
        int_in(layer, "layer", 0, self.n_layers)
        return torch.tensor(
            [s.start + s.lens[layer] for s in self._rows()], dtype=torch.long, device=self.k_pool[0].device
        )

    @property
    def length(self):
        """Tokens held by each selected sequence, ``(B,)`` (less than ``seen`` after ``evict``)."""
        return torch.tensor([s.lens[0] for s in self._rows()], dtype=torch.long, device=self.k_pool[0].device)

    def seq_len(self, seq: int) -> int:
        """Absolute position of the next token of ``seq`` (every layer written)."""
        s = self._get(seq, "seq_len")
        return s.start + min(s.lens)

    def block_table(self, seq: int) -> list:
        return list(self._get(seq, "block_table").table)

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more tokens in every selected sequence now (allocation and
        copy-on-write), or raise :class:`CacheFullError` having changed nothing."""
        nonneg_int(n, "PagedCache.reserve: n")
        rows = self._rows()
        for q, s in zip(self._sel, rows, strict=True):
            self._synced(q, s, "reserve")
        if n:
            self._make_room(rows, n)

    # -- writes ---------------------------------------------------------------------------
    def update(self, layer, k, v):
        self._check_layer(layer, k, v)
        rows = self._rows()
        K, V = self.k_pool[layer], self.v_pool[layer]
        B, Hkv, n, D = k.shape
        if B != len(rows) or Hkv != K.shape[0] or D != K.shape[3] or v.shape[3] != V.shape[3]:
            raise ValueError(
                f"PagedCache.update: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit {len(rows)} "
                f"selected sequences and pools (Hkv, n_blocks, block_size, D) = {tuple(K.shape)} / "
                f"{tuple(V.shape)}"
            )
        check_write("PagedCache.update", layer, k, v, K.dtype, K.device)
        if layer == 0:
            for q, s in zip(self._sel, rows, strict=True):
                self._synced(q, s, "update")
            self._wrapped = {}
            if n:
                self._make_room(rows, n)
        else:
            for q, s in zip(self._sel, rows, strict=True):
                if s.lens[layer] + n > s.lens[0]:
                    raise ValueError(
                        f"PagedCache.update: layer {layer} of sequence {q} would hold "
                        f"{s.lens[layer] + n} tokens but layer 0 holds {s.lens[0]}: update layer 0 "
                        "first (it allocates the blocks of all layers)"
                    )
        before = [s.lens[layer] for s in rows]
        if n:
            bs, ar = self.block_size, torch.arange(n)
            bids = torch.cat(
                [torch.tensor(s.table, dtype=torch.long)[(ar + L) // bs] for s, L in zip(rows, before, strict=True)]
            )
            offs = torch.cat([(ar + L) % bs for L in before])
            bids, offs = bids.to(K.device), offs.to(K.device)
            K[:, bids, offs] = k.transpose(0, 1).reshape(Hkv, B * n, D)
            V[:, bids, offs] = v.transpose(0, 1).reshape(Hkv, B * n, V.shape[3])
            for s in rows:
                s.lens[layer] += n
            if layer == self.n_layers - 1:
                for s in rows:
                    self._register(s)
        return PagedKV(
            self,
            layer,
            [(tuple(s.table), s.start, b, s.lens[layer]) for s, b in zip(rows, before, strict=True)],
            rows,
            self._sel,
        )

    def _make_room(self, rows, n):
        """Blocks for ``n`` more tokens of each row, copying shared blocks about to be written.
        Counts first; raises before changing anything."""
        A, bs = self.allocator, self.block_size
        grow = 0
        writers: dict[int, int] = {}
        for s in rows:
            L = s.lens[0]
            end = -(-(L + n) // bs)
            grow += max(0, end - len(s.table))
            for i in range(L // bs, min(end, len(s.table))):
                b = s.table[i]
                if A.refcount[b] > 1 or A.is_registered(b):
                    writers[b] = writers.get(b, 0) + 1
        # a block written by w selected rows and held by no one else: the last writer keeps it
        copies = sum(w if A.refcount[b] > w or A.is_registered(b) else w - 1 for b, w in writers.items())
        if grow + copies > A.n_available:
            raise CacheFullError(
                f"PagedCache: appending {n} token(s) to {len(rows)} sequence(s) needs {grow + copies} block(s) "
                f"({grow} new, {copies} copy-on-write) but {A.n_available} of {A.n_blocks} are available "
                f"({A.n_free} free, {A.n_cached} cached prefix blocks); free or evict sequences, or build the cache "
                "with more blocks.  Nothing was written."
            )
        for s in rows:
            L = s.lens[0]
            end = -(-(L + n) // bs)
            for i in range(L // bs, min(end, len(s.table))):
                b = s.table[i]
                if A.refcount[b] > 1 or A.is_registered(b):  # copy-on-write
                    nb = A.allocate(prefer=s.table[i - 1] + 1 if i else None)
                    for K, V in zip(self.k_pool, self.v_pool, strict=True):
                        K[:, nb] = K[:, b]
                        V[:, nb] = V[:, b]
                    s.table[i] = nb
                    A.decref(b)
            while len(s.table) < end:
                s.table.append(A.allocate(prefer=s.table[-1] + 1 if s.table else None))

    # -- prefix hashes --------------------------------------------------------------------------
    def _register(self, s):
        bs = self.block_size
        first = s.start // bs
        full = first + min(s.lens) // bs  # absolute blocks written in every layer
        j = max(s.n_reg, first)
        while j < full:
            h = s.hash_at(j, self.block_size)
            if h is None:
                break
            self.allocator.register(s.table[j - first], h)
            j += 1
        s.n_reg = max(s.n_reg, j)

    # -- reads --------------------------------------------------------------------------------
    def _gather(self, pool, table, L):
        pos = torch.arange(L)
        idx = torch.tensor(table, dtype=torch.long)[pos // self.block_size] if L else pos
        return pool[:, idx.to(pool.device), (pos % self.block_size).to(pool.device)]

    def sequence_kv(self, seq: int, layer: int) -> tuple:
        """``(k (Hkv, L, D), v (Hkv, L, Dv), start)``: a dense copy of what ``seq`` holds in
        ``layer`` (for inspection), its first key at absolute position ``start``."""
        s = self._get(seq, "sequence_kv")
        int_in(layer, "layer", 0, self.n_layers)
        L = s.lens[layer]
        return self._gather(self.k_pool[layer], s.table, L), self._gather(self.v_pool[layer], s.table, L), s.start

    def _wrap(self, cls, obj, row, B):
        key = (cls, id(obj), row, B)
        hit = self._wrapped.get(key)
        if hit is None or hit[0] is not obj:
            hit = self._wrapped[key] = (obj, cls(obj, row, B))
        return hit[1]

    # -- accounting ---------------------------------------------------------------------------
    def waste(self, seq: int | None = None) -> int:
        """Allocated minus used slots: of ``seq``'s blocks, or of all used blocks (a block shared
        by several sequences counts once, with the fill of its fullest holder)."""
        bs = self.block_size
        if seq is not None:
            s = self._get(seq, "waste")
            return len(s.table) * bs - s.lens[0]
        fill: dict[int, int] = {}
        for s in self._seqs.values():
            for i, b in enumerate(s.table):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, s.lens[0] - i * bs)))
        return len(fill) * bs - sum(fill.values())

    def stats(self) -> dict:
        """Blocks by state, slots allocated/used, waste (total and per sequence), and the
        tokens that sharing saved (held by sequences minus slots used)."""
        A, bs = self.allocator, self.block_size
        held = sum(s.lens[0] for s in self._seqs.values())
        used_blocks = A.n_used
        waste = self.waste()
        return {
            "n_blocks": A.n_blocks,
            "block_size": bs,
            "used_blocks": used_blocks,
            "free_blocks": A.n_free,
            "cached_blocks": A.n_cached,
            "shared_blocks": sum(1 for r in A.refcount if r > 1),
            "allocated_slots": used_blocks * bs,
            "used_slots": used_blocks * bs - waste,
            "waste": waste,
            "waste_per_sequence": {q: self.waste(q) for q in self._seqs},
            "tokens_held": held,
            "saved_by_sharing": held - (used_blocks * bs - waste),
            "bytes_per_block": self.nbytes() // A.n_blocks,
        }

    def nbytes(self) -> int:
        """Bytes of the pools (allocated up front, used or not)."""
        return sum(t.numel() * t.element_size() for t in self.k_pool + self.v_pool)

    # -- convenience --------------------------------------------------------------------------
    def prefill(self, model, rows) -> torch.Tensor:
        """Add one sequence per prompt in ``rows`` (lists of token ids), sharing cached
        prefixes; run ``model`` over each prompt's uncached tokens, one sequence at a time;
        select them all (in order) and return the logits of each prompt's last token
        ``(B, vocab)``.  On error the sequences added here are freed."""
        device = self.k_pool[0].device
        seqs, last = [], []
        try:
            for r in rows:
                toks = token_list(r, "prefill(rows)")
                if not toks:
                    raise ValueError("PagedCache.prefill: every prompt needs at least one token")
                seq, n = self.add_sequence(toks)
                seqs.append(seq)
                self.select([seq])
                last.append(model(torch.tensor([toks[n:]], device=device), cache=self).logits[:, -1])
        except BaseException:
            for q in seqs:
                self.free(q)
            raise
        self.select(seqs)
        return torch.cat(last)

    def __repr__(self):
        A = self.allocator
        return (
            f"PagedCache(layers={self.n_layers}, blocks={A.n_blocks}x{self.block_size}, sequences="
            f"{len(self._seqs)}, used={A.n_used}, free={A.n_free}, cached={A.n_cached})"
        )
