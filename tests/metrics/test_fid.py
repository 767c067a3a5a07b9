import os
import pathlib

import numpy as np
import pytest
import torch

from flm.data import shipped_mnist
from flm.metrics import fid
from flm.metrics.fid import (
    FeatureNet,
    Stats,
    check_stats,
    features,
    frechet_distance,
    load_inception,
    moments,
    prepare,
    read_stats,
    reference_stats,
    stats_key,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
INCEPTION = os.environ.get(fid.INCEPTION_ENV) or str(ROOT / "data" / "fid" / fid.INCEPTION_FILE)


def scipy_fid(mu1, s1, mu2, s2):
    """The textbook formula with scipy's matrix square root."""
    linalg = pytest.importorskip("scipy.linalg")
    covmean = linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


@pytest.mark.parametrize("shift", [0.0, 0.3])
def test_frechet_distance_matches_scipy_sqrtm(shift):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(600, 48, generator=g, dtype=torch.float64) @ torch.randn(48, 48, generator=g, dtype=torch.float64)
    b = torch.randn(500, 48, generator=g, dtype=torch.float64) * 1.5 + shift
    (mu1, s1), (mu2, s2) = moments(a), moments(b)
    assert np.allclose(mu1, a.mean(0).numpy()) and np.allclose(s1, np.cov(a.numpy(), rowvar=False))
    expected = scipy_fid(mu1, s1, mu2, s2)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-8)
    assert frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0.0, abs=1e-8)


def test_frechet_distance_of_singular_covariances_is_real_and_symmetric():
    # fewer samples than dimensions, as with 1,000 images and 2,048 Inception features
    g = torch.Generator().manual_seed(1)
    (mu1, s1), (mu2, s2) = moments(torch.randn(20, 64, generator=g)), moments(torch.randn(30, 64, generator=g) + 0.1)
    d = frechet_distance(mu1, s1, mu2, s2)
    assert np.isfinite(d) and d > 0
    assert d == pytest.approx(frechet_distance(mu2, s2, mu1, s1), rel=1e-6)
    # the square roots of zero eigenvalues magnify rounding: zero to a 1e-7 fraction of the trace
    assert frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0.0, abs=1e-7 * np.trace(s1))


def test_moments_refuse_fewer_than_two_images():
    with pytest.raises(ValueError, match="at least 2 images"):
        moments(torch.zeros(1, 8))


def test_prepare_grey_any_size():
    x = torch.rand(2, 1, 28, 28) * 2 - 1
    out = prepare(x, 299)
    assert out.shape == (2, 3, 299, 299) and out.dtype == torch.float32
    assert torch.equal(out[:, 0], out[:, 2])
    with pytest.raises(ValueError, match="1 or 3 channels"):
        prepare(torch.zeros(1, 2, 8, 8), 299)


def test_uint8_and_float_images_give_the_same_features(standin):
    u8 = shipped_mnist().images[:50]
    a = features(u8.permute(0, 2, 3, 1).numpy(), standin)
    b = features(u8.float() / 127.5 - 1, standin)
    assert torch.allclose(a, b, atol=1e-6)


def test_fp16_network_takes_fp32_images(standin_file):
    net = load_inception(standin_file)
    half = FeatureNet(net=net.net.half(), name=net.name, size=net.size)
    x = shipped_mnist().images[:16].float() / 127.5 - 1
    f16 = features(x, half)
    assert f16.dtype == torch.float32 and f16.shape == (16, 32)
    assert torch.allclose(f16, features(x, load_inception(standin_file)), atol=1e-2)


def test_missing_network_names_the_fetch_script(tmp_path, monkeypatch):
    monkeypatch.delenv(fid.INCEPTION_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="fetch-data.sh DIR fid"):
        load_inception(str(tmp_path / "nope.pt"))
    with pytest.raises(FileNotFoundError, match=fid.INCEPTION_ENV):
        load_inception(None)


def test_network_from_the_environment(standin_file, monkeypatch):
    monkeypatch.setenv(fid.INCEPTION_ENV, standin_file)
    net = load_inception()
    assert net.name == f"inception-{fid.file_hash(standin_file)}" and len(net.name) == len("inception-") + 16


def test_reference_stats_are_cached_under_a_key_and_reused(standin, tmp_path, monkeypatch):
    ref = reference_stats(standin, "mnist_shipped", cache=str(tmp_path))
    path = tmp_path / stats_key("mnist", "test", 28, "standin")
    assert path.name == "mnist-test-28x28-standin.npz" and path.is_file()
    assert (ref.n, ref.dataset, ref.split, ref.resolution, ref.network) == (10000, "mnist", "test", 28, "standin")
    monkeypatch.setattr(fid, "features", lambda *a, **k: pytest.fail("recomputed instead of read from the cache"))
    again = reference_stats(standin, "mnist_shipped", cache=str(tmp_path))
    assert np.array_equal(again.mu, ref.mu) and np.array_equal(again.sigma, ref.sigma) and again.n == 10000


def test_reference_stats_of_another_dataset_or_resolution_are_refused(tmp_path):
    stats = Stats(np.zeros(4), np.eye(4), n=10, dataset="mnist", split="test", resolution=28, network="standin")
    check_stats(stats, source="s.npz", dataset="mnist_shipped", split="test", resolution=28, network="standin")
    with pytest.raises(ValueError, match=r"are for mnist test 28x28 \(standin\), but this evaluation needs cifar10 train 32x32"):
        check_stats(stats, source="s.npz", dataset="cifar10", split="train", resolution=32, network="standin")
    with pytest.raises(ValueError, match="differs in network"):
        check_stats(stats, source="s.npz", dataset="mnist", split="test", resolution=28, network="inception-0123")
    # a stale cache file under the right name is refused too, not trusted by its name
    stale = tmp_path / stats_key("mnist", "test", 28, "standin")
    Stats(np.zeros(4), np.eye(4), dataset="mnist", split="test", resolution=32, network="standin").save(str(stale))
    with pytest.raises(ValueError, match="differs in resolution"):
        reference_stats(FeatureNet(net=torch.nn.Identity(), name="standin"), "mnist_shipped", cache=str(tmp_path))


def test_adm_reference_batches(standin, tmp_path):
    mu, sigma = np.arange(3.0), np.diag([1.0, 2.0, 3.0])
    np.savez(tmp_path / "ref_stats.npz", mu=mu, sigma=sigma)
    stats = read_stats(str(tmp_path / "ref_stats.npz"), standin)
    assert np.array_equal(stats.mu, mu) and stats.dataset is None and stats.resolution is None
    check_stats(stats, source="ref_stats.npz", dataset="mnist", split="test", resolution=28, network="standin")
    images = shipped_mnist().images[:40].permute(0, 2, 3, 1).numpy()
    np.savez(tmp_path / "ref_batch.npz", arr_0=images)
    stats = read_stats(str(tmp_path / "ref_batch.npz"), standin)
    assert stats.resolution == 28 and stats.mu.shape == (32,)
    with pytest.raises(ValueError, match="differs in resolution"):
        check_stats(stats, source="ref_batch.npz", dataset="cifar10", split="train", resolution=32, network="standin")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="neither mu and sigma nor arr_0"):
        read_stats(str(tmp_path / "other.npz"), standin)


def test_real_digits_are_closer_to_digits_than_noise_is(standin):
    digits = shipped_mnist().images
    a, b = digits[:2000].float() / 127.5 - 1, digits[2000:4000].float() / 127.5 - 1
    noise = torch.rand(2000, 1, 28, 28) * 2 - 1
    ref = moments(features(b, standin))
    close, far = (frechet_distance(*moments(features(x, standin)), *ref) for x in (a, noise))
    assert close * 20 < far


@pytest.mark.skipif(not os.path.isfile(INCEPTION), reason="needs the FID Inception file ($FLM_FID_INCEPTION)")
def test_real_inception_features():
    net = load_inception(INCEPTION)
    x = shipped_mnist().images[:4].float() / 127.5 - 1
    f = features(x, net, batch_size=2)
    assert f.shape == (4, 2048) and f.dtype == torch.float32 and torch.isfinite(f).all() and (f >= 0).all()
