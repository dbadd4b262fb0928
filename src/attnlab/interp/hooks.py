"""Named hook points, TransformerLens-style: ``hook_names``, ``run_with_hooks``, ``hooks``.

Every model — attnlab :class:`~attnlab.nn.Decoder` / :class:`~attnlab.nn.Encoder`, and
transformers GPT-2, Llama/Mistral and BERT models (through :mod:`attnlab.models.hf_points`)
— exposes the same names (TransformerLens' conventions: batch, pos, head_index, d_head)::

    hook_embed, hook_pos_embed                     (B, N, d_model)
    blocks.{l}.hook_resid_pre / _mid / _post       (B, N, d_model)
    blocks.{l}.ln1.hook_scale (B, N, 1)   blocks.{l}.ln1.hook_normalized (B, N, d_model)   (ln2 alike)
    blocks.{l}.attn.hook_q (B, N, H, d_head)   hook_k / hook_v (B, N, Hkv, d_head)   (before RoPE)
    blocks.{l}.attn.hook_rot_q / hook_rot_k    after RoPE (RoPE models only)
    blocks.{l}.attn.hook_attn_scores / hook_pattern (B, H, Nq, Nk)   float32, computed only when asked
    blocks.{l}.attn.hook_z (B, N, H, d_head)   blocks.{l}.attn.hook_result (B, N, H, d_model)
    blocks.{l}.hook_attn_out (B, N, d_model)
    blocks.{l}.mlp.hook_pre / hook_post (B, N, d_mlp)  (gated MLPs: also hook_pre_linear)
    blocks.{l}.hook_mlp_out (B, N, d_model)
    ln_final.hook_scale, ln_final.hook_normalized, logits

A hook function is ``fn(activation, hook) -> None | tensor``: a returned tensor (same shape)
replaces the activation and the forward continues from it.  ``hook.name`` is the name and
``hook.layer()`` its block (``None`` outside blocks).  Editing ``hook_pattern`` or
``hook_attn_scores`` recomputes that layer's ``z = pattern · v`` from the edited pattern;
editing ``hook_result`` makes the attention output ``Σ_h result_h + b_O``; editing
``ln*.hook_scale`` recomputes the norm from the edited scale.

Nothing is computed or kept for a point without functions: the forward pass runs its fast
kernels, patterns are never materialised unless a hook asks for them.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.interp import hook_names, run_with_hooks
>>> model = Decoder(DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
>>> ids = torch.randint(0, 50, (1, 6))
>>> hook_names(model)[:4]
['hook_embed', 'hook_pos_embed', 'blocks.0.hook_resid_pre', 'blocks.0.ln1.hook_scale']
>>> def zero_head_1(z, hook):
...     z[:, :, 1] = 0.0                          # edit in place, or return a new tensor
>>> logits = run_with_hooks(model, ids, fwd_hooks=[("blocks.0.attn.hook_z", zero_head_1)])
>>> logits.shape
torch.Size([1, 6, 50])
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from attnlab.nn.attention import MultiHeadAttention

__all__ = ["hook_names", "hook_points", "run_with_hooks", "hooks", "HookInfo", "model_outputs"]

_LAYER = re.compile(r"^blocks\.(\d+)\.")


class HookInfo:
    """What a hook function receives as ``hook``: ``name`` and ``layer()`` (TransformerLens' HookPoint)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def layer(self) -> int | None:
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None

    def __repr__(self):
        return f"HookInfo({self.name!r})"


class NnPoint:
    """One attnlab :class:`~attnlab.nn.hooks.HookPoint` under its name."""

    __slots__ = ("lazy", "point")

    def __init__(self, point, lazy: bool = False):
        self.point, self.lazy = point, lazy

    def add(self, fn) -> Callable[[], None]:
        self.point.fns.append(fn)
        return lambda: self.point.fns.remove(fn)


def _attnlab_points(model) -> dict:
    pts: dict = {}
    pts["hook_embed"] = NnPoint(model.hook_embed)
    if getattr(model, "pos_embed", None) is not None:
        pts["hook_pos_embed"] = NnPoint(model.hook_pos_embed)
    if getattr(model, "type_embed", None) is not None:
        pts["hook_token_type_embed"] = NnPoint(model.hook_token_type_embed)

    def attn(p, l, block):
        if not isinstance(block.attn, MultiHeadAttention):
            return
        a = block.attn.attnlab_points
        names = ["hook_q", "hook_k", "hook_v"]
        if hasattr(block.attn.positions, "cos_sin"):
            names += ["hook_rot_q", "hook_rot_k"]
        names += ["hook_attn_scores", "hook_pattern", "hook_z", "hook_result"]
        for n in names:
            p[f"blocks.{l}.attn.{n}"] = NnPoint(
                getattr(a, n), lazy=n in ("hook_attn_scores", "hook_pattern", "hook_result")
            )

    def ln(p, l, which, norm_points):
        p[f"blocks.{l}.{which}.hook_scale"] = NnPoint(norm_points.hook_scale)
        p[f"blocks.{l}.{which}.hook_normalized"] = NnPoint(norm_points.hook_normalized)

    def mlp(p, l, block):
        p[f"blocks.{l}.mlp.hook_pre"] = NnPoint(block.mlp.hook_pre)
        if hasattr(block.mlp, "hook_pre_linear"):
            p[f"blocks.{l}.mlp.hook_pre_linear"] = NnPoint(block.mlp.hook_pre_linear)
        p[f"blocks.{l}.mlp.hook_post"] = NnPoint(block.mlp.hook_post)

    for l, b in enumerate(model.blocks):
        pts[f"blocks.{l}.hook_resid_pre"] = NnPoint(b.hook_resid_pre)
        if b.attn_only:
            attn(pts, l, b)
            pts[f"blocks.{l}.hook_attn_out"] = NnPoint(b.hook_attn_out)
        elif b.post:
            attn(pts, l, b)
            pts[f"blocks.{l}.hook_attn_out"] = NnPoint(b.hook_attn_out)
            pts[f"blocks.{l}.hook_resid_mid"] = NnPoint(b.hook_resid_mid)
            ln(pts, l, "ln1", b.ln1_points)
            mlp(pts, l, b)
            pts[f"blocks.{l}.hook_mlp_out"] = NnPoint(b.hook_mlp_out)
        else:
            ln(pts, l, "ln1", b.ln1_points)
            attn(pts, l, b)
            pts[f"blocks.{l}.hook_attn_out"] = NnPoint(b.hook_attn_out)
            pts[f"blocks.{l}.hook_resid_mid"] = NnPoint(b.hook_resid_mid)
            ln(pts, l, "ln2", b.ln2_points)
            mlp(pts, l, b)
            pts[f"blocks.{l}.hook_mlp_out"] = NnPoint(b.hook_mlp_out)
        pts[f"blocks.{l}.hook_resid_post"] = NnPoint(b.hook_resid_post)
        if b.post:
            ln(pts, l, "ln2", b.ln2_points)
    final = getattr(model, "norm", None) if hasattr(model, "lm_head") else getattr(model, "final_norm", None)
    if final is not None:
        pts["ln_final.hook_scale"] = NnPoint(model.ln_final_points.hook_scale)
        pts["ln_final.hook_normalized"] = NnPoint(model.ln_final_points.hook_normalized)
    if hasattr(model, "hook_logits"):
        pts["logits"] = NnPoint(model.hook_logits)
    return pts


def is_attnlab_model(model) -> bool:
    from attnlab.nn import Decoder, Encoder

    return isinstance(model, (Decoder, Encoder))


def hook_points(model: nn.Module) -> dict:
    """``{name: point}`` in forward order; a point has ``add(fn) -> remove`` (``fn(tensor) -> None | tensor``)
    and ``lazy`` (True for patterns, scores and per-head results: computed only when asked)."""
    if is_attnlab_model(model):
        return _attnlab_points(model)
    if isinstance(model, nn.Module) and hasattr(model, "config") and hasattr(model, "set_attn_implementation"):
        from attnlab.models.hf_points import hf_points

        return hf_points(model)
    raise TypeError(
        f"model: expected an attnlab Decoder or Encoder or a transformers GPT-2 / Llama / Mistral / "
        f"BERT model, got {type(model).__name__}"
    )


def hook_names(model: nn.Module) -> list[str]:
    """Every hook point of ``model``, in forward order."""
    return list(hook_points(model))


def select_points(points: dict, name_or_filter, arg: str) -> list[str]:
    if isinstance(name_or_filter, str):
        if name_or_filter not in points:
            near = [n for n in points if n.split(".")[-1] == name_or_filter.split(".")[-1]][:4]
            raise ValueError(
                f"{arg}: no hook point named {name_or_filter!r} in this model"
                + (f"; similar names: {near}" if near else "; hook_names(model) lists them")
            )
        return [name_or_filter]
    if callable(name_or_filter):
        return [n for n in points if name_or_filter(n)]
    raise TypeError(
        f"{arg}: expected a hook name (str) or a filter callable(name) -> bool, got {type(name_or_filter).__name__}"
    )


def uses_bridge(model) -> bool:
    return not is_attnlab_model(model)


@contextmanager
def hooks(model: nn.Module, fwd_hooks=()):
    """Install ``fwd_hooks = [(name_or_filter, fn)]`` for the ``with`` body; removed on exit (also after an
    exception).  A transformers model runs attnlab attention for the duration."""
    points = hook_points(model)
    pairs = []
    for i, item in enumerate(fwd_hooks):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and callable(item[1])):
            raise TypeError(f"fwd_hooks[{i}]: expected a pair (name_or_filter, fn(activation, hook)), got {item!r}")
        for n in select_points(points, item[0], f"fwd_hooks[{i}]"):
            pairs.append((n, item[1]))
    removers, restore = [], None
    try:
        if uses_bridge(model):
            from attnlab.interp.capture import use_bridge

            restore = use_bridge(model)
        for n, fn in pairs:
            info = HookInfo(n)
            removers.append(points[n].add(lambda x, fn=fn, info=info: fn(x, info)))
        yield points
    finally:
        for r in reversed(removers):
            r()
        if restore is not None:
            restore()


def model_outputs(model, out) -> torch.Tensor:
    """The logits of a forward's output; for a model without an LM head (Encoder, BertModel) the final hidden
    states (after the final norm where there is one)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    return out.last_hidden_state


def run_with_hooks(model: nn.Module, tokens, *, fwd_hooks=(), **forward_kwargs) -> torch.Tensor:
    """``model(tokens, **forward_kwargs)`` with ``fwd_hooks = [(name_or_filter, fn)]`` installed; returns the
    logits ``(B, N, vocab)`` (an encoder without LM head: its final hidden states ``(B, N, d_model)``).

    ``fn(activation, hook)`` may return a tensor of the activation's shape to replace it, or edit it in place;
    hooks are removed on exit, also when the forward raises."""
    with hooks(model, fwd_hooks):
        out = model(tokens, **forward_kwargs)
    return model_outputs(model, out)
