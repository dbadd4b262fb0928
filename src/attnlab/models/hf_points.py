"""TransformerLens hook names on transformers models: GPT-2, Llama / Mistral (GQA) and BERT families.

:func:`hf_points` maps each name of :mod:`attnlab.interp.hooks` onto the transformers modules:
residual, norm and MLP points are torch forward (pre-)hooks on the HF submodules; attention's
q/k/v, scores, pattern and z run inside :func:`attnlab.models.bridge.attention_forward` through the
module's ``attnlab_points`` (an :class:`attnlab.nn.hooks.AttentionPoints`), so the model must run the
``"attnlab"`` attention implementation (``attnlab.interp`` switches it for the call and back after).
Nothing is registered on a module until a function is installed on one of its points.

=================  ===============================  ============================  =============================
name               GPT-2                            Llama / Mistral               BERT
=================  ===============================  ============================  =============================
hook_embed         wte                              embed_tokens                  word_embeddings
hook_pos_embed     wpe (expanded to (B, N, d))      —                             position_embeddings (expanded)
resid_pre          h[l] input                       layers[l] input               layer[l] input
ln1.*              ln_1                             input_layernorm               attention.output.LayerNorm
attn.hook_q/k/v    in the bridge                    q_proj / k_proj / v_proj out  in the bridge
attn.hook_rot_q/k  —                                in the bridge (after RoPE)    —
scores/pattern/z   in the bridge                    in the bridge                 in the bridge
attn.hook_result   c_proj (input -> per head)       o_proj                        attention.output.dense
hook_attn_out      attn output                      self_attn output              attention.output.dense output
resid_mid          ln_2 input (edits copied in)     post_attention_layernorm in   attention.output.LayerNorm in
ln2.*              ln_2                             post_attention_layernorm      output.LayerNorm
mlp.hook_pre       c_fc out                         gate_proj out                 intermediate.dense out
mlp.hook_pre_lin.  —                                up_proj out                   —
mlp.hook_post      c_proj input                     down_proj input               intermediate out
hook_mlp_out       mlp output                       mlp output                    output.dense output
resid_post         h[l] output                      layers[l] output              output.LayerNorm input
ln_final.*         ln_f                             norm                          —
logits             lm_head                          lm_head                       — (final hidden states)
=================  ===============================  ============================  =============================

BERT is post-norm, named as TransformerLens' BERT (see :mod:`attnlab.nn.block`).  With a KV cache,
hook_k / hook_v of GPT-2 and BERT hold every cached key (they are read where the op reads them).
"""

from __future__ import annotations

from typing import Any

import torch

from attnlab.nn.hooks import AttentionPoints, HookPoint, edited_norm

__all__ = ["hf_points", "hf_spec", "family"]


def family(model) -> tuple[str, Any]:
    """``("gpt2" | "llama" | "bert", base)``: the family and the module holding the layers
    (a transformers module, read by the attribute names of its family)."""
    for attr in ("transformer", "model", "bert", None):
        base = model if attr is None else getattr(model, attr, None)
        if base is None:
            continue
        if hasattr(base, "h") and hasattr(base, "wte"):
            return "gpt2", base
        if hasattr(base, "layers") and hasattr(base, "embed_tokens"):
            l0 = base.layers[0]
            if hasattr(l0, "self_attn") and hasattr(l0.self_attn, "q_proj") and hasattr(l0, "input_layernorm"):
                return "llama", base
        if hasattr(base, "encoder") and hasattr(base, "embeddings") and hasattr(base.encoder, "layer"):
            return "bert", base
    raise TypeError(
        f"model: {type(model).__name__} is not a transformers GPT-2, Llama/Mistral or BERT model "
        "(the families with hook names); use attnlab.interp.capture for other models' attention"
    )


def _first(t):
    return t[0] if isinstance(t, tuple) else t


class _Out:
    """A forward hook on ``module``: the activation is ``view(output)``; a replacement is put back."""

    lazy = False

    def __init__(self, module, view=None, unview=None):
        self.module, self.view, self.unview = module, view, unview

    def add(self, fn):
        def hook(mod, args, out):
            t = _first(out)
            act = t if self.view is None else self.view(t)
            r = fn(act)
            if r is None:
                return None
            if not isinstance(r, torch.Tensor) or r.shape != act.shape:
                raise ValueError(
                    f"hook {fn!r}: must return None or a tensor of shape {tuple(act.shape)}, got "
                    f"{tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}"
                )
            new = r if self.unview is None else self.unview(r, t)
            return (new, *out[1:]) if isinstance(out, tuple) else new

        return self.module.register_forward_hook(hook).remove


class _In:
    """A forward pre-hook on ``module``: the activation is its first input (``hidden_states``).
    ``copy_in``: a replacement is written into the input tensor itself, so that every other reader of it
    (a residual branch kept beside the norm) sees it too."""

    lazy = False

    def __init__(self, module, view=None, unview=None, copy_in=False):
        self.module, self.view, self.unview, self.copy_in = module, view, unview, copy_in

    def add(self, fn):
        def hook(mod, args, kwargs):
            if args:
                t = args[0]
            elif "hidden_states" in kwargs:
                t = kwargs["hidden_states"]
            else:
                raise TypeError(f"{type(mod).__name__}: no hidden_states input to hook")
            act = t if self.view is None else self.view(t)
            r = fn(act)
            if r is None:
                return None
            if not isinstance(r, torch.Tensor) or r.shape != act.shape:
                raise ValueError(
                    f"hook {fn!r}: must return None or a tensor of shape {tuple(act.shape)}, got "
                    f"{tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}"
                )
            new = r if self.unview is None else self.unview(r, t)
            if self.copy_in:
                t.copy_(new)
                return None
            if args:
                return (new, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": new}

        return self.module.register_forward_pre_hook(hook, with_kwargs=True).remove


class _Scale:
    """``hook_scale`` of a norm module: computed from its input for the functions installed (one torch hook
    per module runs them all, in order); an edit recomputes the norm's output from the edited scale."""

    lazy = False

    def __init__(self, norm):
        self.norm = norm

    def add(self, fn):
        d = self.norm.__dict__
        hp = d.get("attnlab_scale_point")
        if hp is None:
            hp = d["attnlab_scale_point"] = HookPoint()
        if not hp.fns:

            def hook(mod, args, out):
                return edited_norm(mod, args[0], hp)  # None when only read: the module's output stands

            # prepend: the scale's functions run before those of hook_normalized (the same module's output)
            d["attnlab_scale_handle"] = self.norm.register_forward_hook(hook, prepend=True)
        hp.fns.append(fn)

        def remove():
            hp.fns.remove(fn)
            if not hp.fns:
                d.pop("attnlab_scale_handle").remove()

        return remove


class _Attn:
    """A point run by the bridge inside the attention function (``module.attnlab_points``)."""

    def __init__(self, module, name, stage):
        self.module, self.name = module, name
        self.lazy = name in ("hook_attn_scores", "hook_pattern", "hook_result")
        pts = module.__dict__.get("attnlab_points")
        if pts is None:
            pts = module.__dict__["attnlab_points"] = AttentionPoints()
        pts.bridge_stage = stage
        self.point = getattr(pts, name)

    def add(self, fn):
        self.point.fns.append(fn)
        return lambda: self.point.fns.remove(fn)


class _Result:
    """``hook_result (B, N, H, d_model)`` at the output projection: its input is z, heads concatenated."""

    lazy = True

    def __init__(self, proj, W_O, b_O):
        self.proj, self.W_O, self.b_O = proj, W_O, b_O

    def add(self, fn):
        def hook(mod, args, out):
            x = args[0]
            W = self.W_O()
            z = x.view(*x.shape[:-1], W.shape[0], W.shape[1])
            r = torch.einsum("bnhd,hdm->bnhm", z, W.to(z.dtype))
            v0 = r._version
            r2 = fn(r)
            if r2 is None and r._version == v0:
                return None
            r2 = r if r2 is None else r2
            if r2.shape != r.shape:
                raise ValueError(f"hook {fn!r}: must return None or a tensor of shape {tuple(r.shape)}")
            b = self.b_O()
            return r2.sum(2) if b is None else r2.sum(2) + b

        return self.proj.register_forward_hook(hook).remove


def _heads(x, n):
    return x.view(*x.shape[:-1], n, -1)


def _flat(r, t):
    return r.reshape(t.shape)


class _Batch:
    """Records the batch size of the input ids, so shared position embeddings are seen as (B, N, d)."""

    def __init__(self, model):
        self.B = 1
        self.model = model

    def expand(self, t):
        return t.expand(self.B, *t.shape[1:]) if t.dim() == 3 and t.shape[0] == 1 else t

    def unexpand(self, r, t):
        return r


def _embed_points(pts, emb_module, pos_module, tt_module, batch):
    pts["hook_embed"] = _Out(emb_module)
    if pos_module is not None:
        pts["hook_pos_embed"] = _Out(pos_module, view=batch.expand, unview=batch.unexpand)
    if tt_module is not None:
        pts["hook_token_type_embed"] = _Out(tt_module)


def _ln(pts, prefix, norm):
    pts[f"{prefix}.hook_scale"] = _Scale(norm)
    pts[f"{prefix}.hook_normalized"] = _Out(norm)


def _attn(pts, l, module, stage, names):
    for n in names:
        pts[f"blocks.{l}.attn.{n}"] = _Attn(module, n, stage)


def hf_points(model) -> dict:
    """``{name: point}`` in forward order for a transformers GPT-2 / Llama / Mistral / BERT model."""
    fam, base = family(model)
    pts: dict = {}
    batch = _Batch(model)
    if fam == "gpt2":
        _embed_points(pts, base.wte, base.wpe, None, batch)
        for l, b in enumerate(base.h):
            a = b.attn
            H, dh = a.num_heads, a.head_dim
            pts[f"blocks.{l}.hook_resid_pre"] = _In(b)
            _ln(pts, f"blocks.{l}.ln1", b.ln_1)
            _attn(pts, l, a, "qkv", ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"))
            pts[f"blocks.{l}.attn.hook_result"] = _Result(
                a.c_proj, lambda a=a, H=H, dh=dh: a.c_proj.weight.view(H, dh, -1), lambda a=a: a.c_proj.bias
            )
            pts[f"blocks.{l}.hook_attn_out"] = _Out(a)
            pts[f"blocks.{l}.hook_resid_mid"] = _In(b.ln_2, copy_in=True)
            _ln(pts, f"blocks.{l}.ln2", b.ln_2)
            pts[f"blocks.{l}.mlp.hook_pre"] = _Out(b.mlp.c_fc)
            pts[f"blocks.{l}.mlp.hook_post"] = _In(b.mlp.c_proj)
            pts[f"blocks.{l}.hook_mlp_out"] = _Out(b.mlp)
            pts[f"blocks.{l}.hook_resid_post"] = _Out(b)
        _ln(pts, "ln_final", base.ln_f)
    elif fam == "llama":
        _embed_points(pts, base.embed_tokens, None, None, batch)
        for l, b in enumerate(base.layers):
            a = b.self_attn
            cfg = a.config
            H = cfg.num_attention_heads
            Hkv = getattr(cfg, "num_key_value_heads", None) or H
            dh = a.head_dim
            pts[f"blocks.{l}.hook_resid_pre"] = _In(b)
            _ln(pts, f"blocks.{l}.ln1", b.input_layernorm)
            for n, proj, h in (("hook_q", a.q_proj, H), ("hook_k", a.k_proj, Hkv), ("hook_v", a.v_proj, Hkv)):
                pts[f"blocks.{l}.attn.{n}"] = _Out(proj, view=lambda x, h=h: _heads(x, h), unview=_flat)
            _attn(pts, l, a, "rot", ("hook_rot_q", "hook_rot_k", "hook_attn_scores", "hook_pattern", "hook_z"))
            pts[f"blocks.{l}.attn.hook_result"] = _Result(
                a.o_proj, lambda a=a, H=H, dh=dh: a.o_proj.weight.T.reshape(H, dh, -1), lambda a=a: a.o_proj.bias
            )
            pts[f"blocks.{l}.hook_attn_out"] = _Out(a)
            pts[f"blocks.{l}.hook_resid_mid"] = _In(b.post_attention_layernorm, copy_in=True)
            _ln(pts, f"blocks.{l}.ln2", b.post_attention_layernorm)
            pts[f"blocks.{l}.mlp.hook_pre"] = _Out(b.mlp.gate_proj)
            pts[f"blocks.{l}.mlp.hook_pre_linear"] = _Out(b.mlp.up_proj)
            pts[f"blocks.{l}.mlp.hook_post"] = _In(b.mlp.down_proj)
            pts[f"blocks.{l}.hook_mlp_out"] = _Out(b.mlp)
            pts[f"blocks.{l}.hook_resid_post"] = _Out(b)
        _ln(pts, "ln_final", base.norm)
    else:  # bert
        e = base.embeddings
        _embed_points(
            pts,
            e.word_embeddings,
            getattr(e, "position_embeddings", None),
            getattr(e, "token_type_embeddings", None),
            batch,
        )
        for l, b in enumerate(base.encoder.layer):
            s, so = b.attention.self, b.attention.output
            H, dh = s.num_attention_heads, s.attention_head_size
            pts[f"blocks.{l}.hook_resid_pre"] = _In(b)
            _attn(pts, l, s, "qkv", ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"))
            pts[f"blocks.{l}.attn.hook_result"] = _Result(
                so.dense, lambda d=so.dense, H=H, dh=dh: d.weight.T.reshape(H, dh, -1), lambda d=so.dense: d.bias
            )
            pts[f"blocks.{l}.hook_attn_out"] = _Out(so.dense)
            pts[f"blocks.{l}.hook_resid_mid"] = _In(so.LayerNorm)
            _ln(pts, f"blocks.{l}.ln1", so.LayerNorm)
            pts[f"blocks.{l}.mlp.hook_pre"] = _Out(b.intermediate.dense)
            pts[f"blocks.{l}.mlp.hook_post"] = _Out(b.intermediate)
            pts[f"blocks.{l}.hook_mlp_out"] = _Out(b.output.dense)
            pts[f"blocks.{l}.hook_resid_post"] = _In(b.output.LayerNorm)
            _ln(pts, f"blocks.{l}.ln2", b.output.LayerNorm)
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        pts["logits"] = _Out(lm_head)
    if "hook_pos_embed" in pts:  # record B for the (1, N, d) shared position embeddings
        pts["hook_pos_embed"] = _WithBatch(pts["hook_pos_embed"], base, batch)
    return pts


class _WithBatch:
    lazy = False

    def __init__(self, point, base, batch):
        self.point, self.base, self.batch = point, base, batch

    def add(self, fn):
        def pre(mod, args, kwargs):
            ids = args[0] if args else kwargs.get("input_ids")
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            if ids is not None:
                self.batch.B = ids.shape[0]

        h = self.base.register_forward_pre_hook(pre, with_kwargs=True)
        rm = self.point.add(fn)

        def remove():
            rm()
            h.remove()

        return remove


def hf_spec(model) -> dict:
    """The fields of :class:`attnlab.interp.spec.ModelSpec` for a transformers GPT-2 / Llama / BERT model."""
    fam, base = family(model)
    pts = hf_points(model)
    lm_head = getattr(model, "lm_head", None)
    if fam == "gpt2":
        layers, H, norm, final = base.h, base.h[0].attn.num_heads, "layernorm", base.ln_f
    elif fam == "llama":
        layers, H, norm, final = base.layers, base.layers[0].self_attn.config.num_attention_heads, "rmsnorm", base.norm
    else:
        layers, H, norm, final = (
            base.encoder.layer,
            base.encoder.layer[0].attention.self.num_attention_heads,
            "layernorm",
            None,
        )
    W = {l: pts[f"blocks.{l}.attn.hook_result"].W_O for l in range(len(layers))}
    return dict(
        n_layers=len(layers),
        n_heads=H,
        norm=norm,
        additive_resid=fam != "bert",
        has_mlp=True,
        has_pos_embed="hook_pos_embed" in pts,
        has_ln_final=final is not None,
        unembed=None if lm_head is None else lm_head.weight,
        ln_final_weight=None if final is None else final.weight,
        W_O=lambda l: W[l](),
        b_O=lambda l: pts[f"blocks.{l}.attn.hook_result"].b_O(),
    )
