"""flm.ablate on the CPU: every backend in the table (flash skipped), the flags, the plot; and the
per-backend metrics of `train.py -m attention=...`."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from flm.ablate import Result, ablate, compare, how_steps_ran, image_side

from .train.conftest import ROOT, TINY, run_script

# DiT-T/2 on 4x4 patches, 3 steps; a large learning rate so attention counts by the end (DiT's zero-init
# gates keep it out of the first steps).
ABLATE = [
    "model=DiT-T/2",
    "ablate.tokens=16",
    "trainer.batch_size=4",
    "trainer.max_steps=3",
    "trainer.sample_n=2",
    "trainer.sample_steps=1",
    "trainer.device=cpu",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "ablate.warmup=1",
]


def row(md: str, backend: str) -> list[str]:
    (line,) = [line for line in md.splitlines() if line.startswith(f"| {backend} |")]
    return [cell.strip() for cell in line.strip("|").split(" | ")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rows (flash skipped)")
def test_ablation_table_plot_and_flags(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="ablate", overrides=ABLATE + ["ablate.grad_tol=1e-30"])  # this flag must fire
    ablate(cfg, str(tmp_path), command="pytest")
    md = (tmp_path / "ablation.md").read_text()
    assert [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| ") and "---" not in line] == [
        "| backend",
        "| math",
        "| sdpa",
        "| flash",
        "| triton_jvp",
    ]
    assert row(md, "math")[-1] == "reference" and float(row(md, "math")[1]) > 0
    assert row(md, "flash")[-1].startswith("skipped: attention backend 'flash' needs a CUDA GPU")
    for backend in ("sdpa", "triton_jvp"):
        cells = row(md, backend)
        assert cells[2] == "eager" and cells[4] == "n/a"  # on the CPU: eager steps, no peak GPU memory
        mse_diff, grad_err, tangent_err = (float(c.split(" ± ")[0]) for c in cells[6:9])
        assert mse_diff < 1e-3 and 0 < grad_err < 1e-4 and tangent_err < 1e-4  # agrees with math in fp32...
        assert cells[-1].startswith("**DRIFT**: grad") and "tangent" not in cells[-1]  # ...but not within 1e-30
    assert (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    numbers = json.loads((tmp_path / "ablation.json").read_text())
    assert [len(r["losses"]) for r in numbers["results"]] == [3, 3, 0, 3]
    assert not (tmp_path / "math" / "checkpoints").exists() and (tmp_path / "math" / "metrics.jsonl").is_file()


def test_compare_flags_drift_and_nan():
    ref = Result("math", losses=[1.0, 0.5], grads={"w": torch.ones(4)}, tangent=torch.ones(4))
    tols = {"loss": 1e-3, "grad": 1e-4, "tangent": 1e-4}
    close = Result("sdpa", losses=[1.0, 0.5], grads={"w": torch.ones(4) * (1 + 1e-5)}, tangent=torch.ones(4))
    compare(close, ref, tols)
    assert close.drift == [] and close.diffs["grad"] == pytest.approx(1e-5, rel=0.1)
    far = Result("x", losses=[1.0, math.nan], grads={"w": torch.ones(4) * 1.1}, tangent=torch.zeros(4))
    compare(far, ref, tols)
    assert [d.split()[0] for d in far.drift] == ["loss", "grad", "tangent"]


def test_a_backends_steps_are_named_by_how_its_logged_windows_ran():
    assert how_steps_ran([{"cuda_graph": True}, {"cuda_graph": True}]) == "CUDA graph"
    assert how_steps_ran([{"cuda_graph": False}]) == "eager"
    assert how_steps_ran([{"cuda_graph": True}, {"cuda_graph": False}]) == "mixed"  # a kind of step fell back to eager
    assert how_steps_ran([{"step_ms": 1.0}]) is None  # an older run's records do not say


def test_tokens_must_be_square():
    assert image_side("DiT-B/2", 1024) == 64 and image_side("DiT-T/4", None) is None
    with pytest.raises(ValueError, match="ablate.tokens must be a square number.*got 1000"):
        image_side("DiT-B/2", 1000)


def test_multirun_records_metrics_per_backend(tmp_path):
    rc, out, err = run_script(
        "train",
        "-m",
        *TINY,
        "trainer.max_steps=2",
        "trainer.log_every=1",
        "attention=math,flash,sdpa",
        f"hydra.sweep.dir={tmp_path}",
    )
    if torch.cuda.is_available():
        pytest.skip("checks that flash fails its job on a machine without CUDA")
    assert rc == 1 and "error: 1 job(s) failed" in err and "job 1 (" in err and "'flash' needs a CUDA GPU" in err
    assert not (tmp_path / "1").exists()  # the failed job leaves nothing; the one after it still ran
    for job in ("0", "2"):
        records = [json.loads(line) for line in (tmp_path / job / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
        assert all(r["step_ms"] > 0 and r["images_per_s"] > 0 and math.isfinite(r["loss"]) for r in records)
        assert all(r["cuda_graph"] is False for r in records)  # the CPU steps eagerly


def test_repeats_time_each_backend_again_in_alternating_order(tmp_path, monkeypatch):
    """ablate.repeats=3: every backend that ran is trained twice more for its step time, the rounds in reversed order
    (a drifting host favours none), and its row gives the median of the three runs' medians with their range."""
    import flm.ablate as fa

    calls, train_with = [], fa.train_with
    monkeypatch.setattr(
        fa, "train_with", lambda cfg, backend, *args, **kw: calls.append(backend) or train_with(cfg, backend, *args, **kw)
    )
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="ablate", overrides=ABLATE + ["ablate.backends=[math,flash,sdpa]", "ablate.repeats=3"])
    results = ablate(cfg, str(tmp_path), command="pytest")
    assert calls == ["math", "flash", "sdpa", "sdpa", "math", "math", "sdpa"]  # flash cannot run on the CPU: not again
    for r in results:
        if r.backend == "flash":
            assert r.skipped and r.step_ms_runs == [] and r.step_ms is None
            continue
        assert len(r.step_ms_runs) == 3 and r.step_ms == sorted(r.step_ms_runs)[1]
        assert r.images_per_s == pytest.approx(4 * 1000 / r.step_ms)
        cells = row((tmp_path / "ablation.md").read_text(), r.backend)
        assert cells[1] == f"{r.step_ms:.1f} ({min(r.step_ms_runs):.1f}-{max(r.step_ms_runs):.1f}, 3 runs)"
        assert len(r.losses) == 3  # the first run's curve
        for round_ in (2, 3):
            assert (tmp_path / "repeats" / f"{r.backend}-{round_}" / "metrics.jsonl").is_file()
    numbers = json.loads((tmp_path / "ablation.json").read_text())
    assert [len(r["step_ms_runs"]) for r in numbers["results"]] == [3, 0, 3]


@pytest.mark.parametrize("repeats", [0, 1.5, "two"])
def test_repeats_must_be_a_whole_number_of_runs(tmp_path, repeats):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="ablate", overrides=ABLATE + [f"ablate.repeats={repeats}"])
    with pytest.raises(ValueError, match="ablate.repeats must be a whole number of runs, 1 or more"):
        ablate(cfg, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_unknown_backend_is_an_error_not_a_row(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="ablate", overrides=ABLATE + ["ablate.backends=[math,fast]"])
    with pytest.raises(ValueError, match="unknown attention backend.*fast; valid names: math, sdpa"):
        ablate(cfg, str(tmp_path))


def test_loss_gap_is_judged_against_the_scatter_of_the_curves():
    g = torch.Generator().manual_seed(0)
    ref = (1 + 0.2 * torch.randn(100, generator=g)).tolist()
    tols = {"loss": 1e-2, "grad": 1.0, "tangent": 1.0}
    grads = {"w": torch.ones(4)}
    noisy = Result("noisy", losses=(1 + 0.2 * torch.randn(100, generator=g)).tolist(), grads=grads)
    shifted = Result("shifted", losses=[x + 0.5 for x in noisy.losses], grads=grads)
    reference = Result("math", losses=ref, grads=grads)
    compare(noisy, reference, tols)
    compare(shifted, reference, tols)
    # same mean, per-step scatter 0.2: a gap of a few 1e-2 is noise (standard error ~0.06), not drift
    assert noisy.drift == [] and 0.03 < noisy.loss_noise < 0.1
    assert [d.split()[0] for d in shifted.drift] == ["loss"] and shifted.diffs["loss"] > 0.4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rows")
def test_a_distilled_student_is_ablated_with_its_teacher_fake_score_and_discriminator(tmp_path):
    teacher = tmp_path / "teacher"
    rc, _, err = run_script("train", *TINY, "trainer.max_steps=2", "objective=flow_matching", f"run_dir={teacher}")
    assert rc == 0, err
    student = ["objective=rcm_gan", f"objective.teacher={teacher}", "objective.dmd_start=2", "objective.warmup_steps=2"]
    student += ["objective.disc_width=8", "ablate.backends=[math,sdpa]", "ablate.warmup=1", "trainer.log_every=1"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="ablate", overrides=[*TINY, *student])
    ablate(cfg, str(tmp_path / "ablation"), command="pytest")
    cells = row((tmp_path / "ablation" / "ablation.md").read_text(), "sdpa")
    # the probe's step (max_steps, 4) is a fake-score step: the student's gradient is taken at the next one
    assert cells[-1] == "ok" and 0 < float(cells[7]) < 1e-4
    numbers = json.loads((tmp_path / "ablation" / "ablation.json").read_text())
    # steps 1-2 sCD alone, 3 the fake score, 4 the student with DMD and the GAN term: the mse of the student's steps
    assert [(r["curve"], len(r["losses"])) for r in numbers["results"]] == [("mse", 3), ("mse", 3)]


def test_module_entry_runs_the_script(tmp_path):
    """`python -m flm.ablate` (issue 16's command) is ablate.py, not a module that imports and exits 0 doing nothing:
    from any folder, a bad model name ends in ablate.py's one-line error and exit code 1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "flm.ablate", "model=DiT-Nope/2", f"run_dir={tmp_path}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DiT-Nope/2" in proc.stderr + proc.stdout


def test_module_entry_outside_a_checkout_says_where_it_runs(tmp_path):
    """flm without its checkout around it (no ablate.py beside the package): one line naming the missing script, exit 1."""
    shutil.copytree(ROOT / "flm", tmp_path / "flm", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "flm.ablate"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'ablate.py'} not found; `python -m flm.ablate` runs from a checkout of flm (configs/ beside it)"
    )
