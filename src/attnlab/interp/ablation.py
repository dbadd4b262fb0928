"""Per-head ablation: replace a head's output ``z_h`` (before W_O) and measure what breaks.

``kind``:

* ``"zero"``: ``z_h ← 0`` (the head writes nothing but ``W_O``'s bias share);
* ``"mean"``: ``z_h ←`` its mean over a reference batch and all positions (the head's
  average contribution, removing only the information it carries);
* ``"resample"``: ``z_h ←`` its value on a different input (a reference batch, rows
  cycled), the causal-scrubbing style of ablation.

:func:`ablation_effects` gives, for every head, the loss with the head ablated minus the
clean loss, as a ``[layer, head]`` :class:`~attnlab.interp.detectors.HeadScores`.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.interp import ablate
>>> model = Decoder(DecoderConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, attn_only=True)).eval()
>>> ids = torch.randint(0, 20, (2, 6))
>>> clean = model(ids).logits
>>> with ablate(model, [(0, 0), (0, 1)], kind="zero"):
...     ablated = model(ids).logits
>>> bool(torch.allclose(ablated, model.lm_head(model.embed(ids) + model.pos_embed(torch.arange(6))
...                                                + model.blocks[0].attn.b_O)))
True
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from attnlab.interp.capture import attention_modules, capture
from attnlab.interp.detectors import HeadScores

KINDS = ("zero", "mean", "resample")


def _heads_by_layer(model, heads):
    mods = {l: (m, kind) for l, m, kind in attention_modules(model)}
    by = {}
    for item in heads:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"heads: expected (layer, head) pairs, got {item!r}")
        l, h = int(item[0]), int(item[1])
        if l not in mods:
            raise ValueError(f"heads: layer {l} not in the model's layers {sorted(mods)}")
        m = mods[l][0]
        H = getattr(m, "n_heads", None) or getattr(getattr(m, "config", None), "num_attention_heads", None)
        if H is not None and not 0 <= h < H:
            raise ValueError(f"heads: head {h} out of range for layer {l} with {H} heads")
        by.setdefault(l, []).append(h)
    return mods, by


@contextmanager
def ablate(model, heads, *, kind: str = "zero", reference=None, forward=None):
    """Ablate ``heads`` (``[(layer, head)]``) inside a ``with``.

    ``reference``: input ids for ``"mean"`` and ``"resample"`` (run once, clean, to record
    the heads' outputs).  ``forward(model, ids)`` overrides how the model is called.
    For ``"resample"`` the reference's rows are cycled to the ablated batch's size and
    must have the same sequence length.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    mods, by = _heads_by_layer(model, heads)
    fwd = forward or (lambda m, x: m(x))
    saved = {}
    if kind != "zero":
        if reference is None:
            raise ValueError(f"reference: kind={kind!r} needs reference inputs to take head outputs from")
        with torch.no_grad(), capture(model, layers=sorted(by), keep=("z",)) as cap:
            fwd(model, reference)
        for l in by:
            z = cap[l].z
            saved[l] = z.mean(dim=(0, 2), keepdim=True) if kind == "mean" else z

    def hook_for(l, hs):
        def hook(call):
            z = call.z.clone()
            for h in hs:
                if kind == "zero":
                    z[:, h] = 0
                elif kind == "mean":
                    z[:, h] = saved[l][:, h].to(z.dtype)
                else:
                    r = saved[l][:, h]
                    if r.shape[1] != z.shape[2]:
                        raise ValueError(f"reference: sequence length {r.shape[1]} differs from the input's "
                                         f"{z.shape[2]} (resample ablation needs equal lengths)")
                    z[:, h] = r[torch.arange(z.shape[0]) % r.shape[0]].to(z.dtype)
            return z
        return hook

    installed = []
    try:
        for l, hs in by.items():
            m, k = mods[l]
            lst = m.hooks if k == "attnlab" else m.__dict__.setdefault("attnlab_hooks", [])
            hk = hook_for(l, hs)
            lst.append(hk)
            installed.append((lst, hk))
        if any(mods[l][1] == "hf" for l in by):
            from attnlab.interp.capture import _use_bridge
            restore = _use_bridge(model)
        else:
            restore = None
        try:
            yield
        finally:
            if restore is not None:
                restore()
    finally:
        for lst, hk in installed:
            lst.remove(hk)


def lm_loss(model, ids) -> torch.Tensor:
    """Mean next-token cross-entropy of a decoder on ``ids (B, N)``."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def ablation_effects(model, ids, *, kind: str = "zero", reference=None, loss_fn=lm_loss, layers=None,
                     progress: bool = True) -> HeadScores:
    """``[layer, head]``: loss with that one head ablated minus the clean loss (positive =
    the head helps).  One forward pass per head, with a progress bar."""
    mods = attention_modules(model)
    layers = [l for l, _, _ in mods] if layers is None else list(layers)
    n_heads = {l: (getattr(m, "n_heads", None) or m.config.num_attention_heads) for l, m, _ in mods}
    with torch.no_grad():
        clean = float(loss_fn(model, ids))
        H = max(n_heads[l] for l in layers)
        out = torch.full((len(layers), H), float("nan"))
        todo = [(i, l, h) for i, l in enumerate(layers) for h in range(n_heads[l])]
        for i, l, h in tqdm(todo, desc=f"{kind} ablation", unit="head", disable=not progress, leave=False):
            with ablate(model, [(l, h)], kind=kind, reference=reference,
                        forward=lambda m, x: loss_fn(m, x)):
                out[i, h] = float(loss_fn(model, ids)) - clean
    return HeadScores(f"{kind}-ablation Δloss", out, layers)
