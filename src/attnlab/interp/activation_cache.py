"""``run_with_cache`` and ``ActivationCache``: every activation by name, TransformerLens' semantics.

``logits, cache = run_with_cache(model, tokens, names_filter=...)`` runs one forward pass
(fast kernels on) and keeps the activations named by the filter (default: all), detached.
Patterns, scores and per-head results are *lazy*: the cache keeps the layer's q and k (and
z) and computes ``cache["pattern", l]`` when it is first read — ``cache.pattern(l, heads=[3])``
computes one head only.  Indexing::

    cache["blocks.0.attn.hook_z"]   the full name
    cache["pattern", 1]             = cache["blocks.1.attn.hook_pattern"]     (TL's get_act_name)
    cache["resid_post", -1]         negative layers count from the end
    cache["scale", 0, "ln1"]        = cache["blocks.0.ln1.hook_scale"];  cache["embed"] = cache["hook_embed"]

Residual-stream helpers (:meth:`~ActivationCache.accumulated_resid`,
:meth:`~ActivationCache.decompose_resid`, :meth:`~ActivationCache.stack_head_results`) take
``layer`` as a position among the ``n_layers + 1`` residual streams (resid_pre of 0 .. L-1, then the
final one): ``None`` or ``-1`` is the final stream, as TransformerLens' -1 and as Python indexes
``range(L + 1)``.  :meth:`~ActivationCache.apply_ln_to_stack` centres (LayerNorm) and divides by the
cached scale, *without* the norm's weight and bias (TransformerLens assumes folded norms);
:meth:`~ActivationCache.logit_attrs` therefore folds ``ln_final``'s weight into the unembedding
directions, so the attributions of a full decomposition sum to the logit minus the final norm's
bias term (``b · W_U[:, token]``).

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> from attnlab.interp import run_with_cache
>>> model = Decoder(DecoderConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
>>> ids = torch.randint(0, 50, (1, 6))
>>> logits, cache = run_with_cache(model, ids)
>>> cache["pattern", 1].shape, cache["resid_post", -1].shape, cache.pattern(0, heads=[2]).shape
(torch.Size([1, 4, 6, 6]), torch.Size([1, 6, 32]), torch.Size([1, 1, 6, 6]))
>>> parts, labels = cache.decompose_resid(return_labels=True)
>>> labels[:3], bool(torch.allclose(parts.sum(0), cache["resid_post", -1], atol=1e-5))
(['embed', 'pos_embed', '0_attn_out'], True)
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from attnlab.interp.hooks import hook_points, hooks, model_outputs, select_points
from attnlab.interp.spec import model_spec

__all__ = ["ActivationCache", "run_with_cache", "get_act_name"]

_ATTN = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores")
_MLP = ("pre", "post", "mid", "pre_linear")
_ALIAS = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_mid": "mid",
    "mlp_post": "post",
}
_LAZY = ("hook_attn_scores", "hook_pattern", "hook_result")


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None, n_layers: int | None = None):
    """TransformerLens' ``utils.get_act_name``: ``("pattern", 1)`` -> ``"blocks.1.attn.hook_pattern"``.
    With ``n_layers``, a negative ``layer`` counts from the end."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name  # already a full name
    name = _ALIAS.get(name, name)
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}")
        if n_layers is not None:
            if not -n_layers <= layer < n_layers:
                raise ValueError(f"layer: {layer} not in [-{n_layers}, {n_layers}) for n_layers={n_layers}")
            layer %= n_layers
    if layer_type is None:
        if name in _ATTN:
            layer_type = "attn"
        elif name in _MLP:
            layer_type = "mlp"
        elif name in ("scale", "normalized") and layer is None:
            layer_type = "ln_final"
    elif layer_type == "a":
        layer_type = "attn"
    elif layer_type == "m":
        layer_type = "mlp"
    if name == "logits":
        return "logits"
    full = "" if layer is None else f"blocks.{layer}."
    if layer_type:
        full += f"{layer_type}."
    return full + f"hook_{name}"


def _positions_apply(t: torch.Tensor, pos_slice, dim: int) -> torch.Tensor:
    """TransformerLens' ``Slice``: None (all), an int (keeps the dim), a slice, or a list/tensor of indices."""
    if pos_slice is None:
        return t
    if isinstance(pos_slice, int) and not isinstance(pos_slice, bool):
        return t.narrow(dim, pos_slice % t.shape[dim], 1)
    if isinstance(pos_slice, slice):
        idx = [slice(None)] * t.dim()
        idx[dim] = pos_slice
        return t[tuple(idx)]
    if isinstance(pos_slice, (list, tuple, torch.Tensor)):
        return t.index_select(dim, torch.as_tensor(pos_slice, dtype=torch.long, device=t.device).reshape(-1))
    raise TypeError(f"pos_slice: expected None, an int, a slice or a list of positions, got {type(pos_slice).__name__}")


class ActivationCache:
    """Activations of one forward pass by name; see the module docstring.  Build with :func:`run_with_cache`."""

    def __init__(self, store: dict, lazy: dict, spec, calls: dict | None = None, order=None):
        self._store = store  # name -> tensor
        self._lazy = lazy  # name -> () -> tensor, computed once when read
        self._calls = calls or {}  # layer -> AttentionCall (q, k kept) for lazy patterns
        self.spec = spec
        self._order = list(order) if order is not None else list(store) + [n for n in lazy if n not in store]

    # -- dict-like ----------------------------------------------------------------
    def _name(self, key) -> str:
        if isinstance(key, tuple):
            if not 1 <= len(key) <= 3:
                raise KeyError(f"cache[{key!r}]: expected (name, layer) or (name, layer, layer_type)")
            layer = key[1] if len(key) > 1 else None
            layer_type = key[2] if len(key) > 2 else None
            return get_act_name(key[0], layer, layer_type, n_layers=self.spec.n_layers)
        if isinstance(key, str):
            if key in self._store or key in self._lazy:
                return key
            return get_act_name(key)
        raise TypeError(f"cache key: expected a hook name or (name, layer[, layer_type]), got {key!r}")

    def __getitem__(self, key) -> torch.Tensor:
        name = self._name(key)
        if name in self._store:
            return self._store[name]
        if name in self._lazy:
            t = self._lazy[name]()
            self._store[name] = t
            return t
        raise KeyError(
            f"{name!r} is not in the cache (it holds {len(self)} names; was it excluded by "
            f"names_filter, or does the model have no such point? see hook_names(model))"
        )

    def __contains__(self, key) -> bool:
        try:
            name = self._name(key)
        except (TypeError, ValueError, KeyError):
            return False
        return name in self._store or name in self._lazy

    def keys(self) -> list[str]:
        return list(self._order)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._order)

    def items(self):
        return [(n, self[n]) for n in self._order]

    def values(self):
        return [self[n] for n in self._order]

    def __repr__(self):
        return f"ActivationCache({len(self)} names, n_layers={self.spec.n_layers})"

    def pattern(self, layer: int, heads=None) -> torch.Tensor:
        """``(B, h, Nq, Nk)`` float32 pattern of ``layer`` for the query ``heads`` (default all; negative
        indices count from the end), recomputed from the cached q and k (no other head is computed)."""
        L = self.spec.n_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not -L <= layer < L:
            raise ValueError(f"layer: expected an int in [-{L}, {L}), got {layer!r}")
        layer %= L
        name = f"blocks.{layer}.attn.hook_pattern"
        if name in self._store:  # formed already (read, or edited by a hook in the pass)
            p = self._store[name]
            if heads is None:
                return p
            idx = torch.as_tensor(heads, dtype=torch.long).reshape(-1)
            H = p.shape[1]
            if idx.numel() and (int(idx.min()) < -H or int(idx.max()) >= H):
                raise ValueError(f"heads: expected query-head indices in [-{H}, {H}), got {idx.tolist()}")
            return p[:, idx % H]
        if layer not in self._calls:
            raise KeyError(
                f"layer {layer}: its pattern was not cached (names_filter excluded "
                f"blocks.{layer}.attn.hook_pattern, or the layer has no softmax attention)"
            )
        return self._calls[layer].pattern(heads)

    def nbytes(self) -> int:
        """Bytes of the distinct storages the cache keeps alive (views of one tensor counted once)."""
        seen, total = set(), 0
        tensors = list(self._store.values())
        for c in self._calls.values():
            tensors += [t for t in (c.q, c.k, c.v, c.z) if t is not None]
        for t in tensors:
            st = t.untyped_storage()
            key = (st.data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
        return total

    # -- the residual stream --------------------------------------------------------
    def _resid_position(self, layer) -> int:
        L = self.spec.n_layers
        if layer is None:
            return L
        if isinstance(layer, bool) or not isinstance(layer, int) or not -(L + 1) <= layer <= L:
            raise ValueError(
                f"layer: expected None or an int in [-{L + 1}, {L}] (a position among the "
                f"n_layers + 1 = {L + 1} residual streams; -1 / None: the final one), got {layer!r}"
            )
        return layer % (L + 1)

    def _additive(self, what: str):
        if not self.spec.additive_resid:
            raise ValueError(
                f"{what}: the residual stream of this model is not a sum of its components "
                "(post-norm blocks or an embedding norm, as BERT); use a pre-norm decoder"
            )

    def accumulated_resid(
        self,
        layer=None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice=None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ):
        """The residual stream at each layer up to ``layer``: ``[components, B, N, d_model]`` — resid_pre of
        0..layer (and resid_mid of each before ``layer`` with ``incl_mid``; of ``layer`` itself with
        ``mlp_input``), then ``final_post`` when ``layer`` is the final stream.  The logit lens is
        ``apply_ln=True`` followed by the unembedding."""
        L = self.spec.n_layers
        layer = self._resid_position(layer)
        comps, labels = [], []
        for l in range(layer + 1):
            if l == L:
                comps.append(self[f"blocks.{L - 1}.hook_resid_post"])
                labels.append("final_post")
                continue
            comps.append(self[f"blocks.{l}.hook_resid_pre"])
            labels.append(f"{l}_pre")
            if (incl_mid and l < layer) or (mlp_input and l == layer):
                comps.append(self[f"blocks.{l}.hook_resid_mid"])
                labels.append(f"{l}_mid")
        out = torch.stack([_positions_apply(c, pos_slice, -2) for c in comps])
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (out, labels) if return_labels else out

    def decompose_resid(
        self,
        layer=None,
        mlp_input: bool = False,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice=None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ):
        """The residual stream entering ``layer`` as the sum of what wrote it: ``embed``, ``pos_embed``, each
        earlier layer's ``attn_out`` and ``mlp_out`` (``mode``: "all", "attn" or "mlp"), and with
        ``mlp_input`` the attention output of ``layer`` itself.  ``[components, B, N, d_model]``; the
        components sum to ``resid_pre`` of ``layer`` (the final ``resid_post`` for the final stream)."""
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode: expected 'all', 'attn' or 'mlp', got {mode!r}")
        self._additive("decompose_resid")
        layer = self._resid_position(layer)
        incl_attn = mode != "mlp"
        incl_mlp = mode != "attn" and self.spec.has_mlp
        comps, labels = [], []
        if incl_embeds:
            comps.append(self["hook_embed"])
            labels.append("embed")
            if self.spec.has_pos_embed:
                comps.append(self["hook_pos_embed"])
                labels.append("pos_embed")
        for l in range(layer):
            if incl_attn:
                comps.append(self[f"blocks.{l}.hook_attn_out"])
                labels.append(f"{l}_attn_out")
            if incl_mlp:
                comps.append(self[f"blocks.{l}.hook_mlp_out"])
                labels.append(f"{l}_mlp_out")
        if mlp_input and incl_attn:
            if layer == self.spec.n_layers:
                raise ValueError("mlp_input: the final residual stream enters no MLP; give a layer < n_layers")
            comps.append(self[f"blocks.{layer}.hook_attn_out"])
            labels.append(f"{layer}_attn_out")
        if not comps:
            raise ValueError("decompose_resid: no components (incl_embeds=False and layer=0)")
        comps = [_positions_apply(c, pos_slice, -2) for c in comps]
        shape = torch.broadcast_shapes(*(c.shape for c in comps))
        out = torch.stack([c.expand(shape) for c in comps])
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (out, labels) if return_labels else out

    def stack_head_results(
        self,
        layer=-1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice=None,
        apply_ln: bool = False,
    ):
        """Each head's output through W_O for the layers before ``layer`` (-1 / None: all):
        ``[layers·H, B, N, d_model]``, labels ``L{l}H{h}``; ``incl_remainder`` adds ``resid_post`` of
        ``layer - 1`` minus their sum (embeddings, biases, MLPs)."""
        layer = self._resid_position(layer)
        comps, labels = [], []
        for l in range(layer):
            r = _positions_apply(self[f"blocks.{l}.attn.hook_result"], pos_slice, -3)  # (B, N, H, d_model)
            comps.append(r.movedim(-2, 0))
            labels += [f"L{l}H{h}" for h in range(r.shape[-2])]
        if not comps:
            raise ValueError("stack_head_results: layer=0 gives no heads")
        out = torch.cat(comps)
        if incl_remainder:
            rest = _positions_apply(self[f"blocks.{layer - 1}.hook_resid_post"], pos_slice, -2) - out.sum(0)
            out = torch.cat([out, rest[None]])
            labels.append("remainder")
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, pos_slice=pos_slice)
        return (out, labels) if return_labels else out

    def get_full_resid_decomposition(
        self, layer=None, mlp_input: bool = False, apply_ln: bool = False, pos_slice=None, return_labels: bool = False
    ):
        """The stream entering ``layer`` as every head's result (``L{l}H{h}``), each MLP's output, ``embed``,
        ``pos_embed`` and ``bias`` (the attention output biases): ``[components, B, N, d_model]``, summing to
        resid_pre of ``layer`` (resid_mid with ``mlp_input``, whose heads of ``layer`` are then included).
        TransformerLens' method without ``expand_neurons``."""
        self._additive("get_full_resid_decomposition")
        layer = self._resid_position(layer)
        if mlp_input and layer == self.spec.n_layers:
            raise ValueError("mlp_input: the final residual stream enters no MLP; give a layer < n_layers")
        upto = layer + 1 if mlp_input else layer
        comps, labels = [], []
        if upto:
            heads, labels = self.stack_head_results(upto, pos_slice=pos_slice, return_labels=True)
            comps.append(heads)
        if self.spec.has_mlp and layer:
            mlp, mlp_labels = self.decompose_resid(
                layer, mode="mlp", incl_embeds=False, pos_slice=pos_slice, return_labels=True
            )
            comps.append(mlp)
            labels += mlp_labels
        emb = [("embed", "hook_embed")] + ([("pos_embed", "hook_pos_embed")] if self.spec.has_pos_embed else [])
        for label, name in emb:
            comps.append(_positions_apply(self[name], pos_slice, -2)[None])
            labels.append(label)
        shape = torch.broadcast_shapes(*(c.shape[1:] for c in comps))
        bias = torch.zeros(shape[-1], dtype=comps[0].dtype, device=comps[0].device)
        for l in range(upto):
            b = self.spec.b_O(l)
            if b is not None:
                bias = bias + b.detach().to(bias)
        comps.append(bias.expand(1, *shape))
        labels.append("bias")
        out = torch.cat([c.expand(c.shape[0], *shape) for c in comps])
        if apply_ln:
            out = self.apply_ln_to_stack(out, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (out, labels) if return_labels else out

    def stack_activation(self, name: str, layer=-1, sublayer_type: str | None = None) -> torch.Tensor:
        """``cache[name, l]`` of the layers before ``layer`` (-1 / None: all), stacked: ``[layers, ...]``."""
        layer = self._resid_position(layer)
        return torch.stack([self[name, l, sublayer_type] if sublayer_type else self[name, l] for l in range(layer)])

    def apply_ln_to_stack(
        self,
        residual_stack: torch.Tensor,
        layer=None,
        mlp_input: bool = False,
        pos_slice=None,
        batch_slice=None,
        has_batch_dim: bool = True,
    ) -> torch.Tensor:
        """``residual_stack [..., B, N, d_model]`` through the norm that reads the stream at ``layer``
        (ln1 of ``layer``, ln2 with ``mlp_input``, ln_final for the final stream) *as a linear map*: centred
        (LayerNorm) and divided by the cached scale of the actual forward; weight and bias not applied."""
        layer = self._resid_position(layer)
        final = layer == self.spec.n_layers
        if not self.spec.norm or (final and not self.spec.has_ln_final) or (not final and not self.spec.has_mlp):
            return residual_stack  # no norm reads this stream
        if self.spec.norm == "layernorm":
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        if final:
            name = "ln_final.hook_scale"
        else:
            name = f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale"
        scale = _positions_apply(self[name], pos_slice, -2)
        if has_batch_dim and batch_slice is not None:
            scale = _positions_apply(scale, batch_slice, 0)
        elif not has_batch_dim:
            scale = scale[0]
        return residual_stack / scale

    def logit_attrs(
        self,
        residual_stack: torch.Tensor,
        tokens,
        incorrect_tokens=None,
        pos_slice=None,
        batch_slice=None,
        has_batch_dim: bool = True,
    ) -> torch.Tensor:
        """Direct logit attribution: each component's contribution to the logit of ``tokens`` (minus that of
        ``incorrect_tokens``): ``apply_ln_to_stack(stack, -1) · (w_ln ⊙ W_U[:, token])``, shape
        ``[..., B, N]`` (``tokens`` an int, or a LongTensor broadcastable to ``(B, N)``)."""
        spec = self.spec
        if spec.unembed is None:
            raise ValueError("logit_attrs: the model has no unembedding (an encoder without LM head)")
        dirs = self._directions(tokens, "tokens")
        if incorrect_tokens is not None:
            dirs = dirs - self._directions(incorrect_tokens, "incorrect_tokens")
        scaled = self.apply_ln_to_stack(
            residual_stack, None, pos_slice=pos_slice, batch_slice=batch_slice, has_batch_dim=has_batch_dim
        )
        return (scaled * dirs.to(scaled.dtype)).sum(-1)

    def _directions(self, tokens, arg) -> torch.Tensor:
        W = self.spec.unembed  # (vocab, d_model)
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            t = torch.tensor(tokens)
        elif isinstance(tokens, torch.Tensor) and not tokens.dtype.is_floating_point and tokens.dtype != torch.bool:
            t = tokens
        else:
            raise TypeError(f"{arg}: expected an int or an integer tensor of token ids, got {tokens!r}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= W.shape[0]):
            raise ValueError(f"{arg}: token ids must lie in [0, {W.shape[0]}), got [{int(t.min())}, {int(t.max())}]")
        d = W.detach()[t.to(W.device)]
        if self.spec.ln_final_weight is not None:
            d = d * self.spec.ln_final_weight.detach()
        return d


def _names(points: dict, names_filter) -> list[str]:
    if names_filter is None:
        return list(points)
    if isinstance(names_filter, str):
        names_filter = [names_filter]
    if isinstance(names_filter, (list, tuple, set)):
        bad = [n for n in names_filter if n not in points]
        if bad:
            raise ValueError(f"names_filter: {bad} are not hook points of this model (see hook_names(model))")
        return [n for n in points if n in set(names_filter)]
    if callable(names_filter):
        return [n for n in points if names_filter(n)]
    raise TypeError(
        f"names_filter: expected None, a name, a list of names or a callable(name) -> bool, got "
        f"{type(names_filter).__name__}"
    )


def run_with_cache(model, tokens, *, names_filter=None, fwd_hooks=(), device=None, **forward_kwargs):
    """``(logits, ActivationCache)`` of ``model(tokens, **forward_kwargs)``.

    Args:
        names_filter: which hook points to keep: ``None`` (all), a name, a list of names, or
            ``callable(name) -> bool``.  Patterns, scores and per-head results are kept lazily (the
            layer's q and k, or z), computed when read.
        fwd_hooks: hooks to run in the same pass (``[(name_or_filter, fn)]``, as :func:`run_with_hooks`);
            the cache sees the activations after them.
        device: move each kept tensor there (e.g. ``"cpu"``).

    ``logits`` as :func:`run_with_hooks` (an encoder without LM head: its final hidden states)."""
    from attnlab.interp.capture import capture

    points = hook_points(model)
    names = _names(points, names_filter)
    spec = model_spec(model)
    store: dict = {}
    lazy: dict = {}
    z_kept: dict = {}

    def keep(name):
        def fn(x, hook):
            store[name] = x.detach() if device is None else x.detach().to(device)

        return fn

    touched = set()  # points the caller's hooks run on: a lazy one is then formed in the pass, kept as edited
    for i, item in enumerate(fwd_hooks):
        if isinstance(item, (tuple, list)) and len(item) == 2:
            touched.update(select_points(points, item[0], f"fwd_hooks[{i}]"))
    eager = [n for n in names if not points[n].lazy or n in touched]
    lazy_names = [n for n in names if points[n].lazy and n not in touched]
    pattern_layers = sorted({int(n.split(".")[1]) for n in lazy_names if not n.endswith("hook_result")})
    result_layers = sorted({int(n.split(".")[1]) for n in lazy_names if n.endswith("hook_result")})
    extra = []
    for l in result_layers:
        zn = f"blocks.{l}.attn.hook_z"

        def keep_z(x, hook, l=l):
            z_kept[l] = x.detach() if device is None else x.detach().to(device)

        extra.append((zn, keep_z))
    with ExitStack() as stack:
        stack.enter_context(hooks(model, list(fwd_hooks) + [(n, keep(n)) for n in eager] + extra))
        cap = stack.enter_context(capture(model, layers=pattern_layers, keep=("q",))) if pattern_layers else None
        out = model(tokens, **forward_kwargs)
    calls = {}
    if cap is not None:
        for l in pattern_layers:
            c = cap[l]
            if device is not None:
                c.q, c.k = c.q.to(device), c.k.to(device)
            calls[l] = c
    for n in lazy_names:
        l = int(n.split(".")[1])
        if n.endswith("hook_pattern"):
            lazy[n] = lambda c=calls[l]: c.pattern()
        elif n.endswith("hook_attn_scores"):
            lazy[n] = lambda c=calls[l]: c.scores()
        else:
            W_O = spec.W_O(l)
            lazy[n] = lambda z=z_kept[l], W=W_O: torch.einsum("bnhd,hdm->bnhm", z, W.detach().to(z.device, z.dtype))
    ordered = {n: store[n] for n in names if n in store}
    return model_outputs(model, out), ActivationCache(ordered, lazy, spec, calls, order=names)
