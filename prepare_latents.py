"""Encode an image dataset once into VAE latents for latent-space training (compose, build, run).

    python prepare_latents.py data=imagefolder data.root=DIR data.resolution=256 vae=stabilityai/sd-vae-ft-ema out=LAT
    python prepare_latents.py data=imagefolder data.root=DIR data.resolution=256 vae=/path/to/vae_folder out=LAT
    python train.py data=latents data.root=LAT ...

Writes LAT/latents-NNNNN.npy (float16 posterior means of every image and of its horizontal flip),
LAT/labels-NNNNN.npy and LAT/meta.json (the VAE, its scaling factor, the channel statistics, the source),
flm.latents describes the layout. Needs diffusers (pip install 'flm[latent]'). Bad input ends with one line
`error: ...` and exit code 1.
"""

import os

import hydra
from omegaconf import DictConfig

from flm import dist
from flm.latents import encode_dataset, load_vae
from flm.cli import report_user_errors
from flm.train.config import build_group


def run(cfg: DictConfig) -> dict:
    data = build_group(cfg, "data")
    if data.name == "latents":
        raise ValueError("data=latents is already encoded; pass the images, e.g. data=imagefolder data.root=DIR")
    if cfg.out is None:
        raise ValueError("out is not set; pass out=<folder for the latents>")
    device = dist.init(cfg.device)
    vae = load_vae(str(cfg.vae) if cfg.vae else "", device)
    dataset = data.build()
    source = {"name": data.name, "root": os.path.abspath(data.root), "channels": dataset.channels}
    meta = encode_dataset(
        dataset, vae, str(cfg.vae), str(cfg.out), source=source, batch_size=cfg.batch_size, shard_size=cfg.shard_size
    )
    print(
        f"{meta['num_images']} images ({meta['resolution']}x{meta['resolution']}, and their flips) -> latents "
        f"{'x'.join(map(str, meta['latent_shape']))} in {cfg.out} ({len(meta['shards'])} shards)",
        flush=True,
    )
    return meta


@hydra.main(config_path="configs", config_name="prepare_latents", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with report_user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
