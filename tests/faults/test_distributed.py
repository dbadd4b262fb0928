"""Faults across processes (issue 13, `attnlab.distributed`): real gloo ranks that die,
and ranks that call with different arguments.

* **Deaths.** Two spawned groups of 16 ranks, split into pairs (subgroups); in each
  pair one rank kills itself (``os._exit`` or ``SIGKILL``) at one point of ring,
  zigzag-ring or Ulysses attention — before it posts the messages of a forward or
  backward ring step, right after posting them, before a collective — while its
  partner is slowed down just before the same point (as if it were still computing
  the previous step), so that the partner posts to a peer that is already gone.  The
  survivor must raise ``PeerFailureError`` / ``PeerTimeoutError`` naming its rank, the
  dead peer and the step (ring step or collective), within bounded time.
* **Mismatches.** One group of 2 ranks runs every case in turn: the ranks call with
  shards of problems that differ in one field (mask parameter, score-mod parameter,
  scale, dtype, shape, ...); both must raise the same ``ValueError`` naming the field,
  and the group must stay usable for the next case.

Contracts: docs/reliability/distributed.md.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import signal
import time

import pytest
import torch

import attnlab.distributed as D
from attnlab import masks, scores

T = 6.0  # seconds: the timeout of every call here (a death is noticed at once; this bounds a miss)
BOUND = 25.0  # seconds a survivor may take to report (T plus slack for 16 processes on 2 busy cores)
DELAY = 0.4  # seconds the survivor is held back before the point where its partner dies
N, B, H, HKV, DH = 16, 1, 2, 1, 8


def _me():
    """This module under the name the spawned ranks can import (pytest may import it as
    ``test_distributed``)."""
    return importlib.import_module("tests.faults.test_distributed")


def _tensors(rank, world, layout="contiguous", dtype=torch.float32, h=H, d=DH, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, N, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, HKV, N, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, HKV, N, d, generator=g, dtype=torch.float64).to(dtype)
    return [D.shard_sequence(x, dim=2, layout=layout, rank=rank, world_size=world) for x in (q, k, v)]


# ----------------------------------------------------------------------------- deaths
# (name, method, layout, Comm method to instrument, its call index, die after the call?)
# Ring, P = 2: Comm.start is called once per step: forward steps 0, 1, then backward
# steps 0, 1, 2 (calls 0..4).  Ulysses: all_gather 0 is the handshake; all_to_all calls
# are q/k/v, output, LSE (forward), then the LSE, output, q/k/v gradients (backward).
DEATHS = [
    ("ring-before-forward-step-0", "ring", "contiguous", "start", 0, False),
    ("ring-before-forward-step-1", "ring", "contiguous", "start", 1, False),
    ("ring-before-backward-step-0", "ring", "contiguous", "start", 2, False),
    ("ring-before-backward-step-1", "ring", "contiguous", "start", 3, False),
    ("ring-before-backward-step-2", "ring", "contiguous", "start", 4, False),
    ("ring-after-posting-forward-step-0", "ring", "contiguous", "start", 0, True),
    ("ring-after-posting-backward-step-1", "ring", "contiguous", "start", 3, True),
    ("zigzag-before-forward-step-1", "ring", "zigzag", "start", 1, False),
    ("zigzag-before-backward-step-1", "ring", "zigzag", "start", 3, False),
    ("handshake-ulysses", "ulysses", "contiguous", "all_gather", 0, False),
    ("ulysses-before-qkv-all-to-all", "ulysses", "contiguous", "all_to_all", 0, False),
    ("ulysses-before-output-all-to-all", "ulysses", "contiguous", "all_to_all", 1, False),
    ("ulysses-before-lse-all-to-all", "ulysses", "contiguous", "all_to_all", 2, False),
    ("ulysses-before-backward-lse-all-to-all", "ulysses", "zigzag", "all_to_all", 3, False),
    ("ulysses-before-backward-output-all-to-all", "ulysses", "zigzag", "all_to_all", 4, False),
    ("ulysses-before-backward-qkv-all-to-all", "ulysses", "zigzag", "all_to_all", 5, False),
]
PAIRS_PER_GROUP = 8  # 16 processes per spawned group: 2 groups in all

# Where the survivor reports the death: the first step at or after the dying rank's at
# which the survivor communicates (ring, P = 2, no skipped sends: it posts nothing at
# forward step 1, so a death there is found at backward step 0).
RING_STEP = {
    0: "forward step 0",
    1: "backward step 0",
    2: "backward step 0",
    3: "backward step 1",
    4: "backward step 2",
}
ULYSSES_WHAT = {
    0: "q/k/v all-to-all (sequence to heads, forward)",
    1: "output all-to-all (heads to sequence, forward)",
    2: "LSE all-to-all (heads to sequence, forward)",
    3: "LSE all-to-all (heads to sequence, backward)",
    4: "output all-to-all (heads to sequence, backward)",
    5: "q/k/v all-to-all (sequence to heads, backward)",
}


def _instrument(name, index, action):
    """Run ``action(before: bool)`` around call ``index`` of ``Comm.<name>`` in this process."""
    from attnlab.distributed import comm as C

    orig = getattr(C.Comm, name)
    count = [0]

    def patched(self, *args, **kwargs):
        i = count[0]
        count[0] += 1
        if i == index:
            action(True)
        out = orig(self, *args, **kwargs)
        if i == index:
            action(False)
        return out

    setattr(C.Comm, name, patched)


def _die(how):
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def death_pairs(rank, world, cases, timeout):
    """Pair ``i`` (global ranks ``2i, 2i+1``, a subgroup) runs case ``i``: its group rank
    ``1 - i % 2`` dies (``SIGKILL`` for every third case, ``os._exit`` otherwise) and
    the other returns ``(type, message, seconds, group rank)``."""
    import torch.distributed as dist

    groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(len(cases))]
    i, grank = rank // 2, rank % 2
    _name, method, layout, fn_name, index, after = cases[i]
    dies = grank == 1 - i % 2
    if dies:
        how = "kill" if i % 3 == 0 else "exit"
        _instrument(fn_name, index, lambda before: _die(how) if before != after else None)
    else:
        _instrument(fn_name, index, lambda before: time.sleep(DELAY) if before else None)
    q, k, v = (x.requires_grad_() for x in _tensors(grank, 2, layout))
    mask = masks.causal() if layout == "zigzag" else None
    fn = D.ring_attention if method == "ring" else D.ulysses_attention
    t0 = time.perf_counter()
    try:
        out, lse = fn(q, k, v, group=groups[i], mask=mask, layout=layout, seq_len=N, return_lse=True, timeout=timeout)
        (out.sum() + lse.sum()).backward()
        return ("no error", "", time.perf_counter() - t0, grank)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return (type(e).__name__, str(e), time.perf_counter() - t0, grank)


@pytest.fixture(scope="module")
def deaths():
    out = {}
    for g in range(0, len(DEATHS), PAIRS_PER_GROUP):
        cases = DEATHS[g : g + PAIRS_PER_GROUP]
        # timeout: launching 16 ranks that each import torch; the bound under test is T/BOUND below
        res = D.run_local(_me().death_pairs, 2 * len(cases), cases, T, timeout=300, return_errors=True)
        for i, c in enumerate(cases):
            a, b = res[2 * i], res[2 * i + 1]
            assert isinstance(a, D.RankError) != isinstance(b, D.RankError), (c[0], a, b)  # exactly one died
            out[c[0]] = b if isinstance(a, D.RankError) else a
    return out


def _check_survivor(res, name, step_text):
    kind, msg, took, grank = res
    dead = 1 - grank
    assert kind in ("PeerFailureError", "PeerTimeoutError"), f"{name}: {kind}: {msg}"
    assert took < BOUND, f"{name}: took {took:.1f} s"
    op = "ulysses_attention" if "ulysses" in name else "ring_attention"
    assert msg.startswith(f"{op}: rank {grank} "), f"{name}: {msg}"
    named = (
        f"lost the connection to rank {dead} ",
        f"cannot reach rank {dead} ",
        f"and rank {dead} never answered",
        f": rank {dead} did not answer",
    )
    assert any(x in msg for x in named), f"{name}: the dead peer is not named: {msg}"
    assert step_text in msg, f"{name}: expected {step_text!r} in: {msg}"


def _by(prefix):
    return [c for c in DEATHS if c[0].startswith(prefix)]


@pytest.mark.parametrize("layout", ["ring", "zigzag"])
def test_a_rank_dying_at_each_ring_step_is_reported_with_rank_peer_and_step(deaths, layout):
    for name, _m, _l, _f, index, _a in _by(f"{layout}-before-"):
        _check_survivor(deaths[name], name, RING_STEP[index])


def test_a_rank_dying_with_its_messages_in_flight_is_reported_with_the_step(deaths):
    # after posting step t, the partner may fail waiting on step t or posting step t+1
    for name, _m, _l, _f, index, _a in _by("ring-after-posting-"):
        _check_survivor(deaths[name], name, "step")
        phase = "backward" if index >= 2 else "(forward|backward)"
        assert re.search(rf"\({phase} step \d", deaths[name][1]), deaths[name][1]


def test_a_rank_dying_before_each_ulysses_collective_is_reported_with_the_collective(deaths):
    for name, _m, _l, _f, index, _a in _by("ulysses-before-"):
        _check_survivor(deaths[name], name, ULYSSES_WHAT[index])


def test_a_rank_dying_before_the_handshake_is_reported_by_the_handshake(deaths):
    for name in ("handshake-ulysses",):
        _check_survivor(deaths[name], name, "handshake")
        assert deaths[name][0] == "PeerFailureError", deaths[name]


def test_posting_to_a_dead_peer_is_a_peer_failure_not_a_raw_backend_error(deaths):
    # the survivor was held back before the step its partner died at: it posts to a dead peer
    for name in ("ring-before-forward-step-1", "ring-before-backward-step-1", "zigzag-before-backward-step-1"):
        kind, msg, _took, _g = deaths[name]
        assert kind == "PeerFailureError" and "exited or crashed" in msg, (name, kind, msg)


# ----------------------------------------------------------------------------- mismatches
def _ids(shift):
    ids = torch.arange(N) * 3 // N
    if shift:
        ids[5] += 1
    return ids


def _window_fn(w):
    return lambda b, h, q, kv: (kv <= q) & (q - kv < w)


def _other_fn(b, h, q, kv):
    return kv <= q


# name -> (kwargs of rank 0, kwargs of rank 1, a path the error must name, texts each value shows)
_S = 1 / math.sqrt(DH)  # the default scale, computed as the library documents it
MISMATCHES = {
    "window": (dict(mask=masks.sliding_window(7)), dict(mask=masks.sliding_window(8)), "mask.w", ("7", "8")),
    "document-ids": (dict(mask=masks.document(_ids(0))), dict(mask=masks.document(_ids(1))), "mask.q_ids", ()),
    "prefix": (dict(mask=masks.prefix_lm(5)), dict(mask=masks.prefix_lm(6)), "mask.n", ("5", "6")),
    "padding-lengths": (
        dict(mask=masks.padding([12])),
        dict(mask=masks.padding([13])),
        "mask.lengths",
        ("[12]", "[13]"),
    ),
    "key-padding": (
        dict(mask=masks.key_padding(torch.arange(N).view(1, N) < 12)),
        dict(mask=masks.key_padding(torch.arange(N).view(1, N) < 11)),
        "mask.keep",
        (),
    ),
    "sinks": (dict(mask=masks.sink_window(2, 4)), dict(mask=masks.sink_window(1, 4)), "mask.sinks", ("2", "1")),
    "and-vs-or": (
        dict(mask=masks.causal() & masks.sliding_window(4)),
        dict(mask=masks.causal() | masks.sliding_window(4)),
        "mask",
        ("causal & sliding_window", "causal | sliding_window"),
    ),
    "negation": (
        dict(mask=masks.causal() & ~masks.sliding_window(2)),
        dict(mask=masks.causal() & masks.sliding_window(2)),
        "mask.b",
        ("~sliding_window",),
    ),
    "combined-window": (
        dict(mask=masks.document(_ids(0)) & masks.sliding_window(3)),
        dict(mask=masks.document(_ids(0)) & masks.sliding_window(4)),
        "mask.b.w",
        ("3", "4"),
    ),
    "custom-function": (
        dict(mask=masks.custom(_window_fn(3))),
        dict(mask=masks.custom(_other_fn)),
        "mask.fn",
        ("_window_fn", "_other_fn"),
    ),
    "custom-closure": (
        dict(mask=masks.custom(_window_fn(3))),
        dict(mask=masks.custom(_window_fn(4))),
        "mask.fn.w",
        ("3", "4"),
    ),
    "mask-or-none": (dict(mask=masks.causal()), dict(mask=None), "mask", ("causal", "None")),
    "scale": (dict(scale=0.25), dict(scale=0.3), "scale", ("0.25", "0.3")),
    "alibi-slopes": (
        dict(score_mod=scores.alibi(torch.tensor([0.5, 0.25]))),
        dict(score_mod=scores.alibi(torch.tensor([0.5, 0.125]))),
        "score_mod.slopes",
        ("0.25", "0.125"),
    ),
    "softcap": (
        dict(score_mod=scores.softcap(20.0)),
        dict(score_mod=scores.softcap(30.0)),
        "score_mod.c",
        ("20.0", "30.0"),
    ),
    "relative-bias-table": (
        dict(score_mod=scores.relative_bias(torch.ones(H, 9))),
        dict(score_mod=scores.relative_bias(torch.ones(H, 9) * 2)),
        "score_mod.table",
        (),
    ),
    "score-mod-or-none": (dict(score_mod=scores.softcap(20.0)), dict(), "score_mod", ("softcap", "None")),
    "dtype": (dict(dtype=torch.float32), dict(dtype=torch.float64), "q.dtype", ("float32", "float64")),
    "shape": (dict(d=8), dict(d=16), "q.shape", ("(1, 2, 8, 8)", "(1, 2, 8, 16)")),
    "layout": (dict(layout="contiguous"), dict(layout="striped"), "layout", ("'contiguous'", "'striped'")),
    "seq-len": (dict(seq_len=16), dict(seq_len=15), "seq_len", ("16", "15")),
    "ring-vs-ulysses": (dict(method="ring"), dict(method="ulysses"), "function", ("ring_attention",)),
    "return-lse": (dict(return_lse=True), dict(return_lse=False), "return_lse", ("True", "False")),
    "gradients": (dict(grad=True), dict(grad=False), "gradients", ("True", "False")),
    "ulysses-backend": (
        dict(method="ulysses", backend="flash"),
        dict(method="ulysses", backend="reference"),
        "backend",
        ("'flash'", "'reference'"),
    ),
    "ulysses-window": (
        dict(method="ulysses", mask=masks.sliding_window(3)),
        dict(method="ulysses", mask=masks.sliding_window(5)),
        "mask.w",
        ("3", "5"),
    ),
    "an-argument-error-on-one-rank": (dict(), dict(bad_k=True), "error", ("none", "ValueError")),
}

# equal problems built independently on each rank: no error, and the result is computed
SAME = {
    "default-scale-equals-explicit": (dict(), dict(scale=_S)),
    "document-ids-built-apart": (dict(mask=masks.document(_ids(1))), dict(mask=masks.document(_ids(1).clone()))),
    "custom-closure-built-apart": (dict(mask=masks.custom(_window_fn(3))), dict(mask=masks.custom(_window_fn(3)))),
    "alibi-built-apart": (
        dict(score_mod=scores.alibi(torch.tensor([0.5, 0.25]))),
        dict(score_mod=scores.alibi(torch.tensor([0.5, 0.25]))),
    ),
}


def _call(rank, world, kw):
    kw = dict(kw)
    layout, seq_len = kw.pop("layout", "contiguous"), kw.pop("seq_len", N)
    q, k, v = _tensors(rank, world, layout, kw.pop("dtype", torch.float32), d=kw.pop("d", DH))
    if kw.pop("bad_k", False):
        k = k[:, :, :-1]
    if kw.pop("grad", True):
        q.requires_grad_()
    method, ret = kw.pop("method", "ring"), kw.pop("return_lse", True)
    fn = D.ring_attention if method == "ring" else D.ulysses_attention
    res = fn(q, k, v, layout=layout, seq_len=seq_len, return_lse=ret, timeout=T, **kw)
    out = res[0] if ret else res
    if out.requires_grad:
        out.sum().backward()
    return out.detach()


def mismatch_group(rank, world, names, same):
    """Every equal-problem case (first: they must pass on any version), then every
    mismatch case; after a mismatch error the group must still serve the next case."""
    res = {}
    for name in same:
        try:
            res[name] = ("ok", _call(rank, world, SAME[name][rank]))
        except Exception as e:  # noqa: BLE001
            res[name] = (type(e).__name__, str(e))
    for name in names:
        try:
            _call(rank, world, MISMATCHES[name][rank])
            res[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - the test inspects it
            res[name] = (type(e).__name__, str(e))
    try:
        res["__after__"] = ("ok", _call(rank, world, {}))
    except Exception as e:  # noqa: BLE001
        res["__after__"] = (type(e).__name__, str(e))
    try:
        res["__fp__"] = _fp()
    except Exception as e:  # noqa: BLE001 - (no fingerprint module in old versions)
        res["__fp__"] = f"{type(e).__name__}: {e}"
    return res


@pytest.fixture(scope="module")
def mismatches():
    return D.run_local(_me().mismatch_group, 2, list(MISMATCHES), list(SAME), timeout=150, return_errors=True)


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_ranks_that_differ_in_one_field_all_raise_the_same_error_naming_it(mismatches, name):
    for r in (0, 1):
        assert not isinstance(mismatches[r], D.RankError), mismatches[r]
    (k0, m0), (k1, m1) = mismatches[0][name], mismatches[1][name]
    assert k0 == k1 == "ValueError", (name, k0, m0, k1, m1)
    assert m0 == m1, f"{name}: the ranks' messages differ:\n{m0}\n---\n{m1}"
    path, values = MISMATCHES[name][2], MISMATCHES[name][3]
    head = re.match(r".*?the ranks called with different arguments \(differs: ([^)]*)\)", m0, re.S)
    assert head, m0
    assert path in [p.strip() for p in head.group(1).split(",")], f"{name}: {path} not named in: {head.group(1)}"
    for r, val in enumerate(values):
        line = [ln for ln in m0.splitlines() if ln.strip().startswith(f"rank {r}:")]
        assert len(line) == 1 and val in line[0], f"{name}: rank {r}'s value {val!r} missing:\n{m0}"


@pytest.mark.parametrize("name", list(SAME))
def test_equal_problems_built_apart_pass_the_handshake(mismatches, name):
    for r in (0, 1):
        kind, out = mismatches[r][name]
        assert kind == "ok", (name, r, kind, out)
        assert out.shape == (B, H, N // 2, DH) and torch.isfinite(out).all()


def test_after_mismatch_errors_the_group_still_works(mismatches):
    # every rank raised the same error at the same point: no message is left half-sent
    for r in (0, 1):
        assert mismatches[r]["__after__"][0] == "ok", mismatches[r]["__after__"]


def test_the_fingerprint_does_not_depend_on_the_process_hash_seed(mismatches):
    # the ranks fork from the forkserver, a fresh interpreter with its own str-hash seed:
    # a fingerprint built on Python's salted hash() would differ from this process's
    if os.environ.get("PYTHONHASHSEED") not in (None, "random"):
        pytest.skip("PYTHONHASHSEED is fixed: every process hashes alike")
    assert mismatches[0]["__fp__"] == mismatches[1]["__fp__"] == _me()._fp()


def _fp():
    """A digest of the fingerprint of a call with every kind of field."""
    from attnlab.distributed import fingerprint as F

    q, k, v = _tensors(0, 2)
    m = masks.document(_ids(1)) & masks.custom(_window_fn(3)) | ~masks.padding([9])
    mod = scores.compose(scores.alibi(torch.tensor([0.5, 0.25])), scores.softcap(20.0))
    f = F.call_fields(
        "ring_attention", q, k, v, seq_len=N, layout="zigzag", mask=m, score_mod=mod, scale=0.3, return_lse=True
    )
    return sum(F.digests(f)) % (1 << 61)
