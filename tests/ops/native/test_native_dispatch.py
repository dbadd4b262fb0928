"""How the native kernel is chosen, disabled and built: backend="native" and "auto",
ATTNLAB_NATIVE=0, a failed build (one warning, the flash path), the CPU-feature variants,
and the problems that fall back."""

from __future__ import annotations

import warnings
from pathlib import Path

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


def test_headers_name_every_header_of_the_kernel_folder():
    # the build hashes every *.h of the folder; HEADERS names them, and each is included
    here = Path(build.__file__).parent
    assert build.HEADERS == tuple(sorted(p.name for p in here.glob("*.h")))
    text = "".join((here / name).read_text() for name in (*build.SOURCES, *build.HEADERS))
    for name in build.HEADERS:
        assert f'#include "{name}"' in text, name


def test_auto_picks_native_where_it_would_pick_flash(native_ext):
    q, k, _v = make_qkv(1, 2, 1, 20, 30, 16)
    assert _auto(q, k, masks.sliding_window(6), None, 10, 0, True) == "native"
    assert _auto(q, k, masks.causal() & masks.padding([25]), None, 10, 0, True) == "native"
    # document ids and key padding are evaluated inside the kernel too
    ids = torch.tensor([0] * 14 + [1] * 16)
    assert _auto(q, k, masks.document(ids), None, 10, 0, True) == "native"
    assert _auto(q, k, masks.document(ids) & masks.causal(), None, 10, 0, True) == "native"
    assert _auto(q, k, masks.key_padding((torch.arange(30) % 3 > 0)[None]), None, 10, 0, True) == "native"
    # and the built-in score mods (softcap, ALiBi, relative bias, their compositions)
    assert _auto(q, k, None, scores.softcap(5.0), 10, 0, True) == "native"
    slopes, table = torch.tensor([0.5, 0.25]), torch.zeros(2, 9)
    assert _auto(q, k, masks.causal(), scores.alibi(slopes), 10, 0, True) == "native"
    mod = scores.compose(scores.relative_bias(table), scores.softcap(5.0))
    assert _auto(q, k, masks.document(ids), mod, 10, 0, True) == "native"
    # varlen's band positions and per-batch query shifts are read by the kernel too
    cu = torch.tensor([0, 8, 20])
    assert _auto(q, k[:, :, :20], masks.varlen(cu, cu, window=(None, 0)), None, 0, 0, True) == "native"
    shifted = masks.per_batch_q_offset(masks.causal(), torch.tensor([3]))
    assert _auto(q, k, shifted, None, 0, 0, True) == "native"
    # masks with no structure (custom, tree, |, ~) and dense ones through a BlockMask's tiles
    custom = masks.custom(lambda b, h, qp, kp: kp % 2 == 0)
    assert _auto(q, k, custom, None, 10, 0, True) == "native"
    assert _auto(q, k, masks.sliding_window(2) | masks.prefix_lm(3), None, 10, 0, True) == "native"
    assert _auto(q, k, ~masks.causal(), None, 10, 0, True) == "native"
    # custom score mods, additive biases and float64 keep the flash path
    assert _auto(q, k, None, scores.custom(lambda s, b, h, qp, kp: s * 0.5), 10, 0, True) == "flash"
    assert (
        _auto(q, k, None, scores.compose(scores.softcap(5.0), scores.custom(lambda s, *a: s)), 10, 0, True) == "flash"
    )
    assert _auto(q.double(), k.double(), masks.sliding_window(6), None, 10, 0, True) == "flash"


@pytest.mark.parametrize(
    "dtype, Nq, Nk, grad, mask, want",
    [
        (torch.float32, 128, 128, False, None, "native"),  # dense: SDPA maps it, native measured faster
        (torch.float32, 128, 128, True, "causal", "native"),
        (torch.float32, 127, 4096, False, None, "sdpa"),  # fewer query rows: SDPA's per-call cost wins
        (torch.float32, 1, 16384, False, None, "native"),  # a decode step: the decode kernel (dense_decode)
        (torch.float32, 1, 16384, True, None, "sdpa"),  # ... unless a gradient is wanted
        (torch.float32, 5, 4096, False, None, "sdpa"),  # more rows than a decode step
        (torch.float32, 1, 256, False, None, "sdpa"),  # a short float32 decode step: SDPA as cheap
        (torch.bfloat16, 1, 256, False, None, "native"),  # a short bf16 decode step (below 1024 pairs)
        (torch.float16, 1, 1024, False, None, "sdpa"),  # unmeasured: torch's kernel
        (torch.bfloat16, 32, 32, True, "causal", "native"),  # 1024 pairs
        (torch.bfloat16, 1, 1024, False, None, "native"),  # a bf16 decode step: torch's bf16 SDPA is slow
        (torch.bfloat16, 31, 32, True, None, "sdpa"),  # fwd+bwd below 1024 pairs
        (torch.float16, 256, 256, False, None, "sdpa"),  # unmeasured: torch's kernel
    ],
)
def test_auto_picks_native_over_sdpa_from_the_measured_sizes(dtype, Nq, Nk, grad, mask, want, native_ext):
    q, k, _v = make_qkv(1, 2, 2, Nq, Nk, 64, dtype=dtype)
    q.requires_grad_(grad)
    m = masks.causal() if mask == "causal" else None
    assert _auto(q, k, m, None, 0, 0, False) == want


def test_auto_keeps_sdpa_where_the_kernel_is_off(monkeypatch):
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    q, k, _v = make_qkv(1, 2, 2, 256, 256, 64)
    assert _auto(q, k, None, None, 0, 0, False) == "sdpa"


@pytest.mark.parametrize("case", ["score_mod", "float64", "bias"])
def test_unsupported_problems_fall_back(case, native_ext):
    """backend="native" on a problem the kernel does not implement runs the flash path."""
    q, k, v = make_qkv(1, 2, 1, 12, 12, 8)
    kw = {
        "score_mod": {"score_mod": scores.custom(lambda s, b, h, qp, kp: s * 0.5)},
        "bias": {"score_mod": scores.bias(torch.randn(12, 12), q_offset=0)},
        "float64": {"mask": masks.causal()},
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


@pytest.mark.parametrize(
    "mask",
    [
        masks.document(torch.tensor([0] * 7 + [1] * 20 + [2] * 3)),
        masks.key_padding((torch.arange(30) % 4 != 1).expand(2, 30)) & masks.sliding_window(5),
        masks.document(torch.tensor([[0] * 10 + [1] * 20, [0] * 25 + [1] * 5])) & masks.causal(),
    ],
    ids=["document", "key_padding&window", "document&causal"],
)
def test_document_and_key_padding_run_native(mask, native_ext):
    """backend="native" and auto run these masks in the kernel: the same bits as the
    kernel called directly, and the float64 reference's values."""
    from attnlab.ops.native.ops import native_attention

    q, k, v = make_qkv(2, 4, 2, 30, 30, 16)
    s, why = plan(q, k, v, mask, None, 0, 0)
    assert s is not None, why
    out, lse = native_attention(q, k, v, s, scale=0.25, q_offset=0, kv_offset=0)
    for backend in ("native", "auto"):
        got, glse = attnlab.attention(q, k, v, mask=mask, scale=0.25, q_offset=0, backend=backend, return_lse=True)
        assert torch.equal(got, out) and torch.equal(glse, lse), backend
    ref, rlse = attnlab.attention(
        q.double(), k.double(), v.double(), mask=mask, scale=0.25, q_offset=0, backend="reference", return_lse=True
    )
    assert (out - ref).abs().max() < 1e-5 and (lse - rlse).abs().max() < 1e-5


def test_key_padding_fully_masked_rows_are_zero(native_ext):
    """A batch row with no kept key: output and every gradient exactly 0 (never NaN), LSE -inf;
    the other batch row is untouched."""
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1] = False
    mask = masks.key_padding(keep) & masks.causal()
    q, k, v = make_qkv(2, 2, 1, 40, 40, 24, dtype=torch.bfloat16)
    assert plan(q, k, v, mask, None, 0, 0)[0] is not None
    r = run_case(q, k, v, backend="native", mask=mask)
    assert torch.equal(r["out"][1], torch.zeros_like(r["out"][1]))
    assert bool((r["lse"][1] == float("-inf")).all())
    for key in ("dq", "dk", "dv"):
        assert torch.equal(r[key][1], torch.zeros_like(r[key][1])), key
        assert bool(torch.isfinite(r[key]).all()), key
    assert bool((r["out"][0].abs().sum(-1) > 0).all())
