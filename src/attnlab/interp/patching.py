"""Activation patching, path patching and attribution patching (TransformerLens' ``patching``).

All three compare a **clean** input (the behaviour works) with a **corrupted** one (it does
not), equal shapes ``(B, N)``, through a scalar ``metric(output)`` of the model's output
(:func:`~attnlab.interp.run_with_hooks`' logits; an encoder's final hidden states).  The
default metric is the logit difference at position ``pos`` (:func:`logit_diff`) between
``answer`` and ``wrong`` tokens — by default the clean and the corrupted run's own top
predictions there.  Results are *denoising* effects, normalised so that 0 is the corrupted
run and 1 the clean one::

    effect = (metric(corrupted run with one activation patched from clean) − m_corrupt)
             / (m_clean − m_corrupt)

* :func:`activation_patching` — one forward per patch: ``site`` (``resid_pre``,
  ``resid_mid``, ``resid_post``, ``attn_out``, ``mlp_out``; per head ``z``, ``result``,
  ``q``, ``k``, ``v``, ``pattern``) patched ``by`` ``"position"`` (axes ``layer × pos``),
  ``"head"`` (``layer × head``, every position) or ``"head_position"``.  Progress bar.
* :func:`path_patching` — the effect of sender heads that travels *only* through the
  receivers' ``q``/``k``/``v`` (Wang et al., 2022): run the corrupted input with the sender
  patched from clean and every other head of the layers in between frozen to its corrupted
  output (MLPs and norms recompute), record the receivers' input, then run the corrupted
  input again with only that input patched in.  Two forwards per sender.
* :func:`attribution_patching` — the first-order approximation from one clean cache and
  one corrupted forward + backward: ``effect ≈ Σ (a_clean − a_corrupt) · ∂metric/∂a``
  (Nanda, 2023), same axes as :func:`activation_patching`; :func:`agreement` is the
  correlation between the two.

Results are :class:`PatchResult`: ``values`` with named ``axes`` (``("layer", "pos")``,
``("layer", "head")`` ...), straight into ``Report.head_grid``.  Layers, heads and positions
take negative indices as Python does.  GQA: patching ``k``/``v`` of head ``h`` patches kv
head ``h // (H // Hkv)``, which every query head of the group reads.

>>> import torch
>>> from attnlab.nn import Decoder, DecoderConfig
>>> model = Decoder(DecoderConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, attn_only=True)).eval()
>>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 5, 4]])
>>> r = activation_patching(model, clean, corrupted, site="resid_pre", answer=3, wrong=5, progress=False)
>>> r.axes, tuple(r.values.shape), round(float(r.values[0, 2]), 4)    # all of layer 0 at pos 2: full restore
(('layer', 'pos'), (2, 4), 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from attnlab.interp.activation_cache import get_act_name, run_with_cache
from attnlab.interp.hooks import run_with_hooks
from attnlab.interp.spec import model_spec

__all__ = [
    "PatchResult",
    "logit_diff",
    "activation_patching",
    "path_patching",
    "attribution_patching",
    "agreement",
    "SITES",
    "HEAD_SITES",
]

#: sites without a head axis: ``(B, N, d_model)``
SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
#: per-head sites: ``(B, N, H, d)`` (``pattern``: ``(B, H, Nq, Nk)``)
HEAD_SITES = ("z", "result", "q", "k", "v", "pattern")


@dataclass
class PatchResult:
    """Effects with named axes: ``values[i, j]`` along ``axes = ("layer", "head")`` etc.;
    ``index[axis]`` lists the layer / head / position each row or column stands for."""

    values: torch.Tensor
    axes: tuple
    index: dict
    site: str
    method: str
    metric_clean: float
    metric_corrupted: float
    normalized: bool = True
    extra: dict = field(default_factory=dict)

    def top(self, k: int = 5) -> list:
        """The ``k`` largest effects: ``[((label per axis...), value)]``, best first (NaN last)."""
        flat = torch.nan_to_num(self.values.flatten().float(), nan=-float("inf"))
        out = []
        for i in flat.argsort(descending=True)[:k].tolist():
            idx = torch.unravel_index(torch.tensor(i), self.values.shape)
            out.append(
                (
                    tuple(self.index[a][int(j)] for a, j in zip(self.axes, idx, strict=True)),
                    float(self.values.flatten()[i]),
                )
            )
        return out

    def __repr__(self) -> str:
        return (
            f"PatchResult({self.method}, site={self.site!r}, axes={self.axes}, shape={tuple(self.values.shape)}, "
            f"metric clean {self.metric_clean:.4g} / corrupted {self.metric_corrupted:.4g}, top={self.top(3)})"
        )


# -- metrics ------------------------------------------------------------------------------
def logit_diff(answer, wrong, pos: int = -1):
    """``metric(logits) = mean_b (logits[b, pos, answer_b] − logits[b, pos, wrong_b])``;
    ``answer``/``wrong``: an int or ``(B,)`` token ids."""

    def metric(logits):
        if logits.dim() != 3:
            raise ValueError(f"metric: logit_diff expects logits (B, N, vocab), got {tuple(logits.shape)}")
        B = logits.shape[0]
        a = torch.as_tensor(answer, device=logits.device).reshape(-1).expand(B)
        w = torch.as_tensor(wrong, device=logits.device).reshape(-1).expand(B)
        row = logits[:, pos]
        row = row if row.dtype == torch.float64 else row.float()
        return (row.gather(1, a[:, None]) - row.gather(1, w[:, None])).mean()

    return metric


def _check_inputs(model, clean, corrupted):
    for name, t in (("clean", clean), ("corrupted", corrupted)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype.is_floating_point:
            raise ValueError(
                f"{name}: expected integer token ids (B, N), got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"clean/corrupted: shapes differ ({tuple(clean.shape)} vs {tuple(corrupted.shape)}); "
            "patching needs aligned positions"
        )


def _default_metric(model, clean, corrupted, answer, wrong, pos, fwd):
    spec = model_spec(model)
    if spec.unembed is None and not _has_lm_head(model):
        raise ValueError(
            f"metric: {type(model).__name__} has no LM head, so there is no logit difference; pass "
            "metric=fn(final_hidden_states) -> scalar (e.g. a similarity to the clean output)"
        )
    if answer is None or wrong is None:
        with torch.no_grad():
            lc = run_with_hooks(model, clean, **fwd)[:, pos].argmax(-1)
            lx = run_with_hooks(model, corrupted, **fwd)[:, pos].argmax(-1)
        answer = lc if answer is None else answer
        wrong = lx if wrong is None else wrong
        a = torch.as_tensor(answer).reshape(-1).expand(clean.shape[0])
        w = torch.as_tensor(wrong).reshape(-1).expand(clean.shape[0])
        if (a.cpu() == w.cpu()).any():
            raise ValueError(
                "answer/wrong: the clean and corrupted runs predict the same token at pos "
                f"{pos} in some rows; pass answer= and wrong= token ids"
            )
    return logit_diff(answer, wrong, pos)


def _has_lm_head(model):
    get = getattr(model, "get_output_embeddings", None)
    return callable(get) and get() is not None


def _run_metric(model, tokens, metric, hooks_, fwd, grad=False):
    with torch.set_grad_enabled(grad):
        m = metric(run_with_hooks(model, tokens, fwd_hooks=hooks_, **fwd))
    if not isinstance(m, torch.Tensor) or m.numel() != 1:
        raise ValueError(
            f"metric: expected a scalar (a 1-element tensor), got "
            f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}"
        )
    return m.reshape(())


# -- index helpers --------------------------------------------------------------------------
def _norm_index(values, n, name):
    if values is None:
        return list(range(n))
    values = [values] if isinstance(values, int) else list(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not -n <= v < n]
    if bad:
        raise ValueError(f"{name}: expected ints in [-{n}, {n}), got {bad}")
    return [v % n for v in values]


def _site(site, by):
    if site not in SITES + HEAD_SITES:
        raise ValueError(f"site: expected one of {SITES + HEAD_SITES}, got {site!r}")
    allowed = ("position",) if site in SITES else ("head", "position", "head_position")
    by = allowed[0] if by is None else by
    if by not in allowed:
        raise ValueError(f"by: site {site!r} can be patched by {allowed}, got {by!r}")
    return by


def _axes_of(site):
    """(pos axis, head axis) of a site's activation."""
    if site == "pattern":
        return 2, 1
    return 1, (2 if site in HEAD_SITES else None)


def _head_slot(site, h, n_act_heads, H):
    """The index along the activation's head axis for query head ``h`` (GQA: its kv head)."""
    return h // (H // n_act_heads) if site in ("k", "v") and n_act_heads != H else h


def _patches(by, layers, positions, heads):
    if by == "position":
        return ("layer", "pos"), [dict(layer=l, pos=p) for l in layers for p in positions]
    if by == "head":
        return ("layer", "head"), [dict(layer=l, head=h) for l in layers for h in heads]
    return ("layer", "pos", "head"), [dict(layer=l, pos=p, head=h) for l in layers for p in positions for h in heads]


def _slicer(site, sel, x, H):
    pa, ha = _axes_of(site)
    sl = [slice(None)] * x.dim()
    if "pos" in sel:
        sl[pa] = sel["pos"]
    if "head" in sel:
        sl[ha] = _head_slot(site, sel["head"], x.shape[ha], H)
    return tuple(sl)


def _replace(clean_act, site, sel, H):
    def fn(x, hook):
        sl = _slicer(site, sel, x, H)
        y = x.clone()
        y[sl] = clean_act[sl].to(device=x.device, dtype=x.dtype)
        return y

    return fn


def _setup(model, clean, corrupted, site, by, metric, answer, wrong, pos, layers, positions, heads, fwd):
    _check_inputs(model, clean, corrupted)
    by = _site(site, by)
    spec = model_spec(model)
    L, H, N = spec.n_layers, spec.n_heads, clean.shape[1]
    layers = _norm_index(layers, L, "layers")
    positions = _norm_index(positions, N, "positions") if by != "head" else []
    heads = _norm_index(heads, H, "heads") if by != "position" else []
    if metric is None:
        metric = _default_metric(model, clean, corrupted, answer, wrong, pos, fwd)
    names = {l: get_act_name(site, l) for l in layers}
    return by, spec, H, layers, positions, heads, metric, names


def _result(values, axes, layers, positions, heads, site, method, mc, mx, normalize, **extra):
    denom = mc - mx
    if normalize:
        if abs(denom) < 1e-12:
            raise ValueError(
                f"metric: clean ({mc:.6g}) and corrupted ({mx:.6g}) give the same value; nothing to "
                "restore (pass normalize=False for raw metric values)"
            )
        values = (values - mx) / denom if method != "attribution" else values / denom
    index = {"layer": layers, "pos": positions, "head": heads}
    return PatchResult(values, axes, {a: index[a] for a in axes}, site, method, mc, mx, normalize, extra)


# -- activation patching ----------------------------------------------------------------------
def activation_patching(
    model,
    clean,
    corrupted,
    *,
    site: str = "resid_pre",
    by: str | None = None,
    metric=None,
    answer=None,
    wrong=None,
    pos: int = -1,
    layers=None,
    positions=None,
    heads=None,
    normalize: bool = True,
    progress: bool = True,
    **forward_kwargs,
) -> PatchResult:
    """Patch one clean activation at a time into the corrupted run (see the module docstring).

    ``by="position"``: ``values [layer, pos]`` (per-head sites: all heads at that position);
    ``"head"``: ``[layer, head]`` (all positions); ``"head_position"``: ``[layer, pos, head]``.
    ``layers``/``positions``/``heads`` restrict the sweep.  ``normalize=False`` gives raw
    metric values.  ``forward_kwargs`` (e.g. ``attention_mask``) go to every forward pass.
    """
    by, _spec, H, layers, positions, heads, metric, names = _setup(
        model, clean, corrupted, site, by, metric, answer, wrong, pos, layers, positions, heads, forward_kwargs
    )
    with torch.no_grad():
        _, cache = run_with_cache(model, clean, names_filter=lambda n: n in names.values(), **forward_kwargs)
        mc = float(_run_metric(model, clean, metric, [], forward_kwargs))
        mx = float(_run_metric(model, corrupted, metric, [], forward_kwargs))
    axes, todo = _patches(by, layers, positions, heads)
    out = torch.empty(len(todo), dtype=torch.float64)
    for i, sel in enumerate(
        tqdm(todo, desc=f"patching {site} by {by}", unit="patch", disable=not progress, leave=False)
    ):
        name = names[sel["layer"]]
        out[i] = _run_metric(model, corrupted, metric, [(name, _replace(cache[name], site, sel, H))], forward_kwargs)
    shape = [len({"layer": layers, "pos": positions, "head": heads}[a]) for a in axes]
    return _result(out.view(shape), axes, layers, positions, heads, site, "activation", mc, mx, normalize)


# -- attribution patching -----------------------------------------------------------------------
def attribution_patching(
    model,
    clean,
    corrupted,
    *,
    site: str = "resid_pre",
    by: str | None = None,
    metric=None,
    answer=None,
    wrong=None,
    pos: int = -1,
    layers=None,
    positions=None,
    heads=None,
    normalize: bool = True,
    **forward_kwargs,
) -> PatchResult:
    """The linear approximation of :func:`activation_patching` (same arguments, same axes):
    ``Σ (a_clean − a_corrupt) · ∂metric/∂a`` at the corrupted run, summed over everything
    the patch covers (batch included), divided by ``m_clean − m_corrupt`` when ``normalize``.
    One clean forward and one corrupted forward + backward, whatever the number of patches."""
    by, _spec, H, layers, positions, heads, metric, names = _setup(
        model, clean, corrupted, site, by, metric, answer, wrong, pos, layers, positions, heads, forward_kwargs
    )
    with torch.no_grad():
        _, cache = run_with_cache(model, clean, names_filter=lambda n: n in names.values(), **forward_kwargs)
        mc = float(_run_metric(model, clean, metric, [], forward_kwargs))
    acts, deltas = {}, {}

    def probe(x, hook):
        d = torch.zeros_like(x, requires_grad=True)  # ∂metric/∂d = ∂metric/∂a; the graph through x stays
        acts[hook.name], deltas[hook.name] = x.detach(), d
        return x + d

    m = _run_metric(model, corrupted, metric, [(n, probe) for n in names.values()], forward_kwargs, grad=True)
    grads = torch.autograd.grad(m, [deltas[n] for n in names.values()], allow_unused=True)
    mx = float(m.detach())
    axes, todo = _patches(by, layers, positions, heads)
    out = torch.empty(len(todo), dtype=torch.float64)
    contrib = {}
    for (l, n), g in zip(names.items(), grads, strict=True):
        c = (cache[n].to(acts[n].dtype) - acts[n]) * (torch.zeros_like(acts[n]) if g is None else g)
        contrib[l] = c
    for i, sel in enumerate(todo):
        c = contrib[sel["layer"]]
        sl = _slicer(site, sel, c, H)
        out[i] = c[sl].sum()
    shape = [len({"layer": layers, "pos": positions, "head": heads}[a]) for a in axes]
    return _result(out.view(shape), axes, layers, positions, heads, site, "attribution", mc, mx, normalize)


def agreement(a, b) -> float:
    """Pearson correlation of two results' values (or tensors) over the entries finite in both."""
    x = (a.values if isinstance(a, PatchResult) else torch.as_tensor(a)).flatten().double()
    y = (b.values if isinstance(b, PatchResult) else torch.as_tensor(b)).flatten().double()
    if x.shape != y.shape:
        raise ValueError(f"agreement: the results have {x.numel()} and {y.numel()} entries; compare equal sweeps")
    ok = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[ok] - x[ok].mean(), y[ok] - y[ok].mean()
    den = x.norm() * y.norm()
    return float((x @ y) / den) if den > 0 else float("nan")


# -- path patching -------------------------------------------------------------------------------
def path_patching(
    model,
    clean,
    corrupted,
    *,
    receivers,
    receiver_input: str = "k",
    senders=None,
    metric=None,
    answer=None,
    wrong=None,
    pos: int = -1,
    normalize: bool = True,
    progress: bool = True,
    **forward_kwargs,
) -> PatchResult:
    """The effect of each sender head on the metric through the ``receiver_input`` (``"q"``,
    ``"k"`` or ``"v"``) of the ``receivers`` ``[(layer, head)]`` only; see the module docstring.

    ``senders``: ``[(layer, head)]`` (default every head of every layer before the first
    receiver layer).  Returns ``values [layer, head]`` over the sender layers (NaN for heads
    not among the senders)."""
    _check_inputs(model, clean, corrupted)
    if receiver_input not in ("q", "k", "v"):
        raise ValueError(f"receiver_input: expected 'q', 'k' or 'v', got {receiver_input!r}")
    spec = model_spec(model)
    L, H = spec.n_layers, spec.n_heads
    recv = _pairs(receivers, L, H, "receivers")
    if not recv:
        raise ValueError("receivers: expected at least one (layer, head)")
    first = min(l for l, _ in recv)
    send = _pairs(senders, L, H, "senders") if senders is not None else [(l, h) for l in range(first) for h in range(H)]
    late = [(l, h) for l, h in send if l >= first]
    if late:
        raise ValueError(f"senders: {late} are not in a layer before the first receiver layer {first}")
    if metric is None:
        metric = _default_metric(model, clean, corrupted, answer, wrong, pos, forward_kwargs)
    z = lambda l: get_act_name("z", l)  # noqa: E731
    inp = {l: get_act_name(receiver_input, l) for l in {l for l, _ in recv}}
    with torch.no_grad():
        _, cc = run_with_cache(model, clean, names_filter=lambda n: n.endswith("attn.hook_z"), **forward_kwargs)
        _, cx = run_with_cache(model, corrupted, names_filter=lambda n: n.endswith("attn.hook_z"), **forward_kwargs)
        mc = float(_run_metric(model, clean, metric, [], forward_kwargs))
        mx = float(_run_metric(model, corrupted, metric, [], forward_kwargs))
    layers = sorted({l for l, _ in send})
    out = torch.full((len(layers), H), float("nan"), dtype=torch.float64)
    for sl, sh in tqdm(
        send, desc=f"path patching → {receiver_input}", unit="sender", disable=not progress, leave=False
    ):

        def sender(x, hook, sl=sl, sh=sh):
            y = cx[z(hook.layer())].to(x.dtype).clone()  # freeze every head of the layer to corrupted ...
            if hook.layer() == sl:
                y[:, :, sh] = cc[z(sl)][:, :, sh].to(x.dtype)  # ... except the sender, from clean
            return y

        rec: dict[str, torch.Tensor] = {}

        def record(x, hook, rec=rec):
            rec[hook.name] = x.detach().clone()

        hooks_a = [(z(l), sender) for l in range(sl, first)] + [(n, record) for n in inp.values()]
        with torch.no_grad():
            run_with_hooks(model, corrupted, fwd_hooks=hooks_a, **forward_kwargs)
        hooks_b = []
        for l, n in inp.items():
            hs = [h for ll, h in recv if ll == l]

            def put(x, hook, hs=hs, rec=rec):
                y = x.clone()
                for h in hs:
                    s = _head_slot(receiver_input, h, x.shape[2], H)
                    y[:, :, s] = rec[hook.name][:, :, s].to(x.dtype)
                return y

            hooks_b.append((n, put))
        out[layers.index(sl), sh] = _run_metric(model, corrupted, metric, hooks_b, forward_kwargs)
    res = _result(out, ("layer", "head"), layers, [], list(range(H)), receiver_input, "path", mc, mx, normalize)
    res.extra["receivers"] = recv
    return res


def _pairs(items, L, H, name):
    out = []
    for it in items:
        if not (
            isinstance(it, (tuple, list))
            and len(it) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in it)
        ):
            raise ValueError(f"{name}: expected (layer, head) int pairs, got {it!r}")
        l, h = it
        if not (-L <= l < L and -H <= h < H):
            raise ValueError(f"{name}: ({l}, {h}) is outside {L} layers × {H} heads")
        out.append((l % L, h % H))
    return out
