"""The hostile- and careless-user cases of docs/reliability.md: each ends in one clear line (or works),
runs nothing from a file, deletes nothing that is not the run's and leaves no temporary file."""

import os

import pytest
import torch

from flm.train import checkpoint
from flm.train.config import objective_from_config, plain

from .conftest import TINY, run_script
from .test_entrypoints import error_of


def crafted(run_dir, tmp_path, objective: dict) -> str:
    """The run's checkpoint with its stored objective config replaced by `objective`."""
    path = checkpoint.find_checkpoint(str(run_dir))
    bundle = checkpoint.load(path)
    bundle["config"]["objective"] = objective
    torch.save(bundle, path)
    return path


def shell(marker) -> dict:
    """A Hydra call that would create `marker` if anything instantiated it."""
    return {"_target_": "os.system", "_args_": [f"touch {marker}"]}


@pytest.mark.parametrize("where", ["nested", "top"])
def test_crafted_checkpoint_runs_no_code_in_sample(tmp_path, train_run, cfg_of, sample_entry, where):
    train_run(tmp_path / "run", ["trainer.max_steps=1", "objective=flow_matching"])
    marker = tmp_path / "pwned"
    objective = {"_target_": "flm.objectives.build_objective", "name": "flow_matching", "t_mean": shell(marker)}
    crafted(tmp_path / "run", tmp_path, objective if where == "nested" else {**shell(marker), "name": "flow_matching"})
    msg = error_of(sample_entry.run, cfg_of("sample", [f"ckpt={tmp_path / 'run'}", "n=2", "device=cpu"]))
    assert "is not allowed" in msg and "objective" in msg
    assert not marker.exists()


def test_crafted_checkpoint_runs_no_code_on_resume(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=1"])
    marker = tmp_path / "pwned"
    crafted(tmp_path, tmp_path, {"_target_": "flm.objectives.build_objective", "name": "meanflow", "t_mean": shell(marker)})
    train_run(tmp_path, ["trainer.resume=auto", "trainer.max_steps=2"])
    assert not marker.exists() and checkpoint.list_checkpoints(str(tmp_path))[-1].endswith("ckpt-00000002.pt")


def test_stored_objective_is_rebuilt_from_its_name():
    objective = objective_from_config(
        {"_target_": "flm.objectives.build_objective", "name": "flow_matching", "sampler": "heun"}, where="ckpt.pt"
    )
    assert type(objective).__name__ == "FlowMatching"
    with pytest.raises(ValueError, match=r"objective._target_='builtins.eval' is not allowed"):
        objective_from_config({"_target_": "builtins.eval", "name": "meanflow"}, where="ckpt.pt")
    with pytest.raises(ValueError, match=r"objective.foo is not an option of objective"):
        objective_from_config({"name": "meanflow", "foo": 1}, where="ckpt.pt")
    with pytest.raises(ValueError, match=r"x\[1\]._call_ is not allowed"):
        plain({"x": [1, {"_call_": True}]}, "cfg")


def test_nested_target_on_the_command_line_is_refused(tmp_path, train_run):
    marker = tmp_path / "pwned"
    msg = error_of(train_run, tmp_path / "run", [f"+objective.t_mean={{_target_: os.system, _args_: ['touch {marker}']}}"])
    assert "objective.t_mean._target_ is not allowed" in msg and not marker.exists()


@pytest.mark.parametrize("content", [{"server.log": "important\n"}, {}, {"train.log": "an earlier run\n"}])
def test_a_failed_run_keeps_a_folder_it_did_not_create(tmp_path, content):
    folder = tmp_path / "mylogs"
    folder.mkdir()
    for name, text in content.items():
        (folder / name).write_text(text)
    rc, _, err = run_script("train", *TINY, f"run_dir={folder}", "trainer.resume=auto")
    assert rc == 1 and err.strip().startswith("error: trainer.resume=auto but run folder")
    assert sorted(os.listdir(folder)) == sorted(content)  # Hydra's .hydra/ is gone, the user's files are not
    assert all((folder / name).read_text().startswith(text) for name, text in content.items())


def test_a_failed_run_removes_the_folders_it_created_above_its_own(tmp_path):
    """The default run_dir is outputs/<date>/<time>: a run refused at its first line leaves no empty date folder, and
    keeps a folder above its own that held something before or holds something now."""
    (tmp_path / "kept").mkdir()
    run_dir = tmp_path / "kept" / "day" / "time"
    rc, _, err = run_script("train", *TINY, f"run_dir={run_dir}", "trainer.batch_size=0")
    assert rc == 1 and "trainer.batch_size must be > 0" in err
    assert os.listdir(tmp_path / "kept") == []
    (tmp_path / "kept" / "day").mkdir()
    (tmp_path / "kept" / "day" / "other").mkdir()
    rc, _, err = run_script("train", *TINY, f"run_dir={run_dir}", "trainer.batch_size=0")
    assert rc == 1 and os.listdir(tmp_path / "kept" / "day") == ["other"]


def test_a_failed_multirun_job_removes_only_its_own_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    rc, _, err = run_script("train", "-m", *TINY, "trainer.batch_size=0", f"hydra.sweep.dir={tmp_path}")
    assert rc == 1 and "trainer.batch_size must be > 0" in err
    assert sorted(os.listdir(tmp_path)) == ["multirun.yaml", "notes.txt"]


def metrics_of(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_a_resume_trains_with_the_new_learning_rate(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=2", "optim.warmup_steps=0", "optim.lr=1e-3"])
    train_run(tmp_path, ["trainer.resume=auto", "trainer.max_steps=4", "optim.warmup_steps=0", "optim.lr=1e-5"])
    records = metrics_of(tmp_path)
    assert [r["lr"] for r in records] == [pytest.approx(1e-3), pytest.approx(1e-5)]
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    assert bundle["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-5) == bundle["config"]["optim"]["lr"]


def test_an_overflowing_update_is_never_saved(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=2", "optim.warmup_steps=0"])
    msg = error_of(
        train_run,
        tmp_path,
        ["trainer.resume=auto", "trainer.max_steps=6", "optim.lr=1e39", "optim.warmup_steps=0", "trainer.ckpt_every=1"],
    )
    assert "the weights are not finite after step 3" in msg and "ckpt-00000002.pt" in msg and "optim.lr" in msg
    latest = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    assert latest["step"] == 2 and all(t.isfinite().all() for t in latest["model"].values())


def leftovers(folder) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if ".tmp" in f]


def test_two_writers_of_one_file_do_not_share_a_temporary_file(tmp_path):
    """Two processes filling one cache file (jobs sharing the reference statistics): the second writer, here nested
    in the first's write, must neither write into the first's temporary file nor rename it away."""
    from flm.files import write_atomically

    path = str(tmp_path / "stats.npz")

    def first(tmp):
        open(tmp, "w").write("first")
        write_atomically(path, lambda tmp2: open(tmp2, "w").write("second"))

    write_atomically(path, first)
    assert open(path).read() == "first" and leftovers(tmp_path) == []


def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, train_run, monkeypatch):
    import collections

    import flm.files

    train_run(tmp_path, ["trainer.max_steps=2"])
    earlier = checkpoint.find_checkpoint(str(tmp_path))

    def save_until_full(obj, f):  # what torch.save does on a full disk: a partial file, then a RuntimeError
        open(f, "wb").write(b"PK\x03\x04 partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1472 vs 1380")

    monkeypatch.setattr(checkpoint.torch, "save", save_until_full)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(flm.files.shutil, "disk_usage", lambda path: usage(100, 100, 0))
    msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=4"])
    assert msg.startswith("disk full: writing") and "ckpt-00000004.pt" in msg and "MiB" in msg and "on '/" in msg
    assert leftovers(tmp_path) == [] and checkpoint.find_checkpoint(str(tmp_path)) == earlier
    assert checkpoint.load(earlier)["step"] == 2


@pytest.mark.parametrize("code", ["EROFS", "ENOSPC"])
def test_sample_to_a_read_only_or_full_output(tmp_path, train_run, cfg_of, sample_entry, monkeypatch, code):
    import errno

    from PIL import Image

    train_run(tmp_path / "run", ["trainer.max_steps=1"])

    def fail(self, fp, *args, **kwargs):
        open(fp, "wb").write(b"\x89PNG partial")
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), fp)

    monkeypatch.setattr(Image.Image, "save", fail)
    out = tmp_path / "out" / "x"
    msg = error_of(sample_entry.run, cfg_of("sample", [f"ckpt={tmp_path / 'run'}", "n=2", "device=cpu", f"out={out}"]))
    assert (msg.startswith("cannot write") if code == "EROFS" else msg.startswith("disk full")) and str(out) in msg
    assert leftovers(tmp_path / "out") == [] and not out.with_suffix(".png").exists()


def test_a_second_run_in_a_folder_in_use_is_refused(tmp_path, train_run):
    import fcntl

    train_run(tmp_path, ["trainer.max_steps=1"])  # a finished run leaves its folder unlocked
    before = sorted(os.listdir(tmp_path))
    with open(tmp_path / ".lock", "w") as held:  # another process's lock, as far as flock is concerned
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=2"])
    assert "is in use by another run" in msg and "choose another run_dir" in msg
    assert sorted(os.listdir(tmp_path)) == before and checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))["step"] == 1
    train_run(tmp_path, ["trainer.resume=auto", "trainer.max_steps=2"])  # free again


def test_a_zero_byte_checkpoint(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=1"])
    open(checkpoint.find_checkpoint(str(tmp_path)), "wb").close()
    msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=2"])
    assert "ckpt-00000001.pt' is truncated or unreadable" in msg


def test_a_corrupt_image_is_refused_at_startup(tmp_path, train_run):
    from PIL import Image

    (tmp_path / "images" / "cat").mkdir(parents=True)
    for i in range(8):
        Image.new("RGB", (8, 8), (i * 30, 0, 0)).save(tmp_path / "images" / "cat" / f"{i}.png")
    (tmp_path / "images" / "cat" / "bad.png").write_bytes(b"not an image")
    msg = error_of(
        train_run,
        tmp_path / "run",
        ["data=imagefolder", f"data.root={tmp_path / 'images'}", "data.resolution=8", "data.num_workers=0"],
    )
    assert "1 unreadable image file(s)" in msg and "bad.png (UnidentifiedImageError)" in msg


@pytest.mark.parametrize("first,then", [("flow_matching", "scm"), ("scm", "flow_matching")])
def test_a_run_resumed_with_another_objective(tmp_path, train_run, first, then):
    train_run(tmp_path, ["trainer.max_steps=1", f"objective={first}"])
    msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=2", f"objective={then}"])
    assert "was trained with another objective" in msg and f"objective={first}" in msg


def test_resuming_past_max_steps_is_refused(tmp_path, train_run):
    train_run(tmp_path, ["trainer.max_steps=3"])
    msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=2"])
    assert "is at step 3, and trainer.max_steps=2: nothing to train" in msg


@pytest.mark.parametrize(
    "override,expected",
    [
        ("trainer.batch_size=abc", "trainer.batch_size must be an integer, e.g. 8; got 'abc'"),
        ("trainer.batch_size=8.0", "trainer.batch_size must be an integer, e.g. 8; got 8.0"),
        ("trainer.max_steps=2.5", "trainer.max_steps must be an integer, e.g. 8; got 2.5"),
        ("trainer.ema_decays=0.5", "trainer.ema_decays must be a list, got 0.5; e.g. trainer.ema_decays=[0.5]"),
        ("+trainer.max_step=5", "trainer.max_step is not an option of trainer"),
        ("+objective.t_men=0", "objective.t_men is not an option of objective"),
        ("optim.lr=abc", "optim.lr must be a number, e.g. 0.5; got 'abc'"),
        ("data=imagefolder", "data.root is not set; pass data.root=<value>"),
    ],
)
def test_wrong_types_name_their_key(tmp_path, train_run, override, expected):
    assert expected in error_of(train_run, tmp_path / "run", [override])


@pytest.mark.parametrize(
    "override,expected",
    [
        ("n=abc", "n must be an integer, e.g. 8; got 'abc'"),
        ("label=abc", "label must be an integer, e.g. 8; got 'abc'"),
        ("cfg_scale=x", "cfg_scale must be a number"),
    ],
)
def test_sample_wrong_types_name_their_key(tmp_path, cfg_of, sample_entry, override, expected):
    assert expected in error_of(sample_entry.run, cfg_of("sample", [f"ckpt={tmp_path}", override]))


def test_sample_without_ckpt(tmp_path):
    rc, _, err = run_script("sample")
    assert rc == 1 and err.strip() == "error: ckpt is not set; pass ckpt=<value> (see its config file's comment)"


def test_a_resume_after_a_kill_logs_each_step_once_with_the_full_window(tmp_path, train_run):
    run = ["trainer.ckpt_every=3", "trainer.log_every=2", "optim.warmup_steps=0"]
    train_run(tmp_path / "whole", run + ["trainer.max_steps=6"])
    killed = tmp_path / "killed"
    train_run(killed, run + ["trainer.max_steps=4", "trainer.keep_last=0"])
    os.remove(checkpoint.checkpoint_path(str(killed), 4))  # killed after logging step 4, before saving it
    (killed / "checkpoints" / "ckpt-00000005.pt.tmp").write_bytes(b"half a checkpoint")
    train_run(killed, run + ["trainer.max_steps=6", "trainer.resume=auto"])
    whole, resumed = metrics_of(tmp_path / "whole"), metrics_of(killed)
    assert [r["step"] for r in resumed] == [2, 4, 6] and leftovers(killed) == []
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], rel=1e-6)


def test_flipped_bytes_in_a_checkpoint_are_caught(tmp_path, train_run):
    import struct
    import zipfile

    train_run(tmp_path, ["trainer.max_steps=1"])
    path = checkpoint.find_checkpoint(str(tmp_path))
    largest = max(zipfile.ZipFile(path).infolist(), key=lambda zi: zi.file_size)
    data = bytearray(open(path, "rb").read())
    name_len, extra_len = struct.unpack("<HH", data[largest.header_offset + 26 : largest.header_offset + 30])
    at = largest.header_offset + 30 + name_len + extra_len + largest.file_size // 2
    data[at] ^= 0xFF
    open(path, "wb").write(bytes(data))
    msg = error_of(train_run, tmp_path, ["trainer.resume=auto", "trainer.max_steps=2"])
    assert "is damaged (checksum mismatch in" in msg


STALL = """
import sys, time, torch
from flm import dist
dist.init("cpu", timeout_s=float(sys.argv[1]))
if dist.rank() == 1:
    time.sleep(30)  # stalled
t = time.time()
try:
    dist.all_min(torch.ones(()))
except Exception as e:
    print(f"rank 0 stopped after {time.time() - t:.0f} s: {type(e).__name__}", flush=True)
    sys.exit(1)
"""


def test_a_stalled_rank_ends_the_run_after_the_collective_timeout(tmp_path):
    import subprocess
    import sys
    import time

    script = tmp_path / "stall.py"
    script.write_text(STALL)
    t = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[0]) + os.pathsep + os.getcwd()},
    )
    assert proc.returncode != 0 and "rank 0 stopped after" in proc.stdout, proc.stdout + proc.stderr
    assert time.time() - t < 60


def test_an_unreadable_checkpoint_is_named_without_torchs_advice_to_unpickle_it(tmp_path):
    """torch's weights_only refusal suggests weights_only=False (which runs the file's code): the error says why the
    file cannot be read instead, for a file that is no zip archive and for one that pickles a callable."""
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint\n")
    with pytest.raises(ValueError, match="not a zip archive") as e:
        checkpoint.load(str(garbage))
    assert "weights_only" not in str(e.value)
    crafted_file = tmp_path / "crafted.pt"
    torch.save({"format": checkpoint.FORMAT, "run": os.system}, crafted_file)
    with pytest.raises(ValueError, match="Python objects besides tensors") as e:
        checkpoint.load(str(crafted_file))
    assert "weights_only" not in str(e.value)


@pytest.mark.parametrize("script", ["train", "ablate"])
def test_a_model_that_does_not_exist_is_one_line_that_lists_the_models(tmp_path, script):
    """model=DiT-X/2 (a nested config group, for which Hydra lists no options), alone and in a sweep: one line with the
    valid names, before Hydra writes anything."""
    for value in ["DiT-X/2", "DiT-T/4,DiT-Q/2"]:
        rc, _, err = run_script(
            script, f"model={value}", f"run_dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'm'}", cwd=tmp_path
        )
        bad = value.split(",")[-1]
        assert rc == 1 and err.strip() == err.strip().splitlines()[0]
        assert err.startswith(f"error: model={bad} is not a model; valid: ") and "DiT-S/2" in err and "DiT-XL/2" in err
        assert os.listdir(tmp_path) == []


def test_the_model_check_passes_quoted_names_sweeps_and_the_models_own_keys():
    from flm.cli import check_model_choices

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    check_model_choices(["model='DiT-S/2'", "model=DiT-T/4, DiT-S/2", "model.prediction=data", "model=choice(a,b)"], configs)
    with pytest.raises(SystemExit, match="model=DiT-S/3 is not a model"):
        check_model_choices(["model.prediction=data", "model=DiT-S/3"], configs)
