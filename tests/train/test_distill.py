"""Distillation in the loop (objective=scd / rcm / rcm_gan / meanflow_distill / ...): the teacher stays frozen, the
student starts from it, every network resumes bit-exactly, two gloo processes (DDP, FSDP2) train as one,
a student samples without its teacher's file, and a bad teacher is one `error:` line with nothing written."""

import json
import shutil
from typing import ClassVar

import pytest
import torch

from flm.models import MODEL_SIZES, build_model
from flm.objectives import RCM
from flm.objectives.teacher import check_teacher, feature_blocks, load_teacher
from flm.train import checkpoint
from flm.train.loop import start_from

from .conftest import ROOT, TINY, load_entry, run_script, torchrun
from .test_loop import assert_same_state

STUDENT = ["trainer.ckpt_every=2", "trainer.keep_last=0", "objective.warmup_steps=2"]
FEATURE_MATCHING = "objective.adv_loss=feature_matching"
FROM_START = "objective.adv_from_start=true"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """Flow-matching runs of the TINY model (DiT-T/4 on the shipped MNIST), predicting the velocity and the image, and a
    MeanFlow run."""
    tmp = tmp_path_factory.mktemp("teacher")
    runs = {
        "flow_matching": ["objective=flow_matching"],
        "flow_matching_data": ["objective=flow_matching", "model.prediction=data", "objective.loss_t_min=0.05"],
        "meanflow": ["objective=meanflow"],
    }
    for run, overrides in runs.items():
        rc, _, err = run_script("train", *TINY, "trainer.max_steps=2", *overrides, f"run_dir={tmp / run}")
        assert rc == 0, err
    return tmp


def objective_of(name, teacher, extra=()):
    """A student's objective options; its teacher predicts what the student does (model.prediction in extra)."""
    run = "flow_matching_data" if "model.prediction=data" in extra else "flow_matching"
    return [f"objective={name}", f"objective.teacher={teacher / run}"]


class Watched(RCM):
    """rCM that keeps the teacher and the fake score it is handed, to look at after training."""

    seen: ClassVar[dict] = {}

    def loss(self, model, x, y=None, *, step=0, phase=None, teacher, fake_score):
        assert not any(p.requires_grad or p.grad is not None for p in teacher.parameters())
        assert phase == self.phase(step)  # the loop names each step's kind
        Watched.seen.update(teacher=teacher, fake_score=fake_score)
        return super().loss(model, x, y, step=step, phase=phase, teacher=teacher, fake_score=fake_score)


def test_the_teacher_stays_frozen_and_the_student_starts_from_it(tmp_path, teacher, train_run):
    args = [
        "objective._target_=tests.train.test_distill.Watched",
        "~objective.name",
        "optim.lr=1e-12",
        "trainer.ema_decays=[0.9]",
    ]
    train_run(tmp_path, objective_of("rcm", teacher) + STUDENT + args)
    saved = Watched.seen["teacher"].state_dict()
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(teacher / "flow_matching")))
    fresh = load_teacher(str(teacher / "flow_matching"), bundle["model_args"])
    assert_same_state(saved, fresh.state_dict())  # unchanged after 4 steps
    moved = [k for k, v in Watched.seen["fake_score"].state_dict().items() if not torch.equal(v, fresh.state_dict()[k])]
    assert moved, "the fake score did not train"
    student = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    for k, v in fresh.state_dict().items():  # lr 1e-12: the student is still its teacher
        torch.testing.assert_close(student["model"][k], v, rtol=0, atol=1e-6)
        torch.testing.assert_close(student["ema"]["0.9"][k], v, rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_on_a_gpu_the_teacher_is_stored_in_bf16_after_the_student_starts_from_its_float32_weights(tmp_path, teacher, train_run):
    """On CUDA the frozen teacher runs under bf16 autocast only, so the loop stores its linear weights in bf16
    (flm.objectives.teacher.matmuls_in_bf16): exactly its float32 weights rounded; the student and its EMA start from
    the float32 ones. The fake score, trained, stays float32."""
    args = ["objective._target_=tests.train.test_distill.Watched", "~objective.name", "optim.lr=1e-12"]
    args += ["trainer.ema_decays=[0.9]", "trainer.device=cuda"]
    train_run(tmp_path, objective_of("rcm", teacher) + STUDENT + args)
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(teacher / "flow_matching")))
    fresh = load_teacher(str(teacher / "flow_matching"), bundle["model_args"]).state_dict()
    stored = Watched.seen["teacher"].state_dict()
    linear = [k for k in fresh if k.endswith((".weight", ".bias")) and not k.startswith("y_embedder.")]
    assert linear and all(stored[k].dtype == torch.bfloat16 for k in linear)
    for k, v in fresh.items():
        torch.testing.assert_close(stored[k].cpu(), v.to(stored[k].dtype), rtol=0, atol=0)
    assert all(v.dtype == torch.float32 for v in Watched.seen["fake_score"].state_dict().values() if v.is_floating_point())
    student = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    for k, v in fresh.items():
        torch.testing.assert_close(student["model"][k].cpu(), v, rtol=0, atol=1e-6)
        torch.testing.assert_close(student["ema"]["0.9"][k].cpu(), v, rtol=0, atol=1e-6)


def test_teacher_ema_picks_the_teacher_runs_average(tmp_path, teacher, train_run):
    """objective.teacher_ema names which of the teacher run's EMAs the teacher is and the student starts from (the
    fake score too); null takes the first; a missing one is a ValueError naming the option."""
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(teacher / "flow_matching")))
    first = next(iter(bundle["ema"]))
    other = {k: v * 0.9 for k, v in bundle["ema"][first].items()}  # an average unlike the first
    bundle["ema"] = {first: bundle["ema"][first], "0.5": other}
    path = str(tmp_path / "teacher.pt")
    checkpoint.save(bundle, path)
    args = bundle["model_args"]
    assert_same_state(load_teacher(path, args).state_dict(), bundle["ema"][first])
    assert_same_state(load_teacher(path, args, ema=0.5).state_dict(), other)
    with pytest.raises(ValueError, match=r"teacher_ema"):
        load_teacher(path, args, ema=0.25)
    for bad in (1.5, 0, True, ""):
        with pytest.raises(ValueError, match=r"teacher_ema must be"):
            RCM(teacher=path, teacher_ema=bad)

    overrides = ["objective=rcm", f"objective.teacher={path}", "objective.teacher_ema=0.5", *STUDENT]
    train_run(tmp_path / "student", [*overrides, "optim.lr=1e-12", "objective.fake_lr=1e-12", "trainer.ema_decays=[0.9]"])
    student = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path / "student")))
    for k, v in other.items():  # lr 1e-12: the student, its EMA and its fake score still are that average
        torch.testing.assert_close(student["model"][k], v, rtol=0, atol=1e-6)
        torch.testing.assert_close(student["ema"]["0.9"][k], v, rtol=0, atol=1e-6)
        torch.testing.assert_close(student["fake_score"][k], v, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("scd", []),
        (
            "scd",
            [
                "objective.one_step_frac=0.25",
                "objective.teacher_steps=2",
                "objective.one_step_ema=0.98",
                "objective.hf_weight_one_step=16",
                "objective.one_step_solver=heun",
            ],
        ),
        ("rcm", []),
        ("rcm", ["objective.dmd_two_step_frac=0.5"]),
        ("rcm", ["objective.dmd_start=2", "objective.fake_betas=[0.0,0.999]", "objective.fake_weight_decay=0.01"]),
        ("rcm", ["objective.dmd_start=2", "objective.distill_weight=0"]),
        ("meanflow_distill", []),
        ("meanflow_distill", ["objective.split_above=0.0", "objective.split_target=teacher_student"]),
        ("meanflow_distill", ["objective.one_step_frac=0.25", "objective.perceptual_weight=1.0"]),
        ("meanflow_distill", ["model.prediction=data"]),
        ("meanflow_dmd", ["objective.fake_updates=0"]),
        ("meanflow_gan", ["objective.disc_width=8"]),
        ("meanflow_gan", ["objective.disc_backbone=teacher", "objective.r1_gamma=0", "objective.disc_width=8"]),
        ("rcm_gan", ["objective.dmd_start=2", "objective.disc_width=8"]),
        ("rcm_gan", ["objective.dmd_start=2", "objective.disc_backbone=teacher", "objective.r1_gamma=0", FEATURE_MATCHING]),
        (
            "rcm_gan",
            ["objective.dmd_start=2", "objective.disc_backbone=teacher", "objective.r1_gamma=0", FEATURE_MATCHING, FROM_START],
        ),
    ],
)
def test_stop_and_resume_is_bit_exact_with_every_network(tmp_path, teacher, train_run, name, extra):
    common = objective_of(name, teacher, extra) + STUDENT[:2] + extra
    common += ["objective.warmup_steps=2"] if name in ("scd", "rcm", "rcm_gan") else []
    common += ["trainer.grad_accum=2", "trainer.log_every=1"]
    train_run(tmp_path / "whole", common)
    train_run(tmp_path / "split", common + ["trainer.max_steps=2"])
    train_run(tmp_path / "split", common + ["trainer.resume=auto"])
    whole, split = (checkpoint.load(str(tmp_path / run / "checkpoints" / "ckpt-00000004.pt")) for run in ("whole", "split"))
    assert ("fake_score.optimizer" in whole) == (name in ("rcm", "meanflow_dmd", "rcm_gan")) and "teacher" not in whole
    assert ("discriminator.optimizer" in whole) == (name in ("meanflow_gan", "rcm_gan") and FEATURE_MATCHING not in extra)
    for key in set(whole) - {"config"}:
        assert_same_state(whole[key], split[key], key)
    metrics = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
    delayed = "objective.dmd_start=2" in extra
    for m in metrics:  # each network's loss under its own key; a window of one step: the objective's figures
        for network, figure in (("fake_score", "fake_loss"), ("discriminator", "disc_loss")):
            assert (f"{network}.loss" in m) == (figure in m)
            if figure in m:
                assert m[f"{network}.loss"] == pytest.approx(m[figure], rel=1e-5)
    if name == "rcm" and not delayed:  # steps 1 and 3 update the fake score, steps 2 and 4 the student
        assert ["fake_loss" in m for m in metrics] == [True, False, True, False]
        assert ["loss" in m for m in metrics] == [False, True, False, True]  # the student's alone
        assert ["dmd" in m and "grad_norm" in m for m in metrics] == [False, True, False, True]
        assert "fake_score.grad_norm" in metrics[0]
    if name == "rcm" and delayed:  # dmd_start 2: the student alone at steps 1 and 2, then the fake score, then both
        assert ["fake_loss" in m for m in metrics] == [False, False, True, False]
        assert ["dmd" in m for m in metrics] == [False, False, False, True]
        assert ["grad_norm" in m for m in metrics] == [True, True, False, True]
        alone = "objective.distill_weight=0" in extra  # DMD alone in the student's steps: no sCD loss there
        assert ["mse" in m for m in metrics] == [True, True, False, not alone]
    if name == "rcm" and "objective.fake_weight_decay=0.01" in extra:
        group = whole["fake_score.optimizer"]["param_groups"][0]  # its own betas and weight decay, the student's lr
        assert tuple(group["betas"]) == (0.0, 0.999) and group["weight_decay"] == 0.01
        assert tuple(whole["optimizer"]["param_groups"][0]["betas"]) != (0.0, 0.999)
    if name == "meanflow_dmd":  # fake_updates 0: every step updates both networks
        assert all("fake_loss" in m and "dmd" in m and "fake_score.grad_norm" in m for m in metrics)
    if name == "meanflow_gan":  # the student and the discriminator in every step
        assert all("disc_loss" in m and "adv" in m and "discriminator.grad_norm" in m for m in metrics)
    if name == "rcm_gan":  # sCD alone at steps 1 and 2, the fake score at 3, then the student with DMD and the GAN term
        assert ["fake_loss" in m for m in metrics] == [False, False, True, False]
        # the term from step 1 with adv_from_start (sCD's steps), else with DMD from step 4 (the fake score's at 3)
        assert ["adv" in m for m in metrics] == [FROM_START in extra, FROM_START in extra, False, True]
        trained = "disc_loss" if FEATURE_MATCHING in extra else "discriminator.grad_norm"  # feature matching: no D
        assert ["dmd" in m and "adv" in m and (trained in m) != (FEATURE_MATCHING in extra) for m in metrics] == [
            False,
            False,
            False,
            True,
        ]


@pytest.mark.parametrize(
    "name, extra",
    [
        ("rcm_gan", ["objective.dmd_start=2", "objective.disc_width=8", "objective.r1_gamma=1.0"]),  # R1: a double backward
        ("meanflow_distill", []),
    ],
)
def test_bulk_casts_train_every_network_as_per_parameter_casts_do_to_the_bit(
    tmp_path, teacher, train_run, monkeypatch, name, extra
):
    """Under bf16 autocast in one process the loop casts the trainable parameters in bulk by default
    (trainer.bulk_casts): the student, the fake score and the discriminator end where one cast per parameter leaves
    them, to the bit, with gradient accumulation and rCM's alternating steps (a network a step leaves unused gets no
    gradient)."""
    import flm.nn as fnn

    common = objective_of(name, teacher, extra) + STUDENT[:2] + extra
    common += ["trainer.precision=bf16", "trainer.grad_accum=2", "trainer.keep_last=1"]
    bulk_calls = []
    cast_in_bulk = fnn._cast_in_bulk
    monkeypatch.setattr(fnn, "_cast_in_bulk", lambda params: bulk_calls.append(len(params)) or cast_in_bulk(params))
    train_run(tmp_path / "bulk", common)
    assert bulk_calls and all(n > 0 for n in bulk_calls)
    bulk_calls.clear()
    train_run(tmp_path / "off", common + ["trainer.bulk_casts=false", "trainer.max_steps=1"])
    assert bulk_calls and not any(bulk_calls)  # turned off: nothing in bulk
    monkeypatch.setattr(fnn, "_cast_in_bulk", lambda params: None)
    train_run(tmp_path / "each", common)
    bulk, each = (checkpoint.load(str(tmp_path / run / "checkpoints" / "ckpt-00000004.pt")) for run in ("bulk", "each"))
    for key in set(bulk) - {"config"}:
        assert_same_state(bulk[key], each[key], key)


def test_a_student_samples_without_its_teachers_file(tmp_path, teacher, train_run):
    shutil.copytree(teacher / "flow_matching", tmp_path / "teacher")
    train_run(tmp_path / "student", ["objective=scd", f"objective.teacher={tmp_path / 'teacher'}"])
    shutil.rmtree(tmp_path / "teacher")
    rc, _, err = run_script("sample", f"ckpt={tmp_path / 'student'}", "n=2", "steps=2", "device=cpu")
    assert rc == 0, err
    assert list((tmp_path / "student" / "samples").glob("ckpt-00000004-ema-steps2-*.png"))


def trained_teacher(args):
    teacher = build_model("DiT-T/4", **args).eval()
    with torch.no_grad():  # a trained teacher: DiT's zero-initialised adaLN and output would hide any difference
        for p in teacher.parameters():
            p.normal_(std=0.1)
    return teacher


def test_a_meanflow_student_starts_as_its_teacher_at_every_r():
    args = dict(input_size=8, in_channels=1, num_classes=10, attention="math")
    teacher = trained_teacher(args)
    student = build_model("DiT-T/4", time_inputs=2, **args).eval()
    start_from(student, teacher)
    x, t, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 5, 10])
    with torch.no_grad():
        v = teacher(x, t, None, y)
        for r in (t, t * 0.5, torch.zeros(3)):
            torch.testing.assert_close(student(x, t, r, y), v)


def test_a_decoupled_student_is_its_teacher_at_r_equal_t_and_depends_on_r():
    """model.decoder_depth: the student has exactly its teacher's weights, no new ones; at r = t it is the teacher,
    at r != t its last block and output layer see r's embedding."""
    args = dict(input_size=8, in_channels=1, num_classes=10, attention="math")
    teacher = trained_teacher(args)
    student = build_model("DiT-T/4", time_inputs=2, decoder_depth=1, **args).eval()
    assert student.state_dict().keys() == teacher.state_dict().keys()
    start_from(student, teacher)
    x, t, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 5, 10])
    with torch.no_grad():
        torch.testing.assert_close(student(x, t, t, y), teacher(x, t, None, y))
        assert (student(x, t, t * 0.5, y) - teacher(x, t, None, y)).abs().max() > 1e-2
        # the first block sees t alone: its hidden state does not move with r
        torch.testing.assert_close(student(x, t, t * 0.5, y, features=[0])[0], teacher(x, t, None, y, features=[0])[0])
        assert not torch.allclose(student(x, t, t * 0.5, y, features=[1])[0], teacher(x, t, None, y, features=[1])[0])


def test_a_students_two_step_time_is_a_sampling_option(tmp_path, teacher, train_run):
    train_run(tmp_path / "student", ["objective=scd", f"objective.teacher={teacher / 'flow_matching'}"])
    rc, out, err = run_script("sample", f"ckpt={tmp_path / 'student'}", "n=2", "steps=2", "mid_t=[0.8]", "device=cpu")
    assert rc == 0, err
    assert list((tmp_path / "student" / "samples").glob("ckpt-00000004-ema-steps2-cfg1-mid0.8-seed0-n2.png")), out


@pytest.mark.parametrize(
    "override, message",
    [
        (["objective.teacher={tmp}/missing"], "does not exist"),
        (["objective.teacher={teacher}/meanflow"], "was trained with objective 'meanflow', not flow_matching"),
        (["objective.teacher={teacher}/flow_matching", "+data.resolution=16"], "image size 28 vs the student's 16"),
        (["objective.teacher={teacher}/flow_matching", "trainer.class_conditional=false"], "class count 10 vs the student's 0"),
        (["objective.teacher={teacher}/flow_matching", "model=DiT-T/2"], "model size 'DiT-T/4' vs the student's 'DiT-T/2'"),
        (["objective.teacher={teacher}/flow_matching", "model.cond_norm=true"], "(model.cond_norm) False vs the student's True"),
        (["objective.teacher={teacher}/flow_matching", "objective.teacher_ema=0.25"], "set objective.teacher_ema to one of them"),
    ],
)
def test_a_bad_teacher_is_one_error_line_and_nothing_written(tmp_path, teacher, override, message):
    run_dir = tmp_path / "student"
    overrides = [o.format(tmp=tmp_path, teacher=teacher) for o in override]
    rc, out, err = run_script("train", *TINY, "objective=scd", *overrides, f"run_dir={run_dir}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not run_dir.exists()


def test_a_teacher_of_another_prediction_is_named(tmp_path, teacher):
    run_dir = tmp_path / "student"
    rc, _, err = run_script(
        "train", *TINY, *objective_of("meanflow_distill", teacher), "model.prediction=data", f"run_dir={run_dir}"
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1 and "prediction 'velocity' vs the student's 'data'" in lines[0], err
    assert not run_dir.exists()


def test_a_data_predicting_scd_student_trains_with_the_boundary_regression_alone(tmp_path, teacher, train_run):
    """From an image-predicting teacher: refused (one line naming both options) unless boundary_weight > 0 and the
    adaptive weighting is off; with them it trains and logs the regression's mse."""
    run_dir = tmp_path / "refused"
    data = [*objective_of("scd", teacher, ["model.prediction=data"]), "model.prediction=data", "objective.boundary_weight=10"]
    rc, _, err = run_script("train", *TINY, *data, f"run_dir={run_dir}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1 and "objective.adaptive_weighting=false" in lines[0], err
    assert not run_dir.exists()
    train_run(tmp_path / "student", [*data, "objective.adaptive_weighting=false", "objective.boundary_time=0.9"])
    rows = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    assert any("boundary_mse" in r and r["boundary_mse"] == r["boundary_mse"] for r in rows)  # logged, not NaN


@pytest.mark.parametrize("name", ["scd", "rcm", "meanflow_distill"])
def test_a_distillation_without_a_teacher_is_one_error_line(tmp_path, name):
    run_dir = tmp_path / "student"
    rc, _, err = run_script("train", *TINY, f"objective={name}", f"run_dir={run_dir}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1 and "objective.teacher is not set" in lines[0], err
    assert not run_dir.exists()


def test_a_teacher_of_another_channel_count_is_named():
    bundle = {
        "config": {"objective": {"name": "flow_matching"}},
        "model_args": {"name": "DiT-T/4", "input_size": 28, "in_channels": 1, "num_classes": 10, "time_scale": 1.0},
    }
    student = {**bundle["model_args"], "in_channels": 3}
    with pytest.raises(ValueError, match="channel count 1 vs the student's 3"):
        check_teacher("t.pt", bundle, student)


# ------------------------------------------------------------------------------------------------
# Two processes (gloo): rCM, whose updates alternate and which owns a fake score with its own optimizer
# ------------------------------------------------------------------------------------------------

PARALLEL = {"ddp": [], "fsdp": ["trainer.parallel=fsdp"]}


@pytest.mark.parametrize(
    "name, extra, net",
    [
        ("rcm", ["objective.warmup_steps=2"], "fake_score"),
        (
            "rcm",
            [
                "objective.warmup_steps=2",
                "objective.one_step_frac=0.25",
                "objective.teacher_steps=2",
                "objective.one_step_ema=0.98",
            ],
            "fake_score",
        ),
        ("meanflow_gan", ["objective.r1_gamma=0", "objective.disc_width=8"], "discriminator"),
        ("meanflow_gan", ["objective.disc_backbone=teacher", "objective.r1_gamma=0", "objective.disc_width=8"], "discriminator"),
        (
            "rcm_gan",
            ["objective.warmup_steps=2", "objective.dmd_start=2", "objective.r1_gamma=0", "objective.disc_width=8"],
            "discriminator",
        ),
    ],
)
def test_two_processes_distil_as_one(tmp_path, teacher, train_run, name, extra, net):
    common = objective_of(name, teacher) + STUDENT[:2] + extra + ["trainer.batch_size=8", "trainer.sample_n=2"]
    train_run(tmp_path / "one", common + ["trainer.grad_accum=2"])
    jobs = [[str(tmp_path / mode), TINY + common + extra] for mode, extra in PARALLEL.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torchrun(ROOT / "tests" / "train" / "ddp_worker.py", tmp_path / "jobs.json")
    one = checkpoint.load(str(tmp_path / "one" / "checkpoints" / "ckpt-00000004.pt"))
    for mode in PARALLEL:
        assert not (tmp_path / mode / "error.txt").exists(), (tmp_path / mode / "error.txt").read_text()
        two = checkpoint.load(str(tmp_path / mode / "checkpoints" / "ckpt-00000004.pt"))
        for key in ("model", "ema", net):
            torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode} {key}: {m}")
        for key in ("optimizer", f"{net}.optimizer"):
            torch.testing.assert_close(two[key]["state"], one[key]["state"], rtol=1e-5, atol=1e-7)
        assert two["data"] == one["data"] and two["step"] == 4


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, net, extra",
    [
        ("rcm", "fake_score", []),
        ("rcm", "fake_score", ["objective.dmd_start=2"]),  # three graphs: distill, fake_score, model
        ("rcm", "fake_score", ["objective.dmd_start=2", "objective.distill_weight=0"]),  # DMD alone after sCD
        ("rcm", "fake_score", ["objective.dmd_two_step_frac=0.5"]),  # a no-grad jump inside both graphs
        ("rcm", "fake_score", ["objective.one_step_frac=0.25", "objective.teacher_steps=2"]),
        (
            "rcm",
            "fake_score",
            [
                "objective.one_step_frac=0.25",
                "objective.one_step_ema=0.98",
                "objective.hf_weight_one_step=16",
                "objective.one_step_solver=heun",
            ],
        ),
        ("meanflow_gan", "discriminator", []),
        ("rcm_gan", "discriminator", ["objective.dmd_start=2"]),  # the GAN term in the student's DMD graph alone
        # the discriminator as heads on the frozen teacher's hidden states
        ("rcm_gan", "discriminator", ["objective.dmd_start=2", "objective.disc_backbone=teacher", "objective.r1_gamma=0"]),
        # feature matching on those hidden states: no discriminator
        (
            "rcm_gan",
            "fake_score",
            ["objective.dmd_start=2", "objective.disc_backbone=teacher", "objective.r1_gamma=0", FEATURE_MATCHING],
        ),
    ],
)
def test_a_graphed_run_with_a_second_trained_network_follows_the_eager_run(tmp_path, teacher, train_run, name, net, extra):
    """rCM's fake-score and student steps are two CUDA graphs (its phases), replayed in turn (with sCD's one-step
    target in the student's); MeanFlow + GAN's student and discriminator (its R1 a double backward) are one graph."""
    from .test_graphs import read_losses

    common = objective_of(name, teacher) + STUDENT[:2] + extra
    common += ["attention=triton_jvp", "trainer.device=cuda", "trainer.max_steps=6"]
    common += ["objective.warmup_steps=2"] if name.startswith("rcm") else []
    common += ["objective.disc_width=8"] if name.endswith("gan") else []
    common += ["trainer.log_every=1"]
    train_run(tmp_path / "eager", common)
    train_run(tmp_path / "graph", common + ["trainer.cuda_graph=true"])
    eager, graph = (read_losses(tmp_path / name) for name in ("eager", "graph"))
    assert len(eager) == len(graph) == 6
    assert torch.allclose(torch.tensor(graph), torch.tensor(eager), rtol=2e-2, atol=1e-4), (eager, graph)
    fake = [checkpoint.load(checkpoint.find_checkpoint(str(tmp_path / run)))[net] for run in ("eager", "graph")]
    torch.testing.assert_close(fake[1], fake[0], rtol=2e-2, atol=2e-3)  # both networks trained in both runs


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rcm_gan", "meanflow_distill"])
def test_on_a_gpu_bulk_casts_train_as_per_parameter_casts_eager_and_graphed(tmp_path, teacher, train_run, name):
    """trainer.bulk_casts (the default) on CUDA (its foreach copies between float32 and bf16), eager and inside CUDA
    graphs (rCM-GAN's three: sCD, the fake score, the student with DMD and the GAN term): the losses and the student
    of per-parameter casts, to the GPU kernels' run-to-run noise."""
    from .test_graphs import read_losses

    common = objective_of(name, teacher) + STUDENT[:2] + ["attention=triton_jvp", "trainer.device=cuda", "trainer.max_steps=6"]
    common += ["objective.warmup_steps=2", "objective.dmd_start=2", "objective.disc_width=8"] if name == "rcm_gan" else []
    common += ["trainer.log_every=1"]
    runs = {"each": ["trainer.bulk_casts=false"], "bulk": [], "bulk_graph": ["trainer.cuda_graph=true"]}
    for run, extra in runs.items():
        train_run(tmp_path / run, common + extra)
    losses = {run: torch.tensor(read_losses(tmp_path / run)) for run in runs}
    students = {run: checkpoint.load(checkpoint.find_checkpoint(str(tmp_path / run)))["model"] for run in runs}
    for run in ("bulk", "bulk_graph"):
        assert len(losses[run]) == 6 and torch.allclose(losses[run], losses["each"], rtol=2e-2, atol=1e-4), (run, losses)
        torch.testing.assert_close(students[run], students["each"], rtol=2e-2, atol=2e-3)


def test_an_auto_student_predicts_as_its_teacher(tmp_path, teacher, train_run):
    for run, expected in (("flow_matching", "velocity"), ("flow_matching_data", "data")):
        train_run(tmp_path / run, ["objective=meanflow_distill", f"objective.teacher={teacher / run}", "trainer.max_steps=2"])
        assert checkpoint.saved_prediction(str(tmp_path / run)) == expected


def test_disc_probe_reads_a_students_samples_and_refuses_a_teacher(tmp_path, teacher, train_run, capsys):
    """benchmarks/disc_probe.py on a 4-step rcm_gan student: the pixel row, one feature row per block read and s, and
    the run's own heads trained offline; a flow-matching run (no teacher) stops with one line."""
    run = tmp_path / "student"
    overrides = objective_of("rcm_gan", teacher) + STUDENT[:2] + ["objective.dmd_start=2", "objective.disc_width=8"]
    train_run(run, overrides + ["objective.disc_backbone=teacher", "objective.r1_gamma=0", "objective.warmup_steps=2"])
    probe = load_entry("benchmarks/disc_probe")
    probe.main(["--ckpt", str(run), "--n", "20", "--s", "0.1", "0.5", "--train-updates", "2", "--batch", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "accuracy" not in line]
    blocks = feature_blocks(MODEL_SIZES["DiT-T/4"][0], None, "x")
    assert len(rows) == 1 + 2 * len(blocks) + 2
    assert all(0.0 <= float(row.split("|")[3]) <= 1.0 for row in rows)
    with pytest.raises(SystemExit, match="not a distilled student"):
        probe.main(["--ckpt", str(teacher / "flow_matching")])
