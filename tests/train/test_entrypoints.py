"""train.py and sample.py as a user runs them, and every bad input: one clear line, exit code 1,
nothing half-written."""

import os

import pytest
import torch

from flm.train import checkpoint
from flm.cli import user_error
from flm.train.settings import local_batch_size

from .conftest import TINY, run_script


def error_of(fn, *args):
    """The one-line message train.py / sample.py would print for what fn(*args) raises."""
    with pytest.raises(Exception) as info:
        fn(*args)
    cause = user_error(info.value)
    assert cause is not None, f"not reported as a user error: {info.value!r}"
    return str(cause)


def test_train_then_sample_from_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, err = run_script("train", *TINY, f"run_dir={run_dir}")
    assert rc == 0, err
    assert (run_dir / "samples" / "step-00000004.png").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    assert "step 4/4" in err + out  # the progress line
    rc, out, err = run_script("sample", f"ckpt={run_dir}", "n=6", "batch_size=4")
    assert rc == 0, err
    stem = run_dir / "samples" / "ckpt-00000004-ema-steps1-cfg1-seed0-n6"
    assert stem.with_suffix(".png").is_file() and stem.with_suffix(".npz").is_file()


def test_multirun(tmp_path):
    rc, out, err = run_script(
        "train", "-m", *TINY, "trainer.max_steps=2", "objective=flow_matching,meanflow", f"hydra.sweep.dir={tmp_path}"
    )
    assert rc == 0, err
    assert all(checkpoint.list_checkpoints(str(tmp_path / job)) for job in ("0", "1"))


@pytest.mark.parametrize(
    "override,expected",
    [
        ("model=DiT-Q/9", "error: model=DiT-Q/9 is not a model; valid: DiT-B/2"),
        ("trainer.no_such_key=1", "Key 'no_such_key' is not in struct"),
    ],
)
def test_unknown_config_option(tmp_path, override, expected):
    rc, _, err = run_script("train", override, f"run_dir={tmp_path / 'run'}")
    assert rc != 0 and expected in err


def test_bad_value_is_one_line_and_leaves_nothing(tmp_path):
    rc, out, err = run_script("train", *TINY, "trainer.batch_size=0", f"run_dir={tmp_path / 'run'}")
    assert rc == 1 and err.strip() == "error: trainer.batch_size must be > 0, got 0"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override,expected",
    [
        ("trainer.batch_size=-4", "trainer.batch_size must be > 0, got -4"),
        ("trainer.eval_batch_size=0", "trainer.eval_batch_size must be > 0 (or null: the training micro-batch), got 0"),
        ("optim.lr=0", "optim.lr must be a finite number > 0, got 0"),
        ("optim.lr=-1e-3", "optim.lr must be a finite number > 0, got -0.001"),
        ("optim.lr=inf", "optim.lr must be a finite number > 0, got inf"),
        ("trainer.grad_accum=3", "trainer.batch_size=4 is not divisible by world size x grad_accum = 1 x 3"),
        ("data=mnist", "does not exist"),
        ("model.prediction=eps", "unknown prediction 'eps'; valid: velocity, data"),
        ("objective=scd objective.teacher=t.pt model.prediction=data", "model.prediction=data does not fit objective SCD"),
        ("objective=flow_matching model.decoder_depth=1", "model.decoder_depth=1 conditions the last blocks on r"),
        ("model.decoder_depth=3", "model.decoder_depth must be in [0, 2] (DiT-T/4 has 2 blocks), got 3"),
    ],
)
def test_bad_values(tmp_path, train_run, override, expected):
    extra = ["data.root=" + str(tmp_path / "missing")] if override.startswith("data=") else []
    assert expected in error_of(train_run, tmp_path / "run", override.split() + extra)


def test_batch_not_divisible_by_world_size():
    assert local_batch_size(64, 2, 4) == 8
    message = r"trainer.batch_size=6 is not divisible by world size x grad_accum = 4 x 1; pick a multiple of 4"
    with pytest.raises(ValueError, match=message):
        local_batch_size(6, 1, 4)


def test_empty_dataset_folder(tmp_path, train_run):
    (tmp_path / "images").mkdir()
    msg = error_of(train_run, tmp_path / "run", ["data=imagefolder", f"data.root={tmp_path / 'images'}", "data.resolution=8"])
    assert "has no images" in msg and "data.root" in msg


def test_resume_without_checkpoint(tmp_path, train_run):
    msg = error_of(train_run, tmp_path / "run", ["trainer.resume=auto"])
    assert "has no checkpoint" in msg and "run_dir=" in msg


def test_new_run_in_a_folder_with_checkpoints(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=1"])
    assert "pass trainer.resume=auto" in error_of(train_run, tmp_path, [])


def test_truncated_checkpoint(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=1"])
    path = checkpoint.find_checkpoint(str(tmp_path))
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=2"])
    assert "is truncated or unreadable" in msg and os.path.basename(path) in msg


def test_checkpoint_of_another_model_size(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=1"])
    msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=2", "model=DiT-T/2"])
    assert "is for another model" in msg and "model=DiT-T/4" in msg


def test_sample_from_a_folder_without_checkpoint(tmp_path):
    rc, _, err = run_script("sample", f"ckpt={tmp_path}")
    assert rc == 1 and err.strip().startswith(f"error: no checkpoint in '{tmp_path}'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_triton_jvp_without_cuda(tmp_path, train_run, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    msg = error_of(train_run, tmp_path / "run", ["attention=triton_jvp"])
    assert "'triton_jvp' needs a CUDA GPU" in msg


def test_wandb_logger(tmp_path, train_run):
    try:
        import wandb  # noqa: F401
    except ImportError:
        assert "pip install wandb" in error_of(train_run, tmp_path / "run", ["logger=wandb"])
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    else:
        train_run(tmp_path / "run", ["logger=wandb", "logger.mode=disabled", "trainer.max_steps=1"])
