"""flm.data: the shipped dataset, clear errors for missing data, a loader that resumes exactly."""

import pytest
import torch

from flm.data import DataConfig, Loader, build_dataset, shipped_mnist


@pytest.fixture(scope="module")
def digits():
    return shipped_mnist()


def test_shipped_mnist(digits):
    assert len(digits) == 10_000 and (digits.channels, digits.resolution, digits.num_classes) == (1, 28, 10)
    x, y = digits.__getitems__([0, 1, 2])
    assert x.shape == (3, 1, 28, 28) and x.min() >= -1 and x.max() <= 1 and y.tolist() == [7, 2, 1]
    assert torch.bincount(digits.labels).min() > 800  # every digit is there


def test_loader_resumes_exactly(digits):
    a = Loader(digits, batch_size=16, rank=0, world_size=1, seed=3)
    first = [a.next() for _ in range(700)]  # crosses an epoch boundary (625 batches per epoch)
    b = Loader(digits, batch_size=16, rank=0, world_size=1, seed=3)
    for _ in range(650):
        b.next()
    c = Loader(digits, batch_size=16, rank=0, world_size=1, seed=3)
    c.load_state_dict(b.state_dict())
    for (xa, ya), (xc, yc) in zip(first[650:], (c.next() for _ in range(50))):
        assert torch.equal(xa, xc) and torch.equal(ya, yc)


def test_loader_order_does_not_depend_on_world_size(digits):
    one = Loader(digits, batch_size=8, rank=0, world_size=1, seed=0, hflip=True)
    ranks = [Loader(digits, batch_size=4, rank=r, world_size=2, seed=0, hflip=True) for r in range(2)]
    for _ in range(3):
        x, y = one.next()
        parts = [loader.next() for loader in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*data.root"):
        build_dataset("mnist", root=str(tmp_path / "nope"))


def test_torchvision_files_missing_offline(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"mnist not found: expected train-images-idx3-ubyte.*fetch-data"):
        build_dataset("mnist", root=str(tmp_path), download=False)
    with pytest.raises(FileNotFoundError, match=r"mnist not found: expected t10k-images-idx3-ubyte"):
        build_dataset("mnist", root=str(tmp_path), download=False, split="test")
    with pytest.raises(ValueError, match="unknown split 'val'; valid splits: train, test"):
        build_dataset("mnist", root=str(tmp_path), split="val")


def test_empty_image_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no images"):
        DataConfig(name="imagefolder", root=str(tmp_path), resolution=8).build()


def test_image_folder(tmp_path):
    from PIL import Image

    for cls in ("cats", "dogs"):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("RGB", (12, 10), (40 * i, 80, 200)).save(tmp_path / cls / f"{i}.png")
    data = DataConfig(name="imagefolder", root=str(tmp_path), resolution=8).build()
    x, y = data.__getitems__([0, 3])
    assert x.shape == (2, 3, 8, 8) and y.tolist() == [0, 1] and data.num_classes == 2


def test_unknown_dataset():
    with pytest.raises(ValueError, match="valid names: mnist_shipped"):
        DataConfig(name="imagenet")
