"""The built-in score mods inside the native kernel (softcap, ALiBi, relative bias and their
compositions, with masks) against the float64 oracle under DESIGN.md's rule -- output, LSE,
dq/dk/dv and the learnable slopes' / bias table's gradients -- for float32, bfloat16 and
float16, GQA, Nq != Nk, fully masked rows; every case checks that the kernel runs it."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks, scores
from attnlab.ops.native.ops import plan, score_terms
from tests.ops.conftest import compare_backend, make_qkv

R = 6  # relative-bias tables (H, 2R + 1)


def _param(kind, B, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind in ("alibi", "alibi_sym", "alibi&causal"):
        return torch.rand(H, generator=g) * 0.4 + 0.05
    if kind == "alibi_bh":
        return torch.rand(B, H, generator=g) * 0.4 + 0.05
    if kind == "relative_bias":
        return torch.randn(H, 2 * R + 1, generator=g)
    if kind == "compose":  # column 0: ALiBi slopes, the rest: a bias table
        return torch.cat([torch.rand(H, 1, generator=g) * 0.3, torch.randn(H, 2 * R + 1, generator=g)], 1)
    return None


MODS = {
    "softcap": lambda p: scores.softcap(2.5),
    "softcap_twice": lambda p: scores.compose(scores.softcap(4.0), scores.softcap(1.5)),
    "alibi": lambda p: scores.alibi(p),
    "alibi_bh": lambda p: scores.alibi(p),  # per-(batch, head) slopes
    "alibi_sym": lambda p: scores.alibi(p, symmetric=True),
    "relative_bias": lambda p: scores.relative_bias(p),
    "compose": lambda p: scores.compose(scores.alibi(p[:, 0]), scores.relative_bias(p[:, 1:]), scores.softcap(3.0)),
}

L = 1100


def _mask(name, B):
    g = torch.Generator().manual_seed(11)
    if name == "none":
        return None
    if name == "causal":
        return masks.causal()
    if name == "window":
        return masks.sliding_window(9)
    if name == "document&causal":
        return masks.document(torch.randint(0, 6, (B, L), generator=g).sort(-1).values) & masks.causal()
    if name == "key_padding":  # batch 1 keeps no key: fully masked rows
        keep = torch.rand(B, L, generator=g) < 0.7
        keep[B - 1] = False
        return masks.key_padding(keep)
    raise KeyError(name)


#        B  H  Hkv  Nq   Nk    D   Dv  mod              mask
CASES = [
    (1, 2, 1, 1, 1, 40, 40, "softcap", "none"),
    (2, 4, 2, 97, 97, 59, 59, "softcap", "causal"),
    (2, 4, 1, 33, 130, 64, 32, "alibi", "causal"),
    (2, 2, 2, 97, 97, 40, 40, "alibi_bh", "window"),
    (1, 4, 2, 64, 200, 64, 64, "alibi_sym", "none"),
    (2, 4, 2, 97, 130, 40, 56, "relative_bias", "document&causal"),
    (2, 2, 1, 50, 97, 111, 111, "relative_bias", "key_padding"),
    (2, 4, 2, 97, 97, 64, 64, "compose", "causal"),
    (1, 2, 1, 200, 97, 40, 40, "compose", "window"),  # Nq > Nk
    (2, 2, 1, 40, 97, 59, 59, "softcap_twice", "key_padding"),
]


def _id(c):
    B, H, Hkv, Nq, Nk, D, Dv, mod, mask = c
    return f"{B}x{H}:{Hkv}-{Nq}x{Nk}-d{D}v{Dv}-{mod}-{mask}"


def _run(c, dtype):
    B, H, Hkv, Nq, Nk, D, Dv, mod, mask_name = c
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, Dv, dtype=dtype, seed=3)
    mask = _mask(mask_name, B)
    param = _param(mod, B, H)
    factory = MODS[mod]
    s, why = plan(q, k, v, mask, factory(param), Nk - Nq, 0)
    assert s is not None, f"the native kernel does not run this case: {why}"
    fast, _, _ = compare_backend(
        q, k, v, backend="native", mask=mask, mod_factory=factory, param=param, what=f"{_id(c)}-{dtype}"
    )
    if param is not None:
        assert fast["dparam"].abs().sum() > 0, "the parameter got no gradient"
    return fast


@pytest.mark.parametrize("c", CASES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_score_mods_match_oracle(c, dtype, native_ext):
    _run(c, dtype)


@pytest.mark.parametrize("c", [CASES[1], CASES[7]], ids=_id)
def test_native_score_mods_float16(c, native_ext):
    _run(c, torch.float16)


def test_fully_masked_rows_with_mods_are_zero(native_ext):
    """key_padding keeps nothing in the last batch: zeros (not NaN) in the output and every
    gradient, whatever the mod adds; the slopes' gradient comes from the other batch only."""
    fast = _run(CASES[6], torch.float32)
    for key in ("out", "dq", "dk", "dv"):
        assert torch.equal(fast[key][1], torch.zeros_like(fast[key][1])), key
        assert bool(torch.isfinite(fast[key]).all()), key


def test_terms_come_from_lower_not_class_names(native_ext):
    """The kernel reads ScoreMod.lower(): a user mod that lowers to the same terms runs natively
    and gives the built-in's bits; custom and bias mods do not lower."""

    class Capped(scores.ScoreMod):
        def apply(self, score, b, h, q, kv):
            return torch.tanh(score / 2.0) * 2.0

        def lower(self):
            return (scores.ScoreTerm("softcap", value=2.0),)

    assert score_terms(Capped()) == ([1], [2.0], None, None)
    assert isinstance(score_terms(scores.custom(lambda s, *a: s)), str)
    assert isinstance(score_terms(scores.bias(torch.zeros(4, 4), q_offset=0)), str)
    assert isinstance(score_terms(scores.compose(scores.alibi(torch.ones(2)), scores.alibi(torch.ones(2)))), str)
    import attnlab

    q, k, v = make_qkv(1, 2, 1, 20, 20, 16)
    a = attnlab.attention(q, k, v, score_mod=Capped(), backend="native")
    b = attnlab.attention(q, k, v, score_mod=scores.softcap(2.0), backend="native")
    assert torch.equal(a, b)
