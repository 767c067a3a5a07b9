import pytest
import torch

from flm.data import shipped_mnist
from flm.metrics.pixels import faint_share, faint_share_per_image


def levels_image(levels: list[int]) -> torch.Tensor:
    """One (1, 1, 1, len(levels)) float image in [-1, 1] whose pixels round to these 8-bit levels."""
    return (torch.tensor(levels, dtype=torch.float32) / 127.5 - 1).view(1, 1, 1, -1)


def test_counts_the_levels_5_to_15_inclusive():
    x = levels_image([0, 1, 4, 5, 10, 15, 16, 128, 255, 0])
    assert faint_share(x) == pytest.approx(3 / 10)
    assert faint_share(x, faint=(0, 4)) == pytest.approx(4 / 10)
    assert faint_share(levels_image([0] * 8)) == 0.0


def test_rounds_as_a_saved_sample_does():
    # level 4.6 rounds to 5 (faint), 15.4 to 15 (faint), 15.6 to 16 (not); below -1 is black
    x = (torch.tensor([4.6, 15.4, 15.6]) / 127.5 - 1).view(1, 1, 1, -1)
    assert faint_share_per_image(x).tolist() == pytest.approx([2 / 3])
    assert faint_share(torch.full((2, 1, 3, 3), -1.2)) == 0.0


def test_uint8_npz_layout_reads_the_same():
    x = torch.rand(4, 1, 6, 6) * 0.2 - 1  # levels 0-25
    as_npz = ((x + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert torch.equal(faint_share_per_image(as_npz), faint_share_per_image(x))


def test_test_digits_have_few_and_noisy_digits_many():
    digits = shipped_mnist().images[::5].float() / 127.5 - 1  # 2,000 test digits
    clean = faint_share(digits)
    noisy = faint_share(digits + 0.05 * torch.randn(digits.shape, generator=torch.Generator().manual_seed(0)))
    assert 0.004 < clean < 0.012 and noisy > 5 * clean


def test_refuses_a_range_outside_8_bits():
    with pytest.raises(ValueError, match="0 <= low <= high <= 255"):
        faint_share(torch.zeros(1, 1, 2, 2), faint=(16, 5))
