"""Decoder, Encoder and their configs: caching, padding, tying, attention-only, errors."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab import masks
from attnlab.cache import DynamicCache
from attnlab.nn import Decoder, DecoderConfig, Encoder, EncoderConfig, ModelOutput, mean_pool
from attnlab.positions import LinearScaling, Llama3Scaling, YaRNScaling
from tests.helpers import F32_BACKENDS_DEEP, F32_REORDER

V = 37


def dcfg(**kw):
    base = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=4, d_mlp=32)
    base.update(kw)
    return DecoderConfig(**base)


def ecfg(**kw):
    base = dict(vocab_size=V, d_model=16, n_layers=2, n_heads=4, d_mlp=32)
    base.update(kw)
    return EncoderConfig(**base)


def model(cls, cfg, seed=0):
    torch.manual_seed(seed)
    m = cls(cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so that attention is not ~uniform
        for _name, p in m.named_parameters():
            if p.dim() == 2:
                p.mul_(25.0)
    return m


def ids_of(B, N, seed=1, lo=1):
    return torch.randint(lo, V, (B, N), generator=torch.Generator().manual_seed(seed))


TOL = dict(**F32_BACKENDS_DEEP)  # float32 logits of O(1-10) through 2 layers, different backends

DECODER_KINDS = [
    pytest.param(dict(positions="learned"), id="learned"),
    pytest.param(dict(positions="sinusoidal"), id="sinusoidal"),
    pytest.param(dict(positions="rope"), id="rope"),
    pytest.param(dict(positions="alibi"), id="alibi"),
    pytest.param(dict(positions="none"), id="none"),
    pytest.param(
        dict(
            positions="rope", n_kv_heads=2, norm="rmsnorm", mlp="swiglu", act="silu", bias=False, tie_embeddings=False
        ),
        id="llama-gqa",
    ),
    pytest.param(dict(positions="rope", n_kv_heads=1, rotary_dim=2, rope_interleaved=True), id="mqa-partial-rope"),
    pytest.param(dict(positions="alibi", n_kv_heads=2, norm_position="post"), id="alibi-gqa-post"),
]


# ----------------------------------------------------------------------------- cache
@pytest.mark.parametrize("kw", DECODER_KINDS)
@pytest.mark.parametrize("with_pos", [False, True])
def test_decoder_cache_prefill_then_decode_equals_full_forward(kw, with_pos):
    m = model(Decoder, dcfg(**kw))
    B, N, P = 2, 9, 5
    ids = ids_of(B, N)
    full = m(ids).logits
    cache = DynamicCache.for_model(m.cfg.n_layers)
    pos = torch.arange(N).expand(B, N) if with_pos else None
    outs = [m(ids[:, :P], cache=cache, pos=None if pos is None else pos[:, :P]).logits]
    for t in range(P, N):
        outs.append(m(ids[:, t : t + 1], cache=cache, pos=None if pos is None else pos[:, t : t + 1]).logits)
        assert all(c.seen == t + 1 for c in cache)
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)


def test_decoder_cache_with_per_row_rope_offsets_equals_full_forward():
    m = model(Decoder, dcfg(positions="rope", n_kv_heads=2))
    B, N = 2, 8
    ids = ids_of(B, N)
    pos = torch.arange(N) + torch.tensor([[0], [13]])  # row 1 starts at position 13
    full = m(ids, pos=pos).logits
    # RoPE is relative: the offset of a whole row changes nothing
    torch.testing.assert_close(full, m(ids).logits, **TOL)
    cache = DynamicCache.for_model(2)
    outs = [m(ids[:, :3], cache=cache, pos=pos[:, :3]).logits]
    outs += [m(ids[:, t : t + 1], cache=cache, pos=pos[:, t : t + 1]).logits for t in range(3, N)]
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)


def test_decoder_cache_with_attention_mask_left_padding():
    """Prefill a left-padded batch, then decode one token per row: each row's logits equal the
    row's real tokens run alone (with and without a cache)."""
    for positions in ("rope", "learned", "alibi"):
        m = model(Decoder, dcfg(positions=positions, n_kv_heads=2))
        seqs = [ids_of(1, 7, seed=3)[0], ids_of(1, 4, seed=4)[0]]
        extra = ids_of(2, 2, seed=5)
        N = 7
        ids = torch.zeros(2, N, dtype=torch.long)
        am = torch.zeros(2, N, dtype=torch.bool)
        for b, s in enumerate(seqs):
            ids[b, N - len(s) :] = s
            am[b, N - len(s) :] = True
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache.for_model(2)
        prefill = m(ids, attention_mask=am, pos=pos, cache=cache).logits
        steps = []
        for t in range(2):
            am = torch.cat([am, torch.ones(2, 1, dtype=torch.bool)], 1)
            pos = pos[:, -1:] + 1
            steps.append(m(extra[:, t : t + 1], attention_mask=am, pos=pos, cache=cache).logits)
        steps = torch.cat(steps, 1)
        for b, s in enumerate(seqs):
            alone = m(torch.cat([s, extra[b]])[None]).logits[0]
            torch.testing.assert_close(prefill[b, N - len(s) :], alone[: len(s)], **TOL)
            torch.testing.assert_close(steps[b], alone[len(s) :], **TOL)
        assert torch.isfinite(prefill).all()


@pytest.mark.parametrize("positions", ["rope", "learned", "sinusoidal", "alibi", "none"])
def test_decoder_left_padded_batch_equals_each_sequence_alone(positions):
    m = model(Decoder, dcfg(positions=positions))
    lens = [6, 3, 1]
    N = max(lens)
    seqs = [ids_of(1, n, seed=10 + n)[0] for n in lens]
    ids = torch.zeros(len(lens), N, dtype=torch.long)
    am = torch.zeros(len(lens), N, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, N - len(s) :] = s
        am[b, N - len(s) :] = True
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)  # per-row positions of the real tokens
    out = m(ids, attention_mask=am, pos=pos)
    assert torch.isfinite(out.logits).all(), "padded query rows must not give NaN"
    for b, s in enumerate(seqs):
        alone = m(s[None]).logits[0]
        torch.testing.assert_close(out.logits[b, N - len(s) :], alone, **TOL)


def test_decoder_attention_mask_hides_padding_keys():
    """Changing the token under a padded position changes nothing on the real tokens."""
    m = model(Decoder, dcfg(positions="rope"))
    ids = ids_of(1, 6)
    am = torch.tensor([[False, False, True, True, True, True]])
    a = m(ids, attention_mask=am).logits
    ids2 = ids.clone()
    ids2[0, :2] = (ids2[0, :2] + 5) % V
    b = m(ids2, attention_mask=am).logits
    torch.testing.assert_close(a[:, 2:], b[:, 2:])
    c = m(ids2).logits  # without the mask the pads are attended
    assert (c[:, 2:] - a[:, 2:]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- embeddings and structure
def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = Decoder(dcfg(tie_embeddings=True))
    assert tied.lm_head.weight is tied.embed.weight
    with torch.no_grad():
        tied.embed.weight[3, 0] = 123.0
    assert tied.lm_head.weight[3, 0] == 123.0
    n_tied = sum(p.numel() for p in tied.parameters())
    untied = Decoder(dcfg(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    with torch.no_grad():
        untied.embed.weight[3, 0] = 123.0
    assert untied.lm_head.weight[3, 0] != 123.0
    assert sum(p.numel() for p in untied.parameters()) == n_tied + V * 16
    # the tie survives a state_dict round trip
    t2 = Decoder(dcfg(tie_embeddings=True))
    t2.load_state_dict(tied.state_dict())
    assert t2.lm_head.weight is t2.embed.weight and t2.embed.weight[3, 0] == 123.0


def test_logits_are_the_lm_head_of_the_final_hidden_state():
    m = model(Decoder, dcfg(tie_embeddings=True))
    ids = ids_of(2, 5)
    out = m(ids)
    assert isinstance(out, ModelOutput)
    torch.testing.assert_close(out.logits, out.last_hidden_state @ m.embed.weight.T)


@pytest.mark.parametrize("positions", ["learned", "rope", "none"])
def test_attn_only_has_no_norms_or_mlps_and_is_a_sum_of_attention_outputs(positions):
    m = model(Decoder, dcfg(attn_only=True, positions=positions, n_layers=3))
    names = [n for n, _ in m.named_parameters()]
    assert not any("norm" in n or "mlp" in n for n in names), names
    assert m.norm is None
    assert all(b.norm1 is None and b.norm2 is None and b.mlp is None for b in m.blocks)
    ids = ids_of(2, 6)
    out = m(ids, output_hidden_states=True)
    x = m.embed(ids)
    if m.pos_embed is not None:
        x = x + m.pos_embed(torch.arange(6))
    resid = x
    for b in m.blocks:
        resid = resid + b.attn(resid, mask=masks.causal())
    torch.testing.assert_close(out.last_hidden_state, resid, **F32_REORDER)
    torch.testing.assert_close(out.logits, resid @ m.lm_head.weight.T, **F32_REORDER)
    # the residual stream is exactly the embedding plus every layer's attention output
    deltas = [out.hidden_states[i + 1] - out.hidden_states[i] for i in range(3)]
    torch.testing.assert_close(out.hidden_states[0] + sum(deltas), out.last_hidden_state)


def test_output_hidden_states_and_attentions():
    m = model(Decoder, dcfg(positions="learned", n_layers=3))
    ids = ids_of(2, 5)
    out = m(ids, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 4
    torch.testing.assert_close(out.hidden_states[0], m.embed(ids) + m.pos_embed(torch.arange(5)))
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    # hidden_states[i+1] is block i applied to hidden_states[i] (before the final norm for the last)
    h1, _ = m.blocks[0](out.hidden_states[0], mask=masks.causal())
    torch.testing.assert_close(out.hidden_states[1], h1)
    assert len(out.attentions) == 3
    for w in out.attentions:
        assert w.shape == (2, 4, 5, 5)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5))
        assert (torch.triu(w, 1) == 0).all()
    plain = m(ids)
    assert plain.hidden_states is None and plain.attentions is None
    torch.testing.assert_close(plain.logits, out.logits)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False, n_kv_heads=2),
        dict(attn_only=True, positions="alibi"),
    ],
    ids=["gpt2", "llama", "attn-only"],
)
def test_loss_backward_reaches_every_parameter(kw):
    m = model(Decoder, dcfg(**kw)).train()
    ids = ids_of(2, 7)
    logits = m(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


def test_decoder_llama_defaults_have_no_bias_and_rmsnorm():
    m = Decoder(dcfg(positions="rope", norm="rmsnorm", mlp="swiglu", act="silu", bias=False, tie_embeddings=False))
    assert m.pos_embed is None
    assert not any(n.endswith("bias") for n, _ in m.named_parameters())
    assert type(m.norm).__name__ == "RMSNorm"


# ----------------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "cls, kw",
    [
        (DecoderConfig, dict(positions="rope", rope_scaling=YaRNScaling(4.0, 64, attention_factor=1.2))),
        (DecoderConfig, dict(positions="rope", rope_scaling=LinearScaling(2.0), n_kv_heads=2, rotary_dim=2)),
        (DecoderConfig, dict(positions="rope", rope_scaling=Llama3Scaling(8.0, 1.0, 4.0, 128), attn_only=True)),
        (DecoderConfig, dict()),
        (EncoderConfig, dict(type_vocab_size=0, pooler=False, norm="rmsnorm")),
    ],
)
def test_config_round_trip(cls, kw):
    c = cls(vocab_size=V, d_model=16, n_layers=2, n_heads=4, **kw)
    d = c.to_dict()
    d2 = json.loads(json.dumps(d))  # plain JSON
    back = cls.from_dict(d2)
    assert back == c
    assert type(back.rope_scaling) is type(c.rope_scaling)
    assert back.to_dict() == d
    # and the model built from it has the same structure and output
    M = Decoder if cls is DecoderConfig else Encoder
    a, b = model(M, c, seed=3), model(M, back, seed=3)
    ids = ids_of(1, 5)
    out_a, out_b = a(ids), b(ids)
    torch.testing.assert_close(out_a.last_hidden_state, out_b.last_hidden_state)


def test_config_replace_validates_again():
    c = dcfg()
    c2 = c.replace(n_heads=8, n_kv_heads=None, d_head=None)
    assert (c2.n_heads, c2.n_kv_heads, c2.d_head) == (8, 8, 2) and c.n_heads == 4
    with pytest.raises(ValueError, match="positions"):
        c.replace(positions="relative")


def test_config_defaults():
    c = DecoderConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=4)
    assert (c.n_kv_heads, c.d_head, c.d_mlp, c.norm_position, c.tie_embeddings) == (4, 8, 128, "pre", True)
    e = EncoderConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=4)
    assert (e.norm_position, e.norm_eps, e.max_positions, e.type_vocab_size, e.pooler) == ("post", 1e-12, 512, 2, True)


def test_config_from_dict_errors():
    d = dcfg().to_dict()
    with pytest.raises(ValueError, match=r"unknown fields \['heads'\]"):
        DecoderConfig.from_dict({**d, "heads": 3})
    with pytest.raises(ValueError, match="rope_scaling: unknown type 'Magic'"):
        DecoderConfig.from_dict({**d, "rope_scaling": {"type": "Magic", "factor": 2.0}})
    with pytest.raises(ValueError, match="unknown fields"):
        DecoderConfig.from_dict({**EncoderConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=4).to_dict()})


BAD_FIELDS = [
    ("vocab_size", 0, ValueError),
    ("d_model", -4, ValueError),
    ("n_layers", 0, ValueError),
    ("n_heads", 0, ValueError),
    ("n_heads", 2.0, ValueError),
    ("n_kv_heads", 3, ValueError),
    ("n_kv_heads", 0, ValueError),
    ("d_head", 0, ValueError),
    ("d_mlp", 0, ValueError),
    ("max_positions", 0, ValueError),
    ("positions", "abs", ValueError),
    ("norm", "batchnorm", ValueError),
    ("norm_position", "middle", ValueError),
    ("mlp", "moe", ValueError),
    ("act", "tanh", ValueError),
    ("backend", "cuda", ValueError),
    ("norm_eps", 0.0, ValueError),
    ("norm_eps", float("nan"), ValueError),
    ("rope_base", -1.0, ValueError),
    ("dropout", 1.0, ValueError),
    ("attn_dropout", -0.1, ValueError),
    ("rotary_dim", -2, ValueError),
    ("bias", "yes", TypeError),
    ("rope_interleaved", 1, TypeError),
]


@pytest.mark.parametrize(
    "field, value, exc",
    [*BAD_FIELDS, ("tie_embeddings", "no", TypeError), ("attn_only", None, TypeError), ("final_norm", 0, TypeError)],
)
def test_decoder_config_errors_name_the_field(field, value, exc):
    with pytest.raises(exc) as e:
        dcfg(**{field: value})
    assert field in str(e.value) and "DecoderConfig" in str(e.value)


@pytest.mark.parametrize(
    "field, value, exc",
    [
        *BAD_FIELDS,
        ("type_vocab_size", -1, ValueError),
        ("pad_token_id", -1, ValueError),
        ("pad_token_id", None, ValueError),
    ],
)
def test_encoder_config_errors_name_the_field(field, value, exc):
    with pytest.raises(exc) as e:
        ecfg(**{field: value})
    assert field in str(e.value) and "EncoderConfig" in str(e.value)


def test_config_d_model_not_divisible():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4; set d_head"):
        dcfg(d_model=30)
    assert dcfg(d_model=30, d_head=8).d_head == 8
    m = Decoder(dcfg(d_model=30, d_head=8, positions="rope"))
    assert m(ids_of(1, 3)).logits.shape == (1, 3, V)


def test_encoder_config_pad_token_id_must_be_in_vocab():
    with pytest.raises(ValueError, match="pad_token_id"):
        Encoder(ecfg(pad_token_id=V))


@pytest.mark.parametrize("rd", [0, 3, 6])
def test_config_rotary_dim_is_validated_by_the_config(rd):
    with pytest.raises(ValueError, match=r"DecoderConfig.rotary_dim"):
        dcfg(positions="rope", rotary_dim=rd)  # d_head = 4


def test_config_rope_scaling_must_be_a_scaling():
    with pytest.raises((TypeError, ValueError), match="rope_scaling"):
        dcfg(positions="rope", rope_scaling={"type": "linear", "factor": 2.0})


# ----------------------------------------------------------------------------- decoder errors
@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda m: m(torch.tensor([[1, 2, V]])), ValueError, f"input_ids: token ids must lie in [0, {V})"),
        (lambda m: m(torch.tensor([[-1, 2]])), ValueError, "input_ids"),
        (lambda m: m(torch.tensor([[1.0, 2.0]])), ValueError, "input_ids: expected an integer tensor (B, N)"),
        (lambda m: m(torch.tensor([[True, False]])), ValueError, "input_ids"),
        (lambda m: m(torch.tensor([1, 2, 3])), ValueError, "input_ids: expected an integer tensor (B, N)"),
        (lambda m: m([[1, 2]]), ValueError, "input_ids"),
        (
            lambda m: m(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 4, dtype=torch.bool)),
            ValueError,
            "attention_mask: expected (B=1, 3)",
        ),
        (
            lambda m: m(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(3, dtype=torch.bool)),
            ValueError,
            "attention_mask",
        ),
        (
            lambda m: m(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3) * 0.5),
            TypeError,
            "dtype torch.float32",
        ),
        (
            lambda m: m(torch.tensor([[1, 2, 3]]), cache=DynamicCache.for_model(3)),
            ValueError,
            "cache: expected 2 per-layer caches, got 3",
        ),
        (lambda m: m(torch.tensor([[1, 2, 3]]), pos=torch.arange(4)), ValueError, "pos"),
        (lambda m: m(torch.tensor([[1, 2, 3]]), pos=torch.arange(3.0)), ValueError, "pos"),
    ],
)
def test_decoder_forward_errors(call, exc, words):
    m = Decoder(dcfg())
    with pytest.raises(exc) as e:
        call(m)
    assert words in str(e.value)


def test_decoder_pos_with_wrong_batch_is_rejected():
    m = Decoder(dcfg())
    with pytest.raises(ValueError, match="pos"):
        m(torch.ones(2, 3, dtype=torch.long), pos=torch.arange(3).expand(3, 3))


def test_decoder_pos_with_one_row_broadcasts():
    m = model(Decoder, dcfg())
    ids = ids_of(2, 4)
    torch.testing.assert_close(m(ids, pos=torch.arange(4)[None]).logits, m(ids).logits)


def test_decoder_attention_mask_must_cover_cached_tokens():
    m = Decoder(dcfg(positions="rope"))
    cache = DynamicCache.for_model(2)
    m(ids_of(1, 4), cache=cache)
    with pytest.raises(ValueError, match=r"attention_mask: expected \(B=1, 5\) covering cached and new tokens"):
        m(ids_of(1, 1), cache=cache, attention_mask=torch.ones(1, 1, dtype=torch.bool))


def test_model_rejects_wrong_config_type():
    with pytest.raises(TypeError, match="DecoderConfig"):
        Decoder(ecfg())
    with pytest.raises(TypeError, match="EncoderConfig"):
        Encoder(dcfg())


def test_learned_positions_beyond_max_positions_error():
    m = Decoder(dcfg(max_positions=8))
    with pytest.raises(ValueError, match="max_positions"):
        m(ids_of(1, 9))


# ----------------------------------------------------------------------------- encoder
ENCODER_KINDS = [
    pytest.param(dict(), id="bert"),
    pytest.param(
        dict(positions="rope", norm_position="pre", norm="rmsnorm", mlp="swiglu", n_kv_heads=2), id="rope-pre"
    ),
    pytest.param(dict(positions="sinusoidal", type_vocab_size=0, pooler=False), id="sinusoidal"),
]


@pytest.mark.parametrize("kw", ENCODER_KINDS)
def test_encoder_padding_invariance_right_padding(kw):
    enc = model(Encoder, ecfg(**kw))
    lens = [7, 4, 1]
    N = max(lens)
    seqs = [ids_of(1, n, seed=20 + n)[0] for n in lens]
    ids = torch.zeros(3, N, dtype=torch.long)  # pad id 0
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
    am = ids != 0
    out = enc(ids, attention_mask=am)
    assert torch.isfinite(out.last_hidden_state).all()
    for b, s in enumerate(seqs):
        alone = enc(s[None])
        torch.testing.assert_close(out.last_hidden_state[b, : len(s)], alone.last_hidden_state[0], **TOL)
        if alone.pooled is not None:
            torch.testing.assert_close(out.pooled[b], alone.pooled[0], **TOL)
        pooled = mean_pool(out.last_hidden_state, am)[b]
        torch.testing.assert_close(pooled, alone.last_hidden_state[0].mean(0), **TOL)
    # without the mask, the padding is attended and the short rows change
    unmasked = enc(ids).last_hidden_state
    assert (unmasked[1, :4] - out.last_hidden_state[1, :4]).abs().max() > 1e-3


def test_encoder_is_bidirectional():
    enc = model(Encoder, ecfg())
    ids = ids_of(1, 5)
    a = enc(ids).last_hidden_state
    ids2 = ids.clone()
    ids2[0, -1] = (ids2[0, -1] + 1) % V
    b = enc(ids2).last_hidden_state
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-4  # the first token sees the last


def test_encoder_alibi_is_symmetric():
    enc = model(Encoder, ecfg(positions="alibi", n_layers=1))
    with torch.no_grad():
        a = enc.blocks[0].attn
        a.W_Q.zero_()
        a.b_Q.zero_()  # scores are the ALiBi bias alone
    w = enc(ids_of(1, 7), output_attentions=True).attentions[0][0]  # (H, 7, 7)
    # query 3: keys at distance d to the left and right weigh the same, nearer keys weigh more
    torch.testing.assert_close(w[:, 3, :3].flip(-1), w[:, 3, 4:])
    assert (w[:, 3, 3] > w[:, 3, 4]).all()


def test_mean_pool_ignores_pads():
    h = torch.randn(2, 5, 3)
    am = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    got = mean_pool(h, am)
    torch.testing.assert_close(got[0], h[0, :3].mean(0))
    assert (got[1] == 0).all() and torch.isfinite(got).all()
    h2 = h.clone()
    h2[0, 3:] = 1e6
    torch.testing.assert_close(mean_pool(h2, am)[0], got[0])
    torch.testing.assert_close(mean_pool(h), h.mean(1))
    torch.testing.assert_close(mean_pool(h, am.bool()), got)


def test_encoder_token_types():
    enc = model(Encoder, ecfg())
    ids = ids_of(2, 5)
    a = enc(ids).last_hidden_state
    torch.testing.assert_close(enc(ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state, a)
    tt = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert (enc(ids, token_type_ids=tt).last_hidden_state - a).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"token_type_ids: expected \(2, 5\), got \(2, 4\)"):
        enc(ids, token_type_ids=torch.zeros(2, 4, dtype=torch.long))


def test_encoder_hidden_states_and_errors():
    enc = model(Encoder, ecfg(n_layers=3))
    ids = ids_of(2, 4)
    out = enc(ids, output_hidden_states=True, output_attentions=True)
    assert out.logits is None
    assert len(out.hidden_states) == 4 and len(out.attentions) == 3
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    assert out.pooled.shape == (2, 16)
    torch.testing.assert_close(out.pooled, torch.tanh(enc.pooler(out.last_hidden_state[:, 0])))
    for w in out.attentions:
        assert w.shape == (2, 4, 4, 4)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 4))
    # bidirectional: every key visible (default init, so nothing saturates to 0)
    for w in Encoder(ecfg()).eval()(ids, output_attentions=True).attentions:
        assert (w > 0).all()
    with pytest.raises(ValueError, match="attention_mask"):
        enc(ids, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="input_ids"):
        enc(ids + V)


def test_encoder_backward_reaches_every_parameter():
    enc = model(Encoder, ecfg(dropout=0.1, attn_dropout=0.1)).train()
    ids = ids_of(2, 6)
    out = enc(
        ids,
        attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]),
        token_type_ids=torch.tensor([[0, 0, 0, 1, 1, 1]] * 2),
    )
    (out.last_hidden_state.pow(2).mean() + out.pooled.sum()).backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


def test_replace_derives_defaulted_fields_again():
    c = DecoderConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=4)
    r = c.replace(d_model=32, n_heads=2)
    assert (r.d_mlp, r.d_head, r.n_kv_heads) == (128, 16, 2)
    pinned = DecoderConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=4, d_mlp=50)
    assert pinned.replace(d_model=32).d_mlp == 50  # a value the user set stays


def test_encoder_alibi_symmetric_flag_reaches_the_score_mod():
    enc = Encoder(EncoderConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=4, positions="alibi"))
    dec = Decoder(DecoderConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=4, positions="alibi"))
    assert enc.blocks[0].attn.positions.symmetric and not dec.blocks[0].attn.positions.symmetric
