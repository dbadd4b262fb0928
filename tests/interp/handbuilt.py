"""A 2-layer attention-only Decoder whose heads are set by hand.

Residual stream (d_model 64): dims 0..15 one-hot position, 16..31 one-hot token,
32..47 "the previous token was t" (written by L0H0), 48 a constant 1.

    L0H0  previous-token head; its OV copies the previous token into dims 32..47
    L0H1  sink: every query attends position 0; values are 0 at position 0
    L0H2  duplicate-token head (earlier copies of the current token)
    L0H3  positional head at offset 2
    L1H0  induction head: query = current token, key = "previous token" dims (K-composition with L0H0)
    L1H1..3  zero weights (uniform over the visible keys)
"""

import torch

from attnlab.nn import Decoder, DecoderConfig

V, NPOS, BETA = 16, 16, 60.0
POS, TOK, PREV, CONST = 0, 16, 32, 48


def handbuilt_model() -> Decoder:
    cfg = DecoderConfig(
        vocab_size=V,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_head=32,
        attn_only=True,
        positions="learned",
        max_positions=NPOS,
        bias=False,
        tie_embeddings=False,
    )
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        for t in range(V):
            m.embed.weight[t, TOK + t] = 1.0
            m.embed.weight[t, CONST] = 1.0
        for i in range(NPOS):
            m.pos_embed.weight[i, POS + i] = 1.0
        a0, a1 = m.blocks[0].attn, m.blocks[1].attn
        WQ, WK, WV, WO = a0.W_Q, a0.W_K, a0.W_V, a0.W_O  # views: writing them writes the weights
        for i in range(1, NPOS):  # L0H0: q_i = β e_{i-1}, k_j = e_j
            WQ[0, POS + i, i - 1] = BETA
        for i in range(NPOS):
            WK[0, POS + i, i] = 1.0
        for t in range(V):  # OV: token t at the key -> PREV + t in the stream
            WV[0, TOK + t, t] = 1.0
            WO[0, t, PREV + t] = 1.0
        WQ[1, CONST, 0] = BETA  # L0H1: every query -> position 0
        WK[1, POS + 0, 0] = 1.0
        for i in range(1, NPOS):
            WV[1, POS + i, i] = 1.0  # value norm 0 at the sink, 1 elsewhere
        for t in range(V):  # L0H2: same token, minus itself
            WQ[2, TOK + t, t] = BETA
            WK[2, TOK + t, t] = 1.0
        for i in range(NPOS):
            WQ[2, POS + i, 16 + i] = -BETA
            WK[2, POS + i, 16 + i] = 1.0
        for i in range(2, NPOS):  # L0H3: offset 2
            WQ[3, POS + i, i - 2] = BETA
        for i in range(NPOS):
            WK[3, POS + i, i] = 1.0
        for t in range(V):  # L1H0: current token against "previous token" dims
            a1.W_Q[0, TOK + t, t] = BETA
            a1.W_K[0, PREV + t, t] = 1.0
            a1.W_V[0, TOK + t, t] = 1.0
            a1.W_O[0, t, TOK + t] = 1.0
    return m


def repeated_tokens(T: int = 7, B: int = 3, seed: int = 0) -> torch.Tensor:
    """``(B, 1 + 2T)``: a BOS (token 0), T distinct random tokens from 1..V-1, the same T again.
    (Without the BOS, L0H0's row 0 attends itself and marks position 0 as "after tok_0",
    a spurious induction target.)"""
    g = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(V - 1, generator=g)[:T] + 1 for _ in range(B)])
    return torch.cat([torch.zeros(B, 1, dtype=torch.long), first, first], dim=1)
