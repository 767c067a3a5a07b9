"""Flow matching / rectified flow (Lipman et al. 2023; Liu et al. 2023; SD3's logit-normal t).

Convention (flm.objectives.paths.LinearPath): x_t = (1 - t) x + t eps, t = 0 data, t = 1 noise;
the model predicts the velocity v = eps - x; samplers integrate dx/dt = v from t = 1 to t = 0.

    from flm.objectives import FlowMatching
    fm = FlowMatching(t_mean=0.0, t_std=1.0, sampler="heun")
    loss, metrics = fm.loss(model, x, y)
    images = fm.sample(model, torch.randn_like(x), y, steps=50, cfg_scale=1.5)
"""

import torch
from torch import nn

from flm.objectives.guidance import check_cfg, check_interval, drop_labels, guided, num_classes
from flm.objectives.checks import check_probability, check_std
from flm.objectives.paths import LinearPath, bcast, logit_normal, time_grid
from flm.objectives.posterior import DataVelocity
from flm.objectives.protocol import NO_NETWORKS

SAMPLERS = ("euler", "heun")


class FlowMatching(nn.Module):
    """Velocity regression ||v_theta(x_t, t, y) - (eps - x)||^2 with t ~ logit-normal(t_mean, t_std).

    Args:
        t_mean, t_std: logit-normal time distribution (0, 1 is SD3's default).
        label_dropout: probability of replacing a label by the null class (CFG training); used only
            when labels are given, the class count is read from the model (`model.num_classes`).
        sampler: "euler" (steps evaluations) or "heun" (2 * steps evaluations) for `sample`.
        cfg_interval: [t_min, t_max], guide only there (flm.objectives.guidance); null: at every t.
        loss_t_min: samples with t < loss_t_min weigh (t / loss_t_min)^2 in the loss. A data-predicting model
            (model.prediction=data) has velocity error ||x^ - x||^2 / t^2, whose weight this caps at 1 / loss_t_min^2 (JiT's
            clip, 0.05; uncapped, the rare t near 0 make the loss spike). 0: none (the velocity model's plain loss).
        velocity_estimate: the regression target: "sample" (eps - x, the conditional velocity) or "batch" (its
            posterior mean over the batch's images, flm.objectives.posterior: far less noisy near t = 1).
        velocity_references: with velocity_estimate=batch, this many earlier training images as further references
            (flm.objectives.posterior.ReferenceBank, saved with the objective); 0: the batch alone.

    No parameters or state; it is an nn.Module so that every objective moves and saves alike.
    """

    time_inputs = 1
    sample_steps = 50
    predictions = ("velocity", "data")  # the first is model.prediction=auto's: the data prediction needs loss_t_min
    networks = NO_NETWORKS

    def __init__(
        self,
        *,
        t_mean: float = 0.0,
        t_std: float = 1.0,
        label_dropout: float = 0.1,
        sampler: str = "euler",
        cfg_interval: tuple[float, float] | None = None,
        loss_t_min: float = 0.0,
        velocity_estimate: str = "sample",
        velocity_references: int = 0,
    ):
        super().__init__()
        self.velocity_estimate, self.data_velocity = velocity_estimate, DataVelocity(velocity_estimate, velocity_references)
        check_std("t_std", t_std)
        check_probability("label_dropout", label_dropout)
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; valid samplers: {', '.join(SAMPLERS)}")
        self.t_mean, self.t_std, self.label_dropout, self.sampler = t_mean, t_std, label_dropout, sampler
        self.cfg_interval = check_interval(cfg_interval)
        if not 0.0 <= loss_t_min < 1.0:
            raise ValueError(f"loss_t_min must be in [0, 1) (0: no cap; 0.05 for model.prediction=data), got {loss_t_min!r}")
        self.loss_t_min = loss_t_min
        self.path = LinearPath()

    def loss(self, model, x, y=None, *, step: int = 0):
        y, y_data = drop_labels(model, y, self.label_dropout), y
        t = logit_normal(x.shape[0], self.t_mean, self.t_std, device=x.device)
        s = self.path.sample(x, torch.randn_like(x), t)
        s.dx_t = self.data_velocity(self.path, x, s, y, y_data, num_classes(model), step)
        v = model(s.x_t, t, None, y)
        error = (v.float() - s.dx_t).square()
        if self.loss_t_min > 0:
            error = error * bcast((t / self.loss_t_min).clamp_max(1.0).square(), error)
        loss = error.mean()
        return loss, {"loss": loss.detach()}

    @torch.no_grad()
    def sample(self, model, noise, y=None, *, steps: int, cfg_scale: float = 1.0, generators=None):
        """Integrate from x_1 = noise at t = 1 to t = 0 on a uniform grid of `steps` intervals.

        Deterministic: `generators` (the shared sampler signature) go unused.
        """
        check_cfg(model, y, cfg_scale)
        ts = time_grid(steps, 1.0, 0.0, device=noise.device)
        x = noise
        velocity = lambda x, t: guided(model, x, t.expand(x.shape[0]), None, y, cfg_scale, self.cfg_interval).float()  # noqa: E731
        for t, t_next in zip(ts[:-1], ts[1:]):
            v = velocity(x, t)
            if self.sampler == "heun":
                x_euler = x + (t_next - t) * v
                v = 0.5 * (v + velocity(x_euler, t_next))
            x = x + (t_next - t) * v
        return x
