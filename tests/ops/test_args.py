"""One argument check for every entry point (ops/args.py): the same bad q/k/v, scale or
offset gets the same error, type and words, from attention, attention_probs, head_stats,
ring/Ulysses attention's check, linear and additive attention."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.distributed.args import check_call
from attnlab.interp.stats import head_stats
from attnlab.ops.additive import additive_attention
from attnlab.ops.linear import linear_attention

B, H, Hkv, N, D = 2, 4, 2, 6, 8
BATCH_HINT = " (k/v may also have batch 1, shared by the batch)"  # only attention() broadcasts k/v batch 1


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, H, N, D, generator=g),
        torch.randn(B, Hkv, N, D, generator=g),
        torch.randn(B, Hkv, N, D, generator=g),
    )


def _additive(q, k, v, **kw):
    A = 5
    return additive_attention(q, k, v, torch.randn(A, D), torch.randn(A, D), torch.randn(A), **kw)


ENTRIES = {  # name -> call(q, k, v, **kw)
    "attention": lambda q, k, v, **kw: attnlab.attention(q, k, v, **kw),
    "attention_probs": lambda q, k, v, **kw: attnlab.attention_probs(q, k, **kw),
    "head_stats": lambda q, k, v, **kw: head_stats(q, k, **kw),
    "ring/ulysses": lambda q, k, v, **kw: check_call(
        "ring_attention",
        q,
        k,
        v,
        mask=None,
        score_mod=None,
        scale=kw.get("scale"),
        layout="contiguous",
        seq_len=None,
        return_lse=False,
        world=1,
    ),
    "linear": lambda q, k, v, **kw: linear_attention(q, k, v),
    "additive": lambda q, k, v, **kw: _additive(q, k, v, **kw),
}
NO_V = {"attention_probs", "head_stats"}  # read no values
OFFSETS = {"attention", "attention_probs", "head_stats", "additive"}
SCALE = {"attention", "attention_probs", "head_stats", "ring/ulysses"}


def _bad(name):
    q, k, v = _qkv()
    return {
        "q_not_tensor": (dict(q=q.tolist()), set(ENTRIES)),
        "k_3d": (dict(k=k[0]), set(ENTRIES) - {"additive"}),  # additive names its dims (B, Hkv, Nk, Dk)
        "k_int": (dict(k=k.long()), set(ENTRIES)),
        "k_dtype_mix": (dict(k=k.double(), v=v.double()), set(ENTRIES)),  # (no-v entry points check k as v)
        "batch": (dict(k=torch.cat([k, k[:1]]), v=torch.cat([v, v[:1]])), set(ENTRIES)),
        "gqa": (dict(q=q[:, :3]), set(ENTRIES)),
        "v_tokens": (dict(v=v[:, :, :3]), set(ENTRIES) - NO_V),
        "head_dim": (dict(k=k[..., :5], v=v[..., :5]), set(ENTRIES) - {"additive"}),  # additive projects q and k
    }[name]


CASES = ["q_not_tensor", "k_3d", "k_int", "k_dtype_mix", "batch", "gqa", "v_tokens", "head_dim"]


@pytest.mark.parametrize("case", CASES)
def test_every_entry_point_words_a_bad_qkv_the_same(case):
    change, entries = _bad(case)
    got = {}
    for name in sorted(entries):
        q, k, v = _qkv()
        args = dict(q=q, k=k, v=v) | change
        with pytest.raises((TypeError, ValueError)) as e:
            ENTRIES[name](args["q"], args["k"], args["v"])
        got[name] = (type(e.value), str(e.value).replace(BATCH_HINT, ""))
    assert len(set(got.values())) == 1, "\n".join(f"{n}: {t.__name__}: {m}" for n, (t, m) in got.items())
    if case == "k_dtype_mix":  # the message names each tensor's dtype
        assert "k torch.float64" in got["attention"][1]


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        (dict(q_offset=1.5), TypeError, "q_offset: expected an int, got float 1.5"),
        (dict(kv_offset=True), TypeError, "kv_offset: expected an int, got bool True"),
        (dict(scale=0.0), ValueError, "scale: expected a finite non-zero number, got 0.0"),
        (dict(scale=float("nan")), ValueError, "scale: expected a finite non-zero number, got nan"),
    ],
)
def test_every_entry_point_words_a_bad_scale_or_offset_the_same(kw, exc, words):
    names = OFFSETS if "scale" not in kw else SCALE
    for name in sorted(names):
        with pytest.raises(exc) as e:
            ENTRIES[name](*_qkv(), **kw)
        assert type(e.value) is exc and str(e.value) == words, f"{name}: {type(e.value).__name__}: {e.value}"


def test_normalize_returns_the_problem():
    from attnlab.ops.args import Problem, normalize

    q, k, v = _qkv()
    p = normalize(q, k, v[..., :3], kv_offset=4)
    assert isinstance(p, Problem)
    assert (p.B, p.H, p.Hkv, p.Nq, p.Nk, p.D, p.Dv) == (B, H, Hkv, N, N, D, 3)
    assert (p.q_offset, p.kv_offset) == (4, 4) and p.scale == 1 / math.sqrt(D)  # bottom-right: kv_offset + Nk - Nq
    p = normalize(q[:, :, :2], k, scale=0.5, q_offset=-3)
    assert (p.q_offset, p.kv_offset, p.scale, p.v is k, p.Dv) == (-3, 0, 0.5, True, D)
