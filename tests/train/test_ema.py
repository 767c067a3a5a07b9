"""flm.train.ema: the constant decays and EDM2's power-function profile, checked against the paper's formulas."""

import math

import pytest
import torch
from torch import nn

from flm.train.ema import EMA, gamma_to_sigma_rel, power_beta, sigma_rel_to_gamma


@pytest.mark.parametrize("sigma_rel,gamma", [(0.05, 16.97), (0.10, 6.94)])  # the pairs EDM2 quotes
def test_sigma_rel_to_gamma_is_edm2s_relation(sigma_rel, gamma):
    assert sigma_rel_to_gamma(sigma_rel) == pytest.approx(gamma, abs=0.01)
    g = sigma_rel_to_gamma(sigma_rel)
    assert math.sqrt(g + 1) / (g + 2) / math.sqrt(g + 3) == pytest.approx(sigma_rel, rel=1e-9)
    assert gamma_to_sigma_rel(g) == pytest.approx(sigma_rel, rel=1e-9)


def _averaged(ema: EMA, key: str, values) -> float:
    """The average `ema` keeps of a one-weight model whose weight is values[s] after step s."""
    model = nn.Linear(1, 1, bias=False).to(ema.models[key].weight.dtype)
    for step, v in enumerate(values):
        with torch.no_grad():
            model.weight.fill_(float(v))
        ema.update(model, step)
    return ema.models[key].weight.item()


def test_power_ema_has_edm2s_profile():
    """After T steps, the weight the average gives the model of step tau is ~ tau^gamma (its first two moments
    match the profile's), and its width relative to T is sigma_rel; each step's beta is (1 - 1/t)^(gamma + 1)."""
    sigma_rel, T = 0.10, 2000
    gamma = sigma_rel_to_gamma(sigma_rel)
    key = "sigma_rel0.1"
    tau = torch.arange(1, T + 1, dtype=torch.float64) / T
    mean = _averaged(EMA(nn.Linear(1, 1, bias=False).double(), [], sigma_rels=[sigma_rel]), key, tau)
    second = _averaged(EMA(nn.Linear(1, 1, bias=False).double(), [], sigma_rels=[sigma_rel]), key, tau.square())
    assert mean == pytest.approx((gamma + 1) / (gamma + 2), rel=2e-3)  # E[tau/T] of p(tau) ~ tau^gamma on [0, T]
    assert second == pytest.approx((gamma + 1) / (gamma + 3), rel=2e-3)
    assert math.sqrt(second - mean**2) == pytest.approx(sigma_rel, rel=1e-2)
    assert power_beta(gamma, 0) == 0.0  # the first update copies the weights
    assert power_beta(gamma, 99) == pytest.approx((1 - 1 / 100) ** (gamma + 1), rel=1e-12)


def test_constant_and_power_emas_side_by_side():
    ema = EMA(nn.Linear(1, 1, bias=False), [0.9], sigma_rels=[0.05])
    assert list(ema.models) == ["0.9", "sigma_rel0.05"]
    start = ema.models["0.9"].weight.item()
    _averaged(ema, "0.9", [1.0] * 3)
    assert ema.models["sigma_rel0.05"].weight.item() == 1.0  # its first update copies, and 1.0 stays
    # the constant one's decays are min(0.9, (1 + s) / (10 + s)) at steps 0, 1, 2
    assert ema.models["0.9"].weight.item() == pytest.approx(1 - (1 - start) * (1 / 10) * (2 / 11) * (3 / 12))


@pytest.mark.parametrize("sigma_rels", [[0.0], [0.3], [-0.1]])
def test_a_sigma_rel_without_a_profile_is_refused(sigma_rels):
    with pytest.raises(ValueError, match="trainer.ema_sigma_rels must be"):
        EMA(nn.Linear(1, 1), [], sigma_rels=sigma_rels)


def test_a_run_without_ema_samples_its_raw_weights(tmp_path, train_run):
    from flm.train import checkpoint
    from flm.train.generator import generator_state

    train_run(tmp_path, ["trainer.max_steps=1", "trainer.ema_decays=[]"])
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    assert bundle["ema"] == {}
    with pytest.raises(ValueError, match="keeps no EMA"):
        generator_state(bundle, "ema")
    assert generator_state(bundle, "raw") is bundle["model"]


def test_a_power_ema_run_resumes_and_is_picked_by_name(tmp_path, train_run):
    from flm.train import checkpoint
    from flm.train.generator import generator_state

    train_run(tmp_path, ["trainer.max_steps=2", "trainer.ema_decays=[0.995]", "trainer.ema_sigma_rels=[0.05]"])
    bundle = checkpoint.load(checkpoint.find_checkpoint(str(tmp_path)))
    assert list(bundle["ema"]) == ["0.995", "sigma_rel0.05"]
    assert generator_state(bundle, "ema", ema="sigma_rel0.05") is bundle["ema"]["sigma_rel0.05"]
    assert generator_state(bundle, "ema", ema=0.995) is bundle["ema"]["0.995"]
    with pytest.raises(ValueError, match=r"ema=sigma_rel0.1 is not in the checkpoint; it has 0.995, sigma_rel0.05"):
        generator_state(bundle, "ema", ema="sigma_rel0.1")
    with pytest.raises(ValueError, match="trainer.ema_sigma_rels give"):
        train_run(tmp_path, ["trainer.max_steps=3", "trainer.resume=auto"])
