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
    by: dict[int, list[int]] = {}
    for item in heads:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"heads: expected (layer, head) pairs, got {item!r}")
        l, h = int(item[0]), int(item[1])
        if -len(mods) <= l < 0:
            l = sorted(mods)[l]  # Python's negative indices
        if l not in mods:
            raise ValueError(f"heads: layer {l} not in the model's layers {sorted(mods)}")
        m = mods[l][0]
        H = getattr(m, "n_heads", None) or getattr(getattr(m, "config", None), "num_attention_heads", None)
        if H is not None and not -H <= h < H:
            raise ValueError(f"heads: head {h} out of range for layer {l} with {H} heads")
        h = h % H if H is not None else h
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
                        raise ValueError(
                            f"reference: sequence length {r.shape[1]} differs from the input's "
                            f"{z.shape[2]} (resample ablation needs equal lengths)"
                        )
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
            from attnlab.interp.capture import use_bridge

            restore = use_bridge(model)
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


def _output(model, ids):
    out = model(ids)
    if isinstance(out, torch.Tensor):
        return out, None
    logits = getattr(out, "logits", None)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None and isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        hidden = out[0]
    return logits, hidden


def lm_loss(model, ids) -> torch.Tensor:
    """Mean next-token cross-entropy of a decoder on ``ids (B, N)``; raises ``ValueError``
    for a model without LM logits (an encoder: see :func:`hidden_change`)."""
    logits, _ = _output(model, ids)
    if logits is None:
        raise ValueError(
            f"loss_fn: lm_loss needs next-token logits and {type(model).__name__} returns none "
            "(an encoder); use hidden_change(model, ids) or pass your own loss_fn(model, ids)"
        )
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def hidden_change(model, ids):
    """A loss for models without LM logits: ``fn(model, ids)`` = the mean over tokens of
    ``‖h − h_clean‖ / ‖h_clean‖``, with ``h`` the final hidden states (``last_hidden_state``)
    and ``h_clean`` those of ``model`` on ``ids`` now (clean, no ablation).  It is 0 on the
    clean run, so an ablation's effect is how far (relatively) it moves the encoder's
    output — the default of :func:`ablation_effects` for encoders, where no MLM head exists."""
    with torch.no_grad():
        _, h0 = _output(model, ids)
    if h0 is None:
        raise ValueError(f"model: {type(model).__name__} returns neither logits nor last_hidden_state")
    h0 = h0.detach().float()
    n0 = h0.norm(dim=-1).clamp(min=torch.finfo(h0.dtype).tiny)

    def fn(m, x):
        _, h = _output(m, x)
        if h.shape != h0.shape:
            raise ValueError(f"ids: hidden_change was set up for inputs {tuple(ids.shape)}, got {tuple(x.shape)}")
        return ((h.float() - h0).norm(dim=-1) / n0).mean()

    return fn


def default_loss(model, ids):
    """:func:`lm_loss` when ``model`` gives next-token logits, else :func:`hidden_change`."""
    with torch.no_grad():
        logits, _ = _output(model, ids)
    return lm_loss if logits is not None else hidden_change(model, ids)


def ablation_effects(
    model, ids, *, kind: str = "zero", reference=None, loss_fn=None, layers=None, progress: bool = True
) -> HeadScores:
    """``[layer, head]``: loss with that one head ablated minus the clean loss (positive =
    the head helps).  One forward pass per head, with a progress bar.

    ``loss_fn(model, ids) -> scalar`` defaults to :func:`default_loss`: the next-token
    cross-entropy for a decoder (:func:`lm_loss`), and for an encoder (attnlab ``Encoder``,
    transformers ``BertModel``: no LM logits, and MiniLM ships no MLM head) the relative
    change of the final hidden states (:func:`hidden_change`, 0 when clean; the scores'
    name says which was used)."""
    mods = attention_modules(model)
    layers = [l for l, _, _ in mods] if layers is None else list(layers)
    n_heads = {l: (getattr(m, "n_heads", None) or m.config.num_attention_heads) for l, m, _ in mods}
    L = len(mods)
    bad = [l for l in layers if isinstance(l, bool) or not isinstance(l, int) or not -L <= l < L]
    if bad:
        raise ValueError(f"layers: expected ints in [-{L}, {L}) for a model with {L} attention layers, got {bad}")
    layers = [[l for l, _, _ in mods][l] for l in layers]
    name = f"{kind}-ablation Δloss"
    forward = lambda m, x: loss_fn(m, x)  # noqa: E731  (reference runs go through the loss's own call)
    if loss_fn is None:
        loss_fn = default_loss(model, ids)
        if loss_fn is not lm_loss:
            name = f"{kind}-ablation Δhidden (relative)"
            forward = _output
    with torch.no_grad():
        clean = float(loss_fn(model, ids))
        H = max(n_heads[l] for l in layers)
        out = torch.full((len(layers), H), float("nan"))
        todo = [(i, l, h) for i, l in enumerate(layers) for h in range(n_heads[l])]
        for i, l, h in tqdm(todo, desc=f"{kind} ablation", unit="head", disable=not progress, leave=False):
            with ablate(model, [(l, h)], kind=kind, reference=reference, forward=forward):
                out[i, h] = float(loss_fn(model, ids)) - clean
    return HeadScores(name, out, layers)
