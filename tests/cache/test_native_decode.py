"""The native decode kernel (``attnlab::native_paged_decode`` / ``native_quantized_decode``)
through the caches' ``attend``, against their split-KV path (``attend_split``) and the
float64 oracle on the dense equivalent under DESIGN.md's rule (error <= 2x the split-KV
path's, plus FLOOR): ragged lengths crossing block and group boundaries, length 1, GQA
8:2, MQA, evicted prefixes (keys starting after 0), chunks of several queries under
causal masks, windows and sinks at absolute positions, rows that see no key (0 and
-inf), float32 and bfloat16, small forced splits (the LSE merge) and the automatic one."""

from __future__ import annotations

import copy

import pytest
import torch

from attnlab import masks, scores
from attnlab.cache.paged import PagedCache
from attnlab.cache.quantized import QuantizedCache
from attnlab.ops.dispatch import attention
from attnlab.ops.native import build, decode_ops
from tests.helpers import EXACT, assert_close_rule


@pytest.fixture(scope="module")
def native_ext():
    mod = build.load()
    if mod is None:
        pytest.skip(f"the native extension cannot be built here: {build.status()}")
    return mod


@pytest.fixture
def calls(monkeypatch):
    """Counts the native decode calls (to check that the native path really ran)."""
    seen = {"paged": 0, "quantized": 0}
    for name, op in (("paged", "native_paged_decode"), ("quantized", "native_quantized_decode")):
        real = getattr(torch.ops.attnlab, op)

        def spy(*a, _real=real, _name=name):
            seen[_name] += 1
            return _real(*a)

        monkeypatch.setattr(torch.ops.attnlab, op, spy)
    return seen


def rand(*shape, seed, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


LENGTHS = (1, 15, 16, 17, 100, 250)  # around the block size 16; 1 key; several blocks


def paged(dtype, H, Hkv, D, Nq, bs=16):
    """Sequences of LENGTHS grown in turns (tables of non-adjacent blocks), the last one with
    its first two blocks evicted (keys start at 32), then Nq new tokens each: the view."""
    c = PagedCache(1, 64, Hkv, D, block_size=bs, dtype=dtype)
    seqs = [c.add_sequence()[0] for _ in LENGTHS]
    grown = [0] * len(LENGTHS)
    step, seed = 0, 0
    while any(g < L - Nq for g, L in zip(grown, LENGTHS, strict=True)):
        for i, L in enumerate(LENGTHS):
            n = min(L - Nq - grown[i], 7 + step % 5)
            if n > 0:
                seed += 1
                c.select([seqs[i]]).update(
                    0, rand(1, Hkv, n, D, seed=seed, dtype=dtype), rand(1, Hkv, n, D, seed=-seed, dtype=dtype)
                )
                grown[i] += n
        step += 1
    c.evict(seqs[-1], 2)
    c.select(seqs)
    kv = c.update(
        0, rand(len(seqs), Hkv, Nq, D, seed=99, dtype=dtype), rand(len(seqs), Hkv, Nq, D, seed=98, dtype=dtype)
    )
    assert any(t[j + 1] != t[j] + 1 for t, *_ in kv.rows for j in range(len(t) - 1))  # tables with jumps
    return c, seqs, kv


MASKS = {
    "none": lambda B: None,
    "causal": lambda B: masks.causal(),
    "window": lambda B: masks.sliding_window(20),
    "sink_window": lambda B: masks.sink_window(4, 9),
    "causal&padding": lambda B: masks.causal() & masks.padding(torch.tensor([0, 9, 16, 3, 70, 200][:B])),
}


def _row_mask(name, m, b):
    if name == "causal&padding":
        return masks.causal() & masks.padding(m.lower().kv_len[b : b + 1])
    return m


def paged_oracle(c, seqs, kv, q, mask_name, mask):
    outs, lses = [], []
    for b, s in enumerate(seqs):
        k, v, start = c.sequence_kv(s, 0)
        o, lse = attention(
            q[b : b + 1].double(),
            k[None].double(),
            v[None].double(),
            mask=_row_mask(mask_name, mask, b),
            q_offset=kv.q_offsets[b],
            kv_offset=start,
            backend="reference",
            return_lse=True,
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("split", [0, 32], ids=["auto-split", "split32"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize(
    "H, Hkv, D, Nq", [(8, 2, 64, 1), (4, 1, 40, 3), (2, 2, 128, 1)], ids=["gqa8:2", "mqa-nq3", "mha-d128"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_paged_native_matches_split_kv_and_oracle(
    dtype, H, Hkv, D, Nq, mask_name, split, native_ext, calls, monkeypatch
):
    monkeypatch.setattr(decode_ops, "SPLIT", split)
    c, seqs, kv = paged(dtype, H, Hkv, D, Nq)
    q = rand(len(seqs), H, Nq, D, seed=7, dtype=dtype)
    mask = MASKS[mask_name](len(seqs))
    out, lse = kv.attend(q, mask=mask, return_lse=True)
    assert calls["paged"] == 1, "the native paged decode did not run"
    ref, ref_lse = kv.attend_split(q, mask=mask, return_lse=True)
    o64, l64 = paged_oracle(c, seqs, kv, q, mask_name, mask)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (len(seqs), H, Nq, D)
    assert_close_rule(out, ref, o64, dtype, what=f"{mask_name} out")
    assert_close_rule(lse, ref_lse, l64, dtype, what=f"{mask_name} lse")
    dead = torch.isinf(l64)
    assert torch.equal(torch.isinf(lse), dead)
    assert (out[dead] == 0).all()
    if mask_name == "causal&padding":
        assert dead[0].all()  # kv_len 0: the row sees nothing


def test_paged_native_falls_back_where_it_does_not_apply(native_ext, calls):
    _c, seqs, kv = paged(torch.float32, 4, 2, 16, 1)
    q = rand(len(seqs), 4, 1, 16, seed=3, dtype=torch.float32)
    kv.attend(q, score_mod=scores.softcap(5.0))
    kv.attend(q, backend="flash")
    kv.attend(q, mask=masks.document(torch.zeros(len(seqs), 400, dtype=torch.long)))
    kv.attend(q, mask=masks.key_padding(torch.ones(len(seqs), 400, dtype=torch.bool)))
    kv.attend(q.clone().requires_grad_())
    kv.attend(q, scale=torch.tensor(0.3))
    assert calls["paged"] == 0
    with torch.no_grad():
        kv.attend(q.clone().requires_grad_())
    assert calls["paged"] == 1


def test_with_the_extension_disabled_the_caches_take_the_split_kv_path(native_ext, calls, monkeypatch):
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    _c, seqs, kv = paged(torch.float32, 4, 2, 16, 1)
    q = rand(len(seqs), 4, 1, 16, seed=3, dtype=torch.float32)
    torch.testing.assert_close(kv.attend(q, mask=masks.causal()), kv.attend_split(q, mask=masks.causal()), **EXACT)
    view = quantized(torch.float32, 8, 2, 4, 2, 16, 16, 40, 1)
    q = rand(2, 4, 1, 16, seed=3, dtype=torch.float32)
    torch.testing.assert_close(view.attend(q), view.attend_split(q), **EXACT)
    assert calls == {"paged": 0, "quantized": 0}


def test_paged_native_refuses_bad_tables(native_ext):
    c, seqs, kv = paged(torch.float32, 4, 2, 16, 1)
    tables, lens, starts, q_pos = kv.native_args()
    q = rand(len(seqs), 4, 1, 16, seed=3, dtype=torch.float32)
    args = (c.k_pool[0], c.v_pool[0])
    bad = tables.clone()
    bad[-1, 0] = 64
    with pytest.raises(RuntimeError, match="outside the pool's 64 blocks"):
        torch.ops.attnlab.native_paged_decode(q, *args, bad, lens, starts, q_pos, None, 0.25, [0] * 6, 0, 0)
    long = lens.clone()
    long[0] = tables.shape[1] * 16 + 1
    with pytest.raises(
        RuntimeError, match=f"row 0 holds {int(long[0])} keys but its table has {tables.shape[1]} blocks"
    ):
        torch.ops.attnlab.native_paged_decode(q, *args, tables, long, starts, q_pos, None, 0.25, [0] * 6, 0, 0)
    with pytest.raises(RuntimeError, match="not a multiple of kv heads"):
        torch.ops.attnlab.native_paged_decode(q[:, :3], *args, tables, lens, starts, q_pos, None, 0.25, [0] * 6, 0, 0)


# --------------------------------------------------------------------------- quantized cache
def quantized(dtype, bits, B, H, Hkv, D, Dv, T, Nq, G=8):
    c = QuantizedCache(1, bits=bits, group_size=G, residual=G)
    c.update(0, rand(B, Hkv, T, D, seed=1, dtype=dtype), rand(B, Hkv, T, Dv, seed=2, dtype=dtype))
    return c.update(0, rand(B, Hkv, Nq, D, seed=3, dtype=dtype), rand(B, Hkv, Nq, Dv, seed=4, dtype=dtype))


def quantized_dense64(view):
    """The view's keys and values exactly as stored: codes · scale + zero in float64, then the tail."""
    v64 = copy.copy(view)
    v64.dtype = torch.float64
    k, v = v64.dequantize(0, view.n_groups)
    return torch.cat([k, view.k_tail.double()], 2), torch.cat([v, view.v_tail.double()], 2)


QMASKS = {
    "none": lambda B: None,
    "causal": lambda B: masks.causal(),
    "sink_window": lambda B: masks.sink_window(3, 12),
    "causal&padding": lambda B: masks.causal() & masks.padding(torch.tensor([0, 41, 9][:B])),
}


@pytest.mark.parametrize("split", [0, 16], ids=["auto-split", "split16"])
@pytest.mark.parametrize("mask_name", list(QMASKS))
@pytest.mark.parametrize(
    "B, H, Hkv, D, Dv, T, Nq",
    [(2, 8, 2, 64, 64, 100, 1), (3, 4, 1, 40, 24, 61, 3), (1, 2, 2, 16, 16, 1, 1)],
    ids=["gqa8:2", "mqa-nq3-dv24", "one-key"],
)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantized_native_matches_split_kv_and_oracle(
    dtype, bits, B, H, Hkv, D, Dv, T, Nq, mask_name, split, native_ext, calls, monkeypatch
):
    monkeypatch.setattr(decode_ops, "SPLIT", split)
    view = quantized(dtype, bits, B, H, Hkv, D, Dv, T, Nq)
    q = rand(B, H, Nq, D, seed=5, dtype=dtype)
    mask = QMASKS[mask_name](B)
    out, lse = view.attend(q, mask=mask, return_lse=True)
    assert calls["quantized"] == 1, "the native quantized decode did not run"
    ref, ref_lse = view.attend_split(q, mask=mask, return_lse=True)
    k64, v64 = quantized_dense64(view)
    o64, l64 = attention(q.double(), k64, v64, mask=mask, q_offset=view.q_offset, backend="reference", return_lse=True)
    assert out.dtype == dtype and out.shape == (B, H, Nq, Dv)
    assert_close_rule(out, ref, o64, dtype, what=f"int{bits} {mask_name} out")
    assert_close_rule(lse, ref_lse, l64, dtype, what=f"int{bits} {mask_name} lse")
    dead = torch.isinf(l64)
    assert torch.equal(torch.isinf(lse), dead) and (out[dead] == 0).all()


def test_quantized_native_reads_the_stored_state_and_a_window_only_cache(native_ext, calls):
    c = QuantizedCache(1, bits=8, group_size=8)
    k, v = rand(2, 2, 5, 32, seed=1, dtype=torch.float32), rand(2, 2, 5, 32, seed=2, dtype=torch.float32)
    view = c.update(0, k, v)  # fewer than residual + G tokens: nothing quantized yet
    q = rand(2, 4, 1, 32, seed=3, dtype=torch.float32)
    assert view.n_groups == 0
    out = view.attend(q, mask=masks.causal())
    ref = attention(q.double(), k.double(), v.double(), mask=masks.causal(), q_offset=4, backend="reference")
    assert_close_rule(out, view.attend_split(q, mask=masks.causal()), ref, torch.float32)
    for i in range(40):
        c.update(
            0, rand(2, 2, 1, 32, seed=10 + i, dtype=torch.float32), rand(2, 2, 1, 32, seed=-10 - i, dtype=torch.float32)
        )
    stored = c.view(0)  # its queries default to the newest positions
    assert stored.n_groups > 0
    q = rand(2, 4, 2, 32, seed=4, dtype=torch.float32)
    k64, v64 = quantized_dense64(stored)
    o64 = attention(q.double(), k64, v64, mask=masks.causal(), backend="reference")
    assert_close_rule(
        stored.attend(q, mask=masks.causal()), stored.attend_split(q, mask=masks.causal()), o64, torch.float32
    )
    assert calls["quantized"] == 2
