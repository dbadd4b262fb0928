"""Attention dropout (``attention(..., dropout_p=, dropout_seed=)``, :mod:`attnlab.ops.dropout`).

* the same seed gives the same keep-mask on every backend and tiling, so the flash path
  meets the DESIGN.md rule against the float64 reference *with dropout* (outputs 2x,
  gradients 3x), and the reference equals an independent dense computation with the
  mask from :func:`dropout_mask`;
* reproducible for a given seed (and under ``torch.manual_seed`` when no seed is given);
* statistically right: the keep rate within a binomial bound, neighbours uncorrelated,
  and the mean output over seeds within a CLT bound of the no-dropout output;
* ``dropout_p=0`` is the no-dropout path exactly; fully masked rows stay 0; the LSE is
  that of the undropped scores; SDPA refuses; bad arguments are refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import attnlab
from attnlab import masks
from tests.helpers import FLOOR, check_rule
from tests.ops.conftest import dense_allowed, loss_weights, make_qkv

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
# Statistical tests fail with probability ~ 1e-6 per check at this many standard deviations
# (normal tails); the seeds are fixed, so a pass is deterministic.
SIGMAS = 5.0


def _keep(*a, **kw):
    from attnlab.ops.dropout import dropout_mask

    return dropout_mask(*a, **kw)


def _run(q, k, v, *, backend, grad=True, **kw):
    """out, lse and grads of (out·w).sum() + (finite lse·c).sum() (as tests/ops/conftest.run_case)."""
    q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    out, lse = attnlab.attention(q, k, v, return_lse=True, backend=backend, **kw)
    res = {"out": out.detach(), "lse": lse.detach()}
    if grad:
        B, H, Nq, Dv = out.shape
        w, c = loss_weights(B, H, Nq, Dv)
        loss = (out.double() * w).sum() + (torch.where(torch.isinf(lse), 0, lse).double() * c).sum()
        for n, g in zip(("dq", "dk", "dv"), torch.autograd.grad(loss, (q, k, v)), strict=True):
            res[n] = g
    return res


def _rule(fast, ref, oracle, dtype, what):
    check_rule(fast, ref, oracle, dtype, what, keys=tuple(fast))


CASES = {  # (B, H, Hkv, Nq, Nk, D, Dv), mask
    "mha-none": ((1, 2, 2, 33, 45, 16, 16), None),
    "gqa-causal": ((2, 4, 2, 40, 40, 16, 8), masks.causal()),
    "mqa-window-nq<nk": ((1, 3, 1, 17, 50, 40, 24), masks.sliding_window(9)),
    "decode": ((2, 2, 2, 1, 37, 16, 16), masks.causal()),
}


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_meets_the_rule_against_the_reference_with_the_same_seed(case, dtype):
    shape, mask = CASES[case]
    q, k, v = make_qkv(*shape, dtype=dtype, seed=3)
    kw = dict(mask=mask, dropout_p=0.25, dropout_seed=1234)
    oracle = _run(q.double(), k.double(), v.double(), backend="reference", **kw)
    ref = _run(q, k, v, backend="reference", **kw)
    fast = _run(q, k, v, backend="flash", **kw)
    _rule(fast, ref, oracle, dtype, case)


@pytest.mark.parametrize("block", [(16, 16), (8, 32), (32, 8)])
def test_any_tiling_gives_the_same_mask(block):
    from attnlab.ops.dropout import Dropout
    from attnlab.ops.flash import flash_attention

    q, k, v = make_qkv(2, 4, 2, 37, 53, 16, dtype=F64, seed=5)
    want = _run(q, k, v, backend="reference", mask=masks.causal(), dropout_p=0.4, dropout_seed=77)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = flash_attention(
        q, k, v, mask=masks.causal(), scale=0.25, q_offset=53 - 37, block=block, dropout=Dropout(0.4, 77)
    )
    w, c = loss_weights(2, 4, 37, 16)
    g = torch.autograd.grad((out * w).sum() + (torch.where(torch.isinf(lse), 0, lse) * c).sum(), (q, k, v))
    tol = 1e3 * FLOOR[F64]  # float64 sums in a different order: rounding only
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *g), strict=True):
        assert (got - want[name]).abs().max() <= tol, name


@settings(max_examples=8, deadline=None)
@given(
    bq=st.integers(5, 40),
    bk=st.integers(5, 40),
    seed=st.integers(-(2**63), 2**64 - 1),
    p=st.floats(0.01, 0.95),
    causal=st.booleans(),
)
def test_property_flash_equals_reference_at_any_tiling_and_seed(bq, bk, seed, p, causal):
    from attnlab.ops.dropout import Dropout
    from attnlab.ops.flash import flash_attention

    q, k, v = make_qkv(1, 2, 1, 23, 31, 8, dtype=F64, seed=6)
    mask = masks.causal() if causal else None
    want = attnlab.attention(q, k, v, mask=mask, dropout_p=p, dropout_seed=seed, backend="reference")
    got, _ = flash_attention(q, k, v, mask=mask, scale=8**-0.5, q_offset=8, block=(bq, bk), dropout=Dropout(p, seed))
    assert (got - want).abs().max() <= 1e3 * FLOOR[F64]


def test_reference_equals_a_dense_computation_with_the_public_mask():
    q, k, v = make_qkv(2, 4, 2, 9, 13, 8, dtype=F64, seed=1)
    p, seed, qo, ko = 0.3, 2**40 + 7, 2, 5
    out, lse = attnlab.attention(
        q,
        k,
        v,
        mask=masks.causal(),
        dropout_p=p,
        dropout_seed=seed,
        q_offset=qo,
        kv_offset=ko,
        return_lse=True,
        backend="reference",
    )
    allowed = dense_allowed(masks.causal(), 2, 4, 9, 13, qo, ko)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) / math.sqrt(8)
    s = s.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(s, -1).nan_to_num(0.0)
    z = _keep(2, 4, 9, 13, p=p, seed=seed, q_offset=qo, kv_offset=ko)
    want = torch.einsum("bhqk,bhkd->bhqd", probs * z / (1 - p), v.repeat_interleave(2, 1))
    assert (out - want).abs().max() <= 10 * FLOOR[F64]
    assert torch.equal(torch.isinf(lse), torch.isinf(torch.logsumexp(s, -1)))  # LSE of the undropped scores
    assert (lse - torch.logsumexp(s, -1)).nan_to_num(0.0).abs().max() <= 10 * FLOOR[F64]
    assert not z.all() and z.any()


def test_same_seed_same_result_and_a_new_seed_a_new_mask():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, dtype=F32, seed=2)
    a = attnlab.attention(q, k, v, dropout_p=0.5, dropout_seed=9, backend="flash")
    b = attnlab.attention(q, k, v, dropout_p=0.5, dropout_seed=9, backend="flash")
    c = attnlab.attention(q, k, v, dropout_p=0.5, dropout_seed=10, backend="flash")
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(_keep(1, 2, 16, 16, p=0.5, seed=9), _keep(1, 2, 16, 16, p=0.5, seed=10))


def test_no_seed_draws_from_torch_default_generator():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, dtype=F32, seed=2)
    torch.manual_seed(123)
    a1 = attnlab.attention(q, k, v, dropout_p=0.5, backend="flash")
    a2 = attnlab.attention(q, k, v, dropout_p=0.5, backend="flash")
    torch.manual_seed(123)
    b1 = attnlab.attention(q, k, v, dropout_p=0.5, backend="flash")
    b2 = attnlab.attention(q, k, v, dropout_p=0.5, backend="flash")
    assert torch.equal(a1, b1) and torch.equal(a2, b2) and not torch.equal(a1, a2)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(
        attnlab.attention(q, k, v, dropout_p=0.5, dropout_seed=g1, backend="flash"),
        attnlab.attention(q, k, v, dropout_p=0.5, dropout_seed=g2, backend="flash"),
    )


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_binomial(p):
    B, H, Nq, Nk = 2, 3, 64, 96
    z = _keep(B, H, Nq, Nk, p=p, seed=31337, q_offset=-5)
    n = z.numel()
    sd = math.sqrt(n * p * (1 - p))
    assert abs(int(z.sum()) - n * (1 - p)) <= SIGMAS * sd
    for dim in (0, 1, 2, 3):  # every batch, head, row and column keeps 1-p (no stuck counters)
        per = z.float().mean(dim=[d for d in range(4) if d != dim])
        m = n // z.shape[dim]
        assert (per - (1 - p)).abs().max() <= SIGMAS * math.sqrt(p * (1 - p) / m), dim
    # neighbours (next key, next query, next head, next seed) agree as independent bits would
    x = z.float()
    want = p * p + (1 - p) * (1 - p)
    other = _keep(B, H, Nq, Nk, p=p, seed=31338, q_offset=-5).float()
    for a, b in ((x[..., 1:], x[..., :-1]), (x[:, :, 1:], x[:, :, :-1]), (x[:, 1:], x[:, :-1]), (x, other)):
        agree = (a == b).float()
        assert abs(float(agree.mean()) - want) <= SIGMAS * math.sqrt(want * (1 - want) / agree.numel())


def test_rectangles_look_independent():
    """The weak spot of hashes that combine a row state and a column state: the XOR of the
    four corners of a rectangle of bits must be a fair coin (p = 0.5)."""
    z = _keep(1, 1, 256, 256, p=0.5, seed=4)[0, 0].int()
    for a, b in ((1, 1), (2, 3), (7, 1)):
        r = z[a:, b:] ^ z[:-a, b:] ^ z[a:, :-b] ^ z[:-a, :-b]
        assert abs(float(r.float().mean()) - 0.5) <= SIGMAS * math.sqrt(0.25 / r.numel()), (a, b)


def test_mean_over_seeds_is_the_no_dropout_output():
    q, k, v = make_qkv(1, 2, 1, 6, 10, 8, dtype=F64, seed=4)
    S, p = 200, 0.3
    want = attnlab.attention(q, k, v, mask=masks.causal(), backend="reference")
    outs = torch.stack(
        [
            attnlab.attention(q, k, v, mask=masks.causal(), dropout_p=p, dropout_seed=s, backend="reference")
            for s in range(S)
        ]
    )  # = flash's (tested above)
    mean, sd = outs.mean(0), outs.std(0)
    # CLT: the sample mean is within SIGMAS standard errors (rows seeing one key: no variance)
    assert ((mean - want).abs() <= SIGMAS * sd / math.sqrt(S) + 1e3 * FLOOR[F64]).all()
    assert (sd > 0).any()


def test_dropout_zero_is_exactly_the_no_dropout_path():
    q, k, v = make_qkv(1, 2, 2, 20, 20, 8, dtype=F32, seed=6)
    for be in ("auto", "flash", "reference", "sdpa"):
        state = torch.get_rng_state()
        a = attnlab.attention(q, k, v, mask=masks.causal(), backend=be)
        b = attnlab.attention(q, k, v, mask=masks.causal(), backend=be, dropout_p=0.0, dropout_seed=3)
        c = attnlab.attention(q, k, v, mask=masks.causal(), backend=be, dropout_p=0)
        assert torch.equal(a, b) and torch.equal(a, c), be
        assert torch.equal(state, torch.get_rng_state()), f"{be}: p=0 drew from the generator"


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_fully_masked_rows_stay_zero(backend):
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8, dtype=F64, seed=7)
    mask = masks.causal()  # q_offset=-2: the first two rows see no key
    r = _run(q, k, v, backend=backend, mask=mask, q_offset=-2, dropout_p=0.5, dropout_seed=1)
    assert (r["out"][:, :, :2] == 0).all() and torch.isinf(r["lse"][:, :, :2]).all()
    assert (r["dq"][:, :, :2] == 0).all()
    assert all(torch.isfinite(r[n]).all() for n in ("out", "dq", "dk", "dv"))


def test_auto_routes_dropout_to_flash_and_sdpa_refuses():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, dtype=F32, seed=8)
    kw = dict(mask=masks.causal(), dropout_p=0.2, dropout_seed=42)
    assert torch.equal(
        attnlab.attention(q, k, v, backend="auto", **kw), attnlab.attention(q, k, v, backend="flash", **kw)
    )
    with pytest.raises(ValueError, match=r"sdpa.*dropout"):
        attnlab.attention(q, k, v, backend="sdpa", **kw)


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_gradcheck_with_dropout(backend):
    q, k, v = (t.requires_grad_(True) for t in make_qkv(1, 2, 1, 5, 7, 4, dtype=F64, seed=9))
    assert torch.autograd.gradcheck(
        lambda q, k, v: attnlab.attention(
            q, k, v, mask=masks.causal(), dropout_p=0.4, dropout_seed=11, backend=backend
        ),
        (q, k, v),
    )


@pytest.mark.parametrize(
    "p, seed, err",
    [
        (1.0, None, ValueError),
        (-0.1, None, ValueError),
        (float("nan"), None, ValueError),
        ("0.1", None, TypeError),
        (True, None, TypeError),
        (0.1, "7", TypeError),
        (0.1, 1.5, TypeError),
        (0.1, 2**70, ValueError),
    ],
)
def test_bad_dropout_arguments_are_refused(p, seed, err):
    q, k, v = make_qkv(1, 1, 1, 4, 4, 8, dtype=F32)
    with pytest.raises(err, match=r"dropout_(p|seed): expected"):
        attnlab.attention(q, k, v, dropout_p=p, dropout_seed=seed)
