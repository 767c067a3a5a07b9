"""The latent pipeline end to end on one machine, timed: an image folder -> prepare_latents.py -> train.py on the
latents (issue 17's H200 check). Prints the prepare cost (images per second through the VAE encoder, flips
included) and the training throughput (steps per second after the warm-up), with the GPU and versions.

The VAE is a local diffusers folder (--vae), or, with none, an AutoencoderKL of SD-VAE's architecture (4 latent
channels, 8x downsampling, block widths 128-256-512-512) with random weights, built from its config: its encoder
costs what sd-vae-ft-ema's costs, so the prepare time is the real one, and nothing is downloaded. The images are
random RGB images of --resolution in --classes class folders (the cost of a VAE and a DiT does not depend on
the pixels).

    PYTHONPATH=. python benchmarks/latent_run.py --images 2048 --resolution 256 --model DiT-B/2 --steps 300 \
        --attention triton_jvp --objective meanflow --out RESULT.md               # H200: 32 x 32 x 4 latents
    PYTHONPATH=. python benchmarks/latent_run.py --tiny                             # CPU smoke check (seconds)
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.quality import sh, steady_step_ms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SD_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32)
TINY_VAE = dict(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2048, help="images in the folder (each is encoded with its flip)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--vae", default=None, help="a diffusers AutoencoderKL folder; default: SD-VAE's shape, random weights")
    p.add_argument("--model", default="DiT-B/2")
    p.add_argument("--objective", default="meanflow")
    p.add_argument("--attention", default="triton_jvp")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prepare-batch", type=int, default=64)
    p.add_argument("--cuda-graph", action="store_true", help="trainer.cuda_graph=true")
    p.add_argument("--work", default=None, help="folder for the images, VAE, latents and run (default: a temporary one)")
    p.add_argument("--out", default=None, help="also write the table (Markdown) to this file")
    p.add_argument("--tiny", action="store_true", help="CPU smoke check: 16 images of 32 x 32, a tiny VAE, DiT-T/2, 4 steps")
    args = p.parse_args(argv)
    if args.tiny:
        args.images, args.classes, args.resolution, args.model, args.steps = 16, 2, 32, "DiT-T/2", 4
        args.batch_size, args.prepare_batch, args.attention = 4, 8, "math"
    return args


def make_images(root: str, n: int, classes: int, resolution: int) -> None:
    from PIL import Image

    g = np.random.default_rng(0)
    for i in range(n):
        folder = os.path.join(root, f"class{i % classes:03d}")
        os.makedirs(folder, exist_ok=True)
        pixels = g.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.png"))


def make_vae(folder: str, resolution: int, tiny: bool) -> None:
    from diffusers import AutoencoderKL

    blocks = TINY_VAE if tiny else SD_VAE
    n = len(blocks["block_out_channels"])
    torch.manual_seed(0)
    AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        latent_channels=4,
        sample_size=resolution,
        **blocks,
    ).save_pretrained(folder)


def prepare_in_process(overrides: list[str]) -> float:
    """Seconds prepare_latents.py's run takes with these overrides: the VAE's load, the folder's scan and the
    encoding, without the interpreter's start and imports."""
    import importlib.util

    from hydra import compose, initialize_config_dir

    spec = importlib.util.spec_from_file_location("prepare_latents", os.path.join(ROOT, "prepare_latents.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose(config_name="prepare_latents", overrides=overrides)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    module.run(cfg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    args = parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="flm-latent-")
    images, lat, run = (os.path.join(work, name) for name in ("images", "latents", "run"))
    make_images(images, args.images, args.classes, args.resolution)
    vae = args.vae
    if vae is None:
        vae = os.path.join(work, "vae")
        make_vae(vae, args.resolution, args.tiny)
    prepare = ["data=imagefolder", f"data.root={images}", f"data.resolution={args.resolution}", f"vae={vae}"]
    prepare += [f"out={lat}", f"batch_size={args.prepare_batch}", f"device={'cpu' if args.tiny else 'auto'}"]
    prepare_s = prepare_in_process(prepare)
    meta = json.load(open(os.path.join(lat, "meta.json")))

    log_every = max(1, args.steps // 4)
    train = [sys.executable, os.path.join(ROOT, "train.py"), "data=latents", f"data.root={lat}", f"model={args.model}"]
    train += [f"objective={args.objective}", f"attention={args.attention}", f"run_dir={run}", f"trainer.max_steps={args.steps}"]
    train += [f"trainer.batch_size={args.batch_size}", f"trainer.log_every={log_every}", "trainer.sample_every=0"]
    train += ["trainer.ckpt_every=0", "trainer.sample_n=4", f"trainer.device={'cpu' if args.tiny else 'auto'}"]
    train += [f"trainer.cuda_graph={str(args.cuda_graph).lower()}"]
    start = time.perf_counter()
    sh(train, os.path.join(work, "train.log"))
    train_s = time.perf_counter() - start
    step_ms = steady_step_ms(run)

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    import triton

    result = {
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "images": meta["num_images"],
        "resolution": meta["resolution"],
        "latent_shape": meta["latent_shape"],
        "vae": args.vae or ("a tiny VAE, random weights" if args.tiny else "SD-VAE's shape, random weights"),
        "prepare_s": prepare_s,
        "prepare_images_per_s": 2 * meta["num_images"] / prepare_s,  # each image and its flip
        "model": args.model,
        "objective": args.objective,
        "attention": args.attention,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "train_wall_s": train_s,
        "step_ms": step_ms,
        "steps_per_s": 1000 / step_ms,
    }
    table = "\n".join(
        [
            f"# Latent pipeline: {gpu}, torch {torch.__version__}, Triton {triton.__version__}",
            "",
            f"`{' '.join(['python', 'benchmarks/latent_run.py', *(argv or sys.argv[1:])])}`",
            "",
            "| step | what | seconds | throughput |",
            "|---|---|---|---|",
            f"| prepare_latents.py | {meta['num_images']} images {meta['resolution']}x{meta['resolution']} (+ flips) -> "
            f"{'x'.join(map(str, meta['latent_shape']))}, {result['vae']} | {prepare_s:.1f} | "
            f"{result['prepare_images_per_s']:.1f} images/s |",
            f"| train.py | {args.model}, {args.objective}, {args.attention}, batch {args.batch_size}, {args.steps} steps | "
            f"{train_s:.1f} wall | {step_ms:.1f} ms/step = {result['steps_per_s']:.2f} steps/s |",
        ]
    )
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n\n```json\n" + json.dumps(result, indent=1) + "\n```\n")
    return result


if __name__ == "__main__":
    main()
