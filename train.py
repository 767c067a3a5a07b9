"""Train an image generator from the Hydra configs in configs/ (compose, build, run, close).

    python train.py                                           # MeanFlow, DiT-Ti/7, shipped MNIST, CPU: ~4.5 min
    python train.py objective=scm model=DiT-S/2 trainer.max_steps=20000
    python train.py experiment=cifar10_meanflow attention=triton_jvp
    python train.py run_dir=outputs/2025-01-01/12-00-00 trainer.resume=auto   # continue a run exactly
    python train.py -m objective=flow_matching,meanflow,scm   # a Hydra multirun, one folder per job
    python train.py -m attention=math,sdpa,flash,triton_jvp   # per-backend step time, memory, loss (ablate.py compares them)
    torchrun --standalone --nproc_per_node=8 train.py experiment=cifar10_scm   # DDP
    torchrun --nnodes=2 --node_rank=$RANK --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=$HOST:29500 train.py experiment=cifar10_scm run_dir=/shared/runs/scm   # several machines

Every run writes to its folder (run_dir, Hydra's output dir): checkpoints/, samples/*.png,
metrics.jsonl, train.log and .hydra/ (the composed config). Bad input ends with one line saying
what is wrong and how to fix it, and exit code 1 (HYDRA_FULL_ERROR=1 shows the traceback); in a
multirun the other jobs still run, and the failed ones are listed at the end.
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from flm.train import train
from flm.cli import check_model_choices, exit_if_jobs_failed, report_user_errors
from flm.train.config import build_group


def run(cfg: DictConfig, run_dir: str) -> dict:
    return train(
        run_dir=run_dir,
        model=build_group(cfg, "model"),
        objective=build_group(cfg, "objective"),
        data=build_group(cfg, "data"),
        optim=build_group(cfg, "optim"),
        trainer=build_group(cfg, "trainer"),
        logger=build_group(cfg, "logger"),
        config=OmegaConf.to_container(cfg, resolve=True),
    )


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    job = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        job = f"job {hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)})"
    with report_user_errors(run_dir, job=job):
        run(cfg, run_dir)


if __name__ == "__main__":
    check_model_choices(sys.argv[1:], os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"))
    main()
    exit_if_jobs_failed()
