"""Speculative decoding with a token tree (SpecInfer-style), verified in one pass.

Each round the small *draft* model grows a tree of candidate continuations of the last
token — ``branching = (b1, b2, ...)`` children per node at depth 1, 2, ... — level by
level, attending with :func:`attnlab.masks.tree`.  The large *target* model then runs
**once** over all tree nodes with the same tree mask (each node sees the prefix and its
own ancestors) and its logits decide which branch to keep:

* greedy (``temperature = 0``): walk from the root, following the child whose token
  is the target's argmax; stop when none is.  The kept tokens plus the target's
  argmax at the last kept node are exactly what plain greedy decoding of the target
  produces — the draft only decides how many arrive per target pass.
* sampling: at each node try the children in turn; accept child ``x`` with
  probability ``min(1, p(x)/q(x))``; after a rejection replace ``p`` by the residual
  ``norm(max(p − q, 0))``; if no child is accepted, sample the next token from what
  is left of ``p``.  With children drawn independently from ``q`` this keeps the
  target's distribution exactly (Leviathan et al. 2023; SpecInfer, Miao et al. 2024).

Tree nodes sit at position ``prefix + depth`` for RoPE and at ``prefix + index`` for the
mask (what :func:`masks.tree` expects); after verification both caches keep only the
accepted branch (:meth:`attnlab.cache.DynamicCache.retain`).

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.generate import generate
>>> from attnlab.speculative import speculative_generate
>>> cfg = DecoderConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, positions="rope")
>>> target, draft = Decoder(cfg).eval(), Decoder(cfg.replace(n_layers=1)).eval()
>>> out = speculative_generate(target, draft, [3, 1, 4], max_new_tokens=12, branching=(2, 2))
>>> out.tokens == generate(target, [[3, 1, 4]], max_new_tokens=12).new_tokens[0]
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnlab import masks
from attnlab.cache import DynamicCache
from attnlab.generate import Sampling, model_vocab, stop_token_set, token_row
from attnlab.validate import int_sequence, nonneg_int, rng_seed


@dataclass
class SpeculativeResult:
    tokens: list  # the generated tokens
    rounds: int = 0  # target passes after the prompt
    accepted: list = field(default_factory=list)  # draft tokens accepted per round

    @property
    def acceptance_rate(self) -> float:
        """Mean number of draft tokens accepted per round, over the tree depth."""
        return sum(self.accepted) / max(1, len(self.accepted))

    @property
    def tokens_per_round(self) -> float:
        return len(self.tokens) / max(1, self.rounds)


def accept_sampled(p: torch.Tensor, q: torch.Tensor | None, drafts: list, generator=None):
    """Multi-draft speculative sampling at one node: ``drafts`` were drawn i.i.d. from
    ``q``; returns ``(index of the accepted draft, None)`` or ``(None, token)`` drawn from
    the residual.  The returned token is distributed exactly as ``p``.  ``q`` may be
    ``None`` only when there are no drafts (a leaf of the tree: the token is drawn from ``p``)."""
    if q is None:
        if drafts:
            raise ValueError(f"q: expected the distribution the {len(drafts)} drafts were drawn from, got None")
        return None, int(torch.multinomial(p, 1, generator=generator))
    for i, x in enumerate(drafts):
        if float(q[x]) > 0 and torch.rand((), generator=generator) < min(1.0, float(p[x] / q[x])):
            return i, None
        r = (p - q).clamp(min=0)
        if float(r.sum()) <= 0:  # p == q: a rejection cannot happen (kept for float rounding)
            break
        p = r / r.sum()
    return None, int(torch.multinomial(p, 1, generator=generator))


class _Tree:
    """Nodes in breadth-first order: node 0 is the root (the last known token)."""

    def __init__(self, root_token: int):
        self.tokens, self.parents, self.depths = [root_token], [-1], [0]
        self.children: list[list[int]] = [[]]
        self.q: list[torch.Tensor | None] = [None]  # draft distribution each node's children were drawn from

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.q.append(None)
        self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1


def _forward_nodes(model, cache, tree, nodes, prefix_len):
    """Run ``model`` on tree ``nodes`` (consecutive indices) with the tree mask; logits (len, V)."""
    ids = torch.tensor([[tree.tokens[i] for i in nodes]])
    pos = torch.tensor([[prefix_len + tree.depths[i] for i in nodes]])
    parents = torch.tensor(tree.parents[: nodes[-1] + 1])
    mask = masks.tree(parents, prefix_len)
    return model(ids, cache=cache, pos=pos, mask=mask).logits[0]


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    prompt,
    *,
    max_new_tokens: int,
    branching=(2, 2, 1),
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens=(),
) -> SpeculativeResult:
    """Generate from ``target`` with ``draft`` proposing a token tree each round.

    ``prompt``: one sequence of token ids (a list of ints or a 1-d integer tensor).
    ``branching[d]``: children per node at depth ``d + 1`` (``(1, 1, 1, 1)`` is classic
    4-token speculation).  Greedy when ``temperature == 0``.  Both models must share the
    vocabulary.  The arguments are checked by the same functions as
    :func:`attnlab.generate.generate`'s (``ValueError`` naming the argument).
    """
    max_new_tokens = nonneg_int(max_new_tokens, "max_new_tokens")
    branching = list(int_sequence(branching, "branching", lo=1))
    if target.cfg.vocab_size != draft.cfg.vocab_size:
        raise ValueError(f"draft vocab_size {draft.cfg.vocab_size} != target vocab_size {target.cfg.vocab_size}")
    vocab = model_vocab(target)
    if (
        isinstance(prompt, (list, tuple))
        and prompt
        and (isinstance(prompt[0], (list, tuple)) or getattr(prompt[0], "ndim", 0) > 0)
    ):
        raise ValueError(
            "prompt: expected one sequence of token ids (speculative decoding runs one prompt), "
            f"got a nested sequence of {len(prompt)}"
        )
    prompt = token_row(prompt, "prompt", vocab)
    if not prompt:
        raise ValueError("prompt: needs at least one token")
    sampling = Sampling(temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(rng_seed(seed)) if seed is not None else None
    stops = stop_token_set(stop_tokens, vocab)
    tc, dc = DynamicCache(target.cfg.n_layers), DynamicCache(draft.cfg.n_layers)
    ids = torch.tensor([prompt[:-1]]) if len(prompt) > 1 else None
    if ids is not None:  # both caches hold the prompt but its last token (the first tree root)
        target(ids, cache=tc)
        draft(ids, cache=dc)
    res = SpeculativeResult([])
    last = int(prompt[-1])
    while len(res.tokens) < max_new_tokens:
        L = tc.seen
        tree = _Tree(last)
        # -- the draft grows the tree level by level -----------------------------------
        level, fed = [0], 0
        for b in branching:
            fed = level[-1] + 1  # nodes 0..fed-1 are in the draft cache
            logits = _forward_nodes(draft, dc, tree, level, L)
            nxt = []
            for node, lg in zip(level, logits, strict=True):
                q = sampling.probs(lg[None])[0]
                tree.q[node] = q
                if sampling.greedy:
                    toks = q.topk(min(b, q.shape[0])).indices.tolist()
                else:
                    toks = torch.multinomial(q, b, replacement=True, generator=gen).tolist()
                nxt += [tree.add(node, t) for t in toks]
            level = nxt
        # -- one target pass over the whole tree --------------------------------------
        logits = _forward_nodes(target, tc, tree, list(range(len(tree.tokens))), L)
        res.rounds += 1
        path, node = [], 0
        while True:
            p = sampling.probs(logits[node][None])[0]
            kids = tree.children[node]
            chosen = None
            if sampling.greedy:
                want = int(p.argmax())
                chosen = next((c for c in kids if tree.tokens[c] == want), None)
                bonus = want
            else:
                i, bonus = accept_sampled(p, tree.q[node], [tree.tokens[c] for c in kids], gen)
                chosen = None if i is None else kids[i]
            if chosen is None:
                break
            path.append(chosen)
            node = chosen
        res.accepted.append(len(path))
        new = [tree.tokens[i] for i in path] + [bonus]
        # keep the prefix, the root and the accepted branch in both caches
        keep = torch.cat([torch.arange(L + 1), L + torch.tensor(path, dtype=torch.long)])
        tc.retain(keep)
        in_draft = [i for i in path if i < fed]
        dc.retain(torch.cat([torch.arange(L + 1), L + torch.tensor(in_draft, dtype=torch.long)]))
        if len(in_draft) < len(path):  # accepted leaves the draft never ran: catch it up
            draft(torch.tensor([[tree.tokens[i] for i in path[len(in_draft) :]]]), cache=dc)
        for t in new:
            if len(res.tokens) < max_new_tokens:
                res.tokens.append(t)
                if t in stops:
                    return res
        last = new[-1]
    return res
