"""A rank that hangs or dies makes the others raise a clear error within the timeout.

One group of six ranks, split into three pairs (subgroups, so the group path of the
point-to-point code is exercised too), each pair failing in its own way; see
``tests/distributed/_cases.py:failing_group``.
"""

from __future__ import annotations

import pytest

import attnlab.distributed as D
from tests.distributed._cases import failing_group

T = 1.5  # seconds: the timeout of the calls that must time out


@pytest.fixture(scope="module")
def res():
    out = D.run_local(failing_group, 6, T, timeout=90, return_errors=True)
    for r in (1, 3):  # they died (os._exit) without a result
        assert isinstance(out[r], D.RankError) and "without a result" in str(out[r])
    return out


def test_a_dead_peer_is_reported_at_once_not_after_the_timeout(res):
    kind, msg, took = res[0][0]
    assert kind == "PeerFailureError", msg
    assert took < 20  # the call's timeout was 60 s; rank 1 died after 2 T
    assert "ring_attention: rank 0" in msg and "exited or crashed" in msg


def test_a_peer_that_hangs_mid_ring_times_out_naming_the_message(res):
    kind, msg, took = res[2][0]
    assert kind == "PeerTimeoutError", msg
    assert T <= took < T + 5
    assert "ring_attention: rank 0 waited 1.5 s for" in msg and "K/V shard" in msg and "rank 1" in msg
    assert "timeout=" in msg and "set_timeout" in msg


def test_after_a_timeout_the_group_is_reported_unusable_at_once(res):
    kind, msg, took = res[2][1]
    assert kind == "PeerTimeoutError", msg
    assert took < 5 and "earlier timeout" in msg and "destroy the process group" in msg


def test_a_peer_that_never_calls_times_out_in_the_handshake(res):
    kind, msg, took = res[4][0]
    assert kind == "PeerTimeoutError", msg
    assert T <= took < T + 5
    assert "ulysses_attention" in msg and "handshake" in msg


def test_timeout_arguments_are_checked():
    with pytest.raises(ValueError, match="timeout"):
        D.failure.resolve_timeout(0)
    with pytest.raises(ValueError, match="set_timeout"):
        D.set_timeout(-1)
    old = D.get_timeout()
    try:
        D.set_timeout(12)
        assert D.get_timeout() == 12.0 and D.failure.resolve_timeout(None) == 12.0
    finally:
        D.set_timeout(old)


def test_errors_are_translated_by_kind():
    tr = D.failure.translate
    kw = dict(op="ring_attention", rank=0, peer=1, what="the K/V shard", timeout_s=2.0)
    assert isinstance(tr(RuntimeError("Timed out waiting 2000ms for recv"), **kw), D.PeerTimeoutError)
    assert isinstance(tr(RuntimeError("Connection closed by peer [127.0.0.1]"), **kw), D.PeerFailureError)
    e = tr(RuntimeError("something else"), **kw)
    assert type(e) is D.DistributedAttentionError and "something else" in str(e)
    assert isinstance(tr(RuntimeError("timed out"), **kw), TimeoutError)


def test_no_process_group_is_a_clear_error():
    import torch

    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        D.ring_attention(q, q, q)
