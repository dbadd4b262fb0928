"""Capture what attention saw — q, k, v, per-head outputs, patterns — with the fast kernels on.

A capture installs a hook on each attention module (``MultiHeadAttention.hooks`` for
attnlab models, ``module.attnlab_hooks`` through :mod:`attnlab.models.bridge` for
transformers models).  The forward pass runs the usual fast path (flash / SDPA); the
hook keeps the tensors the op attended.  Patterns are *recomputed* afterwards from the
captured q and k, only for the layers and heads asked for, so nothing forces an eager
model or materializes ``L·H·N²`` weights nobody looks at::

    model(ids)  ──▶ layer l: q, k, v ──▶ attention (fast) ──▶ z ──▶ W_O
                                 │                            │
                                 └──── captured ──────────────┘
    cap.pattern(l, heads=[3])  = softmax(scale·q₃k₃ᵀ + mods, masked)   (B, 1, Nq, Nk)
    cap.stats(l)               = entropy, sink / previous-token mass ... at O(N) memory

Shapes: ``q (B, H, Nq, d_head)``, ``k``/``v (B, Hkv, Nk, d_head)`` (after RoPE; with a KV
cache every cached key), ``z (B, H, Nq, d_head)`` (per-head outputs before W_O).

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.interp import capture
>>> model = Decoder(DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
>>> ids = torch.randint(0, 50, (1, 9))
>>> with capture(model, layers=[1]) as cap:
...     logits = model(ids).logits
>>> cap[1].q.shape, cap.pattern(1, heads=[0, 2]).shape
(torch.Size([1, 4, 9, 8]), torch.Size([1, 2, 9, 9]))
>>> want = model(ids, output_attentions=True).attentions[1][:, [0, 2]]
>>> bool(torch.allclose(cap.pattern(1, heads=[0, 2]), want, atol=1e-6))
True
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from attnlab.nn.attention import AttentionCall, MultiHeadAttention

KEEP = ("q", "k", "v", "z")


def attention_modules(model: nn.Module) -> list[tuple[int, Any, str]]:
    """``[(layer, module, kind)]`` for every attention module of ``model`` in layer order.

    ``kind`` is ``"attnlab"`` (a :class:`MultiHeadAttention`) or ``"hf"`` (a transformers
    attention module, recognised by its ``layer_idx``/``is_causal`` attributes).  An attnlab
    model's layer index is its position among the MultiHeadAttention modules (cross-attention
    included, in module order); a transformers module's is its ``layer_idx``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, MultiHeadAttention):
        return [(0, model, "attnlab")]
    found = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if found:
        return [(i, m, "attnlab") for i, m in enumerate(found)]
    hf = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal") and hasattr(m, "config")]
    return [(m.layer_idx if isinstance(m.layer_idx, int) else i, m, "hf") for i, m in enumerate(hf)]


class Capture:
    """The calls recorded per layer; use :func:`capture` to make one.

    ``cap[layer]`` is the layer's latest :class:`~attnlab.nn.attention.AttentionCall`
    (with a KV cache, one call per decoding step: ``cap.calls(layer)`` has them all).
    """

    def __init__(self, layers: list[int], heads, keep, n_layers: int = 0):
        self.layers = layers
        self._n_layers = n_layers
        self.heads = heads
        self.keep = keep
        self._calls: dict[int, list[AttentionCall]] = {l: [] for l in layers}

    def _record(self, layer: int, call: AttentionCall) -> None:
        v, z = call.v, call.z
        self._calls[layer].append(
            AttentionCall(
                None,
                call.q.detach(),
                call.k.detach(),
                v.detach() if "v" in self.keep and v is not None else None,
                z.detach() if "z" in self.keep and z is not None else None,
                mask=call.mask,
                score_mod=call.score_mod,
                scale=call.scale,
                q_offset=call.q_offset,
                kv_offset=call.kv_offset,
                layer=layer,
            )
        )

    def calls(self, layer: int) -> list[AttentionCall]:
        return self._calls[self._check_layer(layer)]

    def __getitem__(self, layer: int) -> AttentionCall:
        c = self.calls(layer)
        if not c:
            raise ValueError(f"layer {layer}: no attention call was recorded (did the model run inside the capture?)")
        return c[-1]

    def __len__(self) -> int:
        return len(self.layers)

    def _check_layer(self, layer):
        if isinstance(layer, int) and not isinstance(layer, bool) and layer < 0 and self._n_layers:
            layer += self._n_layers  # Python's meaning: -1 is the model's last layer
        if layer not in self._calls:
            raise ValueError(f"layer: {layer!r} was not captured; captured layers are {self.layers}")
        return layer

    def pattern(self, layer: int, heads=None) -> torch.Tensor:
        """``(B, h, Nq, Nk)`` float32 pattern of ``layer`` for the query ``heads`` (default: the
        capture's heads, else all), recomputed from the captured q and k."""
        return self[layer].pattern(self.heads if heads is None else heads)  # negative heads: AttentionCall

    def patterns(self, heads=None) -> torch.Tensor:
        """``(L, B, h, Nq, Nk)``: :meth:`pattern` of every captured layer, stacked."""
        return torch.stack([self.pattern(l, heads) for l in self.layers])

    def stats(self, layer: int, **kw):
        """:func:`attnlab.interp.stats.head_stats` of ``layer``'s latest call (O(N) memory);
        keyword arguments (``sink_tokens``, ``key_positions``...) are passed on."""
        from attnlab.interp.stats import head_stats

        c = self[layer]
        return head_stats(
            c.q,
            c.k,
            mask=c.mask,
            score_mod=c.score_mod,
            scale=c.scale,
            q_offset=c.q_offset,
            kv_offset=c.kv_offset,
            **kw,
        )


@contextmanager
def capture(model: nn.Module, layers=None, heads=None, *, keep=KEEP):
    """Record the attention calls of ``model`` (attnlab or transformers) inside a ``with``.

    Args:
        layers: layer indices to record (default all); negative ones count from the end (-1: the last).
        heads: the query heads :meth:`Capture.pattern` returns by default (all by default).
        keep: which of ``"q", "k", "v", "z"`` to keep (q and k are always kept: patterns
            and statistics are recomputed from them).

    A transformers model is switched to the ``"attnlab"`` attention implementation
    (:func:`attnlab.models.bridge.register`) for the duration and switched back after.
    The hooks observe only: outputs are unchanged.
    """
    keep = tuple(keep)
    bad = [k for k in keep if k not in KEEP]
    if bad:
        raise ValueError(f"keep: unknown entries {bad}; expected a subset of {KEEP}")
    mods = attention_modules(model)
    if not mods:
        raise ValueError(
            f"model: no attention modules found in {type(model).__name__} (expected attnlab "
            "MultiHeadAttention modules or a transformers model)"
        )
    have = [l for l, _, _ in mods]
    if layers is None:
        layers = have
    else:
        layers = normalize_layers(layers, have, "layers")
    cap = Capture(layers, heads, keep, n_layers=len(have))
    installed, restore = [], None
    if any(kind == "hf" for _, _, kind in mods):
        restore = use_bridge(model)
    try:
        for l, m, kind in mods:
            if l not in layers:
                continue

            def hook(call, l=l):
                return cap._record(l, call)

            lst = m.hooks if kind == "attnlab" else m.__dict__.setdefault("attnlab_hooks", [])
            lst.append(hook)
            installed.append((lst, hook))
        yield cap
    finally:
        for lst, hook in installed:
            lst.remove(hook)
        if restore is not None:
            restore()


def normalize_layers(layers, have: list[int], arg: str = "layers") -> list[int]:
    """``layers`` (an int or a sequence of ints) as indices into ``have`` (the model's layers, 0..L-1);
    negative indices count from the end, as in Python (-1 is the last layer)."""
    items = [layers] if isinstance(layers, int) else layers
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{arg}: expected an int or a sequence of ints, got {type(layers).__name__}") from None
    L, out = len(have), []
    for l in items:
        if (
            isinstance(l, bool)
            or not isinstance(l, (int, torch.Tensor))
            or (isinstance(l, torch.Tensor) and (l.numel() != 1 or l.is_floating_point()))
        ):
            raise TypeError(f"{arg}: expected ints, got {l!r}")
        l = int(l)
        if not -L <= l < L:
            raise ValueError(f"{arg}: {l} not in the model's layers (expected an int in [-{L}, {L}), n_layers={L})")
        out.append(have[l])
    return out


def use_bridge(model) -> Callable[[], None]:
    """Switch a transformers model to attnlab attention; return a function that switches back."""
    from attnlab.models import bridge

    name = bridge.register()
    cfg = getattr(model, "config", None)
    before = getattr(cfg, "_attn_implementation", None)
    if before == name:
        return lambda: None
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(
            f"model: {type(model).__name__} has transformers attention modules but no "
            "set_attn_implementation(); pass the top-level transformers model"
        )
    model.set_attn_implementation(name)
    return lambda: model.set_attn_implementation(before)


_use_bridge = use_bridge  # the former private name
