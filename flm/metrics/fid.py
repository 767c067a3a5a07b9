"""FID: the Fréchet distance between Gaussians fitted to Inception pool3 features of two image sets.

    net = load_inception()                                   # inception=<file> or $FLM_FID_INCEPTION
    ref = reference_stats(net, "mnist", split="test", root="data", cache_dir="~/.cache/flm/fid")
    fid = frechet_distance(*moments(features(images, net)), ref.mu, ref.sigma)

The network is the 2015-12-05 Inception-v3 as TorchScript (input N x 3 x 299 x 299 in [-1, 1], output
N x 2048), read from a local file only; `shared/scripts/fetch-data.sh DIR fid` writes it. Images of any
size and channel count are prepared as the reference evaluations prepare saved samples: quantised to
8 bits (a generator is scored on the pixels it would save), grey repeated to 3 channels, resized to
299 x 299 with bilinear interpolation (half-pixel centres, no antialiasing). An fp16 TorchScript copy
works too: inputs are cast to the network's dtype, features come back in fp32.

Reference statistics are computed once per (dataset, split, resolution, Inception file) and cached
as .npz; a file whose recorded dataset, split, resolution or network differs from what an evaluation
needs is refused. ADM's reference batches (.npz with `mu` and `sigma`, or images in `arr_0`) are read too.
"""

import functools
import hashlib
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flm.files import write_atomically
from flm.metrics.images import as_float_images, to_levels

INCEPTION_ENV = "FLM_FID_INCEPTION"
CACHE_ENV = "FLM_FID_CACHE"
INCEPTION_FILE = "inception-2015-12-05-fid.torchscript.pt"


# ----------------------------------------------------------------------------------------------
# Feature network
# ----------------------------------------------------------------------------------------------


@dataclass
class FeatureNet:
    """A feature network and how to feed it: (N, 3, size, size) in [-1, 1] -> (N, D)."""

    net: torch.nn.Module
    name: str  # recorded in reference statistics: a hash of the network's file
    size: int = 299

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.net.parameters()).dtype


@functools.lru_cache(maxsize=8)
def _file_hash(path: str, size: int, mtime: float) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def file_hash(path: str) -> str:
    """The first 16 hex digits of the file's sha256 (hashed once per process and file version)."""
    st = os.stat(path)
    return _file_hash(os.path.abspath(path), st.st_size, st.st_mtime)


def inception_path(path: str | None = None) -> str:
    """`path`, else $FLM_FID_INCEPTION; a clear error when neither names an existing file."""
    path = path or os.environ.get(INCEPTION_ENV)
    if not path:
        raise FileNotFoundError(
            f"no FID Inception network given: pass inception=<file> or set {INCEPTION_ENV}=<file>; "
            f"shared/scripts/fetch-data.sh DIR fid writes it to DIR/fid/{INCEPTION_FILE}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"FID Inception network {path!r} not found; shared/scripts/fetch-data.sh DIR fid writes it to "
            f"DIR/fid/{INCEPTION_FILE} (flm never downloads it), then pass inception=<that file> or set {INCEPTION_ENV}"
        )
    return path


def load_inception(path: str | None = None, device="cpu") -> FeatureNet:
    """The TorchScript Inception from `path` (or $FLM_FID_INCEPTION), in eval mode on `device`."""
    path = inception_path(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch.jit's deprecation notice: noise to a user
        net = torch.jit.load(path, map_location=device).eval()
    return FeatureNet(net=net, name=f"inception-{file_hash(path)}")


def prepare(x: torch.Tensor, size: int) -> torch.Tensor:
    """[-1, 1] (N, C, H, W) float -> (N, 3, size, size) float32, as saved 8-bit images are prepared."""
    x = to_levels(x) / 127.5 - 1
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    elif x.shape[1] != 3:
        raise ValueError(f"FID takes images with 1 or 3 channels, got {x.shape[1]}")
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=False)
    return x


@torch.no_grad()
def features(images, net: FeatureNet, batch_size: int = 200) -> torch.Tensor:
    """(N, D) fp32 features on the network's device of images in [-1, 1] (N, C, H, W) or uint8 (N, H, W, C).

    No host synchronisation: batches go to the device without waiting, and the result stays there.
    """
    x = as_float_images(images)
    device = net.device
    out = []
    for lo in range(0, len(x), batch_size):
        batch = x[lo : lo + batch_size]
        if device.type == "cuda" and batch.device.type == "cpu":
            batch = batch.pin_memory()
        batch = prepare(batch.to(device, non_blocking=True), net.size)
        out.append(net.net(batch.to(net.dtype)).float())
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------
# Statistics and the distance
# ----------------------------------------------------------------------------------------------


def moments(feats: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean (D,) and covariance (D, D; unbiased, as the reference implementations) in float64."""
    if len(feats) < 2:
        raise ValueError(f"FID needs at least 2 images, got {len(feats)}")
    f = feats.double()
    mu = f.mean(0)
    d = f - mu
    sigma = d.T @ d / (len(f) - 1)
    return mu.cpu().numpy(), sigma.cpu().numpy()


def _sqrt_psd(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2)).

    tr((S1 S2)^(1/2)) is computed as the sum of square roots of the eigenvalues of the symmetric
    S1^(1/2) S2 S1^(1/2), which S1 S2 is similar to: symmetric eigen-decompositions in float64, with
    the tiny negative eigenvalues of rounding clipped to 0. This needs no regularising offset for
    singular covariances (fewer images than feature dimensions) and never has imaginary parts.
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    sigma1, sigma2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(
            f"statistics of different feature sizes: {mu1.shape} vs {mu2.shape}; both must come from the same feature network"
        )
    root1 = _sqrt_psd(sigma1)
    m = root1 @ sigma2 @ root1
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * tr_covmean)


# ----------------------------------------------------------------------------------------------
# Reference statistics
# ----------------------------------------------------------------------------------------------

_CANONICAL = {"mnist_shipped": "mnist"}  # the shipped digits are MNIST's test split, bit for bit


def dataset_name(dataset: str, root: str = "data") -> str:
    """The dataset as reference statistics record it; an image folder is named by its path's hash."""
    if dataset == "imagefolder":
        return f"imagefolder-{hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:8]}"
    return _CANONICAL.get(dataset, dataset)


def default_split(dataset: str) -> str:
    """test for the 10,000-image test splits of MNIST and Fashion-MNIST; train (all images) otherwise."""
    return "test" if dataset in ("mnist", "mnist_shipped", "fashion_mnist") else "train"


_META = ("n", "dataset", "split", "resolution", "network")


@dataclass
class Stats:
    """Feature statistics of an image set and what they were computed from (None where a file does not say)."""

    mu: np.ndarray
    sigma: np.ndarray
    n: int | None = None
    dataset: str | None = None
    split: str | None = None
    resolution: int | None = None
    network: str | None = None

    def describe(self) -> str:
        res = f"{self.resolution}x{self.resolution}" if self.resolution else "unknown resolution"
        return f"{self.dataset or 'unknown dataset'} {self.split or 'unknown split'} {res} ({self.network or 'unknown network'})"

    def save(self, path: str) -> None:
        meta = {k: np.asarray("" if getattr(self, k) is None else getattr(self, k)) for k in _META}  # no pickles
        # np.savez adds .npz to other names
        write_atomically(path, lambda tmp: np.savez(tmp, mu=self.mu, sigma=self.sigma, **meta), tmp_suffix=".tmp.npz")


def stats_of(feats: torch.Tensor, **meta) -> Stats:
    mu, sigma = moments(feats)
    return Stats(mu, sigma, n=len(feats), **meta)


def check_stats(stats: Stats, *, source: str, dataset: str, split: str, resolution: int, network: str) -> None:
    """Refuse statistics recorded for another dataset, split, resolution or feature network."""
    want = {"dataset": _CANONICAL.get(dataset, dataset), "split": split, "resolution": resolution, "network": network}
    diff = [k for k, v in want.items() if getattr(stats, k) is not None and getattr(stats, k) != v]
    if diff:
        need = Stats(stats.mu, stats.sigma, **want).describe()
        raise ValueError(
            f"reference statistics {source!r} are for {stats.describe()}, but this evaluation needs "
            f"{need} (differs in {', '.join(diff)}); pass matching statistics or leave ref unset to compute them"
        )
    if stats.mu.shape[0] != stats.sigma.shape[0]:
        raise ValueError(f"reference statistics {source!r} are malformed: mu {stats.mu.shape}, sigma {stats.sigma.shape}")


def _npz_array_shape(path: str, name: str) -> tuple[int, ...]:
    """The shape of array `name` of an .npz, read from its header (ADM's reference images are gigabytes)."""
    import zipfile

    with zipfile.ZipFile(path) as z, z.open(f"{name}.npy") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return tuple(read_header(f)[0])


def read_stats(path: str, net: FeatureNet, *, batch_size: int = 200) -> Stats:
    """Statistics from an .npz: flm's (mu, sigma and what they were computed from), ADM's reference
    batches (`mu` and `sigma`, with their images in `arr_0`: the resolution is read from those images'
    shape, so a batch of another resolution is refused), or images (`arr_0`, uint8 (N, H, W, C)), whose
    features are computed here."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reference statistics {path!r} not found; pass an .npz with mu and sigma (or arr_0 images)")
    with np.load(path, allow_pickle=False) as f:
        if "mu" in f and "sigma" in f:
            meta = {k: f[k].item() for k in _META if k in f and f[k].item() != ""}
            meta |= {k: int(meta[k]) for k in ("n", "resolution") if k in meta}
            if "arr_0" in f and "resolution" not in meta:  # ADM's reference batch: (N, H, W, C) images beside the moments
                shape = _npz_array_shape(path, "arr_0")
                meta |= {"resolution": int(shape[1]), "n": int(shape[0])}
            return Stats(f["mu"], f["sigma"], **meta)
        if "arr_0" in f:
            images = f["arr_0"]
            return stats_of(features(images, net, batch_size), resolution=images.shape[1], network=net.name)
        raise ValueError(f"{path!r} has neither mu and sigma nor arr_0 (images); keys: {', '.join(f.files)}")


def cache_dir(path: str | None = None) -> str:
    """`path`, else $FLM_FID_CACHE, else ~/.cache/flm/fid."""
    return os.path.expanduser(path or os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "flm", "fid"))


def stats_key(dataset: str, split: str, resolution: int, network: str) -> str:
    """The cache file's name: names the dataset, split, resolution and feature network."""
    return f"{_CANONICAL.get(dataset, dataset)}-{split}-{resolution}x{resolution}-{network}.npz"


def reference_images(dataset: str, *, split: str, root: str = "data", resolution: int | None = None, channels: int = 3):
    """The dataset split whose statistics FID compares against."""
    from flm.data import build_dataset

    if dataset == "mnist_shipped" and split != "test":
        raise ValueError("data=mnist_shipped is MNIST's test split only; use split=test, or data=mnist for the train split")
    if dataset == "imagefolder" and split != "train":
        raise ValueError("an image folder has one split: use split=train (all its images)")
    return build_dataset(dataset, root=root, download=False, resolution=resolution, channels=channels, split=split)


def reference_stats(
    net: FeatureNet,
    dataset: str,
    *,
    split: str | None = None,
    root: str = "data",
    resolution: int | None = None,
    channels: int = 3,
    cache: str | None = None,
    batch_size: int = 200,
) -> Stats:
    """Statistics of all images of a dataset split, read from the cache or computed and cached.

    `resolution` and `channels` apply to imagefolder (how its images are read; the cache key then names
    the folder too); the other datasets have one resolution each.
    """
    split = split or default_split(dataset)
    name = dataset_name(dataset, root)
    data = reference_images(dataset, split=split, root=root, resolution=resolution, channels=channels)
    path = os.path.join(cache_dir(cache), stats_key(name, split, data.resolution, net.name))
    if os.path.isfile(path):
        stats = read_stats(path, net)
        check_stats(stats, source=path, dataset=name, split=split, resolution=data.resolution, network=net.name)
        return stats
    feats = torch.cat(
        [
            features(data.__getitems__(range(lo, min(lo + 1000, len(data))))[0], net, batch_size)
            for lo in range(0, len(data), 1000)
        ]
    )
    stats = stats_of(feats, dataset=name, split=split, resolution=data.resolution, network=net.name)
    stats.save(path)
    return stats
