"""Every config group option composes and instantiates; so does every experiment preset."""

import pathlib

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from flm.attention import BACKENDS, get_attention
from flm.data import DataConfig
from flm.log import LoggerConfig
from flm.models import MODEL_SIZES, PREDICTIONS, ModelConfig, build_model
from flm.train import OptimConfig, TrainerConfig

from .conftest import ROOT

CONFIGS = ROOT / "configs"


def options(group: str) -> list[str]:
    """Option names of a config group, nested ones included (model=DiT-B/2 is model/DiT-B/2.yaml)."""
    folder = CONFIGS / group
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml"))


def test_every_group_has_options():
    for group in ("model", "objective", "attention", "data", "optim", "trainer", "logger", "experiment"):
        assert options(group), group


@pytest.mark.parametrize("name", options("model"))
def test_model_options(cfg_of, name):
    cfg = cfg_of("train", [f"model={name}"])
    model_cfg = instantiate(cfg.model)
    assert isinstance(model_cfg, ModelConfig) and model_cfg.name == name and name in MODEL_SIZES
    if name.startswith("DiT-T"):  # build the tiny ones; the others only name a registered size
        args = model_cfg.resolve_prediction(("velocity",)).args(
            input_size=28 if name == "DiT-Ti/7" else 8, in_channels=1, num_classes=10, time_inputs=2
        )
        model = build_model(**args)
        assert sum(p.numel() for p in model.parameters()) > 0


def test_every_registered_size_has_a_config():
    assert set(MODEL_SIZES) == set(options("model"))


def with_teacher(cfg):
    """A distillation's cfg with objective.teacher set (`???` in its preset; the objective reads it only in training)."""
    if OmegaConf.is_missing(cfg.objective, "teacher"):
        cfg.objective.teacher = "runs/teacher"
    return cfg


@pytest.mark.parametrize("name", options("objective"))
def test_objective_options(cfg_of, name):
    cfg = with_teacher(cfg_of("train", [f"objective={name}"]))
    objective = instantiate(cfg.objective)
    assert objective.time_inputs in (1, 2) and objective.sample_steps >= 1
    assert objective.predictions and set(objective.predictions) <= set(PREDICTIONS)
    assert cfg.trainer.sample_steps is None  # the objective's own, unless the command line says otherwise


@pytest.mark.parametrize("name", options("attention"))
def test_attention_options(cfg_of, name):
    backend = instantiate(cfg_of("train", [f"attention={name}", "model=DiT-B/2"]).model).attention  # after the model
    assert backend == name and (backend == "auto" or get_attention(backend).__name__.endswith(backend))
    assert set(options("attention")) == {"auto", *BACKENDS}


def test_unknown_attention_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown attention backend 'fast'; valid names: auto, math"):
        ModelConfig(attention="fast")


@pytest.mark.parametrize("name", options("data"))
def test_data_options(cfg_of, name):
    overrides = [f"data={name}"] + (["data.root=/nonexistent"] if name in ("imagefolder", "latents") else [])
    data = instantiate(cfg_of("train", overrides).data)
    assert isinstance(data, DataConfig) and data.name == name


@pytest.mark.parametrize("group,cls", [("optim", OptimConfig), ("trainer", TrainerConfig), ("logger", LoggerConfig)])
def test_dataclass_groups(cfg_of, group, cls):
    for name in options(group):
        assert isinstance(instantiate(cfg_of("train", [f"{group}={name}"])[group]), cls)


@pytest.mark.parametrize("name", options("experiment"))
def test_experiments(cfg_of, name):
    cfg = with_teacher(cfg_of("train", [f"experiment={name}"]))
    for group, cls in [("data", DataConfig), ("optim", OptimConfig), ("trainer", TrainerConfig), ("logger", LoggerConfig)]:
        assert isinstance(instantiate(cfg[group]), cls)
    assert instantiate(cfg.model).name in MODEL_SIZES
    assert instantiate(cfg.objective).time_inputs in (1, 2)


def test_sample_config(cfg_of):
    cfg = cfg_of("sample", ["ckpt=somewhere"])
    assert cfg.weights == "ema" and cfg.n > 0


def test_default_is_the_offline_cpu_run(cfg_of):
    cfg = cfg_of("train")
    assert cfg.data.name == "mnist_shipped" and cfg.objective.name == "meanflow"
    assert pathlib.Path(str(cfg.run_dir)).parts[0] == "outputs"


def test_slurm_launcher_composes():
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher",
        reason="hydra-submitit-launcher is an optional extra (pip install hydra-submitit-launcher)",
    )
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.nodes=2",
                "hydra.launcher.gpus_per_node=4",
            ],
            return_hydra_config=True,
        )
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["partition"], launcher["nodes"], launcher["tasks_per_node"]) == ("gpu", 2, 4)
