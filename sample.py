"""Sample images from a checkpoint with its objective's own sampler (compose, build, run).

    python sample.py ckpt=outputs/2025-01-01/12-00-00                # latest checkpoint of a run, EMA weights
    python sample.py ckpt=RUN steps=2 n=64 cfg_scale=1.5 seed=100
    python sample.py ckpt=SCD_RUN steps=2 mid_t=[0.9]          # sCM's 2-step intermediate time (MeanFlow: mid_t=[0.6])
    python sample.py ckpt=RUN/checkpoints/ckpt-00001500.pt weights=raw label=3
    python sample.py ckpt=RUN ema=sigma_rel0.05                     # a power-function EMA, by name
    python sample.py ckpt=EXPORTED_FOLDER                           # export.py's folder (model.safetensors, config.json)

Writes <out>.png (a grid) and <out>.npz (images uint8 (N, H, W, C), seeds, labels); by default
<run folder>/samples/<checkpoint>-<weights>-steps<k>-cfg<s>-seed<seed>-n<n>.*. Image i is drawn from
seed + i with its own generator (multi-step sCM's re-noising included), so the images do not depend
on batch_size. A latent run's samples are decoded through its VAE (diffusers; the VAE id or folder
its latents were prepared with): the PNG and the .npz hold the decoded images.
"""

import os
from dataclasses import dataclass

import hydra
from omegaconf import DictConfig

from flm import dist
from flm.latents import decoder_of
from flm.cli import report_user_errors
from flm.train.generator import load_generator, mid_t_tag, open_generator, output_base, sampler_steps
from flm.train.sampling import class_labels, generate, save_grid, save_npz
from flm.train.settings import amp_dtype
from flm.typed import check_fields


@dataclass
class SampleConfig:
    """configs/sample.yaml's options, checked (see there for what each does)."""

    ckpt: str
    steps: int | None = None
    n: int = 64
    cfg_scale: float = 1.0
    mid_t: list[float] | float | None = None
    gamma: float | None = None
    label: int | None = None
    seed: int = 0
    batch_size: int = 64
    weights: str = "ema"
    ema: float | str | None = None
    ema_decay: float | None = None
    attention: str = "auto"
    device: str = "auto"
    precision: str = "auto"
    out: str | None = None

    def __post_init__(self):
        check_fields(self, "")
        if self.n <= 0 or self.batch_size <= 0 or (self.steps is not None and self.steps <= 0):
            raise ValueError(
                f"n, batch_size and steps must be > 0, got n={self.n} batch_size={self.batch_size} steps={self.steps}"
            )
        if self.weights not in ("ema", "raw"):
            raise ValueError(f"weights must be ema or raw, got {self.weights!r}")


def run(cfg: DictConfig) -> str:
    cfg = SampleConfig(**cfg)
    bundle, path = open_generator(cfg.ckpt)
    device = dist.init(cfg.device)
    model, objective = load_generator(
        bundle,
        weights=cfg.weights,
        ema_decay=cfg.ema_decay,
        ema=cfg.ema,
        attention=cfg.attention,
        device=device,
        source=path,
        mid_t=cfg.mid_t,
        gamma=cfg.gamma,
    )
    decoder = decoder_of(bundle.get("config"), device, path)

    steps = cfg.steps if cfg.steps is not None else sampler_steps(bundle, objective, path)
    seeds = list(range(cfg.seed, cfg.seed + cfg.n))
    num_classes = bundle["model_args"]["num_classes"]
    labels = class_labels(cfg.n, num_classes, cfg.label)
    args = bundle["model_args"]
    images = generate(
        model,
        objective,
        seeds=seeds,
        labels=labels,
        shape=(args["in_channels"], args["input_size"], args["input_size"]),
        steps=steps,
        cfg_scale=cfg.cfg_scale,
        batch_size=cfg.batch_size,
        device=device,
        amp_dtype=amp_dtype(cfg.precision, device),
        decode=decoder,
    )

    run_dir, stem = output_base(path)
    mid = mid_t_tag(objective, cfg.mid_t, cfg.gamma)
    out = cfg.out or os.path.join(
        run_dir, "samples", f"{stem}-{cfg.weights}-steps{steps}-cfg{cfg.cfg_scale:g}{mid}-seed{cfg.seed}-n{cfg.n}"
    )
    save_grid(images, out + ".png", nrow=10 if num_classes == 10 else None)
    save_npz(out + ".npz", images, seeds, labels)
    print(f"{cfg.n} images from {path} ({cfg.weights} weights, {steps} steps, cfg {cfg.cfg_scale:g}) -> {out}.png, {out}.npz")
    return out


@hydra.main(config_path="configs", config_name="sample", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with report_user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
