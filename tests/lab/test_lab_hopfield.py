"""Hopfield capacity experiment (attnlab.lab.hopfield): a small run has the documented
keys, is JSON-able, and shows what the experiment is for — retrieval accuracy falls as
more patterns are stored, capacity rises with the dimension, and the modern network
out-stores the classical Hebbian one."""

import json

import pytest

from attnlab.lab.hopfield import run, summary

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny problems: a 2nd thread only spins


@pytest.fixture(scope="module")
def small():
    return run(dims=(16, 32), ns=(2, 8, 32, 128, 512), n_probes=64, seed=0)


def test_documented_keys_and_json(small):
    r = small
    assert set(r) == {"config", "dims", "ns", "criterion", "modern", "classical", "reference", "growth", "seconds"}
    assert set(r["modern"]) == {"accuracy", "capacity", "censored", "mean_steps"}
    assert set(r["classical"]) == {"accuracy", "capacity", "censored"}
    assert set(r["reference"]) == {"classical_0.138d", "modern_separation_heuristic"}
    assert set(r["growth"]) == {"modern_log2_capacity_per_dim", "classical_capacity_per_dim"}
    for part in (r["modern"], r["classical"]):
        assert set(part["accuracy"]) == {"16", "32"}
        assert all(len(a) == 5 and all(0.0 <= x <= 1.0 for x in a) for a in part["accuracy"].values())
    assert r["config"]["beta"] == 1.0 and r["ns"] == [2, 8, 32, 128, 512]
    assert json.loads(json.dumps(r)) == r


def test_accuracy_falls_with_n_and_capacity_rises_with_d(small):
    m, c = small["modern"], small["classical"]
    for d in ("16", "32"):
        acc = m["accuracy"][d]
        assert acc[0] >= 0.9 and acc[-1] <= 0.2 and acc[0] - acc[-1] >= 0.7
        assert c["accuracy"][d][0] >= c["accuracy"][d][-1]
    assert m["capacity"]["32"] > m["capacity"]["16"] > 0
    assert not any(m["censored"].values())
    # the modern network stores more than the classical one at the same corruption
    assert m["capacity"]["32"] > c["capacity"]["32"]
    assert all(c["accuracy"][d][-1] == 0.0 for d in ("16", "32"))  # 512 patterns swamp a Hebbian net
    assert small["growth"]["modern_log2_capacity_per_dim"] > 0


def test_summary_table(small):
    text = summary(small)
    assert "modern accuracy" in text and "classical accuracy" in text
    assert "d=16" in text and "d=32" in text and "0.138 d" in text
    assert f"{small['modern']['capacity']['32']}" in text


def test_gaussian_masked_variant_and_errors():
    r = run(dims=(8,), ns=(2, 4), beta=2.0, kind="gaussian", corruption="mask", frac=0.25, steps=3, n_probes=8)
    assert r["classical"] is None and r["growth"]["classical_capacity_per_dim"] is None
    assert all(1 <= s <= 3 for s in r["modern"]["mean_steps"]["8"])
    # an uncorrupted probe among two patterns is retrieved
    assert run(dims=(32,), ns=(2,), frac=0.0, n_probes=16, classical=False)["modern"]["accuracy"]["32"] == [1.0]
    with pytest.raises(ValueError, match="kind"):
        run(dims=(8,), ns=(2,), kind="ternary")
    with pytest.raises(ValueError, match="corruption"):
        run(dims=(8,), ns=(2,), corruption="swap")
    with pytest.raises(ValueError, match="frac"):
        run(dims=(8,), ns=(2,), frac=1.0)
    with pytest.raises(ValueError, match="beta"):
        run(dims=(8,), ns=(2,), beta=-1)
    with pytest.raises(ValueError, match="dims"):
        run(dims=(0,), ns=(2,))
