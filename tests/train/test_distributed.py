"""Two processes on the CPU (gloo, launched with torchrun): DDP and FSDP2 with a JVP objective (both
JVP modes) train as one process with the same global batch, a broken sync is caught, checkpoints move
between world sizes and parallel modes (2 -> 1, 1 -> 2, DDP <-> FSDP2); flm.dist.all_mean_, the flat
gradient all-reduce of a CUDA-graphed DDP run, averages in place."""

import json

import pytest
import torch
import torch.distributed as torch_dist
from hydra import compose, initialize_config_dir

from flm import dist
from flm.train import checkpoint

from .conftest import ROOT, TINY, load_entry, torchrun

# 8 images a step: 2 ranks x 4, or 1 rank x 2 accumulation steps x 4 (the same micro-batches and noise)
COMMON = ["trainer.batch_size=8", "objective.r_neq_t=0.75", "trainer.ckpt_every=2", "trainer.keep_last=0", "trainer.sample_n=2"]
ONE = ["trainer.grad_accum=2"]
MODES = ("dual", "two_pass")
FSDP = ["trainer.parallel=fsdp"]


def run_one(run_dir, overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=TINY + COMMON + ONE + overrides)
    load_entry("train").run(cfg, str(run_dir))


def run_two(tmp, jobs, *worker_args):
    """The jobs ([run_dir, overrides]) in one torchrun launch of two CPU processes."""
    jobs_file = tmp / "jobs.json"
    jobs_file.write_text(json.dumps([[str(d), TINY + COMMON + o] for d, o in jobs]))
    torchrun(ROOT / "tests" / "train" / "ddp_worker.py", jobs_file, *worker_args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file: 1-process references, then one 2-process launch (DDP runs "two-*", FSDP2 runs
    "fsdp-*"), then the 2 -> 1 resumes. "a-to-b" resumes run a's step-2 checkpoint under b."""
    tmp = tmp_path_factory.mktemp("ddp")
    resume = lambda run: [f"trainer.resume={tmp / run / 'checkpoints/ckpt-00000002.pt'}"]  # noqa: E731
    for mode in MODES:
        run_one(tmp / f"one-{mode}", [f"objective.jvp_mode={mode}"])
    run_two(
        tmp,
        [(tmp / f"two-{mode}", [f"objective.jvp_mode={mode}"]) for mode in MODES]
        + [(tmp / f"fsdp-{mode}", FSDP + [f"objective.jvp_mode={mode}"]) for mode in MODES]
        + [
            (tmp / "one-to-two", resume("one-dual")),
            (tmp / "one-to-fsdp", FSDP + resume("one-dual")),
            (tmp / "two-to-fsdp", FSDP + resume("two-dual")),
            (tmp / "fsdp-to-two", resume("fsdp-dual")),
            (
                tmp / "bypass",
                ["objective._target_=tests.train.ddp_worker.ModuleBypass", "~objective.name", "trainer.max_steps=2"],
            ),
            (
                tmp / "fsdp-skew",
                FSDP + ["objective._target_=tests.train.ddp_worker.RankSkew", "~objective.name", "trainer.max_steps=2"],
            ),
            (tmp / "fsdp-grids", FSDP + ["trainer.sample_every=2"]),
            (
                tmp / "fsdp-ema-target",
                FSDP + ["objective.split_above=0.0", "objective.split_target=ema", "objective.split_ema=0.98"],
            ),
        ],
    )
    run_one(tmp / "two-to-one", resume("two-dual"))
    run_one(tmp / "fsdp-to-one", resume("fsdp-dual"))
    return tmp


def final(run_dir):
    return checkpoint.load(str(run_dir / "checkpoints" / "ckpt-00000004.pt"))


def logged(run_dir):
    """{(step, metric): value} of the loss and mse in metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {(r["step"], k): r[k] for r in map(json.loads, lines) for k in ("loss", "mse")}


def assert_same_training(a, b):
    """Same weights, EMA, optimizer moments and data position, up to fp32 all-reduce rounding."""
    for key in ("model", "ema"):
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(a["optimizer"]["state"], b["optimizer"]["state"], rtol=1e-5, atol=1e-7)
    assert a["data"] == b["data"] and a["step"] == b["step"] == 4


@pytest.mark.parametrize("parallel", ["two", "fsdp"])
@pytest.mark.parametrize("mode", MODES)
def test_two_processes_train_as_one(runs, parallel, mode):
    one, two = final(runs / f"one-{mode}"), final(runs / f"{parallel}-{mode}")
    assert_same_training(two, one)
    # the logged loss and the objective's metrics are means over all ranks and micro-batches
    assert logged(runs / f"{parallel}-{mode}") == pytest.approx(logged(runs / f"one-{mode}"), rel=1e-5)
    assert (runs / f"{parallel}-{mode}" / "samples" / "step-00000004.png").is_file()
    start = checkpoint.load(str(runs / f"one-{mode}" / "checkpoints" / "ckpt-00000002.pt"))
    assert not torch.allclose(start["model"]["final_layer.linear.weight"], one["model"]["final_layer.linear.weight"])


@pytest.mark.parametrize("direction", ["two-to-one", "one-to-two", "fsdp-to-one", "one-to-fsdp", "two-to-fsdp", "fsdp-to-two"])
def test_checkpoint_resumes_under_another_world_size(runs, direction):
    assert_same_training(final(runs / direction), final(runs / "one-dual"))


def test_a_skipped_gradient_all_reduce_stops_the_run(runs):
    error = (runs / "bypass" / "error.txt").read_text()
    assert error.startswith("RuntimeError: parameters differ across ranks after step 1"), error
    assert "model.module" in error
    assert not checkpoint.list_checkpoints(str(runs / "bypass"))


def test_a_replicated_tensor_out_of_sync_under_fsdp2_stops_the_run(runs):
    """Under FSDP2 the sync check compares what is replicated (the objective's parameters here): sharded
    parameters have a single owner, and their all-gathered values agree by construction."""
    error = (runs / "fsdp-skew" / "error.txt").read_text()
    assert error.startswith("RuntimeError: parameters differ across ranks after step 1 (1 of 1 tensors, e.g. RankSkew.skew)"), (
        error
    )
    assert not checkpoint.list_checkpoints(str(runs / "fsdp-skew"))


@pytest.mark.parametrize("run", ["fsdp-grids", "fsdp-ema-target"])
def test_an_ema_that_ran_a_forward_under_fsdp2_still_averages(run, runs):
    """FSDP2 leaves a root module's parameters gathered after a forward; the EMA's forward (a grid mid-run, a target
    network) then met the model's shards in the next average and the run stopped (size 64 against 32)."""
    assert not (runs / run / "error.txt").exists(), (runs / run / "error.txt").read_text()
    assert final(runs / run)["step"] == 4
    if run == "fsdp-grids":
        assert (runs / run / "samples" / "step-00000002.png").is_file()


def test_two_unwrapped_processes_train_as_one(runs, tmp_path):
    """A CUDA-graphed DDP run's communication, on the CPU: the model left unwrapped, every gradient averaged by the
    optimizer in one flat all-reduce (flm.train.parallel.wrap); the same training as one process."""
    run_two(tmp_path, [(tmp_path / "unwrapped", ["objective.jvp_mode=dual"])], "unwrapped")
    assert not (tmp_path / "unwrapped" / "error.txt").exists(), (tmp_path / "unwrapped" / "error.txt").read_text()
    assert_same_training(final(tmp_path / "unwrapped"), final(runs / "one-dual"))
    assert logged(tmp_path / "unwrapped") == pytest.approx(logged(runs / "one-dual"), rel=1e-5)


def _mean_of_ranks(rank: int, tmp: str) -> None:
    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2)
    try:
        tensors = [
            torch.full((2, 3), float(rank)),
            torch.arange(4.0) * (rank + 1),
            torch.full((5,), rank + 1.0, dtype=torch.float64),
        ]
        given = list(tensors)
        dist.all_mean_(tensors)
        assert all(t is g for t, g in zip(tensors, given))
        torch.save(tensors, f"{tmp}/{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def test_all_mean_averages_tensors_of_two_dtypes_in_place(tmp_path):
    torch.multiprocessing.spawn(_mean_of_ranks, args=(str(tmp_path),), nprocs=2)
    expected = [torch.full((2, 3), 0.5), torch.arange(4.0) * 1.5, torch.full((5,), 1.5, dtype=torch.float64)]
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"{rank}.pt"), expected)
