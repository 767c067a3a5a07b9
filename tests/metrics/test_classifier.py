import pytest
import torch

from flm.data import shipped_mnist
from flm.metrics.classifier import label_accuracy, load_classifier, predict


@pytest.fixture(scope="module")
def digits():
    data = shipped_mnist()
    idx = torch.arange(0, len(data), 5)  # 2,000 of the 10,000 test digits
    return data.images[idx], data.labels[idx]


def test_shipped_weights_read_the_test_digits(digits):
    images_u8, labels = digits
    x = images_u8.float() / 127.5 - 1  # as a generator returns them
    assert label_accuracy(x, labels) >= 0.98


def test_uint8_npz_layout_reads_the_same(digits):
    images_u8, _ = digits
    net = load_classifier()
    as_npz = images_u8[:200].permute(0, 2, 3, 1).numpy()  # sample.py's (N, H, W, C) uint8
    as_float = images_u8[:200].float() / 127.5 - 1
    assert torch.equal(predict(as_npz, classifier=net), predict(as_float, classifier=net))


def test_wrong_labels_score_low(digits):
    images_u8, labels = digits
    assert label_accuracy(images_u8.float() / 127.5 - 1, (labels + 1) % 10) < 0.05


def test_refuses_other_shapes():
    with pytest.raises(ValueError, match="1 x 28 x 28"):
        label_accuracy(torch.zeros(4, 3, 32, 32), torch.zeros(4))
    with pytest.raises(ValueError, match="4 images but 3 labels"):
        label_accuracy(torch.zeros(4, 1, 28, 28), torch.zeros(3))
