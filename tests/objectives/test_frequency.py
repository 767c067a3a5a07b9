"""The high-pass part of an image-shaped error (flm.objectives.frequency).

python -m pytest tests/objectives/test_frequency.py -q
"""

import pytest
import torch

from flm.objectives.checks import check_hf_weight
from flm.objectives.frequency import high_pass, squared_error


def _loop_high_pass(e):
    """e - the 3 x 3 binomial blur with replicated edges, one pixel at a time."""
    w = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
    B, C, H, W = e.shape
    out = torch.empty_like(e)
    for i in range(H):
        for j in range(W):
            acc = torch.zeros(B, C, dtype=e.dtype)
            for di in (-1, 0, 1):
                for dj in (-1, 0, 1):
                    ii, jj = min(max(i + di, 0), H - 1), min(max(j + dj, 0), W - 1)
                    acc += w[di + 1, dj + 1] * e[:, :, ii, jj]
            out[:, :, i, j] = e[:, :, i, j] - acc
    return out


def test_high_pass_matches_a_pixel_loop():
    e = torch.randn(3, 2, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(high_pass(e), _loop_high_pass(e))


def test_high_pass_removes_constants_and_ramps_and_keeps_the_finest_pattern():
    assert high_pass(torch.full((1, 1, 6, 6), 3.0)).abs().max() == 0
    ramp = torch.arange(8.0).expand(1, 1, 8, 8)
    assert high_pass(ramp)[..., 1:-1, 1:-1].abs().max() < 1e-6  # the blur keeps a linear image inside the borders
    i = torch.arange(8)
    checker = ((i[:, None] + i[None]) % 2 * 2 - 1).float().expand(1, 1, 8, 8)
    torch.testing.assert_close(high_pass(checker)[..., 1:-1, 1:-1], checker[..., 1:-1, 1:-1])  # the blur removes it all


def test_high_pass_needs_images():
    with pytest.raises(ValueError, match="image-shaped"):
        high_pass(torch.zeros(4, 2))


def test_squared_error_adds_the_weighted_high_pass_part():
    err = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    expected = err.square().flatten(1).sum(1) + 5.0 * _loop_high_pass(err).square().flatten(1).sum(1)
    torch.testing.assert_close(squared_error(err, 5.0), expected)
    torch.testing.assert_close(squared_error(err), err.square().flatten(1).sum(1))
    toy = torch.randn(8, 2)  # 2-D points: the plain squared error only
    torch.testing.assert_close(squared_error(toy), toy.square().sum(1))
    with pytest.raises(ValueError, match="hf_weight=0"):
        squared_error(toy, 1.0)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_check_hf_weight(bad):
    assert check_hf_weight(2.0) == 2.0
    with pytest.raises(ValueError, match="hf_weight"):
        check_hf_weight(bad)
