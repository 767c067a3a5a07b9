"""Training: the loop, checkpoints, EMA, optimizer and sampling helpers (no Hydra in here)."""

from flm.train.loop import TrainerConfig, train
from flm.train.optim import OptimConfig

__all__ = ["OptimConfig", "TrainerConfig", "train"]
