import math

import pytest
import torch

from attnlab import scores
from attnlab.positions import (
    ALiBi,
    DynamicNTKScaling,
    LearnedEmbedding,
    LinearScaling,
    Llama3Scaling,
    NTKScaling,
    RoPE,
    SinusoidalEmbedding,
    YaRNScaling,
    alibi_slopes,
    rope_from_hf,
    sinusoidal,
)
from tests.helpers import EXACT, F32_FEW_ULPS, F32_ROPE_FREQ, F32_ROPE_FREQ_RESCALED, F64_FORMULA


def test_alibi_slopes_power_of_two_is_the_papers_geometric_sequence():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_alibi_slopes_other_counts_follow_the_reference_interleaving():
    s12 = alibi_slopes(12)
    assert torch.allclose(s12[:8], alibi_slopes(8))
    assert torch.allclose(s12[8:], alibi_slopes(16)[0::2][:4])
    assert s12.shape == (12,) and (s12 > 0).all()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"])
def test_alibi_slopes_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="n_heads"):
        alibi_slopes(bad)


# ----------------------------------------------------------------------------- RoPE and friends
def _hf():
    return pytest.importorskip("transformers")


def _llama_config(rope_parameters, head_dim=64, max_pos=8192, **kw):
    tf = _hf()
    return tf.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters),
        **kw,
    )


HF_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn_gptoss": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    },
    "yarn_partial": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 1024,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_rope_inv_freq_and_attention_factor_match_transformers(case):
    _hf()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _llama_config(HF_CASES[case], max_pos=65536 if case == "llama3" else 8192)
    kind = cfg.rope_parameters["rope_type"]
    fn = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    inv_freq, af = fn(cfg)
    rope = rope_from_hf(cfg.to_dict(), 64)
    assert rope.inv_freq.dtype == torch.float32 and rope.inv_freq.shape == inv_freq.shape
    assert torch.equal(rope.inv_freq, inv_freq)  # same float32 ops: bit for bit
    assert rope.attention_factor == pytest.approx(af, rel=1e-12)
    assert rope.rotary_dim == 2 * inv_freq.numel()


def test_rope_dynamic_ntk_matches_transformers_above_the_original_length():
    _hf()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _llama_config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, max_pos=4096)
    rope = rope_from_hf(cfg.to_dict(), 64)
    assert rope.scaling == DynamicNTKScaling(2.0, 4096)
    base_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg)  # at init: the unscaled frequencies
    torch.testing.assert_close(rope.inv_freq, base_freq, **F32_ROPE_FREQ)
    for seq_len in (4096, 5000, 20000):
        ref, af = ROPE_INIT_FUNCTIONS["dynamic"](cfg, seq_len=seq_len)
        torch.testing.assert_close(rope.inv_freq_at(seq_len).float(), ref, **F32_ROPE_FREQ_RESCALED)
        assert af == rope.attention_factor == 1.0
    # cos_sin uses the base of the largest position in the call
    pos = torch.arange(19990, 20000)
    c, _ = rope.cos_sin(pos)
    torch.testing.assert_close(c, torch.cos(pos[:, None].float() * rope.inv_freq_at(20000).float()))


@pytest.mark.parametrize("case", ["default", "yarn", "llama3", "dynamic"])
def test_rope_rotation_matches_transformers_apply_rotary_pos_emb(case):
    _hf()
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = HF_CASES.get(case, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    cfg = _llama_config(params, max_pos=65536 if case == "llama3" else 256)
    hf = LlamaRotaryEmbedding(cfg)
    rope = rope_from_hf(cfg.to_dict(), 64)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 64, generator=g), torch.randn(2, 4, 6, 64, generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [290, 291, 292, 293, 294, 295]])
    cos, sin = hf(q, pos)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rope(q, pos), q_ref, **F32_FEW_ULPS)
    torch.testing.assert_close(rope(k, pos), k_ref, **F32_FEW_ULPS)


def _complex_rope(x, pos, inv_freq):
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    ang = pos.double()[:, None] * inv_freq.double()
    return torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)).flatten(-2)


def test_rope_interleaved_matches_the_complex_number_form():
    rope = RoPE(40, base=500.0, interleaved=True)
    x = torch.randn(2, 3, 7, 40, dtype=torch.float64)
    pos = torch.arange(3, 10)
    torch.testing.assert_close(rope(x, pos), _complex_rope(x, pos, rope._freq64), **F64_FORMULA)
    # the half-split form is the same rotation on permuted channels
    perm = torch.cat((torch.arange(0, 40, 2), torch.arange(1, 40, 2)))
    half = RoPE(40, base=500.0)(x[..., perm], pos)
    torch.testing.assert_close(half[..., perm.argsort()], rope(x, pos), **F64_FORMULA)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaling", [None, YaRNScaling(4.0, 64), Llama3Scaling(8.0, 1.0, 4.0, 64)])
def test_rope_scores_depend_only_on_relative_position(interleaved, scaling):
    rope = RoPE(16, interleaved=interleaved, scaling=scaling)
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64),
    )

    def score(m, n):
        return float((rope(q, m) * rope(k, n)).sum())

    for d in (0, 3, -5, 40):
        vals = [score(m, m - d) for m in (50, 100, 1000, 5000) if m - d >= 0]
        assert max(vals) - min(vals) < 1e-9 * (1 + abs(vals[0]))
    assert abs(score(10, 0) - score(0, 10)) > 1e-6  # not symmetric: direction matters


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_offset_equals_the_row_of_the_full_sequence(interleaved):
    rope = RoPE(32, rotary_dim=24, interleaved=interleaved)
    x = torch.randn(2, 3, 9, 32)
    full = rope(x, 0)
    torch.testing.assert_close(rope(x[:, :, -1:], 8), full[:, :, -1:], **F32_FEW_ULPS)
    torch.testing.assert_close(rope(x[:, :, 4:], torch.tensor(4)), full[:, :, 4:], **F32_FEW_ULPS)
    torch.testing.assert_close(rope(x, torch.arange(9)), full, **EXACT)


def test_rope_per_sequence_positions():
    rope = RoPE(16)
    x = torch.randn(3, 2, 5, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4], [1, 1, 1, 2, 3], [7, 8, 9, 10, 11]])  # e.g. left padding
    out = rope(x, pos)
    for b in range(3):
        torch.testing.assert_close(out[b : b + 1], rope(x[b : b + 1], pos[b]), **EXACT)
    c, s = rope.cos_sin(pos)
    assert c.shape == s.shape == (3, 5, 8)


def test_rope_partial_rotary_leaves_the_tail_untouched():
    x = torch.randn(2, 2, 6, 40)
    out = RoPE(40, rotary_dim=10)(x, 3)
    assert torch.equal(out[..., 10:], x[..., 10:])
    torch.testing.assert_close(out[..., :10], RoPE(10)(x[..., :10].contiguous(), 3), **EXACT)
    assert not torch.allclose(out[..., :10], x[..., :10])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_keeps_the_dtype_and_computes_in_float32(dtype):
    rope = RoPE(64, base=1e6)
    x = torch.randn(1, 2, 33, 64, dtype=torch.float64)
    exact = rope(x, 100)  # the float64 path (checked against the complex form above)
    assert exact.dtype == torch.float64
    out = rope(x.to(dtype), 100)
    assert out.dtype == dtype and out.shape == x.shape
    # error <= rounding the input and the output to the dtype, plus the float32 angle error
    # (position * inv_freq rounded in float32: ~ position * eps32 radians)
    ref_err = (exact.to(dtype).double() - exact).abs().max()
    angle_err = 4 * 133 * torch.finfo(torch.float32).eps * x.abs().max()
    assert (out.double() - exact).abs().max() <= 3 * ref_err + angle_err


def test_rope_float64_is_differentiable():
    rope = RoPE(8, rotary_dim=6, scaling=YaRNScaling(4.0, 16))
    x = torch.randn(2, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rope(t, torch.tensor([[0, 1, 2], [7, 8, 9]])), (x,))


def test_rope_preserves_pair_norms_and_inv_freq_stays_float32_after_a_cast():
    rope = RoPE(8, interleaved=True)
    x = torch.randn(4, 2, 50, 8, dtype=torch.float64)
    out = rope(x, 1000)
    pairs = lambda t: t.reshape(*t.shape[:-1], 4, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pairs(out), pairs(x), **F64_FORMULA)
    f = rope.inv_freq.clone()
    rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, f)
    assert "inv_freq" not in rope.state_dict() and not list(rope.parameters())


def test_rope_yarn_scales_cos_and_sin_by_the_attention_factor():
    rope = RoPE(16, scaling=YaRNScaling(16.0, 128))
    assert rope.attention_factor == pytest.approx(0.1 * math.log(16.0) + 1)
    x = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    torch.testing.assert_close(rope(x, 5).norm(dim=-1), x.norm(dim=-1) * rope.attention_factor)
    assert RoPE(16, scaling=YaRNScaling(16.0, 128, attention_factor=1.0)).attention_factor == 1.0


def test_rope_static_scalings():
    base = RoPE(32, base=10000.0).inv_freq
    torch.testing.assert_close(RoPE(32, scaling=LinearScaling(4.0)).inv_freq, base / 4)
    ntk = RoPE(32, scaling=NTKScaling(8.0)).inv_freq
    torch.testing.assert_close(ntk, RoPE(32, base=10000.0 * 8.0 ** (32 / 30)).inv_freq)
    assert ntk[0] == 1.0 and ntk[-1] < base[-1]  # highest frequency kept, lowest stretched
    # linear scaling == dividing the positions
    x = torch.randn(1, 1, 1, 32, dtype=torch.float64)
    torch.testing.assert_close(RoPE(32, scaling=LinearScaling(4.0))(x, 40), RoPE(32)(x, 10))


def test_rope_from_hf_reads_legacy_and_new_layouts():
    legacy = {
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "dynamic", "factor": 2.0},
    }
    r = rope_from_hf(legacy, 128)
    assert (r.base, r.rotary_dim, r.scaling, r.interleaved) == (1e6, 32, DynamicNTKScaling(2.0, 4096), False)
    new = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert rope_from_hf(new, 64).base == 5e5 and rope_from_hf({}, 64).base == 10000.0
    assert rope_from_hf({"rope_scaling": None, "rope_theta": 3.0}, 8).scaling is None


# ----------------------------------------------------------------------------- sinusoidal / learned / ALiBi
def test_sinusoidal_values_follow_the_formula():
    pe = sinusoidal(50, 16, dtype=torch.float64)
    for p, i in [(0, 0), (1, 0), (7, 3), (49, 7)]:
        w = 10000.0 ** (-2 * i / 16)
        assert pe[p, 2 * i] == pytest.approx(math.sin(p * w), abs=1e-14)
        assert pe[p, 2 * i + 1] == pytest.approx(math.cos(p * w), abs=1e-14)
    odd = sinusoidal(10, 7, base=100.0)
    assert odd.shape == (10, 7) and odd.dtype == torch.float32
    for p in range(10):
        for j in range(7):
            ang = p * 100.0 ** (-(j - j % 2) / 7)
            assert odd[p, j].item() == pytest.approx(math.cos(ang) if j % 2 else math.sin(ang), abs=1e-6)
    assert odd[9, 6].item() == pytest.approx(math.sin(9 * 100.0 ** (-6 / 7)), abs=1e-6)  # last column: a sin


def test_sinusoidal_dot_products_depend_only_on_the_offset():
    d = 32
    pe = sinusoidal(300, d, dtype=torch.float64)
    w = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    for k in (0, 1, 5, 100):
        dots = (pe[: 300 - k] * pe[k:]).sum(-1)
        torch.testing.assert_close(dots, torch.full_like(dots, float(torch.cos(k * w).sum())))


def test_sinusoidal_embedding_grows_on_demand_and_has_no_parameters():
    emb = SinusoidalEmbedding(12, max_positions=8)
    assert not list(emb.parameters()) and "table" not in emb.state_dict()
    pos = torch.tensor([[0, 3], [20, 7]])
    out = emb(pos)
    assert out.shape == (2, 2, 12) and emb.table.shape[0] >= 21
    torch.testing.assert_close(out, sinusoidal(21, 12)[pos])
    with pytest.raises(ValueError, match="positions"):
        emb(torch.tensor([-1]))
    with pytest.raises(TypeError, match="positions"):
        emb(torch.tensor([1.0]))


def test_learned_embedding_lookup_gradients_and_range_errors():
    emb = LearnedEmbedding(10, 4)
    assert emb.weight.shape == (10, 4)
    out = emb(torch.tensor([[0, 9]]))
    assert out.shape == (1, 2, 4) and torch.equal(out[0], emb.weight[[0, 9]])
    out.sum().backward()
    assert emb.weight.grad[[0, 9]].eq(1).all() and emb.weight.grad[1:9].eq(0).all()
    for bad in ([10], [-1]):
        with pytest.raises(ValueError, match="max_positions=10"):
            emb(torch.tensor(bad))
    with pytest.raises(TypeError, match="positions"):
        emb(torch.tensor([0.0]))


def test_alibi_class_builds_the_score_mod():
    a = ALiBi(8)
    assert torch.equal(a.slopes, alibi_slopes(8))
    mod = a.score_mod()
    assert isinstance(mod, scores.ScoreMod)
    s = mod(
        torch.zeros(1, 8, 1, 3),
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.arange(8)[None, :, None, None],
        torch.tensor(2).view(1, 1, 1, 1),
        torch.arange(3).view(1, 1, 1, 3),
    )
    torch.testing.assert_close(s[0, :, 0], -alibi_slopes(8)[:, None] * torch.tensor([2.0, 1.0, 0.0]))
    assert torch.equal(ALiBi(2, slopes=torch.tensor([1.0, 0.5])).slopes, torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="slopes"):
        ALiBi(3, slopes=torch.ones(4))


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_head=0), "d_head"),
        (dict(d_head=8.0), "d_head"),
        (dict(d_head=7), "rotary_dim"),
        (dict(d_head=16, rotary_dim=5), "rotary_dim"),
        (dict(d_head=16, rotary_dim=18), "rotary_dim"),
        (dict(d_head=16, base=0.5), "base"),
    ],
)
def test_rope_rejects_bad_shapes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoPE(**kwargs)


@pytest.mark.parametrize(
    "make",
    [
        lambda: LinearScaling(0.0),
        lambda: LinearScaling(-2.0),
        lambda: NTKScaling(0.5),
        lambda: DynamicNTKScaling(0.9, 4096),
        lambda: DynamicNTKScaling(2.0, 0),
        lambda: YaRNScaling(0.5, 4096),
        lambda: YaRNScaling(4.0, 4096, beta_fast=1.0, beta_slow=2.0),
        lambda: YaRNScaling(4.0, 4096, attention_factor=0.0),
        lambda: Llama3Scaling(0.0, 1.0, 4.0, 8192),
        lambda: Llama3Scaling(8.0, 4.0, 1.0, 8192),
    ],
)
def test_scalings_reject_meaningless_factors(make):
    with pytest.raises(ValueError, match=r"factor|beta|original_max_positions"):
        make()


def test_rope_input_errors_name_the_argument():
    rope = RoPE(8)
    with pytest.raises(TypeError, match="scaling"):
        RoPE(8, scaling={"factor": 2.0})
    with pytest.raises(ValueError, match="x must be"):
        rope(torch.randn(2, 5, 8), 0)
    with pytest.raises(TypeError, match="x must be"):
        rope(torch.ones(1, 1, 2, 8, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"positions must have shape"):
        rope(torch.randn(2, 1, 5, 8), torch.arange(4))
    with pytest.raises(ValueError, match=r"positions must have shape"):
        rope(torch.randn(2, 1, 5, 8), torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="positions"):
        rope(torch.randn(1, 1, 5, 8), torch.arange(5.0))
    with pytest.raises(TypeError, match="positions"):
        rope(torch.randn(1, 1, 5, 8), 1.5)
    with pytest.raises(ValueError, match="offset"):
        rope(torch.randn(1, 1, 5, 8), -1)
    with pytest.raises(ValueError, match="NTKScaling needs rotary_dim"):
        RoPE(2, scaling=NTKScaling(2.0))


def test_rope_from_hf_errors():
    with pytest.raises(ValueError, match="supported: default, linear, dynamic, yarn, llama3"):
        rope_from_hf({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, 64)
    with pytest.raises(ValueError, match="'factor'"):
        rope_from_hf({"rope_parameters": {"rope_type": "linear"}}, 64)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        rope_from_hf({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 64)
    with pytest.raises(ValueError, match="per-layer"):
        rope_from_hf(
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "default"},
                }
            },
            64,
        )
    with pytest.raises(TypeError, match="config_dict"):
        rope_from_hf("config.json", 64)
