"""Attention backends side by side: the same training run with each, checked against `math`
(flm.ablate; compose, run, close).

    python ablate.py                                           # DiT-Ti/7 MeanFlow, shipped MNIST, 50 steps
    python ablate.py model=DiT-B/2 objective=meanflow ablate.tokens=1024 trainer.batch_size=32 \\
        trainer.max_steps=100 run_dir=ablations/dit-b2-meanflow-1024
    python ablate.py objective=flow_matching ablate.backends=[math,sdpa] trainer.precision=fp32

Every train.py option works (configs/ablate.yaml is configs/train.yaml plus an `ablate:` section).
Writes run_dir/ablation.md, ablation.png and ablation.json. Bad input ends with one line `error: ...`
and exit code 1.
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flm.ablate import ablate
from flm.cli import check_model_choices, report_user_errors


@hydra.main(config_path="configs", config_name="ablate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    command = " ".join(["python ablate.py", *hydra_cfg.overrides.task])
    with report_user_errors(run_dir):
        ablate(cfg, run_dir, command)


if __name__ == "__main__":
    check_model_choices(sys.argv[1:], os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"))
    main()
