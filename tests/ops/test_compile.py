"""torch.compile of attention(): zero graph breaks for every built-in mask and score mod,
compiled == eager (outputs and gradients), and no recompiles for a fresh mask per call.

Compiling is slow on this machine: the compiled functions are built once per module
(``aot_eager`` runs the fake implementations and AOTAutograd's joint graph, which is what
fullgraph/export need; inductor's code generation adds nothing attnlab-specific).
"""

import pytest
import torch
import torch._dynamo as dynamo

import attnlab
from attnlab import masks, scores

F64 = torch.float64


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, 4, dtype=F64, generator=g)
    k = torch.randn(2, 1, 8, 4, dtype=F64, generator=g)
    v = torch.randn(2, 1, 8, 3, dtype=F64, generator=g)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1]])
    slopes = torch.tensor([0.5, 0.25], dtype=F64)
    table = torch.randn(2, 7, dtype=F64, generator=g)
    return q, k, v, ids, slopes, table


def _builtins(w, ids, slopes, table):
    """Every built-in mask and score mod (built inside the traced region, as models do)."""
    return [
        (masks.causal(), None),
        (masks.causal() & masks.sliding_window(w), None),
        (masks.prefix_lm(w), None),
        (masks.sink_window(1, w), None),
        (masks.document(ids) & masks.causal(), None),
        (masks.padding(torch.tensor([5, 8])), None),
        (masks.key_padding(ids > 0), None),
        (masks.sliding_window(w) | masks.prefix_lm(2), None),
        (masks.causal(), scores.alibi(slopes)),
        (None, scores.alibi(slopes, symmetric=True)),
        (None, scores.softcap(5.0)),
        (None, scores.relative_bias(table)),
        (masks.causal(), scores.compose(scores.alibi(slopes), scores.softcap(5.0))),
    ]


def _all(q, k, v, w, ids, slopes, table, backend="flash"):
    return [
        attnlab.attention(q, k, v, mask=m, score_mod=s, backend=backend, return_lse=True)
        for m, s in _builtins(w, ids, slopes, table)
    ]


def test_every_builtin_mask_and_score_mod_traces_with_zero_graph_breaks(data):
    q, k, v, ids, slopes, table = data
    dynamo.reset()
    ex = dynamo.explain(_all)(q, k, v, 3, ids, slopes, table)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
    assert ex.graph_count == 1


def test_tree_and_inverted_masks_built_outside_trace_with_zero_graph_breaks(data):
    """tree() computes its ancestor table in Python at construction, and dynamo cannot always
    trace ``~mask`` (docs/compile.md): build those outside the compiled function and pass them in."""
    q, k, v, *_ = data
    ms = (masks.tree([-1, 0, 0, 1], prefix_len=4), ~masks.sliding_window(3) | masks.causal())
    dynamo.reset()
    ex = dynamo.explain(lambda q, k, v, ms: [attnlab.attention(q, k, v, mask=m, backend="flash") for m in ms])(
        q, k, v, ms
    )
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]


@pytest.fixture(scope="module")
def compiled_all():
    dynamo.reset()
    return torch.compile(_all, backend="aot_eager", fullgraph=True)


def test_compiled_equals_eager_outputs_and_gradients(data, compiled_all):
    q, k, v, ids, slopes, table = data
    leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes, table)]
    got = compiled_all(leaves[0], leaves[1], leaves[2], 3, ids, leaves[3], leaves[4])
    want = _all(leaves[0], leaves[1], leaves[2], 3, ids, leaves[3], leaves[4])
    for (go, gl), (wo, wl) in zip(got, want, strict=True):
        torch.testing.assert_close(go, wo, atol=0, rtol=0)  # the same kernel runs in both
        torch.testing.assert_close(gl, wl, atol=0, rtol=0)

    def loss(res):
        return sum(o.sum() + torch.where(torch.isfinite(l), l, torch.zeros_like(l)).sum() for o, l in res)

    g_got = torch.autograd.grad(loss(got), leaves)
    g_want = torch.autograd.grad(loss(want), leaves)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)  # float64: summation order only
    assert g_got[3].abs().sum() > 0 and g_got[4].abs().sum() > 0  # learnable slopes / table get gradients


class _Counting:
    """A dynamo backend that counts the graphs it is handed (one per compile/recompile)."""

    def __init__(self):
        self.n = 0

    def __call__(self, gm, example_inputs):
        self.n += 1
        return gm.forward


def test_fresh_mask_per_call_does_not_recompile_and_a_new_w_recompiles_at_most_once(data):
    q, k, v, *_ = data
    dynamo.reset()
    inside, outside = _Counting(), _Counting()

    def f(q, k, v, w):
        return attnlab.attention(q, k, v, mask=masks.causal() & masks.sliding_window(w), backend="flash")

    def g(q, k, v, m):
        return attnlab.attention(q, k, v, mask=m, backend="flash")

    cf = torch.compile(f, backend=inside, fullgraph=True)
    cg = torch.compile(g, backend=outside, fullgraph=True)
    for w in (3, 3, 3):
        cf(q, k, v, w)
        cg(q, k, v, masks.causal() & masks.sliding_window(w))
    assert inside.n == 1 and outside.n == 1  # fresh mask objects: no recompile
    for w in (4, 5, 6, 2):
        torch.testing.assert_close(cf(q, k, v, w), f(q, k, v, w), atol=0, rtol=0)
        torch.testing.assert_close(cg(q, k, v, masks.causal() & masks.sliding_window(w)), f(q, k, v, w), atol=0, rtol=0)
    assert inside.n <= 2 and outside.n <= 2  # the window size becomes a dynamic int once


def test_custom_mask_and_custom_score_mod_compile_fullgraph_and_match_eager(data):
    """Documented fallbacks (docs/compile.md): a custom mask is evaluated densely in the graph and
    handed to the flash op; a custom score mod runs the reference math inline."""
    q, k, v, *_ = data
    mask = masks.custom(lambda b, h, qp, kp: (qp - kp) % 3 != 1)
    mod = scores.custom(lambda s, b, h, qp, kp: s * 0.5 + (kp - qp).to(s.dtype) * 0.1)

    def f(q, k, v):
        return (
            attnlab.attention(q, k, v, mask=mask, backend="flash"),
            attnlab.attention(q, k, v, mask=mask, score_mod=mod, backend="flash"),
        )

    dynamo.reset()
    ex = dynamo.explain(f)(q, k, v)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
    dynamo.reset()
    qq = q.clone().requires_grad_()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(qq, k, v)
    want = f(qq, k, v)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        torch.autograd.grad(sum(o.sum() for o in got), qq)[0],
        torch.autograd.grad(sum(o.sum() for o in want), qq)[0],
        atol=1e-12,
        rtol=0,
    )


def test_bad_tensor_argument_built_inside_compiled_code_still_raises(data):
    """Value checks of mask/mod tensors built in the traced region become in-graph assertions."""
    q, k, v, *_ = data
    dynamo.reset()
    f = torch.compile(
        lambda q, k, v, n: attnlab.attention(q, k, v, mask=masks.padding(n), backend="flash"),
        backend="aot_eager",
        fullgraph=True,
    )
    f(q, k, v, torch.tensor([3, 8]))
    with pytest.raises(RuntimeError, match="padding"):
        f(q, k, v, torch.tensor([-1, 8]))


def test_dropout_with_an_int_seed_compiles_fullgraph_and_matches_eager(data):
    """The flash op carries dropout_p and the seed; q passed as q, k and v (one tensor thrice) too."""
    q = data[0].clone().requires_grad_()

    def f(q, seed):
        return attnlab.attention(q, q, q, mask=masks.causal(), dropout_p=0.3, dropout_seed=seed, backend="flash")

    dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = cf(q, 7), f(q, 7)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(
        torch.autograd.grad(got.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0], atol=1e-12, rtol=0
    )


def test_the_custom_ops_pass_torch_library_opcheck():
    """Schema, fake implementation (non-contiguous q, as after a projection), autograd
    registration and AOT dispatch with dynamic shapes (inductor checks the fake's strides)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 2, 4, dtype=F64, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 1, 8, 4, dtype=F64, generator=g, requires_grad=True)
    v = torch.randn(1, 1, 8, 3, dtype=F64, generator=g, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], dtype=F64, requires_grad=True)
    args = (q, k, v, "sliding_window(i0)", [], "alibi(t0,0)", [slopes], [3], 0.5, 0, 0, [], 0.0, 0)
    res = torch.library.opcheck(torch.ops.attnlab.flash_fwd.default, args)
    assert set(res.values()) == {"SUCCESS"}, res
    # with dropout and a seed drawn in a graph (the optional seed_tensor input)
    res = torch.library.opcheck(torch.ops.attnlab.flash_fwd.default, (*args[:-2], 0.3, 0, torch.tensor(5)))
    assert set(res.values()) == {"SUCCESS"}, res


class _OpRecorder:
    """A torch.compile backend that records the operators of dynamo's graph and of its
    subgraphs (an autograd.Function's forward is one), then runs it eagerly."""

    def __init__(self):
        self.targets = []

    def __call__(self, gm, example_inputs):
        for m in gm.modules():
            if hasattr(m, "graph"):
                self.targets += [str(n.target) for n in m.graph.nodes if n.op == "call_function"]
        return gm.forward


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_dropout_without_a_seed_compiles_fullgraph_and_draws_what_eager_draws(data, backend):
    """``dropout_seed=None`` draws the seed with a traced op (no graph break); under aot_eager it
    is torch's default generator's draw, so after ``torch.manual_seed`` compiled == eager,
    outputs and gradients (the backward regenerates the same mask); each call draws anew."""
    q = data[0].clone().requires_grad_()

    def f(q):
        return attnlab.attention(q, q, q, mask=masks.causal(), dropout_p=0.3, backend=backend)

    dynamo.reset()
    ex = dynamo.explain(f)(q)
    assert ex.graph_break_count == 0, [str(r.reason)[:200] for r in ex.break_reasons]
    dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.manual_seed(5)
    got = cf(q)
    torch.manual_seed(5)
    want = f(q)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(
        torch.autograd.grad(got.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0], atol=1e-12, rtol=0
    )
    assert not torch.equal(cf(q), got)  # a fresh seed per call


def test_a_dense_additive_bias_has_a_structural_key_and_compiles_to_the_flash_op(data):
    """``mask=float_tensor`` (scores.bias) goes to attnlab::flash_fwd under compile (not the
    materialized reference math), and a learnable bias gets its gradient there."""
    q, k, v = data[:3]
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(1, 2, 8, 8, dtype=F64, generator=g)
    bias[..., 0, 3:] = float("-inf")  # a hidden pair too
    mod = scores.bias(bias, q_offset=-2)
    spec, tensors, _ = mod.key()
    assert spec == "bias(t0,-2,0)" and tensors[0] is mod.t
    rebuilt = scores.mod_from_key(spec, tensors, [])
    s = torch.randn(2, 2, 8, 8, dtype=F64, generator=g)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(2).view(1, 2, 1, 1)
    qp, kp = (torch.arange(8) - 2).view(1, 1, 8, 1), torch.arange(8).view(1, 1, 1, 8)
    torch.testing.assert_close(rebuilt(s, b, h, qp, kp), mod(s, b, h, qp, kp), atol=0, rtol=0)

    learn = bias.clone().requires_grad_()

    def f(q, bias):
        return attnlab.attention(q, k, v, mask=bias, backend="flash")

    rec = _OpRecorder()
    dynamo.reset()
    got = torch.compile(f, backend=rec, fullgraph=True)(q, learn)
    assert any("attnlab.flash_fwd" in t for t in rec.targets), rec.targets
    dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = cf(q, learn)
    want = f(q, learn)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    (ga,) = torch.autograd.grad(got.sum(), learn)
    (gb,) = torch.autograd.grad(want.sum(), learn)
    torch.testing.assert_close(ga, gb, atol=1e-12, rtol=0)
    assert ga.abs().sum() > 0
