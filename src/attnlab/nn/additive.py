"""``AdditiveAttention``: the Bahdanau scoring network as a module.

It holds ``W_q (A, Dq)``, ``W_k (A, Dk)``, ``v_a (A,)`` and an optional bias ``b (A,)``
(or one set per head with ``heads=H``) and calls
:func:`attnlab.ops.additive.additive_attention`, the tiled op that never materialises
the ``(B, H, Nq, Nk, A)`` tanh tensor.  No value or output projection: compose it with
``nn.Linear`` where a model needs them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnlab.ops.additive import additive_attention
from attnlab.validate import integer

__all__ = ["AdditiveAttention"]


class AdditiveAttention(nn.Module):
    """``out_i = Σ_j softmax_j(v_aᵀ tanh(W_q q_i + W_k k_j + b)) v_j``.

    Args:
        d_query: ``Dq``, the query (decoder state) width.
        d_key: ``Dk``, the key (encoder annotation) width; default ``d_query``.
        d_attn: ``A``, the hidden width of the scoring network; default ``d_query``.
        heads: ``None`` for one scoring network shared by every head (and 3-D inputs
            allowed); an int ``H`` for one network per query head (4-D inputs with ``H`` heads).
        bias: include ``b`` inside the tanh.
        chunk_size, q_chunk_size: tile sizes of the op (keys, query rows).

    ``forward(q, k, v=None, *, mask=None, q_offset=None, kv_offset=0, return_lse=False)``
    takes the library layout ``q (B, H, Nq, Dq)``, ``k (B, Hkv, Nk, Dk)``,
    ``v (B, Hkv, Nk, Dv)`` → ``(B, H, Nq, Dv)``, or, with shared weights, the single-head
    ``q (B, Nq, Dq)``, ``k (B, Nk, Dk)``, ``v (B, Nk, Dv)`` → ``(B, Nq, Dv)``.
    ``v=None`` uses the keys as values (Bahdanau's annotations serve as both).
    Masks use absolute positions, as in :func:`attnlab.attention`.

    Initialisation: ``W_q``, ``W_k`` as ``nn.Linear`` weights, ``v_a`` uniform in
    ``±1/sqrt(A)``, ``b = 0``.

    >>> import torch
    >>> att = AdditiveAttention(8, 6, 16)
    >>> att(torch.randn(2, 5, 8), torch.randn(2, 7, 6), torch.randn(2, 7, 3)).shape
    torch.Size([2, 5, 3])
    """

    def __init__(
        self,
        d_query: int,
        d_key: int | None = None,
        d_attn: int | None = None,
        *,
        heads: int | None = None,
        bias: bool = True,
        chunk_size: int = 64,
        q_chunk_size: int = 64,
        device=None,
        dtype=None,
    ):
        super().__init__()
        d_query = integer(d_query, "d_query", lo=1)
        d_key = d_query if d_key is None else integer(d_key, "d_key", lo=1)
        d_attn = d_query if d_attn is None else integer(d_attn, "d_attn", lo=1)
        if heads is not None:
            heads = integer(heads, "heads", lo=1)
        if not isinstance(bias, bool):
            raise TypeError(f"bias: expected a bool, got {type(bias).__name__}")
        self.d_query, self.d_key, self.d_attn, self.heads = d_query, d_key, d_attn, heads
        self.chunk_size = integer(chunk_size, "chunk_size", lo=1)
        self.q_chunk_size = integer(q_chunk_size, "q_chunk_size", lo=1)
        lead = () if heads is None else (heads,)
        kw = dict(device=device, dtype=dtype)
        self.w_q = nn.Parameter(torch.empty(*lead, d_attn, d_query, **kw))
        self.w_k = nn.Parameter(torch.empty(*lead, d_attn, d_key, **kw))
        self.v_a = nn.Parameter(torch.empty(*lead, d_attn, **kw))
        self.bias = nn.Parameter(torch.empty(*lead, d_attn, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w, fan_in in ((self.w_q, self.d_query), (self.w_k, self.d_key), (self.v_a, self.d_attn)):
                bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's kaiming_uniform(a=sqrt(5)) bound
                w.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.zero_()

    def extra_repr(self) -> str:
        return (
            f"d_query={self.d_query}, d_key={self.d_key}, d_attn={self.d_attn}, heads={self.heads}, "
            f"bias={self.bias is not None}"
        )

    def forward(self, q, k, v=None, *, mask=None, q_offset=None, kv_offset=0, return_lse=False):
        v = k if v is None else v
        three_d = isinstance(q, torch.Tensor) and q.dim() == 3
        if three_d:
            if self.heads is not None:
                raise ValueError(
                    f"q: a per-head AdditiveAttention (heads={self.heads}) needs 4-D inputs "
                    f"(B, H, Nq, Dq), got q {tuple(q.shape)}"
                )
            for name, t in (("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    raise ValueError(
                        f"{name}: with a 3-D q (B, Nq, Dq) expected a 3-D {name} (B, Nk, dim), got "
                        f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                    )
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        res = additive_attention(
            q,
            k,
            v,
            self.w_q,
            self.w_k,
            self.v_a,
            bias=self.bias,
            mask=mask,
            q_offset=q_offset,
            kv_offset=kv_offset,
            return_lse=return_lse,
            chunk_size=self.chunk_size,
            q_chunk_size=self.q_chunk_size,
        )
        if three_d:
            return (res[0].squeeze(1), res[1].squeeze(1)) if return_lse else res.squeeze(1)
        return res
