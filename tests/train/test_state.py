"""flm.train.state: the checkpoint's contents named once, and an objective's extra networks (a frozen
teacher, a trainable fake score with its own optimizer) trained, saved and resumed with no special case."""

import pytest
import torch

from flm.models import build_model
from flm.objectives import FlowMatching, Network
from flm.train import checkpoint

from .conftest import TINY
from .test_loop import assert_same_state

# what the checkpoints of format 1 hold (written since the run-folder lock and the loss window)
FORMAT_1 = {
    "format",
    "model",
    "ema",
    "optimizer",
    "scheduler",
    "objective",
    "step",
    "rng",
    "data",
    "nonfinite",
    "log_window",
    "model_args",
    "config",
}


def test_a_checkpoint_holds_format_1s_parts(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=1"])
    assert set(checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))) == FORMAT_1


class ToyDistill(FlowMatching):
    """Flow matching of the model and of a fake score, next to a frozen teacher whose loss is only logged."""

    def __init__(self, fake_lr: float):
        super().__init__()
        self.networks = {
            "teacher": Network(build=lambda args: build_model(**args)),
            "fake_score": Network(build=lambda args: build_model(**args), trainable=True, optim={"lr": fake_lr}),
        }

    def loss(self, model, x, y=None, *, step=0, teacher, fake_score):
        assert not any(p.requires_grad for p in teacher.parameters())
        loss, metrics = super().loss(model, x, y, step=step)
        fake_loss, _ = super().loss(fake_score, x, y, step=step)
        with torch.no_grad():
            teacher_loss, _ = super().loss(teacher, x, y, step=step)
        return loss + fake_loss, {**metrics, "fake_loss": fake_loss.detach(), "teacher_loss": teacher_loss}


def train_distill(run_dir, cfg_of, overrides):
    from hydra.utils import instantiate

    from flm.train import train

    cfg = cfg_of(
        "train",
        TINY
        + [
            "objective=flow_matching",
            "trainer.log_every=1",
            "optim.warmup_steps=0",
            "optim.lr=1e-3",
            "trainer.ckpt_every=2",
            "trainer.keep_last=0",
            *overrides,
        ],
    )
    return train(
        run_dir=str(run_dir),
        model=instantiate(cfg.model),
        objective=ToyDistill(fake_lr=1e-5),
        data=instantiate(cfg.data),
        optim=instantiate(cfg.optim),
        trainer=instantiate(cfg.trainer),
        logger=instantiate(cfg.logger),
    )


def test_an_objectives_networks_train_save_and_resume(tmp_path, cfg_of):
    metrics = train_distill(tmp_path / "whole", cfg_of, ["trainer.max_steps=4"])
    assert {"fake_loss", "teacher_loss"} <= set(metrics)
    start = checkpoint.load(str(tmp_path / "whole" / "checkpoints" / "ckpt-00000002.pt"))
    end = checkpoint.load(str(tmp_path / "whole" / "checkpoints" / "ckpt-00000004.pt"))
    assert set(end) == FORMAT_1 | {"fake_score", "fake_score.optimizer", "fake_score.scheduler"}  # no teacher
    assert end["fake_score.optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-5)
    assert end["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3)
    moved = [k for k in end["fake_score"] if not torch.equal(end["fake_score"][k], start["fake_score"][k])]
    assert moved, "the fake score did not train"

    train_distill(tmp_path / "split", cfg_of, ["trainer.max_steps=2"])
    train_distill(tmp_path / "split", cfg_of, ["trainer.max_steps=4", "trainer.resume=auto"])
    split = checkpoint.load(str(tmp_path / "split" / "checkpoints" / "ckpt-00000004.pt"))
    for key in set(end) - {"config"}:
        assert_same_state(end[key], split[key], key)


def test_a_checkpoint_without_the_networks_says_so(tmp_path, cfg_of, train_run):
    train_run(tmp_path, ["trainer.max_steps=1", "objective=flow_matching"])
    with pytest.raises(ValueError, match="lacks fake_score, fake_score.optimizer, fake_score.scheduler"):
        train_distill(tmp_path, cfg_of, ["trainer.max_steps=2", "trainer.resume=auto"])


def test_each_network_logs_its_mean_loss_over_the_steps_that_trained_it():
    """A DMD student and its fake score alternate: the window keeps each network's loss apart, and a mean counts only
    the steps that trained that network (a skipped step counts, with nothing added)."""
    from flm.train.outcome import Outcomes

    outcomes, t = Outcomes(max_nonfinite=3), torch.tensor
    steps = [({"fake_score": t(4.0)}, 1.0), ({"model": t(2.0), "fake_score": t(6.0)}, 1.0), ({"model": t(float("nan"))}, 0.0)]
    for losses, finite in steps:
        outcomes.record(0, losses, t(finite), t(1.0))
        outcomes.settle()
    assert outcomes.mean_losses() == {"model": 1.0, "fake_score": 5.0}
    assert outcomes.mean_losses() == {}  # a new window
    outcomes.record(0, {"fake_score": t(3.0)}, t(1.0), t(1.0))
    outcomes.settle()
    resumed = Outcomes(max_nonfinite=3)
    resumed.window.load_state_dict(outcomes.window.state_dict())
    assert resumed.mean_losses() == {"fake_score": 3.0}
    resumed.window.load_state_dict({"loss_sum": 2.5, "steps": 1})  # written before the window kept other networks
    assert resumed.mean_losses() == {"model": 2.5}
