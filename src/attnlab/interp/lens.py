"""The logit lens (nostalgebraist, 2020): read every residual stream through the final norm and
the unembedding, as if the model stopped there.

The ``n_layers + 1`` streams are ``resid_pre`` of each block and the final ``resid_post``
(row ``l`` = what the model predicts before block ``l``; the last row is the model's own
output).  The final norm is *applied afresh* to each stream (its own statistics, the norm's
weight and bias), then the unembedding — the last row therefore equals the model's logits.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> model = Decoder(DecoderConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=2)).eval()
>>> ids = torch.randint(0, 30, (2, 7))
>>> lens = logit_lens(model, ids)
>>> lens.axes, tuple(lens.values.shape)
(('layer', 'batch', 'pos', 'vocab'), (3, 2, 7, 30))
>>> bool(torch.allclose(lens.values[-1], model(ids).logits.log_softmax(-1), atol=1e-5))
True
>>> logit_lens(model, ids, target="next").axes              # log-prob of the next token, mean over batch
('layer', 'pos')
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.interp.activation_cache import run_with_cache

__all__ = ["LensResult", "logit_lens"]


@dataclass
class LensResult:
    """``values`` with named ``axes``; ``index["layer"]`` names the streams (``"pre 0"`` ...
    ``"final"``)."""

    values: torch.Tensor
    axes: tuple
    index: dict


def _final_norm_and_unembed(model):
    from attnlab.nn import Decoder

    if isinstance(model, Decoder):
        return model.norm, model.lm_head
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        raise ValueError(
            f"model: {type(model).__name__} has no unembedding (an encoder without LM head); the logit lens needs one"
        )
    base = getattr(model, "base_model", model)
    norm = getattr(base, "ln_f", None) or getattr(base, "norm", None)
    return norm, head


def logit_lens(model, tokens, *, target=None, **forward_kwargs) -> LensResult:
    """Log-probabilities from every residual stream of ``model`` on ``tokens (B, N)``.

    ``target=None``: ``values [layer, batch, pos, vocab]`` (log-softmax over the vocabulary);
    ``target`` ``(B, N)`` ids: the log-probability of ``target[b, i]`` at each position,
    averaged over the batch, ``[layer, pos]``; ``target="next"``: the next token of
    ``tokens`` (``[layer, pos]`` over positions ``0 .. N-2``).  ``layer`` has
    ``n_layers + 1`` rows (see the module docstring).
    """
    norm, head = _final_norm_and_unembed(model)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
        raise ValueError(
            f"tokens: expected integer ids (B, N), got "
            f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}"
        )
    with torch.no_grad():
        _, cache = run_with_cache(
            model, tokens, names_filter=lambda n: n.endswith(("hook_resid_pre", "hook_resid_post")), **forward_kwargs
        )
        L = cache.spec.n_layers
        streams = [cache["resid_pre", l] for l in range(L)] + [cache["resid_post", L - 1]]
        x = torch.stack(streams)
        if norm is not None:
            x = norm(x)
        logp = head(x).float().log_softmax(-1)  # [L+1, B, N, vocab]
    labels = [f"pre {l}" for l in range(L)] + ["final"]
    if target is None:
        return LensResult(
            logp, ("layer", "batch", "pos", "vocab"), {"layer": labels, "pos": list(range(tokens.shape[1]))}
        )
    if isinstance(target, str):
        if target != "next":
            raise ValueError(f"target: expected None, 'next' or token ids (B, N), got {target!r}")
        target, logp = tokens[:, 1:], logp[:, :, :-1]
    target = torch.as_tensor(target, device=logp.device)
    if target.shape != logp.shape[1:3] or target.dtype.is_floating_point:
        raise ValueError(
            f"target: expected integer ids {tuple(logp.shape[1:3])}, got {tuple(target.shape)} {target.dtype}"
        )
    idx = target[None, ..., None].expand(logp.shape[0], -1, -1, 1)
    vals = logp.gather(-1, idx)[..., 0].mean(1)
    return LensResult(vals, ("layer", "pos"), {"layer": labels, "pos": list(range(vals.shape[1]))})
