"""H2O (Zhang et al., 2023): keep the "heavy hitters" — the keys that have received the
most attention so far — plus the most recent tokens, within a fixed budget.

Scores come from the attention op's own statistics: after attending, the op returns
each query row's LSE, and key ``j``'s share of row ``i`` is ``exp(s_ij − LSE_i)``
with ``s_ij = scale·q_i·k_j``.  A decode step has one query row, so this is one
``q·Kᵀ`` vector per head — never an ``N × N`` matrix; a prompt is scored in chunks
of rows.  Shares are summed over the query heads that read a kv head (GQA) and
accumulated over steps; each ``(batch, kv head)`` evicts its own lowest-scoring
non-recent key when the budget is exceeded, so heads keep different tokens.

Keys are stored rotated at their true positions (no re-rotation: H2O keeps original
positions); once a key has been evicted the kept positions are no longer contiguous,
so later calls must be single-token decode steps (a causal mask is then trivially
satisfied; other masks are refused).

>>> import torch
>>> from attnlab.cache.h2o import H2OCache
>>> c = H2OCache(n_layers=1, budget=4, recent=2)
>>> q = torch.randn(1, 2, 1, 8)
>>> for t in range(6):
...     kv = c.update(0, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))
...     _ = kv.attend(q)
>>> c.length, c.seen
(4, 6)
"""

from __future__ import annotations

import torch

from attnlab.cache.base import Cache, DenseKV
from attnlab.ops.dispatch import attention
from attnlab.ops.sdpa import is_causal_mask
from attnlab.validate import int_in, integer

_ROWS = 256  # query rows scored at a time (prompt scoring memory: _ROWS x keys per head)


class _H2OKV(DenseKV):
    def __init__(self, cache, layer, k, v, q_offset, contiguous):
        super().__init__(k, v, kv_offset=0, q_offset=q_offset)
        self.cache, self.layer, self.contiguous = cache, layer, contiguous

    def attend(self, q, *, mask=None, score_mod=None, scale=None, backend="auto", return_lse=False):
        if not self.contiguous:
            if q.shape[2] != 1 or not (mask is None or is_causal_mask(mask)) or score_mod is not None:
                raise ValueError(
                    "H2OCache: after an eviction the kept positions are not contiguous; only "
                    "single-token decode steps with no mask (or causal()) and no score_mod can attend"
                )
            mask = None  # every kept key is in the past of the new token
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out, lse = attention(
            q,
            self.k,
            self.v,
            mask=mask,
            score_mod=score_mod,
            scale=scale,
            q_offset=self.q_offset,
            kv_offset=0,
            return_lse=True,
            backend=backend,
        )
        self.cache._accumulate(self.layer, q, self.k, lse, scale, mask, score_mod, self.q_offset)
        return (out, lse) if return_lse else out


class H2OCache(Cache):
    """At most ``budget`` keys per layer and kv head: the ``recent`` newest plus the
    highest accumulated attention mass."""

    def __init__(self, n_layers: int, budget: int, recent: int):
        super().__init__(n_layers)
        self.budget = integer(budget, "H2OCache: budget", lo=1)
        self.recent = int_in(recent, "H2OCache: recent", 0, self.budget, interval=f"[0, budget={self.budget})")
        self.reset()

    def reset(self):
        n = self.n_layers
        self.k, self.v, self.pos, self.score = [None] * n, [None] * n, [None] * n, [None] * n
        self.total = [0] * n
        self.evicted = [False] * n

    def seen_at(self, layer):
        return self.total[layer]

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def update(self, layer, k, v):
        self._check_layer(layer, k, v)
        self._check_continues(layer, k, v, self.k[layer])
        if self.k[layer] is not None and k.shape[:2] != self.k[layer].shape[:2]:
            raise ValueError(
                f"H2OCache.update: new k {tuple(k.shape)} does not continue the cached k {tuple(self.k[layer].shape)}"
            )
        B, Hkv, n, _ = k.shape
        start = self.total[layer]
        pos = torch.arange(start, start + n, device=k.device).expand(B, Hkv, n)
        zeros = torch.zeros(B, Hkv, n, dtype=torch.float32, device=k.device)
        if self.k[layer] is None:
            self.k[layer], self.v[layer], self.pos[layer], self.score[layer] = k, v, pos, zeros
        else:
            self.k[layer] = torch.cat([self.k[layer], k], 2)
            self.v[layer] = torch.cat([self.v[layer], v], 2)
            self.pos[layer] = torch.cat([self.pos[layer], pos], 2)
            self.score[layer] = torch.cat([self.score[layer], zeros], 2)
        self.total[layer] += n
        L = self.k[layer].shape[2]
        return _H2OKV(self, layer, self.k[layer], self.v[layer], L - n, contiguous=not self.evicted[layer])

    def _accumulate(self, layer, q, K, lse, scale, mask, score_mod, q_offset):
        """Add each key's attention share (from the op's LSE) to its score, then evict."""
        B, H, Nq, D = q.shape
        Hkv, L = K.shape[1], K.shape[2]
        G = H // Hkv
        qg = q.reshape(B, Hkv, G * Nq, D) if G > 1 else q  # query heads of one kv head, as rows
        lg = lse.reshape(B, Hkv, G * Nq)
        total = torch.zeros(B, Hkv, L, dtype=torch.float32, device=q.device)
        for r0 in range(0, G * Nq, _ROWS):
            rows = slice(r0, min(G * Nq, r0 + _ROWS))
            s = torch.matmul(qg[:, :, rows].float(), K.float().transpose(-1, -2)) * scale
            if mask is not None or score_mod is not None:
                qi = torch.arange(rows.start, rows.stop, device=q.device) % Nq + q_offset  # query positions
                h = torch.arange(Hkv, device=q.device).view(1, Hkv, 1, 1) * G + (
                    torch.arange(rows.start, rows.stop, device=q.device) // Nq
                ).view(1, 1, -1, 1)
                b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
                kp = torch.arange(L, device=q.device).view(1, 1, 1, L)
                if score_mod is not None:
                    s = score_mod(s, b, h, qi.view(1, 1, -1, 1), kp)
                if mask is not None:
                    s = s.masked_fill(~mask(b, h, qi.view(1, 1, -1, 1), kp), float("-inf"))
            p = torch.exp(s - lg[:, :, rows].float().unsqueeze(-1)).nan_to_num(0.0)
            total += p.sum(2)
        self.score[layer] += total
        self._evict(layer)

    def _evict(self, layer):
        L = self.k[layer].shape[2]
        if L <= self.budget:
            return
        old = L - self.recent  # candidates: everything but the `recent` newest
        keep_heavy = self.budget - self.recent
        idx = self.score[layer][:, :, :old].topk(keep_heavy, dim=-1).indices.sort(-1).values
        idx = torch.cat([idx, torch.arange(old, L, device=idx.device).expand(*idx.shape[:2], self.recent)], -1)
        take = lambda t: t.gather(2, idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1]))  # noqa: E731
        self.k[layer], self.v[layer] = take(self.k[layer]), take(self.v[layer])
        self.pos[layer] = self.pos[layer].gather(2, idx)
        self.score[layer] = self.score[layer].gather(2, idx)
        self.evicted[layer] = True

    def fork(self):
        c = H2OCache(self.n_layers, self.budget, self.recent)
        c.k, c.v, c.pos, c.score = (
            list(self.k),
            list(self.v),
            list(self.pos),
            [s.clone() if s is not None else None for s in self.score],
        )
        c.total, c.evicted = list(self.total), list(self.evicted)
        return c

    def __repr__(self):
        return f"H2OCache(budget={self.budget}, recent={self.recent}, length={self.length}, seen={self.seen})"
