"""The bf16 forward's local packs (forward.h): on a narrow band (a window) the work items are
chunks of 16 q blocks of one (batch, kv head), and each chunk packs the kv blocks it sees into
its thread's own buffers instead of reading one pass's packs of every block.  The same bits as
that pass (ATTNLAB_NATIVE_LOCAL=0) over windows, bands, padding lengths, Nq != Nk, GQA/MQA,
head dims 40/64/111/128, Dv != D and strided K/V; taken exactly where the plan says
(``last_fwd_plan()``: the chunks, 0 where the call packed K and V once); within DESIGN's rule
of the float64 oracle; and the same bits at one and two threads."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from tests.ops.conftest import compare_backend, make_qkv
from tests.ops.native.flex_bf16 import assert_flex_bf16, eager_bf16


@pytest.fixture
def ext(native_ext, monkeypatch):
    """The extension, on the bf16 pairs path (local packs are that path's; forced where the
    build emulates vdpbf16ps, whose bits are the same)."""
    monkeypatch.setenv("ATTNLAB_NATIVE_BF16", "pairs")
    monkeypatch.delenv("ATTNLAB_NATIVE_LOCAL", raising=False)
    assert "(bf16 forward)" in native_ext.features()
    return native_ext


# name: ((B, H, Hkv, Nq, Nk, D, Dv), mask factory, call kwargs, chunks on local packs; None: either)
W256, MHA = masks.sliding_window(256), (1, 2, 2, 2100, 2100, 64, 64)
FAR_Q = (torch.arange(2100) >= 1001).long() * 2  # rows 0-1000: id 0, then id 2
FAR_KV = (torch.arange(2100) >= 300).long() + (torch.arange(2100) >= 1800).long()  # 0 / 1 / 2 from 300, 1800
DOCS = torch.stack([torch.arange(2100) * 5 // 2100, torch.arange(2100) * 3 // 2100])  # per batch row
CASES = {
    "window256": (MHA, lambda B: W256, {}, True),
    "window300 GQA 4:2 D128": ((1, 4, 2, 2048, 2048, 128, 128), lambda B: masks.sliding_window(300), {}, True),
    "window100 MQA D40 B2": ((2, 3, 1, 1500, 1500, 40, 40), lambda B: masks.sliding_window(100), {}, True),
    "window64 D111 Dv64": ((1, 2, 2, 1100, 1100, 111, 64), lambda B: masks.sliding_window(64), {}, True),
    "band(200,100)": (MHA, lambda B: masks.band(200, 100), {}, True),
    "window&padding": ((2, *MHA[1:]), lambda B: W256 & masks.padding(torch.tensor([2100, 1333])), {}, True),
    "window, queries at the end of the keys": ((1, 2, 2, 1500, 3000, 64, 64), lambda B: W256, {}, True),
    "window, explicit offsets": (
        (1, 2, 2, 1200, 1600, 64, 64),
        lambda B: W256,
        {"q_offset": 700, "kv_offset": 100},
        True,
    ),
    "causal (every key: one pass)": (MHA, lambda B: masks.causal(), {}, False),
    "sinks + window (block 0 in every chunk)": (MHA, lambda B: masks.sink_window(4, 256), {}, None),
    "document&window": (MHA, lambda B: masks.document(torch.arange(2100) * 5 // 2100) & W256, {}, None),
    # sorted kv ids: a chunk's blocks are its documents' runs (a causal mask alone sees every key)
    "documents & causal": (MHA, lambda B: masks.document(torch.arange(2100) * 5 // 2100) & masks.causal(), {}, True),
    "per-batch documents & causal": ((2, *MHA[1:]), lambda B: masks.document(DOCS) & masks.causal(), {}, True),
    "documents, q ids != kv ids": (MHA, lambda B: masks.document(DOCS[1], DOCS[0]), {}, True),
    # q block 15 (rows 960-1023) holds q ids 0 and 2, whose key runs are 1500 columns apart: its
    # blocks span the whole of them (the chunk then sees too many for local packs)
    "documents, one q block's runs far apart": (MHA, lambda B: masks.document(FAR_Q, FAR_KV), {}, False),
    "documents, unsorted kv ids": (
        MHA,
        lambda B: masks.document(DOCS[0], DOCS[0][torch.randperm(2100, generator=torch.Generator().manual_seed(0))]),
        {},
        False,
    ),
}


def problem(name, strided=False):
    (B, H, Hkv, Nq, Nk, D, Dv), mf, kw, _ = CASES[name]
    q, k, v = make_qkv(B, H, Hkv, Nq, Nk, D, Dv, dtype=torch.bfloat16, seed=len(name))
    if strided:  # K and V as (B, N, Hkv, D) storage seen as (B, Hkv, N, D): a row stride of Hkv · D
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    return q, k, v, mf(B), kw


def run(q, k, v, mask, kw):
    with torch.no_grad():
        return attnlab.attention(q, k, v, mask=mask, backend="native", return_lse=True, **kw)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided K/V"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_local_packs_give_the_one_pass_bits(ext, name, strided, monkeypatch):
    q, k, v, mask, kw = problem(name, strided)
    out, lse = run(q, k, v, mask, kw)
    chunks = ext.last_fwd_plan()
    expect = CASES[name][-1]
    if expect is not None:
        assert (chunks > 0) == expect, f"{name}: last_fwd_plan() = {chunks}"
    monkeypatch.setenv("ATTNLAB_NATIVE_LOCAL", "off")
    out1, lse1 = run(q, k, v, mask, kw)
    assert ext.last_fwd_plan() == 0
    assert torch.equal(out.view(torch.int16), out1.view(torch.int16)), f"{name}: outputs differ in their bits"
    assert torch.equal(lse, lse1), f"{name}: LSE differs"


@pytest.mark.parametrize(
    "name",
    [
        "window256",
        "window300 GQA 4:2 D128",
        "window&padding",
        "window, explicit offsets",
        "per-batch documents & causal",
    ],
)
def test_local_packs_against_the_oracle(ext, name):
    q, k, v, mask, kw = problem(name)
    compare_backend(q, k, v, backend="native", grad=False, mask=mask, **kw)
    assert ext.last_fwd_plan() > 0


def test_local_packs_same_bits_on_one_and_two_threads(ext):
    q, k, v, mask, kw = problem("window300 GQA 4:2 D128")
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(q, k, v, mask, kw)
        torch.set_num_threads(2)
        two = run(q, k, v, mask, kw)
    finally:
        torch.set_num_threads(n)
    assert ext.last_fwd_plan() > 0
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize("name", ["window256", "window300 GQA 4:2 D128", "documents & causal"])
def test_local_packs_meet_flex_bf16_rule(ext, name):
    """FlexAttention's bf16 rule (test_flex_attention.py's _check_out): the mean error against
    float64 at most 1.1x that of the same-dtype eager reference (every op in bf16), on the
    local-packs route."""
    q, k, v, mask, kw = problem(name)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    i, j = torch.arange(Nq).view(-1, 1), torch.arange(Nk).view(1, -1)
    allowed = mask(torch.tensor(0), torch.tensor(0), i, j).reshape(Nq, Nk).expand(B, H, Nq, Nk)
    out = run(q, k, v, mask, kw)[0]
    assert ext.last_fwd_plan() > 0
    gold = eager_bf16(q.double(), k.double(), v.double(), allowed, 1 / D**0.5)
    eager = eager_bf16(q, k, v, allowed, 1 / D**0.5)
    e_nat = (out.double() - gold).abs().mean().item()
    e_ref = (eager.double() - gold).abs().mean().item()
    assert_flex_bf16(e_nat, e_ref, name)
