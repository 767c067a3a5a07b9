"""The training loop on the CPU: every objective trains, a resumed run is bit-exact, checkpoints
sample, non-finite losses are handled on purpose."""

import json

import pytest
import torch

from flm.train import checkpoint
from flm.train.sampling import class_labels, generate


def read_metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("objective", ["flow_matching", "meanflow", "scm"])
def test_a_few_steps_of_each_objective(tmp_path, train_run, objective):
    train_run(tmp_path, [f"objective={objective}"])
    assert [p.split("/")[-1] for p in checkpoint.list_checkpoints(str(tmp_path))] == ["ckpt-00000004.pt"]
    assert (tmp_path / "samples" / "step-00000004.png").is_file()
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [2, 4]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)


def assert_same_state(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a} != {b}"


def whole_and_resumed(tmp_path, train_run, common, *, steps: int, stop: int):
    """The last checkpoints of a run of `steps` steps and of the same run stopped after `stop` and resumed."""
    train_run(tmp_path / "whole", common + [f"trainer.max_steps={steps}"])
    train_run(tmp_path / "split", common + [f"trainer.max_steps={stop}"])
    train_run(tmp_path / "split", common + [f"trainer.max_steps={steps}", "trainer.resume=auto"])
    name = f"ckpt-{steps:08d}.pt"
    return tuple(checkpoint.load(str(tmp_path / run / "checkpoints" / name)) for run in ("whole", "split"))


def test_stop_and_resume_is_bit_exact(tmp_path, train_run):
    # sCM: trainable objective parameters and a step-dependent tangent warm-up; two EMAs; accumulation
    common = [
        "objective=scm",
        "objective.warmup_steps=4",
        "trainer.ema_decays=[0.5,0.9]",
        "trainer.grad_accum=2",
        "optim.warmup_steps=3",
        "trainer.ckpt_every=3",
        "trainer.keep_last=1",
    ]
    whole, split = whole_and_resumed(tmp_path, train_run, common, steps=6, stop=3)
    assert len(checkpoint.list_checkpoints(str(tmp_path / "split"))) == 1  # keep_last
    for key in ("model", "ema", "optimizer", "scheduler", "objective", "data", "rng", "nonfinite", "step"):
        assert_same_state(whole[key], split[key], key)
    assert read_metrics(tmp_path / "whole")[-1]["loss"] == read_metrics(tmp_path / "split")[-1]["loss"]  # steps 5-6


def test_an_scm_run_with_the_velocity_head(tmp_path, train_run):
    """objective.velocity_weight > 0: the loop builds the model with its velocity head, the checkpoint records it,
    and the run's generator loads and samples as any other."""
    from flm.train.generator import load_generator

    train_run(tmp_path, ["objective=scm", "objective.velocity_weight=1.0", "objective.cfg_omega=2.0"])
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    assert bundle["model_args"]["velocity_head"] is True
    assert any(name.startswith("velocity_layer.") for name in bundle["model"])
    assert "velocity_mse" in read_metrics(tmp_path)[-1]
    model, objective = load_generator(bundle)
    images = objective.sample(model, torch.randn(2, 1, 28, 28), torch.tensor([3, 4]), steps=2)
    assert images.shape == (2, 1, 28, 28) and torch.isfinite(images).all()


def test_a_run_with_the_normalised_conditioning(tmp_path, train_run):
    """model.cond_norm=true: the checkpoint records it and the run's generator is rebuilt with it."""
    from flm.train.generator import load_generator

    train_run(tmp_path, ["objective=scm", "model.cond_norm=true"])
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    assert bundle["model_args"]["cond_norm"] is True
    model, objective = load_generator(bundle)
    assert model.cond_norm
    images = objective.sample(model, torch.randn(2, 1, 28, 28), torch.tensor([3, 4]), steps=2)
    assert images.shape == (2, 1, 28, 28) and torch.isfinite(images).all()


@pytest.mark.parametrize("objective", ["meanflow", "scm"])  # sCM: 2 steps re-noise between them
def test_sampling_does_not_depend_on_batch_size(tmp_path, train_run, cfg_of, sample_entry, objective):
    train_run(tmp_path, [f"objective={objective}"])
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    from flm.models import build_model
    from hydra.utils import instantiate

    model = build_model(**bundle["model_args"])
    model.load_state_dict(next(iter(bundle["ema"].values())))
    objective = instantiate(bundle["config"]["objective"])
    objective.load_state_dict(bundle["objective"])
    kwargs = dict(seeds=list(range(5, 13)), labels=class_labels(8, 10), shape=(1, 28, 28), steps=2)
    a = generate(model, objective, batch_size=8, **kwargs)
    b = generate(model, objective, batch_size=3, **kwargs)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    out = sample_entry.run(
        cfg_of("sample", [f"ckpt={tmp_path}", "n=8", "batch_size=3", "seed=5", "steps=2", f"out={tmp_path / 'grid'}"])
    )
    saved = __import__("numpy").load(out + ".npz")
    assert saved["images"].shape == (8, 28, 28, 1) and saved["seeds"].tolist() == list(range(5, 13))
    assert (tmp_path / "grid.png").is_file()
    expected = ((a + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    assert abs(saved["images"].astype(int) - expected.astype(int)).max() <= 1


class FlakyObjective(torch.nn.Module):
    """A real objective whose loss is NaN at chosen steps (or always)."""

    def __init__(self, inner, nan_steps):
        super().__init__()
        self.inner, self.nan_steps, self.time_inputs = inner, nan_steps, inner.time_inputs
        self.sample_steps, self.networks, self.predictions = inner.sample_steps, inner.networks, inner.predictions

    def loss(self, model, x, y=None, *, step=0):
        loss, metrics = self.inner.loss(model, x, y, step=step)
        return (loss * float("nan") if self.nan_steps is None or step in self.nan_steps else loss), metrics

    def sample(self, *args, **kwargs):
        return self.inner.sample(*args, **kwargs)


def train_flaky(tmp_path, cfg_of, nan_steps, extra=(), objective_wrapper=FlakyObjective):
    from hydra.utils import instantiate

    from flm.train import train

    from .conftest import TINY

    cfg = cfg_of("train", TINY + ["objective=flow_matching", "trainer.log_every=1"] + list(extra))
    return train(
        run_dir=str(tmp_path),
        model=instantiate(cfg.model),
        objective=objective_wrapper(instantiate(cfg.objective), nan_steps),
        data=instantiate(cfg.data),
        optim=instantiate(cfg.optim),
        trainer=instantiate(cfg.trainer),
        logger=instantiate(cfg.logger),
    )


def test_nonfinite_step_is_skipped(tmp_path, cfg_of, caplog):
    metrics = train_flaky(tmp_path, cfg_of, nan_steps={1})
    assert metrics["nonfinite_steps"] == 1
    assert "non-finite loss" in caplog.text and "skipped (1 in a row, 1 in total)" in caplog.text
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    assert all(torch.isfinite(v).all() for v in bundle["model"].values())
    assert bundle["optimizer"]["state"][0]["step"].item() == 3  # 4 steps, one skipped


def test_nonfinite_gradients_are_named(tmp_path, cfg_of, caplog):
    """A gradient that overflows in one tensor while the loss stays finite (how sCM at lr 1e-3 stopped on the H200):
    the warning names the tensor. Steps that do not log are read one step late, with the next step's gradients."""

    class Overflowing(FlakyObjective):  # the model's last parameter gets an inf gradient
        name = None

        def loss(self, model, x, y=None, *, step=0):
            if Overflowing.name is None:
                Overflowing.name, p = list(model.named_parameters())[-1]
                p.register_hook(lambda g: torch.full_like(g, float("inf")))
            return super().loss(model, x, y, step=step)

    metrics = train_flaky(
        tmp_path, cfg_of, set(), extra=["trainer.log_every=100", "trainer.max_nonfinite=10"], objective_wrapper=Overflowing
    )
    assert metrics["nonfinite_steps"] == 4
    assert "step 0: non-finite loss" in caplog.text
    assert f"the gradients of step 1 (the next) are not finite in 1 tensors: model.{Overflowing.name}" in caplog.text
    assert "model.blocks" not in caplog.text  # the finite ones are not named


def test_an_overflowing_gradient_norm_names_the_largest_gradients(tmp_path, cfg_of, caplog):
    """Every gradient finite, their norm not (float32's sum of squares overflows; how sCM at lr 1e-3 stopped on the
    H200, where no tensor was named): the step is skipped and the warning names the largest gradients instead."""

    class Huge(FlakyObjective):  # the model's last parameter gets a finite gradient of 1e30
        name = None

        def loss(self, model, x, y=None, *, step=0):
            if Huge.name is None:
                Huge.name, p = list(model.named_parameters())[-1]
                p.register_hook(lambda g: torch.full_like(g, 1e30))
            return super().loss(model, x, y, step=step)

    extra = ["trainer.log_every=100", "trainer.max_nonfinite=10"]
    metrics = train_flaky(tmp_path, cfg_of, set(), extra=extra, objective_wrapper=Huge)
    assert metrics["nonfinite_steps"] == 4
    assert f"the gradients of step 1 (the next) are finite, the largest max |g|: model.{Huge.name} (1e+30)" in caplog.text


def test_nonfinite_in_a_row_stops(tmp_path, cfg_of):
    with pytest.raises(FloatingPointError, match="2 non-finite steps in a row .* Lower optim.lr"):
        train_flaky(tmp_path, cfg_of, nan_steps=None, extra=["trainer.max_nonfinite=2"])
    assert not checkpoint.list_checkpoints(str(tmp_path))


def test_unknown_parallel_mode_is_refused():
    from flm.train import TrainerConfig

    with pytest.raises(ValueError, match="must be one of ddp, fsdp, got 'zero'"):
        TrainerConfig(parallel="zero")
    TrainerConfig(parallel="fsdp")


def test_the_ema_split_target_gets_the_runs_ema(tmp_path, train_run, monkeypatch):
    """objective.split_target=ema: the loop hands the loss the EMA of split_ema (frozen, not the trained model);
    a decay the run does not keep is a clear error before anything is written."""
    from flm.objectives import MeanFlow

    split = ["objective=meanflow", "objective.split_above=0.0", "objective.split_target=ema", "objective.split_ema=0.995"]
    with pytest.raises(ValueError, match=r"trainer.ema_decays is \[0.98\]; add 0.995 to trainer.ema_decays"):
        train_run(tmp_path / "missing", split)
    assert not (tmp_path / "missing" / "checkpoints").exists()
    seen = []
    jumps = MeanFlow._split_target
    monkeypatch.setattr(MeanFlow, "_split_target", lambda self, net, *a: seen.append(net) or jumps(self, net, *a))
    train_run(tmp_path / "run", split + ["trainer.ema_decays=[0.98,0.995]"])
    assert len(seen) == 4 and all(net is seen[0] for net in seen)
    assert not any(p.requires_grad for p in seen[0].parameters())


def test_an_auto_prediction_is_recorded_resolved_and_a_resume_keeps_its_own(tmp_path, train_run):
    train_run(tmp_path / "mf", ["objective=meanflow"])
    assert checkpoint.load(str(tmp_path / "mf" / "checkpoints" / "ckpt-00000004.pt"))["model_args"]["prediction"] == "data"
    train_run(tmp_path / "fm", ["objective=flow_matching"])
    assert checkpoint.saved_prediction(str(tmp_path / "fm")) == "velocity"
    # a MeanFlow run made to predict the velocity continues doing so when resumed with the default (auto)
    train_run(tmp_path / "mfv", ["objective=meanflow", "model.prediction=velocity", "trainer.max_steps=2"])
    train_run(tmp_path / "mfv", ["objective=meanflow", "trainer.max_steps=4", "trainer.resume=auto"])
    assert checkpoint.saved_prediction(str(tmp_path / "mfv")) == "velocity"


def test_the_ema_target_velocity_gets_the_runs_ema(tmp_path, train_run, monkeypatch):
    """objective.target_velocity=ema: the loop hands the loss the frozen EMA of split_ema, the same one every step."""
    import flm.objectives.meanflow as meanflow

    seen = []
    check = meanflow.check_target_ema
    monkeypatch.setattr(meanflow, "check_target_ema", lambda ema, *a: seen.append(ema) or check(ema, *a))
    options = ["objective=meanflow", "objective.target_velocity=ema", "objective.adaptive_p=0", "objective.split_ema=0.98"]
    train_run(tmp_path / "run", options)
    assert len(seen) == 4 and all(net is seen[0] for net in seen)
    assert not any(p.requires_grad for p in seen[0].parameters())


def test_scm_bf16_gap_tables_an_scm_run_and_refuses_another(tmp_path, train_run, capsys):
    from .conftest import load_entry

    gap = load_entry("benchmarks/scm_bf16_gap")
    train_run(tmp_path / "scm", ["objective=scm"])
    gap.main(["--ckpt", str(tmp_path / "scm"), "--n", "16", "--device", "cpu"])
    assert "| bf16 change / ||g|| |" in capsys.readouterr().out
    train_run(tmp_path / "fm", ["objective=flow_matching"])
    with pytest.raises(SystemExit, match="is a FlowMatching run; this benchmark takes sCM"):
        gap.main(["--ckpt", str(tmp_path / "fm"), "--device", "cpu"])


@pytest.mark.parametrize("objective", ["meanflow", "scm"])
def test_the_consistency_curriculum_hands_over_and_resumes_exactly(tmp_path, train_run, objective):
    """objective.alpha_steps: the loop passes each step's kind (phase) to the loss, the curriculum's steps log their
    alpha and the JVP's do not, and a run stopped inside the curriculum resumes bit-exactly past the hand-over."""
    common = [f"objective={objective}", "objective.alpha_steps=[1,3]", "objective.alpha_min=0.1", "trainer.log_every=1"]
    whole, split = whole_and_resumed(tmp_path, train_run, common + ["trainer.ckpt_every=2"], steps=4, stop=2)
    metrics = read_metrics(tmp_path / "whole")
    assert [m.get("alpha") for m in metrics[:3]] == pytest.approx([1.0, 1.0, 0.1**0.5])
    assert "alpha" not in metrics[3]
    for key in ("model", "ema", "optimizer"):
        assert_same_state(whole[key], split[key], key)


def test_a_run_with_a_reference_bank_resumes_bit_exactly_and_samples(tmp_path, train_run):
    """objective.velocity_references: the bank of earlier batches is objective state, saved in the checkpoint, so a
    stopped run resumes bit-exactly (with accumulation, whose micro-batches share their step's block), and the run's
    generator loads it as any other objective state."""
    from flm.train.generator import load_generator

    common = [
        "objective=meanflow",
        "objective.velocity_estimate=batch",
        "objective.velocity_references=16",
        "trainer.grad_accum=2",
        "trainer.ckpt_every=3",
    ]
    whole, split = whole_and_resumed(tmp_path, train_run, common, steps=6, stop=3)
    for key in ("model", "ema", "optimizer", "objective"):
        assert_same_state(whole[key], split[key], key)
    assert whole["objective"]["data_velocity.bank.written"].sum() == 6  # a block per step, shared by its micro-batches
    model, objective = load_generator(whole)
    images = objective.sample(model, torch.randn(2, 1, 28, 28), torch.tensor([3, 4]), steps=1)
    assert images.shape == (2, 1, 28, 28) and torch.isfinite(images).all()


def test_an_scm_run_without_adaptive_weighting_has_no_objective_state(tmp_path, train_run):
    """objective.adaptive_weighting=false: sCM and sCD without their learned weight train, save an empty objective state
    and resume from it."""
    common = ["objective=scm", "objective.adaptive_weighting=false", "trainer.ckpt_every=2"]
    whole, split = whole_and_resumed(tmp_path, train_run, common, steps=4, stop=2)
    assert whole["objective"] == {}
    for key in ("model", "ema", "optimizer"):
        assert_same_state(whole[key], split[key], key)


def test_step_ms_leaves_out_each_kind_of_steps_first_run(tmp_path, train_run, monkeypatch):
    """The first step of a process (where torch.compile compiles and a CUDA graph is captured) is timed apart as
    warmup_s, out of its window's step_ms; so is the first step after a resume, and a window of that step alone
    reports it."""
    import time

    from flm.train import loop

    real_accumulate, real_clock, calls, lag = loop.accumulate, time.perf_counter, [], [0.0]

    def slow_first(*args, **kwargs):  # each process's first step "takes" 1000 s more, on a clock the test moves
        calls.append(args[0].step)
        if len(calls) == 1:
            lag[0] += 1000.0
        return real_accumulate(*args, **kwargs)

    monkeypatch.setattr(loop, "accumulate", slow_first)
    monkeypatch.setattr(loop.time, "perf_counter", lambda: real_clock() + lag[0])
    train_run(tmp_path, ["trainer.ckpt_every=4"])
    calls.clear()
    train_run(tmp_path, ["trainer.max_steps=6", "trainer.log_every=1", "trainer.resume=auto"])
    windows = {m["step"]: m for m in read_metrics(tmp_path)}
    assert sorted(windows) == [2, 4, 5, 6]
    assert windows[2]["warmup_s"] >= 1000 and windows[5]["warmup_s"] >= 1000  # the first step of each process
    assert "warmup_s" not in windows[4] and "warmup_s" not in windows[6]
    # counted in its 2-step window the 1000 s would read 500,000 ms a step; a window of the warm-up alone reports it
    assert windows[2]["step_ms"] < 50_000 and windows[5]["step_ms"] >= 1_000_000, windows


def test_step_ms_leaves_out_grids_and_checkpoints(tmp_path, train_run, monkeypatch):
    """A window's step_ms is the steps' own time: a slow grid (at step 2, the end of the first window) and slow
    checkpoint writes (every step) fall outside every window. The slowness is the loop's clock moved on by 1000 s, not a
    sleep, so that a busy CPU cannot fail the test."""
    import time

    from flm.train import loop, state

    real_clock, skipped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + skipped[0])

    def slow(real):
        def call(*args, **kwargs):
            skipped[0] += 1000.0
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(loop, "sample_grid", slow(loop.sample_grid))
    monkeypatch.setattr(state.TrainState, "save", slow(state.TrainState.save))
    train_run(tmp_path, ["trainer.sample_every=2", "trainer.ckpt_every=1", "trainer.keep_last=1"])
    windows = read_metrics(tmp_path)
    assert [m["step"] for m in windows] == [2, 4]
    # one 1000 s jump counted in a window of 2 steps would add 500,000 ms a step; each window saw 2-3 of them
    assert all(m["step_ms"] < 100_000 for m in windows), [m["step_ms"] for m in windows]


def test_the_training_loop_with_the_kernels_logs_pytorchs_losses(tmp_path, monkeypatch, cfg_of, train_entry):
    """train.py's loop (MeanFlow through its JVP, the EMA, the checkpoint) with the kernels: the error and gradient norm
    it logs are PyTorch's ops' to float rounding (flm.kernels.adaln, in Triton's CPU interpreter)."""
    from flm.kernels import adaln

    from .conftest import TINY

    def logged(name):
        # a high lr moves the zero-initialised adaLN and output layers within the 4 steps, so that the norms matter
        overrides = ["objective=meanflow", "trainer.log_every=1", "trainer.ckpt_every=4", "optim.lr=0.02"]
        cfg = cfg_of("train", TINY + overrides + ["optim.warmup_steps=0"])
        train_entry.run(cfg, str(tmp_path / name))
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        return [(r["mse"], r["grad_norm"]) for r in rows if "mse" in r]

    plain = logged("plain")
    monkeypatch.setattr(adaln, "FORCE", True)
    fused = logged("fused")
    assert len(plain) == 4 and (tmp_path / "fused" / "checkpoints").is_dir()
    for p, f in zip(plain, fused, strict=True):
        assert f == pytest.approx(p, rel=1e-4)
