"""Datasets and a resumable, sharded loader.

    data = build_dataset("mnist_shipped")                       # no network, 10,000 digits
    data = build_dataset("cifar10", root="data")                # torchvision layout under root
    loader = Loader(data, batch_size=64, rank=0, world_size=1, seed=0)
    x, y = loader.next()                                        # x (B, C, H, W) in [-1, 1], y (B,)

Every dataset yields images as float tensors in [-1, 1] and integer class labels, and exposes
`resolution`, `channels` and `num_classes`; `latents` (a folder of prepare_latents.py, flm.latents) yields
VAE latents instead, its `resolution` and `channels` the latents'. The loader draws each epoch as one permutation from
(seed, epoch), splits every global batch across ranks, and remembers how many batches it has handed
out, so a resumed run (under any world size) sees exactly the batches it would have seen.
"""

import gzip
import os
import dataclasses
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F

from flm.typed import check_fields

DATASETS = ("mnist_shipped", "mnist", "fashion_mnist", "cifar10", "imagefolder", "latents")

SPLITS = ("train", "test")

# torchvision's folder layout under `root`, and the files each split needs there.
_TORCHVISION = {
    "mnist": (
        "MNIST",
        "MNIST/raw",
        {
            "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        },
    ),
    "fashion_mnist": (
        "FashionMNIST",
        "FashionMNIST/raw",
        {
            "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        },
    ),
    "cifar10": (
        "CIFAR10",
        "cifar-10-batches-py",
        {"train": ("data_batch_1", "data_batch_5", "batches.meta"), "test": ("test_batch", "batches.meta")},
    ),
}
_FETCH_HINT = {
    "mnist": "scripts/fetch-data.sh ROOT mnist (from the flm repository's shared scripts) writes them",
    "fashion_mnist": "scripts/fetch-data.sh ROOT fashion (from the flm repository's shared scripts) writes them",
    "cifar10": "download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and unpack it there",
}


# ----------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------


class ImageTensors(torch.utils.data.Dataset):
    """Images held in memory as uint8 (N, C, H, W) with labels (N,)."""

    stored_flips = False  # the loader flips the images (flm.latents.LatentFiles stores flipped copies instead)

    def __init__(self, images_u8: torch.Tensor, labels: torch.Tensor, num_classes: int):
        assert images_u8.dtype == torch.uint8 and images_u8.dim() == 4, images_u8.shape
        self.images, self.labels, self.num_classes = images_u8, labels.long(), num_classes
        self.channels, self.resolution = images_u8.shape[1], images_u8.shape[2]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i].float() / 127.5 - 1, int(self.labels[i])

    def __getitems__(self, indices):
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.images[idx].float() / 127.5 - 1, self.labels[idx]


class ImageFiles(torch.utils.data.Dataset):
    """torchvision ImageFolder (root/class_name/*.png|jpg...), resized and centre-cropped, read lazily."""

    stored_flips = False

    def __init__(self, root: str, resolution: int, channels: int = 3):
        import torchvision.transforms as T
        from torchvision.datasets import ImageFolder

        mode = {1: "L", 3: "RGB"}[channels]
        transform = T.Compose(
            [
                T.Lambda(lambda im: im.convert(mode)),
                T.Resize(resolution),
                T.CenterCrop(resolution),
                T.PILToTensor(),
            ]
        )
        try:
            self.folder = ImageFolder(root, transform=transform)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"image folder {root!r} has no images ({e}); expected ROOT/CLASS_NAME/IMAGE files: "
                f"put images there or point data.root at another folder"
            ) from None
        self.num_classes, self.channels, self.resolution = len(self.folder.classes), channels, resolution
        check_images([path for path, _ in self.folder.samples], root)

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        try:
            x, y = self.folder[i]
        except OSError as e:  # a file truncated past its header
            raise ValueError(f"image {self.folder.samples[i][0]!r} is unreadable ({e}); remove or replace it") from None
        return x.float() / 127.5 - 1, y

    def __getitems__(self, indices):
        items = [self[int(i)] for i in indices]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


class Resized(torch.utils.data.Dataset):
    """A dataset's images resized (bilinear, antialiased) to side x side."""

    stored_flips = False

    def __init__(self, dataset, side: int):
        self.dataset, self.resolution = dataset, side
        self.channels, self.num_classes = dataset.channels, dataset.num_classes

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, indices):
        x, y = self.dataset.__getitems__(indices)
        return F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear", antialias=True), y


def check_images(paths: list[str], root: str) -> None:
    """Refuse at startup, not mid-training, a folder with files that PIL cannot identify. Only the headers
    are read (fast on large folders); a file broken further in fails when read, naming itself."""
    from PIL import Image, UnidentifiedImageError

    bad = []
    for path in paths:
        try:
            Image.open(path).close()
        except (UnidentifiedImageError, OSError) as e:
            bad.append(f"{path} ({type(e).__name__})")
    if bad:
        raise ValueError(
            f"image folder {root!r} has {len(bad)} unreadable image file(s): {', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}; remove or replace them, or point data.root at another folder"
        )


def _read_idx_gz(path) -> np.ndarray:
    """An idx file (MNIST's format: big-endian magic, dims, uint8 data), gzipped."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4)
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def shipped_mnist() -> ImageTensors:
    """The MNIST test split (10,000 digits) shipped in flm/assets (CC BY-SA 3.0, see its README)."""
    assets = resources.files("flm") / "assets"
    with resources.as_file(assets / "mnist-t10k-images-idx3-ubyte.gz") as p:
        images = _read_idx_gz(p)
    with resources.as_file(assets / "mnist-t10k-labels-idx1-ubyte.gz") as p:
        labels = _read_idx_gz(p)
    return ImageTensors(torch.from_numpy(images.copy())[:, None], torch.from_numpy(labels.copy()), 10)


def _torchvision(name: str, root: str, download: bool, split: str = "train") -> ImageTensors:
    import torchvision.datasets as tvd

    cls_name, subdir, needed = _TORCHVISION[name]
    needed = needed[split]
    folder = os.path.join(root, subdir)
    have = all(os.path.isfile(os.path.join(folder, f)) for f in needed)
    if not have and not download:
        raise FileNotFoundError(
            f"{name} not found: expected {', '.join(needed)} in {folder!r}; {_FETCH_HINT[name]}, "
            f"or set data.download=true on a machine with network"
        )
    try:
        ds = getattr(tvd, cls_name)(root, train=split == "train", download=not have)
    except Exception as e:  # no network, a blocked mirror, a bad archive: all end the same way
        raise FileNotFoundError(
            f"{name} not found in {folder!r} and the download failed ({type(e).__name__}: {e}); {_FETCH_HINT[name]}"
        ) from None
    images = torch.as_tensor(np.asarray(ds.data))
    images = images[:, None] if images.dim() == 3 else images.permute(0, 3, 1, 2)  # (N, C, H, W)
    return ImageTensors(images.contiguous(), torch.as_tensor(ds.targets), len(ds.classes))


def build_dataset(
    name: str,
    *,
    root: str = "data",
    download: bool = True,
    resolution: int | None = None,
    channels: int = 3,
    split: str = "train",
    vae: str | None = None,
):
    """One of DATASETS. `root` holds torchvision's layout (or the class folders for imagefolder);
    `resolution`: imagefolder's images are resized and centre-cropped to it as they are read, the other
    datasets' resized to it (None: their own size); `channels` applies to imagefolder only. `split`:
    train or test for the torchvision datasets (mnist_shipped is MNIST's test split, imagefolder has one
    split: all its images). latents: `root` is a latent folder, `resolution` and `vae` what it must have been
    prepared with (None: whatever it was)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if name == "mnist_shipped":
        return resized(shipped_mnist(), resolution)
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"dataset folder {root!r} does not exist (absolute: {os.path.abspath(root)!r}); create it and "
            f"put the {name} files there, or set data.root=<folder that has them>"
        )
    if name == "latents":
        from flm.latents import LatentFiles

        return LatentFiles(root, resolution=resolution, vae=vae)
    if name == "imagefolder":
        if resolution is None or resolution <= 0:
            raise ValueError(f"data.resolution must be a positive integer for imagefolder, got {resolution}")
        return ImageFiles(root, resolution, channels)
    return resized(_torchvision(name, root, download, split), resolution)


def resized(dataset, resolution: int | None):
    """`dataset` at `resolution` (None or its own: as it is)."""
    if resolution is not None and resolution <= 0:
        raise ValueError(f"data.resolution must be a positive integer (or null: the dataset's own), got {resolution}")
    return dataset if resolution in (None, dataset.resolution) else Resized(dataset, resolution)


@dataclass
class DataConfig:
    """What `data=` selects: the dataset and how the loader reads it."""

    name: str = "mnist_shipped"
    root: str = "data"  # torchvision's layout under it, class folders for imagefolder, a latent folder for latents
    download: bool = True  # torchvision datasets only; a clear error says where to put the files offline
    resolution: int | None = None  # image side; null: the dataset's own (imagefolder: resize and centre-crop to it)
    channels: int = 3  # imagefolder: 1 (grey) or 3 (RGB)
    hflip: bool = False  # random horizontal flips (not for digits)
    num_workers: int = 0  # DataLoader worker processes; 0 reads in the training process
    vae: str | None = None  # latents: the VAE the folder must have been encoded with; null: the folder's

    def __post_init__(self):
        check_fields(self, "data")
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset data.name={self.name!r}; valid names: {', '.join(DATASETS)}")
        if self.channels not in (1, 3):
            raise ValueError(f"data.channels must be 1 or 3, got {self.channels}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")

    def build(self):
        return build_dataset(
            self.name, root=self.root, download=self.download, resolution=self.resolution, channels=self.channels, vae=self.vae
        )


def stored_data(stored: dict | None, root: str | None = None) -> DataConfig:
    """A run's DataConfig from the data section of its stored config (keys DataConfig lacks, such as Hydra's
    `_target_`, dropped), `root` (when given) overriding its folder."""
    known = {f.name for f in dataclasses.fields(DataConfig)}
    data = DataConfig(**{k: v for k, v in (stored or {}).items() if k in known})
    return dataclasses.replace(data, root=root) if root else data


# ----------------------------------------------------------------------------------------------
# Loader
# ----------------------------------------------------------------------------------------------


def mix_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: no correlation between neighbours)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def _collate(batch):
    return batch  # __getitems__ already returns (x, y) tensors


class Loader:
    """Infinite stream of (x, y) batches for this rank, resumable through state_dict().

    Epoch e is the permutation of the dataset drawn from (seed, e), cut into global batches of
    `batch_size * world_size` images; rank r takes the r-th slice of each. An epoch ends after a
    whole number of optimizer steps (`grad_accum` batches each; the rest of the dataset is dropped),
    so with the same global batch per step (batch_size x world_size x grad_accum) every world size
    sees the same images at the same step. The random horizontal flips are drawn with the
    permutation, so both depend on the global position only (a latent dataset reads its stored flipped
    copy, index i + N, instead of flipping the latent). The position (state_dict) counts
    images, so it stays valid when a run resumes under another world size.
    """

    def __init__(
        self,
        dataset,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        grad_accum: int = 1,
        hflip: bool = False,
        num_workers: int = 0,
    ):
        self.dataset, self.batch_size, self.rank, self.world_size = dataset, batch_size, rank, world_size
        self.seed, self.hflip, self.num_workers = seed, hflip, num_workers
        self.global_batch = batch_size * world_size
        step_images = self.global_batch * grad_accum
        self.batches_per_epoch = len(dataset) // step_images * grad_accum
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} images, fewer than one global batch of {step_images}; "
                f"lower trainer.batch_size or use a larger dataset"
            )
        self.epoch, self.batch = 0, 0  # position: batches handed out in this epoch
        self._it = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "images": self.batch * self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        images = int(state["images"])
        if images % self.global_batch:
            raise ValueError(
                f"the saved data position ({images} images into epoch {state['epoch']}) is not a whole number of "
                f"batches of {self.global_batch} images; resume with the run's trainer.batch_size"
            )
        self.epoch, self.batch, self._it = int(state["epoch"]), images // self.global_batch, None

    def _epoch_plan(self, epoch: int):
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        perm = torch.randperm(len(self.dataset), generator=g)
        flips = torch.rand(len(self.dataset), generator=g) < 0.5
        return perm, flips

    def _iterate(self):
        perm, flips = self._epoch_plan(self.epoch)
        # rank r's slice of global batch b: [b * global_batch + r * batch_size, ... + batch_size)
        starts = [b * self.global_batch + self.rank * self.batch_size for b in range(self.batch, self.batches_per_epoch)]
        index_lists = [perm[s : s + self.batch_size] for s in starts]
        flip_lists = [flips[s : s + self.batch_size] for s in starts]
        stored = self.hflip and getattr(self.dataset, "stored_flips", False)  # a dataset of the user's may not say
        if stored:
            index_lists = [idx + len(self.dataset) * flip for idx, flip in zip(index_lists, flip_lists)]
        index_lists = [idx.tolist() for idx in index_lists]
        if self.num_workers > 0:
            batches = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=index_lists,
                num_workers=self.num_workers,
                collate_fn=_collate,
                persistent_workers=False,
                pin_memory=torch.cuda.is_available(),
            )
        else:
            batches = (self.dataset.__getitems__(idx) for idx in index_lists)
        for (x, y), flip in zip(batches, flip_lists):
            if self.hflip and not stored:
                x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            yield x, y

    def next(self):
        """The next (x, y) batch of this rank; moves to the next epoch when one ends."""
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self._it = self._iterate()
        x, y = next(self._it)
        self.batch += 1
        return x, y
