"""How the native kernel is chosen, disabled and built: backend="native" and "auto",
ATTNLAB_NATIVE=0, a failed build (one warning, the flash path), the CPU-feature variants,
and the problems that fall back."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.ops.dispatch import choose_backend as _auto
from attnlab.ops.native import build
from attnlab.ops.native.ops import plan
from tests.ops.conftest import make_qkv, run_case


def _same(a, b):
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(a[key], b[key]), key


def test_disabled_by_env_falls_back_to_flash(monkeypatch):
    """ATTNLAB_NATIVE=0: nothing is built or run; backend="native" gives the flash path's
    bits and auto picks flash where it would pick native."""
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    q, k, v = make_qkv(1, 2, 1, 20, 30, 16)
    m = masks.sliding_window(6)
    s, why = plan(q, k, v, m, None, 10, 0)
    assert s is None and "ATTNLAB_NATIVE=0" in why
    assert build.load() is None and "disabled" in build.status()
    assert _auto(q, k, m, None, 10, 0, True) == "flash"
    _same(run_case(q, k, v, backend="native", mask=m), run_case(q, k, v, backend="flash", mask=m))


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    """No compiler / a failed build: one RuntimeWarning line, never an error."""
    monkeypatch.setattr(build, "_state", {})

    def broken():
        raise RuntimeError("Error building extension 'attnlab_native': c++: not found\nmore lines")

    monkeypatch.setattr(build, "_compile", broken)
    q, k, v = make_qkv(1, 2, 2, 9, 9, 8)
    with pytest.warns(RuntimeWarning, match=r"native CPU attention kernel is unavailable \(Error building"):
        out = run_case(q, k, v, backend="native", mask=masks.causal())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once
        assert build.load() is None
    assert "unavailable" in build.status()
    _same(out, run_case(q, k, v, backend="flash", mask=masks.causal()))


def test_variant_follows_cpu_flags():
    base = {"fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    name, flags = build.variant(frozenset(base | {"avx512_bf16"}))
    assert name == "avx512bf16" and "-mavx512bf16" in flags and "-mavx512f" in flags
    name, flags = build.variant(frozenset(base))
    assert name == "avx512" and "-mavx512bf16" not in flags
    assert build.variant(frozenset({"avx2", "fma"})) == ("avx2", ["-mavx2", "-mfma"])
    assert build.variant(frozenset({"sse2"})) == ("portable", [])
    assert build.cpu_flags("processor : 0\nflags\t\t: fpu sse2 avx2\n") == frozenset({"fpu", "sse2", "avx2"})


def test_auto_picks_native_where_it_would_pick_flash(native_ext):
    q, k, _v = make_qkv(1, 2, 1, 20, 30, 16)
    assert _auto(q, k, masks.sliding_window(6), None, 10, 0, True) == "native"
    assert _auto(q, k, masks.causal() & masks.padding([25]), None, 10, 0, True) == "native"
    # score mods, custom masks and float64 keep the flash path
    assert _auto(q, k, None, scores.softcap(5.0), 10, 0, True) == "flash"
    custom = masks.custom(lambda b, h, qp, kp: kp % 2 == 0)
    assert _auto(q, k, custom, None, 10, 0, True) == "flash"
    assert _auto(q.double(), k.double(), masks.sliding_window(6), None, 10, 0, True) == "flash"


@pytest.mark.parametrize("case", ["score_mod", "custom", "document", "float64", "or"])
def test_unsupported_problems_fall_back(case, native_ext):
    """backend="native" on a problem the kernel does not implement runs the flash path."""
    q, k, v = make_qkv(1, 2, 1, 12, 12, 8)
    kw = {
        "score_mod": {"score_mod": scores.softcap(4.0)},
        "custom": {"mask": masks.custom(lambda b, h, qp, kp: kp != 3)},
        "document": {"mask": masks.document(torch.tensor([0] * 6 + [1] * 6))},
        "float64": {"mask": masks.causal()},
        "or": {"mask": masks.sliding_window(2) | masks.prefix_lm(3)},
    }[case]
    if case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    qo = kw.get("q_offset", 0)
    assert plan(q, k, v, kw.get("mask"), kw.get("score_mod"), qo, 0)[0] is None
    _same(run_case(q, k, v, backend="native", **kw), run_case(q, k, v, backend="flash", **kw))


def test_sink_window_sinks_are_causal(native_ext):
    """sink_window's sinks obey the causal bound (the masks package's ``sinks_right=0``):
    a query before the last sink does not see the later sinks; prefix_lm's sinks are seen
    by every query."""
    q, k, v = make_qkv(1, 2, 1, 8, 8, 16)
    s, _ = plan(q, k, v, masks.sink_window(4, 2), None, 0, 0)
    assert (s.left, s.right, s.sinks, s.sinks_right) == (1, 0, 4, 0)
    assert plan(q, k, v, masks.prefix_lm(4), None, 0, 0)[0].sinks_right is None
    from attnlab.ops.native.ops import native_attention

    out, lse = native_attention(q, k, v, s, scale=0.25, q_offset=0, kv_offset=0)
    ref, rlse = attnlab.attention(
        q, k, v, mask=masks.sink_window(4, 2), scale=0.25, q_offset=0, backend="reference", return_lse=True
    )
    assert (out - ref).abs().max() < 1e-5 and (lse - rlse).abs().max() < 1e-5
    # row 0 sees key 0 only: its output is v[0] exactly
    assert torch.equal(out[0, :, 0], v[0, 0, 0].expand(2, 16))
