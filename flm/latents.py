"""VAE latents: a dataset encoded once into sharded, memory-mapped files, and the VAE that decodes samples.

    python prepare_latents.py data=imagefolder data.root=DIR vae=stabilityai/sd-vae-ft-ema data.resolution=256 out=LAT
    python train.py data=latents data.root=LAT                  # trains on the latents, same loader as pixels

A latent folder holds meta.json (the VAE, the image resolution, the latent shape, the VAE's scaling and
shift factors, the per-channel mean and standard deviation of the latents, the classes, the source images
and the shard list) and shards latents-NNNNN.npy, float16 (n, 2, C, h, w): each image's posterior mean and
that of its horizontally flipped copy, with labels-NNNNN.npy (n,) int64. meta.json is written last, so a
folder without it is an unfinished preparation. Training reads (z - shift) * scaling_factor, the latent
scale the VAE's authors chose (0.18215 for SD's VAE: about unit variance); samples are decoded through
z / scaling_factor + shift. The VAE is diffusers' AutoencoderKL (pip install 'flm[latent]'), read from a
hub id or a local folder, safetensors weights only.
"""

import json
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from flm.files import write_atomically, write_json

META = "meta.json"
FORMAT = "flm-latents"
INSTALL_HINT = "pip install 'flm[latent]' (or: pip install diffusers safetensors)"


# ----------------------------------------------------------------------------------------------
# The VAE
# ----------------------------------------------------------------------------------------------


def load_vae(name: str, device="cpu"):
    """diffusers' AutoencoderKL from a local folder (config.json + safetensors weights) or a hub id, in eval mode."""
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise ImportError(f"VAE latents need diffusers: {INSTALL_HINT}") from None
    if not name:
        raise ValueError(
            "no VAE given: pass vae=<diffusers AutoencoderKL hub id or local folder>, e.g. vae=stabilityai/sd-vae-ft-ema"
        )
    looks_local = os.path.isabs(name) or name.startswith(".") or os.path.exists(name) or name.count("/") > 1
    if looks_local and not os.path.isdir(name):
        raise FileNotFoundError(
            f"VAE folder {name!r} does not exist; pass vae=<a folder with config.json and "
            f"diffusion_pytorch_model.safetensors> or a hub id such as stabilityai/sd-vae-ft-ema"
        )
    try:
        vae = AutoencoderKL.from_pretrained(name, use_safetensors=True, low_cpu_mem_usage=False)  # no accelerate needed
    except Exception as e:  # no network, an unknown id, a folder without weights: all end the same way
        raise FileNotFoundError(
            f"VAE {name!r} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"pass a local folder with config.json and diffusion_pytorch_model.safetensors, or a hub id on a machine "
            f"with network access"
        ) from None
    return vae.to(device).eval().requires_grad_(False)


@dataclass
class LatentInfo:
    """What a latent run records (in its checkpoint's config, key "latents") to decode its samples and find its
    reference images: names and numbers only."""

    vae: str
    resolution: int  # image side
    scaling_factor: float
    shift_factor: float
    channel_mean: list[float]
    channel_std: list[float]
    source: dict  # the images encoded: {"name": "imagefolder", "root": ..., "channels": 3}

    def to_model(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.shift_factor) * self.scaling_factor

    def from_model(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.scaling_factor + self.shift_factor

    def rms(self) -> float:
        """Root mean square of what training reads, (z - shift) * scaling_factor, from the channel statistics."""
        k, c = self.scaling_factor, self.shift_factor
        sq = [((m - c) * k) ** 2 + (d * k) ** 2 for m, d in zip(self.channel_mean, self.channel_std)]
        return math.sqrt(sum(sq) / len(sq))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "the checkpoint") -> "LatentInfo":
        try:
            return cls(
                vae=str(d["vae"]),
                resolution=int(d["resolution"]),
                scaling_factor=float(d["scaling_factor"]),
                shift_factor=float(d["shift_factor"]),
                channel_mean=[float(v) for v in d["channel_mean"]],
                channel_std=[float(v) for v in d["channel_std"]],
                source=dict(d["source"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{where}: the latent record is malformed ({type(e).__name__}: {e}); prepare the latents "
                f"again with prepare_latents.py"
            ) from None


class Decoder:
    """Model-scale latents -> images in [-1, 1] through the run's VAE (loaded once; batches of `batch_size`)."""

    def __init__(self, info: LatentInfo, device="cpu", batch_size: int = 32, vae=None):
        self.info, self.batch_size = info, batch_size
        self.vae = vae if vae is not None else load_vae(info.vae, device)
        self.resolution = info.resolution

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for lo in range(0, len(x), self.batch_size):
            z = self.info.from_model(x[lo : lo + self.batch_size].float().to(self.device))
            out.append(self.vae.decode(z).sample.float().clamp(-1, 1).cpu())
        return torch.cat(out)


def decoder_of(run_config: dict | None, device="cpu", source: str = "the checkpoint") -> Decoder | None:
    """The VAE decoder a run's config records (None for a pixel run)."""
    record = (run_config or {}).get("latents")
    return None if not record else Decoder(LatentInfo.from_dict(record, source), device)


# ----------------------------------------------------------------------------------------------
# Encoding a dataset
# ----------------------------------------------------------------------------------------------


def _vae_factor(vae, key: str, default: float) -> float:
    value = getattr(vae.config, key, None)
    return default if value is None else float(value)


@torch.no_grad()
def encode_dataset(
    dataset, vae, vae_name: str, out: str, *, source: dict, batch_size: int = 64, shard_size: int = 10_000, log=print
) -> dict:
    """Encode every image of `dataset` ((N, C, H, W) in [-1, 1] batches) and its horizontal flip into `out`.
    Returns the meta record (also written to out/meta.json, last)."""
    if os.path.isfile(os.path.join(out, META)):
        raise ValueError(f"latent folder {out!r} already has {META}; pass another out=<folder> or remove it")
    if shard_size <= 0 or batch_size <= 0:
        raise ValueError(f"shard_size and batch_size must be > 0, got {shard_size} and {batch_size}")
    os.makedirs(out, exist_ok=True)
    device = next(vae.parameters()).device
    n, shards = len(dataset), []
    total, total_sq, count = None, None, 0
    for shard, lo in enumerate(range(0, n, shard_size)):
        hi = min(lo + shard_size, n)
        latents, labels = [], []
        for b in range(lo, hi, batch_size):
            x, y = dataset.__getitems__(list(range(b, min(b + batch_size, hi))))
            x = x.to(device)
            both = torch.cat([x, x.flip(-1)])
            z = vae.encode(both).latent_dist.mean.float()  # (2B, C, h, w): the posterior means, no sampling noise
            z = torch.stack(z.chunk(2), dim=1)  # (B, 2, C, h, w)
            total = z.sum((0, 1, 3, 4)).double() if total is None else total + z.sum((0, 1, 3, 4)).double()
            total_sq = z.square().sum((0, 1, 3, 4)).double() + (0 if total_sq is None else total_sq)
            count += z[:, :, 0].numel()
            latents.append(z.half().cpu())
            labels.append(torch.as_tensor(y).long())
        names = {"latents": f"latents-{shard:05d}.npy", "labels": f"labels-{shard:05d}.npy"}
        for key, array in (("latents", torch.cat(latents).numpy()), ("labels", torch.cat(labels).numpy())):
            write_atomically(os.path.join(out, names[key]), lambda tmp, a=array: _save_npy(tmp, a), needed_bytes=array.nbytes)
        shards.append({**names, "n": hi - lo})
        log(f"shard {shard}: images {lo}-{hi - 1} of {n}")
    mean = (total / count).tolist()
    std = (total_sq / count - (total / count).square()).clamp(min=0).sqrt().tolist()
    meta = {
        "format": FORMAT,
        "version": 1,
        "vae": vae_name,
        "resolution": int(dataset.resolution),
        "latent_shape": list(latents[0].shape[2:]),
        "dtype": "float16",
        "flips": True,
        "scaling_factor": _vae_factor(vae, "scaling_factor", 1.0),
        "shift_factor": _vae_factor(vae, "shift_factor", 0.0),
        "channel_mean": mean,
        "channel_std": std,
        "num_images": n,
        "num_classes": int(dataset.num_classes),
        "source": source,
        "shards": shards,
    }
    write_json(os.path.join(out, META), meta)
    return meta


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.save adds .npy to a name
        np.save(f, array)


# ----------------------------------------------------------------------------------------------
# Reading latents
# ----------------------------------------------------------------------------------------------


def read_meta(root: str) -> dict:
    path = os.path.join(root, META)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{root!r} is not a latent folder (no {META}): write one with python prepare_latents.py "
            f"data=imagefolder data.root=<images> vae=<VAE> out={root}"
        )
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path!r} is not an flm latent record (format {meta.get('format')!r}); prepare the folder "
            f"again with prepare_latents.py"
        )
    return meta


def same_vae(a: str, b: str) -> bool:
    """Two VAE names that mean the same one: equal ids, or paths to the same folder."""
    return a == b or (os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b))


class LatentFiles(torch.utils.data.Dataset):
    """A latent folder as a dataset: items are model-scale latents (C, h, w) and labels, read from memory-mapped
    shards. Indices N..2N-1 are the horizontally flipped copies of 0..N-1 (the loader's flips pick them).

    resolution / vae: what the config expects (None: the folder's); a folder of another is refused."""

    stored_flips = True

    def __init__(self, root: str, resolution: int | None = None, vae: str | None = None):
        self.root, self.meta = root, read_meta(root)
        meta = self.meta
        if resolution is not None and resolution != meta["resolution"]:
            raise ValueError(
                f"latent folder {root!r} holds {meta['resolution']}x{meta['resolution']} images, but "
                f"data.resolution={resolution}; prepare latents at {resolution} or set "
                f"data.resolution={meta['resolution']}"
            )
        if vae and not same_vae(vae, meta["vae"]):
            raise ValueError(
                f"latent folder {root!r} was encoded with VAE {meta['vae']!r}, but data.vae={vae!r}; "
                f"prepare latents with that VAE or set data.vae={meta['vae']}"
            )
        self.info = LatentInfo.from_dict({**meta, "source": meta["source"]}, os.path.join(root, META))
        self.channels, self.resolution = int(meta["latent_shape"][0]), int(meta["latent_shape"][1])
        self.num_classes, self.n = int(meta["num_classes"]), int(meta["num_images"])
        self.offsets = np.cumsum([0] + [s["n"] for s in meta["shards"]])
        if self.offsets[-1] != self.n:
            raise ValueError(
                f"latent folder {root!r}: its shards hold {self.offsets[-1]} images, meta.json says {self.n}; prepare it again"
            )
        self.labels = np.concatenate([np.load(os.path.join(root, s["labels"])) for s in meta["shards"]])
        self._arrays = None

    def __getstate__(self):  # worker processes open their own maps (a pickled memmap would copy the data)
        return {**self.__dict__, "_arrays": None}

    def arrays(self) -> list[np.ndarray]:
        if self._arrays is None:
            self._arrays = [np.load(os.path.join(self.root, s["latents"]), mmap_mode="r") for s in self.meta["shards"]]
        return self._arrays

    def __len__(self):
        return self.n

    def __getitems__(self, indices):
        idx = np.asarray(indices, dtype=np.int64)
        flipped, idx = idx >= self.n, idx % self.n
        shard = np.searchsorted(self.offsets, idx, side="right") - 1
        arrays = self.arrays()
        z = np.stack([arrays[s][i - self.offsets[s], int(f)] for s, i, f in zip(shard, idx, flipped)])
        return self.info.to_model(torch.from_numpy(z.astype(np.float32))), torch.from_numpy(self.labels[idx].astype(np.int64))


def reference_source(info: dict, root: str | None = None) -> dict:
    """The DataConfig fields of the images a latent run's reference statistics come from: the encoded source
    images (`root` overriding their folder)."""
    source = dict(info["source"])
    return {
        "name": source["name"],
        "root": root or source["root"],
        "resolution": int(info["resolution"]),
        "channels": int(source.get("channels", 3)),
    }
