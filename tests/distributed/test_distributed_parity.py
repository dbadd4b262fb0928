"""Ring and Ulysses attention on 2 and 4 gloo ranks equal single-process attention of the
whole sequence: output, LSE and dq/dk/dv (and a score mod's parameter gradient), under
the DESIGN.md rule against the float64 oracle.

Two groups are spawned for the whole module (2 ranks and 4 ranks); each runs every case
of its list and returns its shards, which the tests put back together.
"""

from __future__ import annotations

import pytest
import torch

import attnlab.distributed as D
from tests.distributed._cases import DT, case, case_id, reference, run_cases
from tests.distributed.conftest import check_rule, unshard_results
from tests.helpers import F64_FLOOR

LAYOUTS = ("contiguous", "zigzag", "striped")
MASKS = ("full", "causal", "window7", "doc_causal", "doc")


def _p2_cases():
    cs = []
    for lay in LAYOUTS:  # N = 37: padding for every layout at P = 2
        for m in MASKS:
            cs.append(case(f"ring-{lay}-{m}-N37", "ring", lay, 37, m))
            cs.append(case(f"ulysses-{lay}-{m}-N37", "ulysses", lay, 37, m))
    for method in ("ring", "ulysses"):
        cs += [
            case(f"{method}-zigzag-causal-N64", method, "zigzag", 64, "causal"),
            case(f"{method}-striped-causal-N129-d40", method, "striped", 129, "causal", Dh=40, Dv=24),
            case(f"{method}-zigzag-prefix-N37-mqa", method, "zigzag", 37, "prefix", H=4, Hkv=1),
            case(f"{method}-contiguous-holes-N37-mha", method, "contiguous", 37, "holes", H=2, Hkv=2),
            case(f"{method}-zigzag-keypad-B2-N37", method, "zigzag", 37, "keypad", B=2),
            case(f"{method}-striped-heads-custom-N37", method, "striped", 37, "heads"),
            case(f"{method}-zigzag-causal-alibi-N37", method, "zigzag", 37, "causal", mod="alibi"),
            case(f"{method}-contiguous-causal-f64-N37", method, "contiguous", 37, "causal", dtype="f64"),
            case(f"{method}-zigzag-causal-bf16-N64", method, "zigzag", 64, "causal", dtype="bf16", Dh=32),
        ]
    return cs


def _p4_cases():
    cs = []
    for lay in LAYOUTS:  # N = 37 over 4 ranks: 3 padded slots (7 for zigzag)
        for m in ("causal", "window7", "doc_causal"):
            cs.append(case(f"ring-{lay}-{m}-N37", "ring", lay, 37, m))
    for lay in LAYOUTS:
        cs.append(case(f"ulysses-{lay}-causal-gqa2-N37", "ulysses", lay, 37, "causal"))  # Hkv=2 < P: replicated
    cs += [
        case("ulysses-contiguous-doc-mqa-N37", "ulysses", "contiguous", 37, "doc", H=4, Hkv=1),
        case("ulysses-zigzag-full-h8kv4-N37", "ulysses", "zigzag", 37, "full", H=8, Hkv=4),
        case("ulysses-striped-causal-h8kv8-N64", "ulysses", "striped", 64, "causal", H=8, Hkv=8),
        case("ulysses-contiguous-heads-custom-N37", "ulysses", "contiguous", 37, "heads", H=8, Hkv=2),
        case("ulysses-zigzag-causal-alibi-h8-N37", "ulysses", "zigzag", 37, "causal", H=8, Hkv=2, mod="alibi"),
        case("ring-zigzag-full-N129", "ring", "zigzag", 129, "full"),
        case("ring-contiguous-causal-N64", "ring", "contiguous", 64, "causal"),  # no padding: skipped sends
        case("ring-striped-keypad-B2-N37", "ring", "striped", 37, "keypad", B=2),
        case("ring-zigzag-causal-alibi-N37", "ring", "zigzag", 37, "causal", mod="alibi"),
        case("ring-contiguous-N5-padding-only-ranks", "ring", "contiguous", 5, "causal"),
        case("ulysses-h6-not-divisible", "ulysses", "contiguous", 16, "causal", H=6, Hkv=2),
    ]
    return cs


P2, P4 = _p2_cases(), _p4_cases()
_BAD = {"ulysses-h6-not-divisible"}


@pytest.fixture(scope="module")
def group2():
    return D.run_local(run_cases, 2, P2, timeout=240)


@pytest.fixture(scope="module")
def group4():
    return D.run_local(run_cases, 4, P4, timeout=240)


def _check(results, c):
    dtype = DT[c["dtype"]]
    got = unshard_results(results, c["name"], c)
    check_rule(got, reference(c), reference(c, torch.float64), dtype, c["name"])
    assert got["out"].dtype == dtype
    assert got["lse"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("c", P2, ids=case_id)
def test_two_ranks_equal_single_process(group2, c):
    _check(group2, c)


@pytest.mark.parametrize("c", [c for c in P4 if c["name"] not in _BAD], ids=case_id)
def test_four_ranks_equal_single_process(group4, c):
    _check(group4, c)


def test_padded_rows_give_zero_and_minus_inf(group4):
    # N = 5 over 4 ranks (contiguous): ranks hold [0,1] [2,3] [4,pad] [pad,pad]
    r3 = group4[3]["ring-contiguous-N5-padding-only-ranks"]
    assert torch.equal(r3["out"], torch.zeros_like(r3["out"]))
    assert torch.isneginf(r3["lse"]).all()
    assert r3["fwd"]["computed"] == 0 and r3["fwd"]["bytes_sent"] == 0  # rank 3 has no real token
    assert torch.equal(r3["dq"], torch.zeros_like(r3["dq"]))


def test_causal_contiguous_skips_empty_pairs_and_their_messages(group4):
    # causal, 4 contiguous shards: rank r computes r+1 pairs; shard s is sent 3-s hops (the
    # last rank's shard never moves; nothing ever wraps from rank 3 to rank 0)
    name = "ring-contiguous-causal-N64"
    for r in range(4):
        fwd = group4[r][name]["fwd"]
        assert fwd["computed"] == r + 1
    kv_bytes = group4[0][name]["fwd"]["bytes_sent"]
    assert kv_bytes > 0 and group4[3][name]["fwd"]["bytes_sent"] == 0
    assert [group4[r][name]["fwd"]["bytes_sent"] / kv_bytes for r in range(4)] == [1, 2, 3, 0]


def test_heads_that_do_not_divide_are_refused_clearly(group4):
    for r in range(4):
        err = group4[r]["ulysses-h6-not-divisible"]["error"]
        assert err.startswith("ValueError") and "H=6" in err and "4 ranks" in err and "ring_attention" in err


def test_ranks_that_disagree_all_get_the_same_clear_error(group2):
    msgs = [r["__mismatch__"] for r in group2]
    assert msgs[0] == msgs[1]
    assert "different arguments" in msgs[0] and "seq_len=24" in msgs[0] and "seq_len=23" in msgs[0]


def test_gather_sequence_gives_every_rank_the_whole_sequence_and_sums_gradients(group2):
    for r in group2:
        g = r["__gather__"]
        assert torch.equal(g["full"], g["x"])
        assert torch.allclose(g["grad"], g["want_grad"], **F64_FLOOR)
