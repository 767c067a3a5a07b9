"""Export a run's EMA weights as a folder people can share (compose, build, run).

    python export.py ckpt=outputs/2025-01-01/12-00-00 out=exports/my-run          # the run's first EMA
    python export.py ckpt=RUN/checkpoints/ckpt-00400000.pt out=DIR ema=sigma_rel0.05
    python export.py ckpt=RUN out=DIR sigma_rel=0.07        # a post-hoc EMA from the run's saved power EMAs
    python export.py ckpt=RUN out=DIR 'sigma_rel=[0.05,0.1]'  # several: DIR/posthoc_sigma_rel0.05, ... (one read of the run)
    python sample.py ckpt=DIR        # and evaluate.py ckpt=DIR: the folder in place of a checkpoint

Writes DIR/model.safetensors (the chosen EMA) and DIR/config.json (model and objective arguments, the
grid sampler steps, the dataset, and for a latent run the VAE id and its latent scaling); nothing there
needs pickle (flm.train.export). `sigma_rel=` exports a power EMA of that width put together after training from
the power EMAs (trainer.ema_sigma_rels) in the run's kept checkpoints, at the step of `ckpt` (a run folder: its last;
flm.train.posthoc, EDM2's post-hoc EMA). Bad input ends with one line `error: ...` and exit code 1.
"""

import os

import hydra
from omegaconf import DictConfig

from flm.train import checkpoint
from flm.cli import report_user_errors
from flm.train.export import export
from flm.train.posthoc import posthoc_bundle, run_of, widths_of


def run(cfg: DictConfig) -> str:
    if not cfg.out:
        raise ValueError("out is not set; pass out=<folder to write model.safetensors and config.json to>")
    path = checkpoint.find_checkpoint(str(cfg.ckpt))
    if cfg.sigma_rel is None:
        out = export(checkpoint.load(path), str(cfg.out), ema=cfg.ema, source=path)
    else:
        if cfg.ema is not None:
            raise ValueError(f"ema={cfg.ema} and sigma_rel={cfg.sigma_rel} both given; pass one (sigma_rel: a post-hoc EMA)")
        run_dir, widths = run_of(path), widths_of(cfg.sigma_rel)
        bundle, keys = posthoc_bundle(run_dir, widths, step=checkpoint.step_of(path))
        if isinstance(widths, list):  # one folder per width
            for key in keys:
                export(bundle, os.path.join(str(cfg.out), key), ema=key, source=run_dir)
            print(f"{run_dir} -> {', '.join(os.path.join(str(cfg.out), k) for k in keys)}", flush=True)
            return str(cfg.out)
        out = export(bundle, str(cfg.out), ema=keys[0], source=run_dir)
    print(f"{path} -> {out}/model.safetensors, {out}/config.json", flush=True)
    return out


@hydra.main(config_path="configs", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with report_user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
