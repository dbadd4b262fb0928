"""Run a ``transformers`` model's attention through :func:`attnlab.attention`.

:func:`register` adds an ``"attnlab"`` entry to transformers' ``AttentionInterface``
and pairs it in ``AttentionMaskInterface`` with transformers' own ``sdpa_mask``, so
the model builds the masks it builds for SDPA; :func:`attention_forward` turns them
back into attnlab masks:

==========================================  =========================================
what transformers passes                    what attnlab runs
==========================================  =========================================
mask ``None``, causal, ``Nq = 1`` (decode)  no mask: the one query sees every key
mask ``None``, causal, ``Nq > 1``           ``causal()`` aligned top-left (``q_offset=0``),
                                            as SDPA's ``is_causal``: equal to bottom-right
                                            when ``Nq = Nk``; ``Nk > Nq`` only happens for
                                            a static cache's prefill (empty slots after)
... and ``sliding_window=w``                ``sliding_window(w)`` with the same alignment
                                            (a dense mask already holds the window)
mask ``None``, not causal                   no mask
4-D bool mask (True = attend)               ``custom`` mask reading the tensor
4-D additive float mask                     ``custom`` mask where ``mask > finfo.min/2``
                                            (so ``0``/``-inf``/``finfo.min`` map exactly);
                                            other finite values become a score bias
``softcap=c`` (Gemma 2)                     ``scores.softcap(c)``, then the bias
``position_bias``                           a score bias
``s_aux`` (gpt-oss attention sinks)         ``out · sigmoid(lse − s_h)``, exact
==========================================  =========================================

GQA runs natively (K/V keep their ``Hkv`` heads).  Differences from ``eager``:

* fully masked query rows (e.g. left-padded positions) give zeros, where eager's
  ``finfo.min`` mask gives a uniform average; both are ignored downstream;
* attention dropout (``dropout=`` from a *training* module: GPT-2's ``attn_pdrop``,
  BERT's ``attention_probs_dropout_prob``, ``attention_dropout``) runs as the op's
  ``dropout_p`` (:mod:`attnlab.ops.dropout`): its own counter-based mask, seeded from
  torch's default generator (``torch.manual_seed`` reproduces a run; the masks are not
  eager's ``nn.Dropout`` draws), on the flash path (``register(backend="sdpa")``
  refuses it).  Eval mode (or dropout 0) is the no-dropout path exactly.  Weights for
  ``output_attentions`` are the undropped pattern;
* weights are returned (as ``attnlab.attention_probs``, float32 softmax cast to the
  query dtype; the output is then ``weights · V`` as in eager, so gradients reach the
  returned weights, unless dropout or hooks run) only when ``output_attentions=True``
  reaches the function as a keyword
  — it does for models whose attention forwards ``**kwargs`` (Llama, Mistral, Gemma 2,
  ...), not for GPT-2, whose attention swallows it.  Otherwise ``None``, as SDPA.
  ``config.output_attentions = True`` is refused by transformers for any non-eager
  implementation.
* hooks: a list ``module.attnlab_hooks`` on a transformers attention module is run
  like :attr:`attnlab.nn.MultiHeadAttention.hooks` (:mod:`attnlab.interp` installs it);
  ``module.attnlab_points`` (an :class:`attnlab.nn.hooks.AttentionPoints`) runs the named
  points hook_q/k/v (or hook_rot_q/k), hook_attn_scores, hook_pattern and hook_z
  (:mod:`attnlab.models.hf_points`); nothing runs for points without functions;
* unsupported and refused: paged caches (``cache=``) and per-token ``sinks=``.

>>> import pytest; _ = pytest.importorskip("transformers")
>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from attnlab.models import bridge
>>> bridge.register()
'attnlab'
>>> cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                   num_attention_heads=4, num_key_value_heads=2)
>>> _ = torch.manual_seed(0); model = LlamaForCausalLM(cfg).eval()
>>> ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
>>> model.set_attn_implementation("eager"); want = model(ids).logits
>>> model.set_attn_implementation("attnlab"); got = model(ids).logits
>>> bool((got - want).abs().max() < 1e-5)
True
"""

from __future__ import annotations

import weakref

import torch

import attnlab
from attnlab import masks, scores

__all__ = ["register", "attention_forward"]

attention = attnlab.attention  # module attribute, so tests can count calls
_RESERVED = ("flash", "sdpa", "flex", "paged")  # transformers keys behaviour on these substrings


def register(name: str = "attnlab", backend: str = "auto") -> str:
    """Register :func:`attention_forward` as ``attn_implementation=name``; returns ``name``.

    Idempotent (calling again re-registers the same function).  ``backend`` is passed
    to :func:`attnlab.attention` (``"auto"``, ``"flash"``, ``"reference"``, ``"sdpa"``).
    The name must not contain ``flash``, ``sdpa``, ``flex`` or ``paged``: transformers
    tests those substrings to switch on other behaviour (a name with "flash" is
    treated as FlashAttention in ~70 model files and by ``generate``).
    """
    if not isinstance(name, str) or not name or name == "eager" or any(s in name.lower() for s in _RESERVED):
        raise ValueError(
            f"register(name): {name!r} is not usable; transformers gives names equal to 'eager' or "
            f"containing any of {_RESERVED} special meaning.  Use e.g. 'attnlab_tiled'"
        )
    if backend not in attnlab.BACKENDS:
        raise ValueError(f"register(backend): expected one of {attnlab.BACKENDS}, got {backend!r}")
    from transformers import AttentionInterface

    def attnlab_attention_forward(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(name, attnlab_attention_forward)
    try:  # transformers >= 4.53: masks are built per implementation
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # pragma: no cover - older transformers build the mask themselves
        pass
    else:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    sliding_window=None,
    softcap=None,
    position_bias=None,
    s_aux=None,
    *,
    backend="auto",
    **kwargs,
):
    """transformers' attention-function convention, computed by :func:`attnlab.attention`.

    ``query (B, H, Nq, D)``, ``key``/``value (B, Hkv, Nk, D)``; returns
    ``(out (B, Nq, H, Dv) contiguous, weights (B, H, Nq, Nk) or None)``.
    """
    dropout_p = float(dropout) if dropout and getattr(module, "training", False) else 0.0
    for opt in ("cache", "sinks"):
        if kwargs.get(opt) is not None:
            raise NotImplementedError(f"attnlab bridge: `{opt}=` ({type(kwargs[opt]).__name__}) is not supported")
    pts = getattr(module, "attnlab_points", None)  # attnlab.interp's named hook points (models.hf_points)
    if pts is not None and not pts.active():
        pts = None
    if pts is not None:
        if pts.bridge_stage == "qkv" and pts.qkv_active():
            query, key, value = pts.qkv(query, key, value)
        elif pts.bridge_stage == "rot" and pts.rot_active():
            query, key = pts.rot(query, key)
    B, H, Nq, _ = query.shape
    Nk = key.shape[2]
    if attention_mask is None:
        bias = None
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q_offset = 0 if Nq > 1 else Nk - Nq
        if not causal:
            mask = None
        elif sliding_window is not None:
            mask = masks.sliding_window(int(sliding_window))
        else:
            mask = masks.causal() if Nq > 1 else None
    else:
        mask, bias = _from_dense(attention_mask, B, H, Nq, Nk)
        q_offset = 0
    mods = []
    if softcap:  # None or 0: no cap
        mods.append(scores.softcap(float(softcap)))
    for t in (bias, position_bias):
        if t is not None:
            mods.append(
                _bias_mod(
                    _check_4d(t, "position_bias" if t is position_bias else "attention_mask", B, H, Nq, Nk), q_offset
                )
            )
    score_mod = None if not mods else mods[0] if len(mods) == 1 else scores.compose(*mods)
    scale = None if scaling is None else float(scaling)
    res = attention(
        query,
        key,
        value,
        mask=mask,
        score_mod=score_mod,
        scale=scale,
        q_offset=q_offset,
        return_lse=s_aux is not None,
        backend=backend,
        dropout_p=dropout_p,
    )
    hooks = getattr(module, "attnlab_hooks", None)
    if hooks or pts is not None:  # attnlab.interp: capture / ablation / hook points (z before s_aux's gate)
        from attnlab.nn.attention import AttentionCall, run_hooks

        layer = getattr(module, "layer_idx", None)
        z = res[0] if s_aux is not None else res
        if pts is not None and pts.post_active():  # scores / pattern: recomputed from q and k
            z = pts.scores_and_pattern(
                AttentionCall(
                    module,
                    query,
                    key,
                    value,
                    z,
                    mask=mask,
                    score_mod=score_mod,
                    scale=scale,
                    q_offset=q_offset,
                    layer=layer,
                )
            )
        if hooks:
            z = run_hooks(
                hooks,
                AttentionCall(
                    module,
                    query,
                    key,
                    value,
                    z,
                    mask=mask,
                    score_mod=score_mod,
                    scale=scale,
                    q_offset=q_offset,
                    layer=layer,
                ),
            )
        if pts is not None:
            z = pts.z(z)
        res = (z, res[1]) if s_aux is not None else z
    weights = None
    if kwargs.get("output_attentions"):
        weights = attnlab.attention_probs(query, key, mask=mask, score_mod=score_mod, scale=scale, q_offset=q_offset)
        if not dropout_p and not hooks and pts is None:  # as eager: out = weights·V, so gradients reach them
            wv = _weights_times_values(weights, value).to(query.dtype)
            res = (wv, res[1]) if s_aux is not None else wv
    if s_aux is not None:  # a learned logit s_h per head joins every row's softmax denominator
        out, lse = res
        keep = torch.sigmoid(lse - s_aux.to(lse.dtype).view(1, -1, 1))
        res = (out * keep.unsqueeze(-1)).to(query.dtype)
        weights = None if weights is None else weights * keep.unsqueeze(-1)
    weights = None if weights is None else weights.to(query.dtype)
    return res.transpose(1, 2).contiguous(), weights


def _weights_times_values(w, v):
    """``w (B, H, Nq, Nk)`` float32 weights times ``v (B, Hkv, Nk, Dv)`` (GQA: H = G·Hkv) -> (B, H, Nq, Dv)."""
    B, H, Nq, Nk = w.shape
    Hkv = v.shape[1]
    return (w.view(B, Hkv, H // Hkv, Nq, Nk) @ v.to(w.dtype).unsqueeze(2)).view(B, H, Nq, v.shape[-1])


def _check_4d(t, name, B, H, Nq, Nk):
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise TypeError(
            f"{name}: expected a 4-D tensor (B, 1 or H, Nq, Nk), got "
            f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else tuple(t.shape)}"
        )
    if t.shape[0] not in (1, B) or t.shape[1] not in (1, H) or tuple(t.shape[2:]) != (Nq, Nk):
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not fit B={B}, H={H}, Nq={Nq}, Nk={Nk}")
    return t


def _reader(t):
    """``(b, h, q_row, kv_col) -> t[...]`` for a (1 or B, 1 or H, Nq, Nk) tensor, without
    broadcasting over heads the tensor does not have."""
    Bt = t.shape[0]
    if t.shape[1] == 1:
        t1 = t[:, 0]
        return lambda b, h, q, kv: t1[b % Bt, q, kv]
    return lambda b, h, q, kv: t[b % Bt, h, q, kv]


def _bias_mod(t, q_offset):
    read = _reader(t)

    def bias(score, b, h, q, kv):
        return score + read(b, h, q - q_offset, kv).to(score.dtype)

    return scores.custom(bias, params=[t] if t.requires_grad else [])


_last: list[tuple | None] = [None]  # (weakref to the mask tensor, its _version, result): layers share one mask tensor


def _from_dense(m, B, H, Nq, Nk):
    """A 4-D transformers mask -> (attnlab mask or None, additive bias or None); cached per tensor
    so that all layers reuse one attnlab mask and therefore its classified tiles.

    Under ``torch.compile`` / ``torch.export`` nothing here depends on the mask's values (no
    cache, no ``keep.all()``/``bias.any()`` shortcut): a bool mask becomes a mask, an additive
    float mask a mask and a bias (docs/compile.md)."""
    compiling = torch.compiler.is_compiling()
    c = _last[0]
    if not compiling and c is not None and c[0]() is m and c[1] == m._version:
        return c[2]
    _check_4d(m, "attention_mask", B, H, Nq, Nk)
    if m.dtype == torch.bool:
        keep, bias = (m if compiling else m.clone()), None  # a copy: a view would keep `m` alive through the cache
    elif m.dtype.is_floating_point:
        keep = m > torch.finfo(m.dtype).min / 2  # 0 attends; -inf and finfo.min hide
        bias = m.masked_fill(~keep, 0)
        if not compiling and not bool(bias.any()):  # eager shortcut: a 0/-inf mask has no bias
            bias = None
    else:
        raise TypeError(f"attention_mask: expected a bool or additive float mask, got dtype {m.dtype}")
    if compiling:
        return masks.custom(_reader(keep)), bias
    mask = None
    if not bool(keep.all()):  # eager shortcut: an all-True mask hides nothing
        mask = masks.custom(_reader(keep))
    _last[0] = (weakref.ref(m, _forget), m._version, (mask, bias))
    return mask, bias


def _forget(ref):  # the mask tensor died: drop what was derived from it
    if _last[0] is not None and _last[0][0] is ref:
        _last[0] = None
