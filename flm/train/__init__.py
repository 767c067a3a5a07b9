"""Training: the loop, checkpoints, EMA, optimizer and sampling helpers (no Hydra in here)."""

from flm.train.loop import train
from flm.train.optim import OptimConfig
from flm.train.settings import TrainerConfig

__all__ = ["OptimConfig", "TrainerConfig", "train"]
