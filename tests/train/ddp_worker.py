"""Runs under torchrun for test_distributed.py: several short trainings in one process group (one
launch, not one per run). argv[1] is a JSON list of [run_dir, [overrides]]; a run that raises writes
its message to <run_dir>/error.txt (on rank 0) and the next run starts. argv[2] = "unwrapped": DDP is left
out as under trainer.cuda_graph=true (flm.train.parallel.wrap), and the optimizer averages every gradient."""

import json
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from flm import dist  # noqa: E402
from flm.objectives import MeanFlow  # noqa: E402


class ModuleBypass(MeanFlow):
    """MeanFlow on the DDP wrapper's `.module`: the trap the sync check is for (DDP's gradient hooks do
    not fire when its forward is bypassed, so each rank steps with its own gradients)."""

    def loss(self, model, x, y=None, *, step: int = 0):
        return super().loss(getattr(model, "module", model), x, y, step=step)


class RankSkew(MeanFlow):
    """MeanFlow with a parameter of its own (replicated, like sCM's) that each rank shifts by its rank
    outside the optimizer: what the sync check still catches under FSDP2."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.skew = nn.Parameter(torch.zeros(()))

    def loss(self, model, x, y=None, *, step: int = 0):
        with torch.no_grad():
            self.skew += dist.rank()
        return super().loss(model, x, y, step=step)


def main(jobs_file: str) -> None:
    from hydra import compose, initialize_config_dir

    from tests.train.conftest import TINY, load_entry

    train_entry = load_entry("train")
    if sys.argv[2:] == ["unwrapped"]:
        from flm.train import loop, parallel

        parallel.wrapper_syncs = loop.wrapper_syncs = lambda mode, *, cuda_graph: False
    for run_dir, overrides in json.loads(pathlib.Path(jobs_file).read_text()):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=TINY + overrides)
        try:
            train_entry.run(cfg, run_dir)
        except Exception as e:
            if dist.is_main():
                pathlib.Path(run_dir).mkdir(parents=True, exist_ok=True)
                pathlib.Path(run_dir, "error.txt").write_text(f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1])
