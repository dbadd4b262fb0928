"""Modern Hopfield network (attnlab.ops.hopfield): one update is softmax attention with
Q = ξ, K = V = X and scale β; the energy never increases along updates and is ≥ 0;
well-separated patterns are retrieved from noisy probes in one step at large β."""

import math

import pytest
import torch

import attnlab
from attnlab.ops.hopfield import hopfield_energy, hopfield_retrieve, hopfield_update

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny problems: a 2nd thread only spins


def _draw(B=3, N=20, M=5, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, N, d, generator=g, dtype=torch.float64).to(dtype)
    xi = torch.randn(B, M, d, generator=g, dtype=torch.float64).to(dtype)
    return X, xi


def _explicit_update(xi, X, beta):
    """ξ_new = X softmax(β Xᵀ ξ), column-vector form, one state at a time (float64)."""
    out = torch.empty_like(xi, dtype=torch.float64)
    for b in range(xi.shape[0]):
        Xc = X[b].double().T  # (d, N): patterns as columns
        for m in range(xi.shape[1]):
            out[b, m] = Xc @ torch.softmax(beta * (Xc.T @ xi[b, m].double()), dim=0)
    return out


@pytest.mark.parametrize("beta", [0.05, 0.5, 3.0])
@pytest.mark.parametrize("backend", ["reference", "flash", "sdpa"])
def test_update_is_softmax_attention(beta, backend):
    X, xi = _draw(N=37, M=6, d=24, seed=int(beta * 100))
    got = hopfield_update(xi, X, beta)
    att = attnlab.attention(xi[:, None], X[:, None], X[:, None], scale=beta, backend=backend)[:, 0]
    assert got.shape == xi.shape and got.dtype == torch.float64
    assert (got - att).abs().max() < 1e-12
    assert (got - _explicit_update(xi, X, beta)).abs().max() < 1e-12


def test_update_float32_and_unbatched():
    X, xi = _draw(dtype=torch.float32)
    got = hopfield_update(xi, X, 0.7)
    assert got.dtype == torch.float32
    assert (got.double() - _explicit_update(xi, X, 0.7)).abs().max() < 1e-5
    one = hopfield_update(xi[1], X[1], 0.7)
    assert one.shape == xi[1].shape and torch.allclose(one, got[1], atol=1e-6)
    assert hopfield_energy(xi[1], X[1], 0.7).shape == (xi.shape[1],)


@pytest.mark.parametrize("beta", [0.1, 1.0, 8.0])
def test_energy_never_increases_and_is_nonnegative(beta):
    X, xi = _draw(B=4, N=30, M=8, d=12, seed=7)
    X = X * 1.5
    state = xi * 3.0
    e = hopfield_energy(state, X, beta)
    assert e.shape == (4, 8) and (e >= 0).all()
    decreased = torch.zeros_like(e, dtype=torch.bool)
    for _ in range(15):
        state = hopfield_update(state, X, beta)
        e_new = hopfield_energy(state, X, beta)
        assert (e_new <= e + 1e-12 * (1 + e.abs())).all()
        assert (e_new >= 0).all()
        decreased |= e_new < e - 1e-9
        e = e_new
    assert decreased.all()  # it really moves: every state's energy went down at some step


def test_energy_formula():
    X, xi = _draw(B=2, N=5, M=3, d=4, seed=1)
    beta = 0.8
    want = torch.empty(2, 3, dtype=torch.float64)
    for b in range(2):
        Mx = max(float(x.norm()) for x in X[b])
        for m in range(3):
            s = sum(math.exp(beta * float(x @ xi[b, m])) for x in X[b])
            want[b, m] = -math.log(s) / beta + 0.5 * float(xi[b, m] @ xi[b, m]) + math.log(5) / beta + 0.5 * Mx**2
    assert (hopfield_energy(xi, X, beta) - want).abs().max() < 1e-12


def _hadamard(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_one_step_retrieves_well_separated_patterns():
    """Orthogonal ±1 patterns (Hadamard rows), d = 64, probes with 8 entries flipped: the
    target's overlap is 64 − 16 = 48, any other's at most 16, so one step at β = 1 lands
    on the stored pattern up to N·exp(−32) ≈ 1e-13."""
    g = torch.Generator().manual_seed(3)
    B, N, d = 2, 24, 64
    Hd = _hadamard(d)
    X = torch.stack([Hd[torch.randperm(d, generator=g)[:N]] for _ in range(B)])
    X = X * (torch.randint(0, 2, (B, N, 1), generator=g) * 2 - 1)  # random signs
    noisy = X.clone()
    idx = torch.rand(B, N, d, generator=g).argsort(-1)[..., :8]
    noisy.scatter_(-1, idx, -noisy.gather(-1, idx))
    out = hopfield_update(noisy, X, 1.0)
    assert (out - X).abs().max() < 1e-10
    # at small β the same step blurs the patterns together instead of retrieving one
    assert (hopfield_update(noisy, X, 0.01) - X).abs().max() > 0.5


def test_retrieve_reaches_a_fixed_point():
    X, _ = _draw(B=2, N=6, M=1, d=32, seed=5)
    probe = X[:, :3] + 0.3 * torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    state, n = hopfield_retrieve(probe, X, beta=1.0, steps=50, tol=1e-10)
    assert 1 <= n < 50
    assert (hopfield_update(state, X, 1.0) - state).abs().max() <= 1e-10
    # a fixed point near the stored pattern, off it by the other patterns' exp(-β·gap) weights
    assert (state - X[:, :3]).abs().max() < 1e-4
    cos = torch.nn.functional.cosine_similarity(state[:, :, None], X[:, None], dim=-1)  # (B, 3, N)
    assert torch.equal(cos.argmax(-1), torch.arange(3).expand(2, 3))
    state1, n1 = hopfield_retrieve(probe, X, beta=1.0, steps=1)
    assert n1 == 1 and torch.equal(state1, hopfield_update(probe, X, 1.0))


def test_errors_name_the_argument():
    X, xi = _draw()
    with pytest.raises(ValueError, match="beta"):
        hopfield_update(xi, X, 0.0)
    with pytest.raises(ValueError, match="beta"):
        hopfield_update(xi, X, float("inf"))
    with pytest.raises(ValueError, match="pattern dimension"):
        hopfield_update(xi[..., :5], X, 1.0)
    with pytest.raises(ValueError, match="batch sizes differ"):
        hopfield_update(xi[:2], X, 1.0)
    with pytest.raises(ValueError, match="xi, patterns: expected xi"):
        hopfield_update(xi[0], X, 1.0)
    with pytest.raises(TypeError, match="xi, patterns must share a dtype"):
        hopfield_update(xi.float(), X, 1.0)
    with pytest.raises(TypeError, match="xi"):
        hopfield_update(xi.long(), X.long(), 1.0)
    with pytest.raises(ValueError, match="steps"):
        hopfield_retrieve(xi, X, 1.0, steps=0)
    with pytest.raises(ValueError, match="tol"):
        hopfield_retrieve(xi, X, 1.0, tol=-1.0)
    with pytest.raises(ValueError, match="patterns"):
        hopfield_energy(xi, X[:, :0], 1.0)
