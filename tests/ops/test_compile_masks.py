"""torch.compile of the newer mask kinds (issue 15): band, varlen, dense and per-batch query
offsets have structural keys, so compiled code hands them to the flash custom op (block
skipping) instead of evaluating them densely in the graph; ``masks.tree`` built inside the
compiled function from a list of parents traces with no graph break."""

import pytest
import torch
import torch._dynamo as dynamo

import attnlab
from attnlab import masks

F64 = torch.float64


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, 4, dtype=F64, generator=g)
    k = torch.randn(2, 1, 8, 4, dtype=F64, generator=g)
    v = torch.randn(2, 1, 8, 3, dtype=F64, generator=g)
    return q, k, v


def _newer(dense_t, cu, qo):
    return [
        masks.band(2, 1),
        masks.band(None, 2) & masks.causal(),
        masks.dense(dense_t, q_offset=0),
        masks.per_batch_q_offset(masks.sliding_window(3), qo),
    ], masks.varlen(cu, window=(None, 0))


def _run(q, k, v, ms, vl):
    out = [attnlab.attention(q, k, v, mask=m, backend="flash", q_offset=0) for m in ms]
    out.append(attnlab.attention(q[:1], k[:1], v[:1], mask=vl, backend="flash", q_offset=0))  # one packed row
    return out


def test_newer_kinds_compile_to_the_flash_op_with_no_dense_mask(data, monkeypatch):
    """Built outside the compiled function (varlen's and per_batch_q_offset's checks read
    tensor values), passed in, they trace with no graph break and reach the op by key."""
    import attnlab.ops.dispatch as D

    q, k, v = data
    dense_t = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    dense_t[..., 0] = True
    ms, vl = _newer(dense_t, torch.tensor([0, 3, 8]), torch.tensor([0, 0]))
    for m in [*ms, vl]:
        assert m.key() is not None, m
    eager = _run(q, k, v, ms, vl)

    def no_dense(*a, **kw):
        raise AssertionError("a mask with a structural key was evaluated densely")

    monkeypatch.setattr(D, "dense_mask", no_dense)
    dynamo.reset()
    ex = dynamo.explain(_run)(q, k, v, ms, vl)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
    got = torch.compile(_run, backend="aot_eager", fullgraph=True)(q, k, v, ms, vl)
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)  # the same kernel on the same tiles


def test_tree_from_a_list_built_inside_compiled_code_has_no_graph_break(data):
    q, k, v = data

    def f(q, k, v):
        return attnlab.attention(q, k, v, mask=masks.tree([-1, 0, 0, 1], prefix_len=4), backend="flash")

    dynamo.reset()
    ex = dynamo.explain(f)(q, k, v)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, f(q, k, v), rtol=0, atol=1e-12)
