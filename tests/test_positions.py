import pytest
import torch

from attnlab.positions import alibi_slopes


def test_alibi_slopes_power_of_two_is_the_papers_geometric_sequence():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_alibi_slopes_other_counts_follow_the_reference_interleaving():
    s12 = alibi_slopes(12)
    assert torch.allclose(s12[:8], alibi_slopes(8))
    assert torch.allclose(s12[8:], alibi_slopes(16)[0::2][:4])
    assert s12.shape == (12,) and (s12 > 0).all()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"])
def test_alibi_slopes_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="n_heads"):
        alibi_slopes(bad)
