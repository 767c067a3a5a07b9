"""Export a run's EMA weights as a folder people can share (compose, build, run).

    python export.py ckpt=outputs/2025-01-01/12-00-00 out=exports/my-run          # the run's first EMA
    python export.py ckpt=RUN/checkpoints/ckpt-00400000.pt out=DIR ema=sigma_rel0.05
    python sample.py ckpt=DIR        # and evaluate.py ckpt=DIR: the folder in place of a checkpoint

Writes DIR/model.safetensors (the chosen EMA) and DIR/config.json (model and objective arguments, the
grid sampler steps, the dataset, and for a latent run the VAE id and its latent scaling); nothing there
needs pickle (flm.train.export). Bad input ends with one line `error: ...` and exit code 1.
"""

import hydra
from omegaconf import DictConfig

from flm.train import checkpoint
from flm.cli import report_user_errors
from flm.train.export import export


def run(cfg: DictConfig) -> str:
    if not cfg.out:
        raise ValueError("out is not set; pass out=<folder to write model.safetensors and config.json to>")
    path = checkpoint.find_checkpoint(str(cfg.ckpt))
    out = export(checkpoint.load(path), str(cfg.out), ema=cfg.ema, source=path)
    print(f"{path} -> {out}/model.safetensors, {out}/config.json", flush=True)
    return out


@hydra.main(config_path="configs", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with report_user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
