"""tests/helpers.py: the DESIGN rule on result dicts, and the lock the xdist workers share."""

import threading
import time

import pytest
import torch

from tests.helpers import FLOOR, check_rule, lab_lock


def test_check_rule_allows_twice_the_reference_error_on_outputs_and_three_times_on_gradients():
    oracle = {"out": torch.zeros(4, dtype=torch.float64), "dq": torch.zeros(4, dtype=torch.float64)}
    ref = {k: torch.full((4,), 1e-3) for k in oracle}
    f32 = torch.float32
    check_rule({"out": torch.full((4,), 2e-3), "dq": torch.full((4,), 3e-3)}, ref, oracle, f32)
    with pytest.raises(AssertionError, match="out"):
        check_rule({"out": torch.full((4,), 2e-3 + 2 * FLOOR[f32])}, ref, oracle, f32)
    with pytest.raises(AssertionError, match="dq"):
        check_rule({"dq": torch.full((4,), 3e-3 + 2 * FLOOR[f32])}, ref, oracle, f32)
    with pytest.raises(AssertionError, match="missing"):
        check_rule({"out": torch.zeros(4)}, ref, oracle, f32, keys=("out", "dq"))
    with pytest.raises(AssertionError, match="NaN"):
        nan = torch.full((4,), float("nan"))
        check_rule({"out": nan}, {"out": nan}, oracle, f32, nan_free=True)


def test_lab_lock_lets_one_holder_in_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    events, held = [], threading.Event()

    def first():
        with lab_lock("x"):
            held.set()
            time.sleep(0.3)
            events.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert held.wait(10)
    with lab_lock("x"):  # a second open file: flock makes it wait for the first holder
        events.append("second in")
    t.join()
    assert events == ["first out", "second in"]
    with lab_lock("y"):  # another name is another lock
        pass


def test_named_tolerances_are_rtol_atol_pairs_and_scaled_scales_atol_only():
    import inspect

    from tests import helpers

    named = {n: v for n, v in vars(helpers).items() if n.isupper() and isinstance(v, dict) and n != "FLOOR"}
    assert {"EXACT", "F32_MODEL_PARITY", "F64_REORDER_ABS", "MOVED"} <= set(named)
    src = inspect.getsource(helpers)
    for n, tol in named.items():
        assert set(tol) == {"rtol", "atol"}, n
        assert all(isinstance(x, (int, float)) and x >= 0 for x in tol.values()), n
        assert "#: " in src.split(f"\n{n} = ")[0].rsplit("\n", 2)[-1] or n == "F32_ONLINE_STATS_REL", f"{n}: no doc"
    # MOVED (used as `not allclose(a, b, **MOVED)`) keeps torch.allclose's default rtol
    assert helpers.MOVED["rtol"] == helpers.MOVED_SLIGHTLY["rtol"] == 1e-5
    a = torch.zeros(3)
    assert torch.allclose(a, a + 1.5e-3, **helpers.scaled(helpers.MOVED, 2.0))
    assert not torch.allclose(a, a + 1.5e-3, **helpers.MOVED)
    assert helpers.scaled(helpers.F32_FEW_ULPS, 3.0) == dict(rtol=1e-6, atol=3e-6)
