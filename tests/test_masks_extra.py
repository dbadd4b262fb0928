"""masks.band / sliding_window(w, right=r) (flash-attn's window_size=(left, right)) and
masks.dense: predicates and exact tile classification (attnlab/masks/extra.py, issue 15)."""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from tests.helpers import assert_tiles_sound, mask_dense


def _flash_window(Nq, Nk, left, right):
    """flash-attn's local mask (tests/test_flash_attn.py::construct_local_mask): True = attend."""
    row = torch.arange(Nq).view(-1, 1)
    col = torch.arange(Nk).view(1, -1)
    sk, sq = Nk, Nq
    hide = torch.zeros(Nq, Nk, dtype=torch.bool)
    if left >= 0:
        hide |= col < row + sk - sq - left
    if right >= 0:
        hide |= col > row + sk - sq + right
    return ~hide


@pytest.mark.parametrize("left, right", [(3, 2), (0, 0), (5, -1), (-1, 4), (-1, -1), (1, 7)])
@pytest.mark.parametrize("Nq, Nk", [(9, 13), (13, 9), (1, 20), (17, 17)])
def test_band_is_flash_attn_window(left, right, Nq, Nk):
    m = masks.band(left, right)
    assert torch.equal(mask_dense(m, 1, 1, Nq, Nk, Nk - Nq, 0)[0, 0], _flash_window(Nq, Nk, left, right))
    for block in ((4, 4), (3, 5), (8, 2)):
        bm = m.block_mask(1, 1, Nq, Nk, block=block)
        assert_tiles_sound(
            bm.states.expand(1, 1, -1, -1), mask_dense(m, 1, 1, Nq, Nk, Nk - Nq, 0), *block, repr(m), exact=True
        )


def test_sliding_window_right_is_band():
    for w, r in ((1, 0), (4, 3), (6, 1)):
        a = mask_dense(masks.sliding_window(w, right=r), 1, 1, 11, 15, 4, 0)
        b = mask_dense(masks.band(w - 1, r), 1, 1, 11, 15, 4, 0)
        assert torch.equal(a, b)
    assert repr(masks.sliding_window(4)) == "sliding_window(4)"  # right=0 keeps the built-in kind


def test_band_and_window_errors():
    with pytest.raises(ValueError, match=r"band\(left\): expected an int >= 0, got -2"):
        masks.band(-2, 0)
    with pytest.raises(TypeError, match=r"band\(right\): expected an int"):
        masks.band(1, 2.0)
    with pytest.raises(ValueError, match=r"sliding_window\(right\): expected an int >= 0"):
        masks.sliding_window(3, right=-1)


def test_dense_mask_errors():
    with pytest.raises(TypeError, match=r"masks.dense\(t\): expected a bool tensor"):
        masks.dense(torch.ones(3, 3), q_offset=0)
    m = masks.dense(torch.ones(3, 4, dtype=torch.bool), q_offset=1)
    with pytest.raises(ValueError, match=r"masks.dense: built for q_offset=1"):
        m.block_mask(1, 1, 3, 4, q_offset=0)
