"""Shared test helpers: the DESIGN.md tolerance rule.

A fast path's error against the float64 oracle must be at most ``factor`` times the
error of the same-dtype reference (2x for outputs, 3x for gradients), plus a floor
``FLOOR[dtype]`` so that a reference that happens to be exact (float64 against
float64) does not demand bit equality.  The floor is a few ulps at unit scale.
"""

from __future__ import annotations

import torch

FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}


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
            t = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].flatten(2)
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
