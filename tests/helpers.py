"""Shared test helpers: the DESIGN.md tolerance rule.

A fast path's error against the float64 oracle must be at most ``factor`` times the
error of the same-dtype reference (2x for outputs, 3x for gradients), plus a floor
``FLOOR[dtype]`` so that a reference that happens to be exact (float64 against
float64) does not demand bit equality.  The floor is a few ulps at unit scale.
"""

from __future__ import annotations

import contextlib

import torch

FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}


# Named tolerances for the comparisons that are not "a fast path against the float64 oracle"
# (those use assert_close_rule / check_rule).  Each is a dict of ``rtol``/``atol`` for
# ``torch.testing.assert_close(a, b, **TOL)`` or ``torch.allclose(a, b, **TOL)``, grouped by why
# the two sides may differ at all.
#: Bitwise equal: the same kernels on the same inputs (a prefix that later tokens cannot change).
EXACT = dict(rtol=0, atol=0)
#: float64, the same math summed in another order or split into pieces (chunked scan vs the
#: sequential loop, chunked decode vs one call): a few hundred ulps at unit scale.
F64_REORDER = dict(rtol=1e-10, atol=1e-10)
#: float64 through a deeper graph than F64_REORDER covers (gradients, features rotated at an
#: offset): one more rounded product per element.
F64_REORDER_DEEP = dict(rtol=1e-9, atol=1e-9)
#: float64 results that must agree to a few ulps at unit scale (a closed form, another
#: summation order over a short row): FLOOR[float64], absolute.
F64_FLOOR = dict(rtol=0, atol=1e-12)
#: float32 computed in another order than the float64 side (a float32 pattern, float32 chunks
#: against one float32 call): ~100 float32 ulps.
F32_REORDER = dict(rtol=1e-5, atol=1e-5)
#: the same, float32 against float32 at unit scale: FLOOR[float32] absolute.
F32_REORDER_UNIT = dict(rtol=1e-5, atol=2e-6)
#: one float32 product (weights times a scalar): a few ulps, relative.
F32_PRODUCT = dict(rtol=1e-6, atol=0)

# --- float64: the same math written another way -------------------------------------------------
#: a float64 module against its formula written out by hand (the same products, fused or ordered
#: otherwise; a rotation against the complex-number form): ~5000 ulps at unit scale.
F64_FORMULA = dict(rtol=1e-12, atol=1e-12)
#: a float64 elementwise score mod against a Python loop over the same scalars: one or two
#: roundings of O(1-10) values, absolute.
F64_ELEMENTWISE = dict(rtol=0, atol=1e-14)
#: the same through a transcendental (torch's vectorised tanh against ``math.tanh``) or with
#: values up to ~100 (a custom mod adding position offsets): ten times wider.
F64_ELEMENTWISE_WIDE = dict(rtol=0, atol=1e-13)
#: float64 paths that sum in different orders (tiles against one softmax, a streamed or cached
#: decode against one forward), absolute: an LSE of -inf/large rows gets no relative slack.
F64_REORDER_ABS = dict(rtol=0, atol=1e-10)
#: a float64 attention mean over integer-valued tokens (up to a few hundred; a paged cache's
#: decode read): 1e-12 relative, plus an absolute 1e-9 for means near zero.
F64_TOKEN_MEAN = dict(rtol=1e-12, atol=1e-9)
#: float64, the same sums reached from equivalent arguments (a key set as a mask, a list or
#: indices) or a mean of per-row statistics: a few ulps, absolute.
F64_SAME_SUMS = dict(rtol=0, atol=1e-14)
#: float64 scalar summaries through a whole model or an eigendecomposition (copying scores,
#: a trace ratio from ``eigvals``): the eigen solver's backward error, absolute.
F64_SUMMARY = dict(rtol=0, atol=1e-9)

# --- transformers (float64 on both sides) against attnlab ------------------------------------
#: head scores (averaged patterns) of a transformers model against attnlab's copy of it.
HF_F64_HEAD_SCORES = dict(rtol=1e-6, atol=1e-6)
#: ablation effects (a loss or hidden-state change, per head) of a transformers model against
#: attnlab's copy: differences of two forward passes, so relative to the effect.
HF_F64_EFFECTS = dict(rtol=1e-6, atol=1e-9)
#: one ablation effect against the ratio of norms computed by hand (cancellation in h - h0).
ABLATION_BY_HAND = dict(rtol=1e-5, atol=1e-8)

# --- float32 ----------------------------------------------------------------------------------
#: float32 attention probabilities (in [0, 1]) from two paths of one model: ~10 ulps of 1.
F32_PROBS = dict(rtol=0, atol=1e-6)
#: a hook that zeroes heads against the model with those heads' weights zeroed: the same float32
#: products with exact zeros, summed in another order.
F32_ZEROED_HEADS = dict(rtol=0, atol=1e-6)
#: float32 results of one op, or a float64 computation stored as float32, against the same
#: computed another way (RoPE against transformers', the logit lens against the model's
#: log-probabilities): ~8 ulps relative plus 1e-6.
F32_FEW_ULPS = dict(rtol=1e-6, atol=1e-6)
#: a float32 result against the float64 computation of it (a float32 pattern, float32 sums of
#: probabilities): ~100 ulps relative, 1e-6 absolute near zero.
F32_AGAINST_F64 = dict(rtol=1e-5, atol=1e-6)
#: RoPE inverse frequencies (float32 powers of the base) against transformers': ~16 ulps relative.
F32_ROPE_FREQ = dict(rtol=2e-6, atol=0)
#: dynamically rescaled RoPE frequencies (a float64 rescale rounded to float32) against
#: transformers' float32 recomputation.
F32_ROPE_FREQ_RESCALED = dict(rtol=1e-5, atol=0)
#: a float32 block (RMSNorm, SwiGLU, attention) against its formula written out by hand.
F32_FORMULA = dict(rtol=2e-5, atol=2e-5)
#: float32 activations, logits (O(1-10)) or probabilities of one model in two implementations
#: that differ only in summation order (attnlab against transformers / TransformerLens /
#: sentence-transformers / eager attention): the issues' 1e-5 absolute bar.
F32_MODEL_PARITY = dict(rtol=0, atol=1e-5)
#: the gradients of such a pair: one more rounded product per element, so also relative.
F32_MODEL_PARITY_GRAD = dict(rtol=1e-4, atol=1e-5)
#: float32 results of one model, recomputed another way (a hook edit against the same edit made
#: by hand, a cached decode against a full forward, a sequence alone against in a batch): 1e-5.
F32_RECOMPUTE = dict(rtol=0, atol=1e-5)
#: a float32 residual stream (or logit) against the sum of its parts (up to 2L + 2 d_model
#: vectors of size ~1): a few ulps per term, accumulated.
F32_ACCUMULATED_SUM = dict(rtol=0, atol=1e-5)
#: float32 attention statistics accumulated tile by tile (entropy, masses) against their closed
#: forms (log n, 1/n): absolute for the entropy, relative for masses (torch.allclose's atol).
F32_ONLINE_STATS = dict(rtol=0, atol=1e-5)
F32_ONLINE_STATS_REL = dict(rtol=1e-5, atol=1e-8)
#: float32 means of attention mass over a batch, summed in another order than the lab's.
F32_MASS_MEANS = dict(rtol=0, atol=2e-5)
#: float32 logits after ten decode steps through a cache (quantized cache's float reference,
#: transformers' generate with an attnlab cache against its own): the errors of each step add up.
F32_DECODE_STEPS = dict(rtol=0, atol=1e-4)
#: float32 logits of O(1-10) through two layers on different backends (flash against eager).
F32_BACKENDS_DEEP = dict(rtol=1e-4, atol=1e-4)

#: two bf16 results of the same math by different sums (a fast path against the careful one):
#: 2^-7 absolute plus 2^-7 relative, one or two bf16 ulps at magnitudes up to about 1.
BF16_FEW_ULPS = dict(rtol=2**-7, atol=2**-7)

#: FlexAttention's bf16 rule (test_flex_attention.py's _check_out fudge factor): a kernel's mean
#: error against float64 at most this times the same-dtype eager reference's
#: (tests/ops/native/flex_bf16.py; the peers' port, tests/peers/peer_refs.py, for bf16 and float16).
FLEX_BF16_FACTOR = 1.1

# --- inequalities: an edit must change the result ---------------------------------------------
# Used as ``assert not torch.allclose(a, b, **MOVED)``: a looser value makes the check stronger.
# ``rtol`` is torch.allclose's default.
#: the result moves by more than 1e-3 (+ 1e-5 relative) somewhere.
MOVED = dict(rtol=1e-5, atol=1e-3)
#: the result moves by more than 1e-4 (+ 1e-5 relative) somewhere.
MOVED_SLIGHTLY = dict(rtol=1e-5, atol=1e-4)


def scaled(tol: dict, factor: float) -> dict:
    """``tol`` with its ``atol`` multiplied by ``factor`` (a comparison at scale ``factor``)."""
    return dict(tol, atol=tol["atol"] * factor)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error, treating matching infinities as equal; NaN anywhere is infinite error."""
    x, ref = x.double(), ref.double()
    if torch.isnan(x).any():
        return float("inf")
    same_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    d = torch.where(same_inf, torch.zeros_like(x), (x - ref).abs())
    d = torch.nan_to_num(d, nan=float("inf"))
    return float(d.max()) if d.numel() else 0.0


def assert_close_rule(fast, ref_same_dtype, oracle, dtype, factor=2.0, what="output"):
    """``err(fast, oracle) <= factor * err(ref_same_dtype, oracle) + FLOOR[dtype]``."""
    e_fast = max_err(fast, oracle)
    e_ref = max_err(ref_same_dtype, oracle)
    bound = factor * e_ref + FLOOR[dtype]
    assert e_fast <= bound, f"{what}: fast-path error {e_fast:.3e} > {factor}x reference error {e_ref:.3e} + floor"


#: DESIGN.md's factors on the same-dtype reference's error: 2x for an output or an LSE, 3x for
#: a gradient (the backward adds one more rounded product per element).
def rule_factor(key: str) -> float:
    return 2.0 if key in ("out", "lse") else 3.0


# A score mod's parameter gradient is a reduction over all B*H*Nq*Nk scores, of magnitude
# M = max|dparam| (20-300 in these tests, not ~1).  The same-dtype reference differentiates
# the materialized softmax, whose dS rows sum to exactly zero in its accumulator, so a
# parameter that collects whole rows (relative_bias's clipped bins, ALiBi's slope) sees
# almost none of the reference's rounding; the flash backward's dS = P*(dP - rowsum(dO*O))
# has per-row rounding in rowsum(dO*O) that such a parameter sums up.  Measured excess over
# the 3x rule: <= 0.35 eps(dtype) * M over 18 seeds/mods/dtypes on flash; 1.14 eps * M on the
# Triton kernels (interpreted) for symmetric ALiBi under causal() (M = 147: both-sided |dist|
# weights make the slope collect the largest sums).  Those were measured where torch and numpy
# ran MKL/AVX-512 GEMMs; on a 2-core AMD EPYC with AVX2 only (2026-12-01) the same-dtype reference
# sums in another order and the excess of flash's scalar dw (a weight on every score, N=64
# causal) was 5.4 eps * M: allow eight eps * M.
PARAM_GRAD_SLACK_EPS = 8.0
#: ALiBi with slope 4 (scores to about -400) on the interpreted Triton kernels: numpy's AVX2
#: matmul leaves an excess of 36 eps * M (M = 10.5) over the 3x rule in the slope gradient
#: (measured 2026-12-01, AMD EPYC AVX2); the same case was within 2 eps * M on AVX-512.
STEEP_SCORES_PARAM_SLACK_EPS = 48.0


def check_param_grad(fast, ref, oracle, dtype, what="dparam", slack_eps=PARAM_GRAD_SLACK_EPS):
    """The 3x rule for a score mod's parameter gradient, plus ``slack_eps`` eps(dtype) times
    its largest entry (see :data:`PARAM_GRAD_SLACK_EPS`)."""
    e_fast, e_ref = max_err(fast, oracle), max_err(ref, oracle)
    M = float(oracle.abs().max()) if oracle.numel() else 0.0
    bound = 3.0 * e_ref + FLOOR[dtype] + slack_eps * torch.finfo(dtype).eps * M
    assert e_fast <= bound, (
        f"{what}: fast-path error {e_fast:.3e} > 3x reference error {e_ref:.3e} + floor "
        f"+ {slack_eps} eps * max|dparam| ({M:.3g})"
    )


def check_rule(
    fast: dict,
    ref: dict,
    oracle: dict,
    dtype,
    what="",
    *,
    keys=None,
    nan_free=False,
    param_slack_eps=PARAM_GRAD_SLACK_EPS,
):
    """The DESIGN.md rule on a result dict (``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``dparam``):
    :func:`assert_close_rule` with :func:`rule_factor` per key, :func:`check_param_grad` for
    ``dparam``.  ``keys=None`` checks the keys ``fast`` holds (None values skipped); given
    ``keys``, each must be there.  ``nan_free`` also refuses NaN in ``fast`` (even where the
    reference has NaN too, which would make the bound infinite)."""
    required = keys is not None
    for key in keys if required else ("out", "lse", "dq", "dk", "dv", "dparam"):
        if key not in fast or fast[key] is None:
            assert not required, f"{what} {key}: missing from the result"
            continue
        f, r, o = fast[key], ref[key], oracle[key]
        assert f.shape == o.shape, f"{what} {key}: shape {tuple(f.shape)} != oracle {tuple(o.shape)}"
        if nan_free:
            assert not torch.isnan(f).any(), f"{what} {key}: NaN"
        if key == "dparam":
            check_param_grad(f, r, o, dtype, what=f"{what} {key}", slack_eps=param_slack_eps)
        else:
            assert_close_rule(f, r, o, dtype, factor=rule_factor(key), what=f"{what} {key}")


def mask_dense(m, B, H, Nq, Nk, qo, ko):
    """A mask's predicate evaluated on the whole (B, H, Nq, Nk) grid of absolute positions."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qp = (torch.arange(Nq) + qo).view(1, 1, Nq, 1)
    kp = (torch.arange(Nk) + ko).view(1, 1, 1, Nk)
    out = m(b, h, qp, kp)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bool
    return torch.broadcast_to(out, (B, H, Nq, Nk))


def tile_truth(dense, bq, bk):
    """(any, all) per (bq, bk) tile of a dense (B, H, Nq, Nk) mask, by slicing (the last
    tiles are truncated)."""
    B, H, Nq, Nk = dense.shape
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    anyt = torch.zeros(B, H, nqb, nkb, dtype=torch.bool)
    allt = torch.zeros(B, H, nqb, nkb, dtype=torch.bool)
    for i in range(nqb):
        for j in range(nkb):
            t = dense[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].flatten(2)
            anyt[:, :, i, j], allt[:, :, i, j] = t.any(-1), t.all(-1)
    return anyt, allt


def assert_tiles_sound(states, dense, bq, bk, where, exact):
    """A BlockMask's tile states (expanded to (B, H, nqb, nkb)) against the truth from the
    dense mask: EMPTY tiles hold no allowed pair, FULL tiles no forbidden one, and with
    ``exact`` every tile has the one verdict the truth gives."""
    from attnlab.masks import EMPTY, FULL, PARTIAL

    anyt, allt = tile_truth(dense, bq, bk)
    assert not ((states == EMPTY) & anyt).any(), f"{where}: a tile marked EMPTY has an allowed pair"
    assert not ((states == FULL) & ~allt).any(), f"{where}: a tile marked FULL has a forbidden pair"
    if exact:
        want = torch.where(~anyt, EMPTY, torch.where(allt, FULL, PARTIAL)).to(torch.int8)
        bad = torch.nonzero(states != want)
        assert bad.numel() == 0, f"{where}: not exact at (b, h, qb, kb) {bad[:5].tolist()}"


@contextlib.contextmanager
def lab_lock(name: str):
    """An exclusive lock shared by every process of a test run (a file under the lab cache):
    one pytest-xdist worker trains a lab model while the others wait, then read the cache."""
    import fcntl

    from attnlab.lab import cache_dir

    with open(cache_dir() / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
