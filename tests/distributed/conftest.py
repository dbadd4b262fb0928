"""Distributed tests: spawned gloo groups on this CPU (see tests/distributed/_cases.py).

Each test module spawns its group once (a module-scoped fixture) and checks many cases
from the results; every spawn has a deadline (``attnlab.distributed.run_local`` kills
what is left and raises), so nothing here can hang.
"""

from __future__ import annotations

import pytest

import attnlab.distributed as D
from tests.helpers import check_rule as rule


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """The references here are tiny: one torch thread (the root conftest's fixture) while the
    spawned ranks (one thread each) share the cores."""


# A score mod's parameter gradient sums B*H*N*N scores: one eps of the largest entry of slack
# here (the ranks' merges measured within it; tests/helpers.PARAM_GRAD_SLACK_EPS allows two).
PARAM_GRAD_SLACK_EPS = 1.0


def check_rule(got: dict, ref: dict, oracle: dict, dtype, what: str):
    """DESIGN.md's rule (tests/helpers.check_rule) on every key, none missing, no NaN."""
    keys = ("out", "lse", "dq", "dk", "dv") + (("dparam",) if "dparam" in oracle else ())
    rule(got, ref, oracle, dtype, what, keys=keys, nan_free=True, param_slack_eps=PARAM_GRAD_SLACK_EPS)


def unshard_results(results: list, name: str, c: dict) -> dict:
    """Every rank's shards of one case, put back together (the score mod's parameter
    gradient is the sum of the ranks' shares)."""
    per = [r[name] for r in results]
    for r, x in enumerate(per):
        assert "error" not in x, f"rank {r}: {x['error']}"
    out = {
        key: D.unshard_sequence([x[key] for x in per], dim=2, seq_len=c["N"], layout=c["layout"])
        for key in ("out", "lse", "dq", "dk", "dv")
    }
    if "dparam" in per[0]:
        out["dparam"] = sum(x["dparam"] for x in per)
    return out
