"""The guidance interval: classifier-free guidance only for t in [t_min, t_max], in guided() and in every
objective's sampler, and in MeanFlow's guidance in training; each checked against a computation written out here."""

import math

import pytest
import torch
from torch import nn

from flm.objectives import SCM, FlowMatching, MeanFlow
from flm.objectives.guidance import check_interval, guided


class Toy(nn.Module):
    """A class-conditional 'network' whose conditional and null outputs differ, and depend on t and r."""

    num_classes = 3

    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(4, 1, 2, 2, generator=torch.Generator().manual_seed(0)))
        self.calls = []

    def forward(self, x, t, r, y):
        self.calls.append(len(x))
        r = torch.zeros_like(t) if r is None else r
        return x * (0.5 + t - 0.3 * r).view(-1, 1, 1, 1) + self.emb[y] * (1 + t).view(-1, 1, 1, 1)


def reference_guided(model, x, t, r, y, w, interval):
    """Per sample: null + w (cond - null) where t_min <= t <= t_max, cond elsewhere."""
    out = []
    for i in range(len(x)):
        xi, ti, ri, yi = x[i : i + 1], t[i : i + 1], None if r is None else r[i : i + 1], y[i : i + 1]
        cond = model(xi, ti, ri, yi)
        if interval[0] <= ti.item() <= interval[1]:
            null = model(xi, ti, ri, torch.full_like(yi, model.num_classes))
            cond = null + w * (cond - null)
        out.append(cond)
    return torch.cat(out)


def test_guided_with_an_interval_matches_the_reference():
    model, x = Toy(), torch.randn(6, 1, 2, 2)
    t, r, y = torch.tensor([0.0, 0.2, 0.3, 0.5, 0.7, 1.0]), torch.zeros(6), torch.tensor([0, 1, 2, 0, 1, 2])
    for interval in [(0.2, 0.7), (0.0, 1.0), (0.8, 0.9)]:
        torch.testing.assert_close(guided(model, x, t, r, y, 2.5, interval), reference_guided(model, x, t, r, y, 2.5, interval))
    model.calls.clear()
    torch.testing.assert_close(guided(model, x, t, None, y, 2.5, (0.8, 0.9)), model(x, t, None, y))
    assert model.calls == [6, 6]  # a batch with no time inside costs one conditional evaluation


def test_flow_matching_sampler_guides_only_inside_the_interval():
    model, noise, y = Toy(), torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 2, 1])
    steps, w, interval = 5, 3.0, (0.3, 0.7)
    x, ts = noise.clone(), torch.linspace(1.0, 0.0, steps + 1)
    for t, t_next in zip(ts[:-1], ts[1:]):  # Euler, written out
        x = x + (t_next - t) * reference_guided(model, x, t.expand(4), None, y, w, interval)
    model.calls.clear()
    got = FlowMatching(cfg_interval=list(interval)).sample(model, noise, y, steps=steps, cfg_scale=w)
    torch.testing.assert_close(got, x)
    assert model.calls == [4, 4, 8, 8, 4]  # t = 1.0, 0.8 outside, 0.6, 0.4 inside (a doubled batch), 0.2 outside


def test_meanflow_sampler_guides_only_inside_the_interval():
    model, noise, y = Toy(), torch.randn(3, 1, 2, 2), torch.tensor([0, 1, 2])
    z, ts = noise.clone(), torch.linspace(1.0, 0.0, 3)
    for t, r in zip(ts[:-1], ts[1:]):
        z = z - (t - r) * reference_guided(model, z, t.expand(3), r.expand(3), y, 2.0, (0.0, 0.75))
    got = MeanFlow(cfg_interval=[0.0, 0.75]).sample(model, noise, y, steps=2, cfg_scale=2.0)
    torch.testing.assert_close(got, z)
    assert not torch.allclose(got, MeanFlow().sample(model, noise, y, steps=2, cfg_scale=2.0))


def test_scm_sampler_interval_is_in_trigflow_time():
    model, noise, y = Toy(), torch.randn(3, 1, 2, 2), torch.tensor([0, 1, 2])
    scm = SCM()  # 2 steps: t_max = arctan(160) ~ 1.564, then mid_t 1.1

    def two_steps(objective, w):  # the re-noising drawn from the same generators each time
        return objective.sample(
            model, noise, y, steps=2, cfg_scale=w, generators=[torch.Generator().manual_seed(i) for i in range(3)]
        )

    plain, full = two_steps(scm, 1.0), two_steps(scm, 2.0)
    assert torch.equal(two_steps(SCM(cfg_interval=[0.0, 1.0]), 2.0), plain)
    torch.testing.assert_close(two_steps(SCM(cfg_interval=[0.0, math.pi / 2]), 2.0), full)
    assert not torch.allclose(plain, full)
    # guided at the first step only: the reference takes the guided first step, then the plain second
    x0 = math.cos(scm.t_max) * 0.5 * noise - math.sin(scm.t_max) * 0.5 * reference_guided(
        model, noise, torch.full((3,), scm.t_max), None, y, 2.0, (1.2, 1.6)
    )
    torch.testing.assert_close(SCM(cfg_interval=[1.2, 1.6], mid_t=(1.1,)).sample(model, noise, y, steps=1, cfg_scale=2.0), x0)


def test_meanflow_guidance_in_training_only_inside_the_interval():
    """v~ = omega v + kappa u(z_t, t, t | y) + (1 - omega - kappa) u(z_t, t, t | null) where t is inside and the
    label was kept, v elsewhere (the paper's eq. 19 with the interval)."""
    model, x, y = Toy(), torch.randn(8, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    mf = MeanFlow(cfg_omega=0.5, cfg_kappa=0.3, cfg_interval=[0.2, 0.6])
    y_in = y.clone()
    y_in[1] = model.num_classes  # one dropped label
    torch.manual_seed(0)
    s = mf.path.sample(x, torch.randn_like(x), torch.linspace(0.05, 0.95, 8))
    got = mf._guided_velocity(model, s, y, y_in)
    for i in range(8):
        t = s.t[i : i + 1]
        v = s.dx_t[i : i + 1]
        if 0.2 <= t.item() <= 0.6 and i != 1:
            u_c = model(s.x_t[i : i + 1], t, t, y[i : i + 1])
            u_n = model(s.x_t[i : i + 1], t, t, torch.full_like(y[i : i + 1], model.num_classes))
            v = 0.5 * v + 0.3 * u_c + 0.2 * u_n
        torch.testing.assert_close(got[i : i + 1], v)


@pytest.mark.parametrize("bad", [[0.5], [0.7, 0.2], "0.1", [0.1, True]])
def test_a_bad_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"cfg_interval must be \[t_min, t_max\]"):
        check_interval(bad)
    with pytest.raises(ValueError, match="cfg_interval must be"):
        FlowMatching(cfg_interval=bad)
