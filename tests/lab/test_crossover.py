"""Linear-attention crossover (attnlab.lab.crossover) at tiny sizes: the run completes,
its approximation errors are finite, FAVOR+'s error falls as the number of random
features grows, exact softmax backends agree, and the crossover bookkeeping is right.
Times are measurements: nothing here asserts on them beyond their being recorded."""

import json
import math

import pytest

from attnlab.cli import main
from attnlab.lab import crossover
from attnlab.lab.crossover import LINEAR, METHODS, SOFTMAX, _crossover, run, summary

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny problems: a 2nd thread only spins


@pytest.fixture(scope="module")
def tiny():
    return run(
        ns=(32, 64),
        reps=1,
        d_head=16,
        heads=2,
        error_features=(8, 64, 512),
        error_n=64,
        error_scales=(1.0, 0.5),
        error_seeds=3,
        progress=False,
    )


def test_runs_and_records(tiny):
    r = tiny
    assert {
        "config",
        "env",
        "ns",
        "times",
        "samples",
        "ratios",
        "crossover",
        "errors",
        "favor_vs_features",
        "notes",
        "seconds",
    } <= set(r)
    assert r["ns"] == [32, 64]
    for mode in ("fwd", "fwdbwd"):
        for m in METHODS:
            ts = r["times"][mode][m]
            assert len(ts) == 2 and all(t is not None and t > 0 for t in ts)
        for lin in LINEAR:
            for soft in SOFTMAX:
                key = f"{lin}/{soft}"
                assert len(r["ratios"][mode][key]) == 2
                assert set(r["crossover"][mode][key]) == {"n", "interpolated", "below_grid"}
    assert json.loads(json.dumps(r)) == r
    text = summary(r)
    assert "crossover elu/flash" in text and "not an approximation" in text and "FAVOR+" in text


def test_errors_finite_and_meaningful(tiny):
    e = tiny["errors"]
    for name in ("favor", "elu"):
        for s in ("1.0", "0.5"):
            assert len(e[name][s]) == 2 and all(math.isfinite(x) and x > 0 for x in e[name][s])
    # both softmax backends compute the same exact attention
    assert all(x < 1e-5 for x in e["flash_vs_sdpa"])
    # elu+1 is another model: its distance from softmax is far above rounding
    assert all(x > 1e-2 for x in e["elu"]["1.0"])


def test_favor_error_falls_as_features_grow(tiny):
    f = tiny["favor_vs_features"]
    assert f["n"] == 64 and f["features"] == [8, 64, 512]
    for s in ("1.0", "0.5"):
        errs = f["rel_error"][s]
        assert all(math.isfinite(x) for x in errs)
        assert errs[0] > errs[1] > errs[2]
    # 64x the features: roughly 8x less error at the small scale (Monte Carlo: 1/sqrt(m))
    errs = f["rel_error"]["0.5"]
    assert errs[2] < errs[0] / 3


def test_crossover_bookkeeping():
    ns = [256, 512, 1024, 2048]
    assert _crossover(ns, [2.0, 1.5, 0.8, 0.5]) == {
        "n": 1024,
        "interpolated": pytest.approx(2 ** (9 + math.log(1.5) / (math.log(1.5) - math.log(0.8)))),
        "below_grid": False,
    }
    assert _crossover(ns, [0.9, 0.8, 0.5, 0.2])["below_grid"] is True
    assert _crossover(ns, [0.9, 1.2, 1.1, 1.3])["n"] is None
    # a dip below 1 that does not last does not count: the crossover is where it stays below
    assert _crossover(ns, [0.9, 1.2, 0.8, 0.7])["n"] == 1024
    assert _crossover(ns, [None, 2.0, 0.5, None])["n"] == 1024


def test_main_writes_json(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(crossover, "run", lambda **kw: tiny)
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "res.json"
    assert main(["lab", "crossover", "--quick", "--json", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text()) == tiny
    assert (tmp_path / "cache" / "crossover" / "crossover-quick.json").exists()
    assert "forward + backward" in capsys.readouterr().out


def test_bad_arguments():
    with pytest.raises(ValueError, match="reps"):
        run(ns=(32,), reps=0, progress=False)
    with pytest.raises(ValueError, match="error_scales"):
        run(ns=(32,), reps=1, error_scales=(0.0,), progress=False)
