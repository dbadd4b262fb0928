"""Distributed tests: spawned gloo groups on this CPU (see tests/distributed/_cases.py).

Each test module spawns its group once (a module-scoped fixture) and checks many cases
from the results; every spawn has a deadline (``attnlab.distributed.run_local`` kills
what is left and raises), so nothing here can hang.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.helpers import FLOOR, assert_close_rule, max_err  # noqa: E402

import attnlab.distributed as D  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The references here are tiny; one thread avoids OpenMP spin-waits while the spawned
    ranks (one thread each) share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# A score mod's parameter gradient sums B*H*N*N scores; the same slack as tests/ops
# (conftest.PARAM_GRAD_SLACK_EPS, measured there): one eps of the largest entry.
PARAM_GRAD_SLACK_EPS = 1.0


def check_rule(got: dict, ref: dict, oracle: dict, dtype, what: str):
    """DESIGN.md: err(got) <= 2x err(same-dtype reference) + floor for out/lse, 3x for grads."""
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert got[key].shape == oracle[key].shape, f"{what} {key}: shape {tuple(got[key].shape)}"
        assert not torch.isnan(got[key]).any(), f"{what} {key}: NaN"
        assert_close_rule(got[key], ref[key], oracle[key], dtype, factor=2.0 if key in ("out", "lse") else 3.0,
                          what=f"{what} {key}")
    if "dparam" in oracle:
        e, e_ref = max_err(got["dparam"], oracle["dparam"]), max_err(ref["dparam"], oracle["dparam"])
        M = float(oracle["dparam"].abs().max())
        bound = 3.0 * e_ref + FLOOR[dtype] + PARAM_GRAD_SLACK_EPS * torch.finfo(dtype).eps * M
        assert e <= bound, f"{what} dparam: error {e:.3e} > 3x reference {e_ref:.3e} + floor + slack"


def unshard_results(results: list, name: str, c: dict) -> dict:
    """Every rank's shards of one case, put back together (the score mod's parameter
    gradient is the sum of the ranks' shares)."""
    per = [r[name] for r in results]
    for r, x in enumerate(per):
        assert "error" not in x, f"rank {r}: {x['error']}"
    out = {key: D.unshard_sequence([x[key] for x in per], dim=2, seq_len=c["N"], layout=c["layout"])
           for key in ("out", "lse", "dq", "dk", "dv")}
    if "dparam" in per[0]:
        out["dparam"] = sum(x["dparam"] for x in per)
    return out
