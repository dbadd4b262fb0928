"""GPU attention kernels in Triton, with the contract of every other backend.

``attnlab.attention(q, k, v, ..., backend="triton")`` runs here: forward and backward
(FlashAttention-2 tiling, online softmax, natural-log float32 LSE), GQA/MQA without
copying K/V, ``Nq ≠ Nk`` with absolute positions (``q_offset``/``kv_offset``), head
dims up to 256 (padded to a power of two inside), ``Dv ≠ D``, float16/bfloat16/float32
inputs with float32 accumulation, fully masked rows giving 0 / -inf / zero gradients.

Layout (one concept per file):

* :mod:`.forward` — the forward kernel; :mod:`.backward` — Δ, dQ and dK/dV kernels;
* :mod:`.jitlib` — device functions they share (score tile, mask, score mods, tanh);
* :mod:`.masking` — how masks reach the kernels: block lists from the BlockMask
  (EMPTY tiles skipped, FULL tiles computed with no mask code), built-in masks compiled
  in as constexpr variants, anything else through a bit-packed table of its partial
  tiles (the module docstring explains the choice);
* :mod:`.scoremods` — alibi / softcap / relative_bias (and compose) as constexpr variants,
  with their parameters' gradients;
* :mod:`.config` — tiles and autotuning configs; :mod:`.autograd` — the autograd.Function
  and launchers; :mod:`.support` — availability and request checks; :mod:`.bench` — the
  GPU benchmark (``attnlab bench triton``).

Importing this package does not import triton: the kernels load on first use.  They run
on CUDA tensors, or on CPU tensors under the Triton interpreter when ``TRITON_INTERPRET=1``
is set before they are first imported (how CI tests them; slow).
"""

from __future__ import annotations

from attnlab.ops.triton.support import available, unsupported


def triton_attention(q, k, v, *, mask=None, score_mod=None, scale, q_offset, kv_offset=0, block=None, dropout=None):
    """Run the Triton kernels (see :func:`attnlab.ops.triton.autograd.triton_attention`)."""
    from attnlab.ops.triton.autograd import triton_attention as run

    kw = {} if dropout is None else {"dropout": dropout}
    return run(
        q, k, v, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset, kv_offset=kv_offset, block=block, **kw
    )


def interpreting() -> bool:
    """True when the kernels run under the Triton interpreter (imports triton)."""
    from attnlab.ops.triton.support import interpreting as f

    return f()


__all__ = ["available", "interpreting", "triton_attention", "unsupported"]
