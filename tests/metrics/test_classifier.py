import pytest
import torch

from flm.data import shipped_mnist
from flm.metrics.classifier import label_accuracy, load_classifier, predict, read, reference_moments
from flm.metrics.fid import frechet_distance, moments


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


def test_digit_fd_is_small_for_test_digits_and_large_for_blur_and_noise(digits):
    """The digit Fréchet distance against the test digits: 2,000 of them score near 0 (the finite-sample bias,
    2.5 here), a 3 x 3 box blur of the same digits ~140, uniform noise ~800."""
    net = load_classifier()
    ref = reference_moments(net)
    x = digits[0].float() / 127.5 - 1
    fd = lambda images: frechet_distance(*moments(read(images, classifier=net)[0]), *ref)  # noqa: E731
    same, blurred = fd(x), fd(torch.nn.functional.avg_pool2d(x, 3, 1, 1))
    noise = fd(torch.rand(1000, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1)
    assert same < 5 and blurred > 50 * same and noise > 4 * blurred


def test_read_gives_predict_and_the_features_of_one_forward(digits):
    net = load_classifier()
    x = digits[0][:300].float() / 127.5 - 1
    feats, predicted = read(x, classifier=net, batch_size=128)
    assert feats.shape == (300, 64) and (feats >= 0).all()  # after the last hidden ReLU
    assert torch.equal(predicted, net(x).argmax(1))
