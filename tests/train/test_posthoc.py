"""Post-hoc EMA (flm.train.posthoc): the profiles' inner products, the fit against power EMAs run step by step, and
export.py's sigma_rel on a run."""

import json

import numpy as np
import pytest
import torch

from flm.train.ema import power_beta, sigma_rel_to_gamma
from flm.train.export import load_export
from flm.train.posthoc import posthoc_bundle, posthoc_coefficients, profile_dot

from .conftest import load_entry, run_script


@pytest.mark.parametrize("t_a,g_a,t_b,g_b", [(1.0, 6.94, 0.5, 3.46), (0.7, 2.0, 1.0, 10.0), (1.0, 0.0, 1.0, 0.0)])
def test_profile_dot_is_the_integral_of_the_profiles_product(t_a, g_a, t_b, g_b):
    tau = np.linspace(0.0, 1.0, 1_000_001)
    profile = lambda t, g: np.where(tau <= t, (g + 1) * tau**g / t ** (g + 1), 0.0)  # noqa: E731
    numeric = np.trapezoid(profile(t_a, g_a) * profile(t_b, g_b), tau)
    assert profile_dot(t_a, g_a, t_b, g_b) == pytest.approx(numeric, rel=1e-4)
    assert np.isfinite(profile_dot(1e6, 400.0, 5e5, 300.0))  # no overflow at long runs and narrow widths


def _power_emas(theta, gamma, every):
    """The power EMA of trajectory theta (steps x dims) as flm.train.ema updates it: (step, value) every `every`."""
    ema, out = np.zeros(theta.shape[1]), []
    for step, weights in enumerate(theta):
        beta = power_beta(gamma, step)
        ema = beta * ema + (1 - beta) * weights
        if (step + 1) % every == 0:
            out.append((step + 1, ema.copy()))
    return out


def test_a_width_between_the_saved_ones_is_the_power_ema_run_at_it():
    theta = np.cumsum(np.random.default_rng(0).standard_normal((3000, 20)), axis=0)  # weights that wander
    saved = [(t, g, v) for g in map(sigma_rel_to_gamma, (0.05, 0.10)) for t, v in _power_emas(theta, g, 300)]
    for target in (0.07, 0.12):
        gamma = sigma_rel_to_gamma(target)
        x, fit = posthoc_coefficients([(t, g) for t, g, _ in saved], (3000, gamma))
        synthesised = sum(c * v for c, (_, _, v) in zip(x, saved))
        run_at_it = _power_emas(theta, gamma, 3000)[-1][1]
        spread = np.abs(run_at_it - theta[-1]).max()  # how far the average is from the last weights
        assert fit < 0.03 and np.abs(synthesised - run_at_it).max() < 0.02 * spread, (target, fit)
    # a saved profile is its own fit: weight 1 on it, 0 elsewhere
    x, fit = posthoc_coefficients([(t, g) for t, g, _ in saved], (3000, sigma_rel_to_gamma(0.10)))
    np.testing.assert_allclose(x, np.eye(len(saved))[-1], atol=1e-6)
    assert fit < 1e-6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from .conftest import ROOT, TINY

    root = tmp_path_factory.mktemp("posthoc")
    overrides = TINY + ["trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.keep_last=0"]
    overrides += ["trainer.ema_sigma_rels=[0.05,0.1]", "trainer.ema_decays=[0.9]"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    load_entry("train").run(cfg, str(root / "run"))
    return root / "run"


def test_posthoc_bundle_at_a_saved_width_gives_the_saved_average(run):
    bundle, (key,) = posthoc_bundle(str(run), 0.1, log=lambda _: None)
    assert key == "posthoc_sigma_rel0.1" and bundle["step"] == 6
    for name, value in bundle["ema"]["sigma_rel0.1"].items():
        torch.testing.assert_close(bundle["ema"][key][name], value, rtol=1e-5, atol=1e-6)
    between, (key,) = posthoc_bundle(str(run), 0.07, step=4, log=lambda _: None)
    assert between["step"] == 4
    differs = [n for n, v in between["ema"][key].items() if not torch.equal(v, between["ema"]["sigma_rel0.05"][n])]
    assert differs  # a new average, not a copy of a saved one


def test_export_writes_a_posthoc_ema_that_sample_and_evaluate_read(run, tmp_path):
    rc, out, err = run_script("export", f"ckpt={run}", f"out={tmp_path / 'x'}", "sigma_rel=0.07")
    assert rc == 0, err
    assert "post-hoc EMA sigma_rel 0.07" in out and "relative error of its fitted profile" in out
    exported = load_export(str(tmp_path / "x"))
    bundle, keys = posthoc_bundle(str(run), [0.07, 0.12], log=lambda _: None)  # both from one read, as each alone
    for name, value in bundle["ema"][keys[0]].items():
        torch.testing.assert_close(exported["ema"][next(iter(exported["ema"]))][name], value)
    alone, (key,) = posthoc_bundle(str(run), 0.12, log=lambda _: None)
    for name, value in alone["ema"][key].items():
        torch.testing.assert_close(bundle["ema"][keys[1]][name], value)
    rc, out, err = run_script("export", f"ckpt={run}", f"out={tmp_path / 'many'}", "sigma_rel=[0.07,0.12]")
    assert rc == 0 and (tmp_path / "many" / "posthoc_sigma_rel0.12" / "model.safetensors").exists(), err
    rc, out, err = run_script("sample", f"ckpt={tmp_path / 'x'}", "n=2", "device=cpu", f"out={tmp_path / 's'}")
    assert rc == 0, err


def test_bad_posthoc_inputs_are_one_line_errors(run, tmp_path, train_run):
    train_run(tmp_path / "plain", ["trainer.max_steps=2"])  # constant-decay EMAs only
    train_run(tmp_path / "one", ["trainer.max_steps=2", "trainer.ema_sigma_rels=[0.05]"])  # one power EMA, one checkpoint
    for args, expected in (
        ([f"ckpt={run}", "sigma_rel=0.5"], "sigma_rel must be a number in (0, 0.288)"),
        ([f"ckpt={run}", "sigma_rel=wide"], "(a power EMA's relative width, e.g. 0.05), got 'wide'"),
        ([f"ckpt={run}", "sigma_rel=[]"], "sigma_rel is an empty list"),
        ([f"ckpt={run}", "sigma_rel=0.07", "ema=0.9"], "both given; pass one"),
        ([f"ckpt={tmp_path / 'one'}", "sigma_rel=0.07"], "holds 1 power EMA snapshot(s) up to step 2"),
        ([f"ckpt={tmp_path / 'plain'}", "sigma_rel=0.07"], "holds 0 power EMA snapshot(s)"),
    ):
        rc, out, err = run_script("export", *args, f"out={tmp_path / 'y'}")
        assert rc == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "y").exists()  # nothing written
    with pytest.raises(ValueError, match=r"step=5 is not a saved checkpoint's step; the run has \[2, 4, 6\]"):
        posthoc_bundle(str(run), 0.07, step=5)


def test_evaluate_scores_posthoc_emas_in_one_call(run, tmp_path):
    out = tmp_path / "eval.json"
    common = ["n=20", "steps=[1]", "fid=false", "device=cpu", "batch_size=10"]
    rc, stdout, err = run_script("evaluate", f"ckpt={run}", "sigma_rel=[0.07,0.1]", f"out={out}", *common)
    assert rc == 0, err
    assert "posthoc_sigma_rel0.07 weights" in stdout and "posthoc_sigma_rel0.1 weights" in stdout
    scores = {w: json.loads((tmp_path / f"eval-posthoc_sigma_rel{w}.json").read_text()) for w in ("0.07", "0.1")}
    assert scores["0.07"]["ema"] == "posthoc_sigma_rel0.07"
    # the width the run saved comes back as the saved average: the same samples, the same numbers
    rc, _, err = run_script("evaluate", f"ckpt={run}", "ema=sigma_rel0.1", f"out={tmp_path / 'saved.json'}", *common)
    assert rc == 0, err
    assert json.loads((tmp_path / "saved.json").read_text())["results"] == pytest.approx(scores["0.1"]["results"], rel=1e-4)
    assert scores["0.07"]["results"] != scores["0.1"]["results"]
    for args, expected in (
        (["sigma_rel=0.07", "ema=0.9"], "sigma_rel scores post-hoc EMAs; leave ema, ema_decay and weights"),
        (["sigma_rel=0.07", "weights=raw"], "sigma_rel scores post-hoc EMAs"),
    ):
        rc, _, err = run_script("evaluate", f"ckpt={run}", *args, f"out={tmp_path / 'bad.json'}", *common)
        assert rc == 1 and len(err.strip().splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "bad.json").exists()
