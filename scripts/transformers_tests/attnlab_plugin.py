"""pytest plugin: run transformers' model tests with attnlab as their attention.

Enabled with ``-p attnlab_plugin`` (``run.sh`` puts this folder on ``PYTHONPATH``).
At configure time it overrides transformers' ``AttentionInterface`` entries so the
model's attention calls :func:`attnlab.models.bridge.attention_forward`:

* ``"sdpa"`` always: the default implementation of GPT-2, Llama, Mistral and BERT;
  transformers keeps choosing the sdpa *mask* (``sdpa_mask``) for it, which is what
  the bridge is written for (``bridge.register`` pairs its own name with it too);
* ``"eager"`` as well when ``ATTNLAB_ROUTE_EAGER=1`` (``run.sh`` sets it for Gemma-2):
  Gemma-2 declares ``_supports_sdpa = False`` (SDPA has no softcap), so its models
  resolve to ``"eager"`` and would never reach an ``"sdpa"`` entry.  ``get_interface``
  returns a registered ``"eager"`` entry before the model's own
  ``eager_attention_forward`` default, so the override routes every Gemma-2 attention
  call (softcap, sliding window, additive ``eager_mask``) through attnlab without
  changing which tests run.  (Patching ``_supports_sdpa = True`` instead would add the
  SDPA-only tests that stock skips, so the counts would no longer compare.)  Eager
  returns the weights, and transformers' output recorder (``output_attentions=True``)
  takes them from the attention module's return value without passing
  ``output_attentions`` down; so this route asks the bridge for the weights when the
  recorder is collecting ``attentions`` (and always under ``torch.compile``, where the
  recorder's state is not read here), and otherwise runs the plain flash path.

Tests that name ``"eager"`` explicitly (``test_eager_matches_sdpa_*``, ...) then compare
stock eager against attnlab for the other four models.

Every call outside ``torch.compile`` tracing is counted (inside, dynamo would guard on
the counters' values and recompile on each call: the no-recompile tests would fail).
A module-scoped autouse fixture fails (as an ERROR at the module's last teardown) when
a test module made no attnlab call at all, and the session writes
``{module: {"calls": n, "tests_with_calls": t}}`` to the JSON file named by
``ATTNLAB_CALLS_JSON`` (if set) and prints it in the terminal summary.
"""

from __future__ import annotations

import collections
import json
import os

import pytest

_calls = collections.Counter()          # module nodeid -> attnlab calls
_tests_with_calls = collections.Counter()  # module nodeid -> tests that made >= 1 call
_current = {"module": None, "n": 0}
_routed = []


def _counting_forward(module, query, key, value, attention_mask, **kwargs):
    import torch

    from attnlab.models import bridge

    if not torch.compiler.is_compiling():  # dynamo would guard on the counters and recompile
        _current["n"] += 1
        _calls[_current["module"]] += 1
    return bridge.attention_forward(module, query, key, value, attention_mask, **kwargs)


def _counting_forward_eager(module, query, key, value, attention_mask, **kwargs):
    """The ``"eager"`` route: weights whenever transformers' output recorder collects them."""
    import torch

    want = True
    if not torch.compiler.is_compiling():
        try:  # test harness only: transformers' recorder state (a private name) says what it collects
            from transformers.utils.output_capturing import _active_collector
        except ImportError:  # another transformers layout: ask always, as eager returns them always
            pass
        else:
            collecting = _active_collector.get()
            want = collecting is not None and "attentions" in collecting
    if want:
        kwargs = {**kwargs, "output_attentions": True}
    return _counting_forward(module, query, key, value, attention_mask, **kwargs)


def pytest_configure(config):
    from transformers import AttentionInterface

    import attnlab

    AttentionInterface.register("sdpa", _counting_forward)
    _routed[:] = ["sdpa"]
    if os.environ.get("ATTNLAB_ROUTE_EAGER") == "1":
        AttentionInterface.register("eager", _counting_forward_eager)
        _routed.append("eager")
    config.attnlab_info = f"attnlab {getattr(attnlab, '__version__', '?')} from {os.path.dirname(attnlab.__file__)}"


def pytest_report_header(config):
    return [f"attnlab_plugin: {'/'.join(repr(r) for r in _routed)} -> attnlab.models.bridge.attention_forward; "
            f"{config.attnlab_info}"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current["module"] = item.module.__name__ if item.module is not None else item.nodeid
    _current["n"] = 0
    yield
    if _current["n"]:
        _tests_with_calls[_current["module"]] += 1


@pytest.fixture(scope="module", autouse=True)
def _attnlab_was_called(request):
    name = request.module.__name__
    before = _calls[name]
    yield
    if _calls[name] == before:
        pytest.fail(f"attnlab_plugin: no attention call reached attnlab in {name} (routed: {_routed})")


def pytest_terminal_summary(terminalreporter):
    summary = {m: {"calls": _calls[m], "tests_with_calls": _tests_with_calls[m]} for m in sorted(_calls, key=str)}
    terminalreporter.write_line(f"attnlab_plugin calls: {json.dumps(summary)}")
    path = os.environ.get("ATTNLAB_CALLS_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
