"""evaluate.py and flm.train.evaluation on a tiny run, with a small stand-in for the Inception network."""

import json

import numpy as np
import pytest
import torch
from omegaconf import ListConfig

from flm.data import DataConfig, shipped_mnist
from flm.metrics.fid import FeatureNet, Stats
from flm.train import checkpoint
from flm.train.evaluation import Evaluator, check_n, parse_steps
from flm.train.generator import build_objective_from, load_generator, sampler_variants

from ..metrics.standin import StandIn, save_standin
from .conftest import ROOT, load_entry, run_script, torchrun
from .test_entrypoints import error_of


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step MeanFlow run on the shipped digits, and the stand-in network and digit statistics beside it."""
    from hydra import compose, initialize_config_dir

    from .conftest import TINY

    root = tmp_path_factory.mktemp("eval")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=TINY)
    load_entry("train").run(cfg, str(root / "run"))
    np.savez(root / "ref_batch.npz", arr_0=shipped_mnist().images[:200].permute(0, 2, 3, 1).numpy())  # ADM's layout
    return {"dir": root / "run", "inception": save_standin(root / "standin.pt"), "ref": str(root / "ref_batch.npz")}


@pytest.fixture
def evaluate_run(cfg_of):
    entry = load_entry("evaluate")
    return lambda overrides: entry.run(cfg_of("evaluate", overrides))


def test_evaluate_from_the_command_line(run, tmp_path):
    out = tmp_path / "fid.json"
    rc, stdout, err = run_script(
        "evaluate",
        f"ckpt={run['dir']}",
        "n=12",
        "steps=[1,2]",
        "batch_size=5",
        f"inception={run['inception']}",
        f"ref={run['ref']}",
        f"out={out}",
        "device=cpu",
    )
    assert rc == 0, err
    report = json.loads(out.read_text())
    assert set(report["results"]) == {f"{m}_steps{k}" for m in ("fid", "label_acc", "digit_fd", "faint") for k in (1, 2)}
    assert all(np.isfinite(v) for v in report["results"].values()) and report["n"] == 12
    assert "| steps | FID | label accuracy | digit FD | faint pixels |" in stdout and "| 2 |" in stdout
    assert not list(tmp_path.glob("*.png"))  # grids only when asked for


def test_evaluate_writes_grids_of_the_scored_images(run, evaluate_run, tmp_path):
    from PIL import Image

    out = tmp_path / "fid.json"
    evaluate_run(
        [
            f"ckpt={run['dir']}",
            "n=12",
            "steps=[1,2]",
            "batch_size=12",
            f"inception={run['inception']}",
            f"ref={run['ref']}",
            f"out={out}",
            "device=cpu",
            "grid=true",
        ]
    )
    for k in (1, 2):
        grid = Image.open(tmp_path / f"fid-steps{k}.png")
        assert grid.size == (10 * 30 + 2, 2 * 30 + 2)  # 12 images, ten (labels 0-9) per row, 2-pixel gaps


def test_scores_do_not_depend_on_the_batch_size(run):
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(run["dir"])))
    model, objective = load_generator(bundle)
    net = FeatureNet(net=StandIn().eval(), name="standin", size=32)
    scores = [
        Evaluator(
            data=DataConfig(), shape=(1, 28, 28), num_classes=10, n=10, steps=[1], batch_size=b, features=net, ref=run["ref"]
        )(model, objective)
        for b in (3, 10)
    ]
    assert scores[0]["fid_steps1"] == pytest.approx(scores[1]["fid_steps1"], rel=1e-5)
    assert scores[0]["label_acc_steps1"] == scores[1]["label_acc_steps1"]
    assert scores[0]["digit_fd_steps1"] == pytest.approx(scores[1]["digit_fd_steps1"], rel=1e-4)
    assert scores[0]["faint_steps1"] == pytest.approx(scores[1]["faint_steps1"])


def test_objective_is_rebuilt_from_names_only(run):
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(run["dir"])))
    assert type(build_objective_from(bundle)).__name__ == "MeanFlow"
    objective = bundle["config"]["objective"]
    for crafted in ({**objective, "_target_": "os.system"}, {**objective, "path": {"_target_": "os.system", "command": "true"}}):
        bundle["config"]["objective"] = crafted  # refused, never called
        with pytest.raises(ValueError, match="is not allowed"):
            build_objective_from(bundle)


def test_mid_t_sets_the_two_step_time_of_trigflow_runs(run):
    scm = {"config": {"objective": {"name": "scm", "sigma_d": 0.5, "mid_t": [1.1]}}}
    assert build_objective_from(scm).sample_times(2)[1] == 1.1
    for mid_t, times in ((0.8, [0.8]), ([0.9], [0.9]), (ListConfig([1.0]), [1.0]), ([1.2, 0.6], [1.2, 0.6])):  # Hydra's list too
        objective = build_objective_from(scm, mid_t=mid_t)
        assert objective.mid_t == tuple(times) and objective.sample_times(len(times) + 1)[1:] == times
    with pytest.raises(ValueError, match=r"mid_t values must lie in \(0, t_max"):
        build_objective_from(scm, mid_t=[1.7])
    with pytest.raises(ValueError, match="mid_t must be a number or a list of numbers"):
        build_objective_from(scm, mid_t="late")
    flow_matching = {"config": {"objective": {"name": "flow_matching"}}}
    with pytest.raises(ValueError, match="is a flow_matching run, whose sampler has none; leave mid_t=null"):
        build_objective_from(flow_matching, mid_t=[0.6])


def test_sampler_variants_sweep_mid_t_lists_and_gammas():
    assert sampler_variants() == [(None, None)]
    assert sampler_variants([1.1], 0.5) == [([1.1], 0.5)]  # one sampler: a list of times is not a sweep
    assert sampler_variants([1.2, 0.6]) == [([1.2, 0.6], None)]  # nor are a 3-step sampler's two times
    assert sampler_variants([[1.2], [1.1]], [1, 0.5]) == [([1.2], 1), ([1.2], 0.5), ([1.1], 1), ([1.1], 0.5)]
    assert sampler_variants(None, [1, 0]) == [(None, 1), (None, 0)]
    with pytest.raises(ValueError, match="mixes times and lists of times"):
        sampler_variants([[1.2], 1.1])


def test_a_mid_t_sweep_scores_each_sampler_as_its_own_call_would(run, evaluate_run, tmp_path, monkeypatch):
    used = []  # the sampler's times of each scoring (this tiny run's 2-step samples barely depend on them)
    scored = Evaluator.__call__
    monkeypatch.setattr(
        Evaluator, "__call__", lambda self, model, objective: used.append(objective.mid_t) or scored(self, model, objective)
    )
    common = [f"ckpt={run['dir']}", "n=12", "steps=[2]", f"inception={run['inception']}", f"ref={run['ref']}", "device=cpu"]
    swept = evaluate_run([*common, "mid_t=[[0.6],[0.3]]", f"out={tmp_path / 'fid.json'}"])
    assert set(swept) == {"-mid0.6", "-mid0.3"} and used == [(0.6,), (0.3,)]
    one = evaluate_run([*common, "mid_t=[0.3]", f"out={tmp_path / 'one.json'}"])
    assert swept["-mid0.3"] == one and used[2:] == [(0.3,)]  # the same images and scores as a call of its own
    for tag, times in (("-mid0.6", [0.6]), ("-mid0.3", [0.3])):
        report = json.loads((tmp_path / f"fid{tag}.json").read_text())
        assert report["mid_t"] == times and report["results"] == swept[tag]
    assert not (tmp_path / "fid.json").exists()  # each sampler's own file, none under the bare name


def test_gamma_sets_the_re_noising_of_trigflow_runs():
    assert build_objective_from({"config": {"objective": {"name": "scm"}}}).gamma == 1.0  # a run saved before gamma
    assert build_objective_from({"config": {"objective": {"name": "scm"}}}, gamma=0).gamma == 0.0
    with pytest.raises(ValueError, match="gamma must be a number"):
        build_objective_from({"config": {"objective": {"name": "scm"}}}, gamma="none")
    with pytest.raises(ValueError, match=r"gamma must lie in \[0, 1\]"):
        build_objective_from({"config": {"objective": {"name": "scm"}}}, gamma=2)
    for name in ("flow_matching", "meanflow"):
        with pytest.raises(ValueError, match=f"is a {name} run, which does not re-noise; leave gamma=null"):
            build_objective_from({"config": {"objective": {"name": name}}}, gamma=0.5)


def test_mid_t_sets_the_jumps_of_meanflow_sampling(run):
    """MeanFlow's 2 jumps go 1 -> mid_t -> 0 (the default: 1 -> 0.5 -> 0); other step counts stay uniform."""
    meanflow = checkpoint.load(checkpoint.find_checkpoint(str(run["dir"])))
    calls = []

    def model(z, t, r, y):  # records each jump (t, r); u = 0 keeps z
        calls.append((round(t[0].item(), 6), round(r[0].item(), 6)))
        return torch.zeros_like(z)

    for mid_t, steps, jumps in (
        (None, 2, [(1.0, 0.5), (0.5, 0.0)]),
        ([0.6], 2, [(1.0, 0.6), (0.6, 0.0)]),
        ([0.6], 4, [(1.0, 0.75), (0.75, 0.5), (0.5, 0.25), (0.25, 0.0)]),
        ([0.7, 0.3], 3, [(1.0, 0.7), (0.7, 0.3), (0.3, 0.0)]),
    ):
        calls.clear()
        build_objective_from(meanflow, mid_t=mid_t).sample(model, torch.zeros(2, 1, 4, 4), steps=steps)
        assert calls == jumps, (mid_t, steps)
    for bad in ([1.2], [0.0], [0.3, 0.7]):
        with pytest.raises(ValueError, match=r"mid_t must be decreasing times in \(0, 1\)"):
            build_objective_from(meanflow, mid_t=bad)


@pytest.mark.parametrize("value", ["abc", 1, 0, -5, 2.5])
def test_bad_n(value):
    with pytest.raises(ValueError, match="n must be an integer >= 2"):
        check_n(value)


def test_steps_lists():
    assert parse_steps(2) == [2] and parse_steps([1, 2]) == [1, 2] and parse_steps("4") == [4]
    for bad in (0, "x", [], [1, -1], 1.5):
        with pytest.raises(ValueError, match="steps must be a positive integer"):
            parse_steps(bad)


def test_digit_metrics_alone_need_no_inception(run, evaluate_run, tmp_path, capsys):
    """fid=false: label accuracy, digit FD and faint pixels, the same numbers as beside FID, with no Inception file."""
    base = [f"ckpt={run['dir']}", "n=12", "steps=[1,2]", "batch_size=5", "device=cpu"]
    alone = evaluate_run(base + ["fid=false", f"inception={tmp_path / 'none.pt'}", f"out={tmp_path / 'digits.json'}"])
    assert set(alone) == {f"{m}_steps{k}" for m in ("label_acc", "digit_fd", "faint") for k in (1, 2)}
    assert "| steps | label accuracy | digit FD | faint pixels |" in capsys.readouterr().out
    report = json.loads((tmp_path / "digits.json").read_text())
    assert report["inception"] is None and report["reference"] is None
    beside = evaluate_run(base + [f"inception={run['inception']}", f"ref={run['ref']}", f"out={tmp_path / 'all.json'}"])
    assert {k: v for k, v in beside.items() if not k.startswith("fid")} == alone


def test_digit_metrics_alone_refuse_other_data():
    with pytest.raises(ValueError, match="fid=false leaves only the digit classifier's metrics.*keep fid=true"):
        Evaluator(data=DataConfig(name="cifar10"), shape=(3, 32, 32), num_classes=10, n=4, compute_fid=False)


def test_bad_inputs_are_one_line_errors(run, evaluate_run, tmp_path):
    base = [f"ckpt={run['dir']}", "n=4", "device=cpu", f"inception={run['inception']}", f"ref={run['ref']}"]
    assert "n must be an integer >= 2" in error_of(evaluate_run, base + ["n=abc"])
    assert "n must be an integer >= 2" in error_of(evaluate_run, base + ["n=1"])
    assert "fid must be true or false, got 'maybe'" in error_of(evaluate_run, base + ["fid=maybe"])
    missing = error_of(evaluate_run, base + [f"inception={tmp_path / 'none.pt'}"])
    assert "not found" in missing and "fetch-data.sh DIR fid" in missing
    other = tmp_path / "cifar_stats.npz"
    Stats(np.zeros(32), np.eye(32), dataset="cifar10", split="train", resolution=32, network="x").save(str(other))
    assert "needs mnist test 28x28" in error_of(evaluate_run, base + [f"ref={other}"])
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(run["dir"])))
    del bundle["config"]["objective"]
    no_sampler = tmp_path / "ckpt-00000004.pt"
    torch.save(bundle, no_sampler)
    assert "no sampler" in error_of(evaluate_run, base + [f"ckpt={no_sampler}"])


def test_bad_input_exits_with_one_error_line(run, tmp_path):
    rc, _, err = run_script("evaluate", f"ckpt={run['dir']}", "n=abc", f"inception={run['inception']}")
    expected = "error: n must be an integer >= 2 (FID fits a covariance; 10000 is usual), got 'abc'"
    assert rc == 1 and err.strip().splitlines() == [expected]


def test_two_processes_score_as_one(run, tmp_path):
    """Under torchrun the ranks split the images and gather the features: the same numbers as one process."""

    args = [
        f"ckpt={run['dir']}",
        "n=9",
        "steps=[1,2]",
        "batch_size=2",
        "device=cpu",
        f"inception={run['inception']}",
        f"ref={run['ref']}",
    ]
    rc, _, err = run_script("evaluate", *args, f"out={tmp_path / 'one.json'}")
    assert rc == 0, err
    torchrun(ROOT / "evaluate.py", *args, f"out={tmp_path / 'two.json'}")
    one, two = (json.loads((tmp_path / f"{k}.json").read_text())["results"] for k in ("one", "two"))
    assert one.keys() == two.keys()
    for k in one:
        assert two[k] == pytest.approx(one[k], rel=1e-5), k


def test_in_loop_evaluation_is_logged(run, train_run, tmp_path):
    from flm.metrics import fid
    from flm.metrics.fid import features, file_hash, stats_of, stats_key

    # the reference statistics, cached where the loop looks for them (computing all 10,000 is slow here)
    net = fid.load_inception(run["inception"])
    digits = shipped_mnist().images[:300].float() / 127.5 - 1
    stats_of(features(digits, net), dataset="mnist", split="test", resolution=28, network=net.name).save(
        str(tmp_path / "cache" / stats_key("mnist", "test", 28, f"inception-{file_hash(run['inception'])}"))
    )
    train_run(
        tmp_path / "loop",
        [
            "trainer.eval_every=2",
            "trainer.eval_n=6",
            "trainer.eval_batch_size=4",  # two sampling batches of 4 and 2, not the training batch
            "trainer.eval_steps=[1,2]",
            f"trainer.eval_inception={run['inception']}",
            f"trainer.eval_cache={tmp_path / 'cache'}",
        ],
    )
    rows = [json.loads(line) for line in (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "fid_steps1" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(np.isfinite(r["fid_steps2"]) and 0 <= r["label_acc_steps1"] <= 1 for r in evals)

    # benchmarks/fid_curve.py reads these records back as the curve of each sampler
    fid_curve = load_entry("benchmarks/fid_curve")
    assert fid_curve.main([str(tmp_path / "loop"), "--out", str(tmp_path / "curve")]) == 0
    curves = fid_curve.series(str(tmp_path / "loop"), "fid")
    assert curves == {f"loop {k} step{'s' if k > 1 else ''}": {r["step"]: r[f"fid_steps{k}"] for r in evals} for k in (1, 2)}
    report = (tmp_path / "curve" / "fid_curve.md").read_text()
    assert f"| 4 | {evals[1]['fid_steps1']:.4g} | {evals[1]['fid_steps2']:.4g} |" in report
    assert (tmp_path / "curve" / "fid_curve.png").stat().st_size > 0


def test_in_loop_evaluation_samples_in_eval_batch_size(monkeypatch):
    from types import SimpleNamespace

    from flm.train import evaluation

    built = []
    monkeypatch.setattr(evaluation, "Evaluator", lambda **kwargs: built.append(kwargs["batch_size"]))
    for eval_batch_size, expected in ((None, 64), (1000, 1000)):
        trainer = SimpleNamespace(
            eval_every=10, max_steps=100, eval_n=10, eval_steps=[1], sample_cfg_scale=1.0, eval_batch_size=eval_batch_size,
            eval_inception=None, eval_cache=None,
        )  # fmt: skip
        evaluation.InTraining(
            trainer, None, shape=(1, 28, 28), num_classes=10, device="cpu", amp_dtype=None, batch_size=64, sample_steps=2
        )
        assert built[-1] == expected


def test_in_loop_evaluation_fails_before_training(train_run, tmp_path):
    with pytest.raises(FileNotFoundError, match="fetch-data.sh DIR fid"):
        train_run(tmp_path / "loop", ["trainer.eval_every=2", f"trainer.eval_inception={tmp_path / 'none.pt'}"])
    assert not (tmp_path / "loop" / "metrics.jsonl").exists()


def test_evaluate_config_reads_the_environment(cfg_of, monkeypatch):
    monkeypatch.setenv("FLM_FID_INCEPTION", "/somewhere/inception.pt")
    monkeypatch.setenv("FLM_FID_CACHE", "/somewhere/cache")
    cfg = cfg_of("evaluate", ["ckpt=run", "steps=[1,2]"])
    assert cfg.inception == "/somewhere/inception.pt" and cfg.fid_cache == "/somewhere/cache"
    assert parse_steps(cfg.steps) == [1, 2] and cfg.weights == "ema" and cfg.n == 10000
    trainer = cfg_of("train", ["trainer.eval_every=100"]).trainer
    assert trainer.eval_inception == "/somewhere/inception.pt" and trainer.eval_steps is None


def test_image_folder_reference_is_cached_under_its_path(tmp_path):
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "images" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((12, 12, 3), 40 * i + (c == "b") * 100, np.uint8)).save(tmp_path / "images" / c / f"{i}.png")
    data = DataConfig(name="imagefolder", root=str(tmp_path / "images"), resolution=8)
    net = FeatureNet(net=StandIn().eval(), name="standin", size=32)
    ev = Evaluator(data=data, shape=(3, 8, 8), num_classes=2, n=4, features=net, cache=str(tmp_path / "cache"))
    assert ev.reference.n == 6 and ev.reference.resolution == 8 and ev.reference.dataset.startswith("imagefolder-")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{ev.reference.dataset}-train-8x8-standin.npz"]
    with pytest.raises(ValueError, match="differs in resolution"):
        Evaluator(data=data, shape=(3, 16, 16), num_classes=2, n=4, features=net, cache=str(tmp_path / "cache"))


def test_the_digit_metrics_are_for_mnist_only():
    from flm.train.evaluation import is_mnist_like

    assert is_mnist_like((1, 28, 28), 10, "mnist") and is_mnist_like((1, 28, 28), 10, "mnist_shipped")
    assert not is_mnist_like((1, 28, 28), 10, "fashion_mnist")  # same shape and classes, clothes not digits
    assert not is_mnist_like((3, 32, 32), 10, "cifar10")
