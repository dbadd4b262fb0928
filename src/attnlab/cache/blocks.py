"""The bookkeeping behind :class:`attnlab.cache.paged.PagedCache` (no tensors are held
here): the block allocator and the state of one sequence (block table, lengths, hashes).

The allocator hands out block ids ``0 .. n_blocks-1`` and keeps,
for each block, a reference count (how many sequences' block tables hold it).  Every
block is in exactly one of three states::

    free      refcount 0, no content worth keeping           -> allocated first
    used      refcount >= 1 (in one or more block tables)
    cached    refcount 0, but its content is a registered prefix (a hash names it):
              kept, least recently released first, for prefix reuse; evicted (its hash
              forgotten) when an allocation finds no free block

A *registered* block is immutable: its content is the keys/values of a known token
prefix, named by :func:`chain_hash` of all the tokens up to and including the block's
own.  Writers must copy it before writing (the cache does: copy-on-write).

Allocation prefers the block right after a given one (so that a sequence's table is
made of runs of physically adjacent blocks, which the decode attention reads as one
piece), else the lowest free id, else the least recently released cached block.

>>> a = BlockAllocator(3)
>>> x, y = a.allocate(), a.allocate()
>>> a.register(x, chain_hash(None, [1, 2]))
True
>>> a.decref(x); a.decref(y)          # x keeps its content for reuse, y is free again
>>> a.n_free, a.n_cached, a.lookup(chain_hash(None, [1, 2])) == x, a.refcount[x]
(2, 1, True, 1)
"""

from __future__ import annotations

import hashlib
import heapq
import operator
from array import array
from collections import OrderedDict

import torch

from attnlab.validate import MAX_INT, int_in, integer


class CacheFullError(RuntimeError):
    """The paged cache has no block left for a write; the write did not happen."""


_ROOT = b"\0" * 32


def chain_hash(parent: bytes | None, tokens) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids: a name for the
    whole prefix ending with this block (two blocks with the same tokens after different
    prefixes get different hashes)."""
    h = hashlib.sha256(_ROOT if parent is None else parent)
    h.update(array("q", [int(t) for t in tokens]).tobytes())
    return h.digest()


def token_list(tokens, name: str) -> list:
    """``tokens`` (a sequence of ints or a 1-D integer tensor) as a list of ints >= 0."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(
                f"{name}: expected a 1-D integer tensor or a list of ints, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        tokens = tokens.tolist()
    try:
        out = [operator.index(t) for t in tokens]
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of int token ids, got {tokens!r:.80}") from None
    if any(t < 0 or t > MAX_INT for t in out):
        i = next(i for i, t in enumerate(out) if t < 0 or t > MAX_INT)
        int_in(
            out[i],
            f"{name}[{i}]",
            0,
            MAX_INT,
            closed=True,
            interval="[0, 2**62]",
            note=" (token ids are hashed as int64)",
        )
    return out


class SeqState:
    """One sequence: its block table and what the blocks hold."""

    __slots__ = ("generation", "hashes", "lens", "n_reg", "start", "table", "tokens")

    def __init__(self, n_layers: int):
        self.table: list = []  # block ids, oldest first
        self.lens = [0] * n_layers  # tokens held (written) per layer
        self.start = 0  # absolute position of held token 0 (whole blocks evicted before)
        self.tokens: list = []  # known token ids from position 0 (prompt, extend_tokens)
        self.hashes: list = []  # chain hashes of the full blocks of `tokens`
        self.n_reg = 0  # absolute blocks < n_reg were offered to the prefix cache
        self.generation = 0  # bumped whenever blocks are released (free, evict, truncate):
        #                                views taken before then may read blocks reused by others

    def clone(self) -> SeqState:
        c = SeqState.__new__(SeqState)
        c.table, c.lens, c.start = list(self.table), list(self.lens), self.start
        c.tokens, c.hashes, c.n_reg = list(self.tokens), list(self.hashes), self.n_reg
        c.generation = 0
        return c

    def hash_at(self, j: int, block_size: int) -> bytes | None:
        """Chain hash of absolute block ``j`` (``None`` while its tokens are not all known)."""
        bs = block_size
        while len(self.hashes) <= j and (len(self.hashes) + 1) * bs <= len(self.tokens):
            i = len(self.hashes)
            self.hashes.append(chain_hash(self.hashes[-1] if self.hashes else None, self.tokens[i * bs : (i + 1) * bs]))
        return self.hashes[j] if j < len(self.hashes) else None


class BlockAllocator:
    """Reference-counted block ids with a free list and an LRU cache of prefix blocks."""

    def __init__(self, n_blocks: int):
        self.n_blocks = integer(n_blocks, "BlockAllocator: n_blocks", lo=1)
        self.reset()

    def reset(self) -> None:
        n = self.n_blocks
        self.refcount = [0] * n
        self._free = set(range(n))
        self._heap = list(range(n))  # a min-heap of ids; entries not in _free are stale
        self._lru: OrderedDict = OrderedDict()  # cached blocks, least recently released first
        self._block_of: dict = {}  # hash -> block
        self._hash_of: dict = {}  # block -> hash

    # -- counts ------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_cached(self) -> int:
        return len(self._lru)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free) - len(self._lru)

    @property
    def n_available(self) -> int:
        """Blocks an allocation may take: free ones, then cached ones (evicted)."""
        return len(self._free) + len(self._lru)

    def free_blocks(self) -> set:
        return set(self._free)

    def cached_blocks(self) -> list:
        """Cached blocks, least recently released first."""
        return list(self._lru)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, prefer: int | None = None) -> int:
        """A block with refcount 1: ``prefer`` if it is free, else the lowest free id,
        else the least recently released cached block (its hash is forgotten)."""
        if prefer is not None and prefer in self._free:
            b = prefer
            self._free.remove(b)
        elif self._free:
            while True:
                b = heapq.heappop(self._heap)
                if b in self._free:
                    self._free.remove(b)
                    break
        elif self._lru:
            b, _ = self._lru.popitem(last=False)
            self._unregister(b)
        else:
            raise CacheFullError(f"no free block: all {self.n_blocks} blocks are in use")
        self.refcount[b] = 1
        return b

    def incref(self, block: int) -> None:
        if self.refcount[block] < 1:
            raise RuntimeError(f"BlockAllocator: incref of block {block}, which no sequence holds")
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; at 0 the block is cached (if registered) or freed."""
        if self.refcount[block] < 1:
            raise RuntimeError(f"BlockAllocator: block {block} released more often than it was taken (double free)")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._release(block)

    def _release(self, block: int) -> None:
        self._free.add(block)
        heapq.heappush(self._heap, block)
        if len(self._heap) > 2 * self.n_blocks + 64:  # drop stale entries now and then
            self._heap = sorted(self._free)

    # -- prefix cache -------------------------------------------------------------------------
    def register(self, block: int, h: bytes) -> bool:
        """Name a used block's content by its prefix hash.  False (nothing changes) when the
        hash already names another block or the block already has a name."""
        if self.refcount[block] < 1:
            raise RuntimeError(f"BlockAllocator: register of block {block}, which no sequence holds")
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def lookup(self, h: bytes) -> int | None:
        """The block named ``h`` with one more reference (revived from the cache if it sat
        there), or ``None``."""
        b = self._block_of.get(h)
        if b is None:
            return None
        if self.refcount[b] == 0:
            del self._lru[b]
        self.refcount[b] += 1
        return b

    def _unregister(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._block_of[h]

    def evict_cached(self, n: int | None = None) -> int:
        """Forget up to ``n`` (default all) cached blocks, least recently released first;
        they become free.  Returns how many."""
        k = len(self._lru) if n is None else min(int(n), len(self._lru))
        for _ in range(k):
            b, _ = self._lru.popitem(last=False)
            self._unregister(b)
            self._release(b)
        return k

    def __repr__(self):
        return (
            f"BlockAllocator(n_blocks={self.n_blocks}, used={self.n_used}, free={self.n_free}, cached={self.n_cached})"
        )
