"""Continuous-time consistency training, sCT (Lu & Song 2024, arXiv 2410.11081), on TrigFlow.

TrigFlow path (flm.objectives.paths.TrigFlowPath): x_t = cos(t) x0 + sin(t) z, z ~ N(0, sigma_d^2 I),
t in [0, pi/2], t = pi/2 noise. Consistency function (eq. 7), with c_noise(t) = t (section 4.1):

    f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t)          F = the model

or, with a data-predicting DiT (`model.prediction=data`), F built from its clean image x^ (in x_t / sigma_d's units):

    F = (cos(t) x_t / sigma_d - x^) / max(sin(t), SIN_MIN),   so f = sigma_d x^ wherever sin(t) >= SIN_MIN

the network then need not reproduce the noise it is given to cancel it, as flow matching's and MeanFlow's data
prediction (flm.models.dit); below SIN_MIN f blends x_t into sigma_d x^ and still meets f(x, 0) = x. On MNIST it
scored worse than predicting F (docs/quality.md, twenty-second day), so sCM's model.prediction=auto stays the velocity.

Loss (Algorithm 1, sCT: no teacher; dx_t/dt = cos(t) z - sin(t) x0 from the data):

    cos(t) sin(t) dF-/dt = JVP of F-(x_t / sigma_d, t) along (cos t sin t dx_t/dt / sigma_d, cos t sin t)
    g = -cos^2(t) (sigma_d F- - dx_t/dt) - warm * (cos t sin t x_t + sigma_d cos t sin t dF-/dt)
    g = g / (||g|| + c)                                                   (tangent normalisation)
    L = exp(-logvar(t)) ||F - F- - g||^2 / D + logvar(t)                  (adaptive weighting)

where F- = stopgrad(F), warm = min(1, step / warmup_steps) (tangent warm-up) and logvar(t) = -w_phi(t)
is a small learned head (Fourier features of t -> linear, zero-initialised, as EDM2's). With logvar_loss=sum it weighs
||F - F- - g||^2 instead, which starts where the head does (LogVar; sCD's and rCM's default).

The consistency curriculum (`alpha_steps`, off by default; flm.objectives.curriculum, which MeanFlow shares): g is
cos t df-/dt along the trajectory (at full warm-up), so before alpha_steps[1] it is taken by a finite difference,

    g = cos t (f-(x_t, t) - f-(x_s, s)) / (t - s),   s = (1 - alpha) t

with x_s the DDIM step from x_t along dx_t/dt (the sample's own path point for the data's; the guided trajectory with
guidance in training): discrete-time consistency training with its step alpha t shrinking (sCD refuses it: on the toy
its student drifted from the exact map, docs/quality.md).
At alpha = 1, s = 0 and f(x_s, 0) is the clean image itself: the model learns to denoise in one jump. alpha falls
geometrically to alpha_min, then the JVP's g takes over. No JVP in those steps: one more forward without gradient. The
tangent warm-up applies to the JVP's steps only (the discrete target is a whole one at every alpha).

THE OBJECTIVE HAS PARAMETERS: optimise them with the model,
`torch.optim.AdamW(list(model.parameters()) + list(objective.parameters()))`, move it with
`objective.to(device)` and save `objective.state_dict()` in the checkpoint.

Sampling (section 3): x0 = f(sigma_d eps, t_max), then for each intermediate time t_i
x0 = f(cos(t_i) x0 + sin(t_i) sigma_d eps_i, t_i); t_max = arctan(80 / sigma_d), 2-step t_1 = 1.1.
With `generators` (one per image), eps_i of image k is drawn from generators[k], so multi-step samples
do not depend on the batch size (flm.train.sampling.generate passes the generators of the initial noise).

    from flm.objectives import SCM
    scm = SCM(sigma_d=0.5, warmup_steps=10_000, jvp_mode="dual").to(device)
    loss, metrics = scm.loss(model, x, y, step=step)
    images = scm.sample(model, torch.randn_like(x), y, steps=2)
"""

import math

import torch
from torch import nn

from flm.models.dit import data_from_velocity
from flm.objectives.guidance import check_cfg, check_interval, drop_labels, guided, in_interval, null_labels, num_classes, unwrap
from flm.objectives.jvp import check_jvp_mode, jvp
from flm.objectives.checks import check_hf_weight, check_probability, check_std
from flm.objectives.curriculum import Curricular, alpha_metric, build_curriculum
from flm.objectives.frequency import squared_error
from flm.objectives.paths import (
    TrigFlowPath,
    bcast,
    lognormal_trigflow,
    ramp,
    randn_per_image,
)
from flm.objectives.posterior import DataVelocity
from flm.objectives.protocol import NO_NETWORKS

# F = (cos t x_t / sigma_d - x^) / max(sin t, SIN_MIN) for a data-predicting model: the floor bounds F's 1 / sin t and its
# d/dt's 1 / sin^2 t, which amplify x^'s error where the proposal puts most of its draws. A floor of 0.05 collapsed the
# CPU MNIST run; on the H200 0.5 scored better than 1.0, and both worse than F itself (docs/quality.md, twenty-second day)
SIN_MIN = 0.5


LOGVAR_LOSSES = ("mean", "sum")


class LogVar(nn.Module):
    """The adaptive weighting's head, logvar(t) = linear(cos(t * freqs + phases) * sqrt(2)), freqs and phases fixed
    (EDM2's head), zero-initialised, and the per-sample loss it weighs: ||.||^2 / D ("mean", the paper's) or ||.||^2
    ("sum").

    The tangent is normalised to about unit norm, so the sum starts near 1 = exp(0), where the head starts; the mean
    starts near 1 / D, log D away (6.7 on MNIST, 8.0 on CIFAR-10), a gap the head closes at the optimizer's pace.
    Meanwhile the model's gradient grows ~D-fold (a transient Adam's second moment lags: a larger step than lr), and
    at the rarely drawn times near t_max, the 1-step sampler's, the head lags longest: e^3.6 behind after 400 CPU steps
    at lr 2e-3, e^5.3 after 950 at the H200 preset's 2e-4. The sum brought the CPU sCD student 21-38 % closer to its
    teacher's solution (27 % with the preset's optimizer) and the H200 preset's 15 % (2-step FID -12 %, two seeds); sCM
    from scratch scored lower with it on the CPU screen (docs/quality.md, thirtieth and thirty-first days)."""

    def __init__(self, channels: int = 128, loss: str = "mean", seed: int = 0):
        super().__init__()
        if loss not in LOGVAR_LOSSES:
            raise ValueError(f"unknown logvar_loss {loss!r}; valid: {', '.join(LOGVAR_LOSSES)}")
        self.summed = loss == "sum"
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("freqs", 2 * math.pi * torch.randn(channels, generator=g))
        self.register_buffer("phases", 2 * math.pi * torch.rand(channels, generator=g))
        self.linear = nn.Linear(channels, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        features = torch.cos(t.float()[:, None] * self.freqs + self.phases) * math.sqrt(2)  # (B, C)
        return self.linear(features).squeeze(1)  # (B,)

    def weigh(self, sq: torch.Tensor, t: torch.Tensor, numel: int) -> torch.Tensor:
        """exp(-logvar(t)) loss + logvar(t) per sample (B,), from sq = ||.||^2 / D (B,) with D = numel."""
        logvar = self(t)
        return torch.exp(-logvar) * (sq * numel if self.summed else sq) + logvar


def consistency_value(x_t: torch.Tensor, t: torch.Tensor, sigma_F: torch.Tensor) -> torch.Tensor:
    """f(x_t, t) = cos(t) x_t - sin(t) sigma_d F in fp32, from sigma_F = sigma_d F (a model's, or a teacher's dx_t/dt:
    its x-prediction); t (B,)."""
    return bcast(torch.cos(t), x_t) * x_t.float() - bcast(torch.sin(t), x_t) * sigma_F.float()


class SCM(Curricular, nn.Module):
    """sCT loss on TrigFlow and its 1- or few-step sampler.

    Args:
        sigma_d: data standard deviation (0.5 for images in [-1, 1]; adjust for latents).
        p_mean, p_std: proposal tan(t) = exp(N(p_mean, p_std^2)) / sigma_d (paper: -1.0, 1.4 on
            CIFAR-10; -0.8, 1.6 on ImageNet 64).
        tangent_c: c of the tangent normalisation g / (||g|| + c) (paper: 0.1).
        hf_weight: ||F - F- - g||^2 becomes ||.||^2 + hf_weight ||high_pass(.)||^2 (flm.objectives.frequency): the
            pixel-scale part of the update counts (1 + hf_weight) times; 0 (the default) is the paper's loss.
        warmup_steps: tangent warm-up length in training steps (paper: 10k); 0 turns it off.
        logvar_channels: Fourier features of the adaptive-weighting head.
        adaptive_weighting: the paper's learned weight exp(-logvar(t)) (+ logvar(t)) on each sample's loss; False: the
            plain mean of ||.||^2 / D. The weight rescales each time's loss to about one, so a step's size no longer
            shrinks as the error does; with an exact velocity (sCD; sCM with velocity_estimate=batch) that left the
            toy's map 5-15x further from the exact one than without it (docs/quality.md, twenty-ninth day).
        logvar_loss: what that weight weighs: "mean" (||.||^2 / D, the paper's) or "sum" (||.||^2, which starts at the
            zero-initialised head's scale; LogVar says why it matters in short runs).
        label_dropout: probability of the null label (CFG training); classes read from the model.
        cfg_omega: guidance in training (MeanFlow's eq. 19 with kappa = 0, on TrigFlow): dx_t/dt becomes
            omega dx_t/dt + (1 - omega) v_null, one more forward without gradient, in the target and the JVP tangent
            alike; samples whose label was dropped keep dx_t/dt. 1.0 turns it off. v_null is the velocity head's
            sigma_d V(x_t / sigma_d, t | null) with velocity_weight > 0 (the guided flow), else sigma_d F(x_t / sigma_d,
            t | null), which is NOT the guided flow: a consistency model's sigma_d F is not its flow's velocity at
            t > 0 (that is sigma_d F + tan t (x_t + sigma_d dF/dt)). On the class-conditional toy (benchmarks/toy.py
            --classes) the 1-step samples then land on the map of that field, whose guidance is nearly gone
            (docs/quality.md, nineteenth day); it still raised the CPU MNIST run's label accuracy.
        velocity_weight: > 0 trains the model's velocity head (flm.models.dit, velocity_head: the flow's velocity
            from the trunk that computes F, in the same forward) by flow matching on TrigFlow,
            velocity_weight x ||sigma_d V - dx_t/dt||^2 / D with the data's dx_t/dt, and takes guidance in training's
            null velocity from it. 0 (the default): no head.
        jvp_mode: "dual" (one dual pass) or "two_pass" (no-grad JVP pass + gradient pass).
        sigma_max: t_max = arctan(sigma_max / sigma_d) is where sampling starts.
        mid_t: intermediate times for multi-step sampling, used when steps == len(mid_t) + 1
            (paper: (1.1,) for 2 steps); other step counts space times uniformly in t.
        gamma: how much fresh noise multi-step sampling re-noises with (gamma-sampling, as consistency trajectory
            models name it): x_s = cos(s) x0 + sin(s) sigma_d (sqrt(1 - gamma^2) z^ + gamma eps), z^ the noise that the
            previous step's input implies, (x_t - cos(t) x0) / (sin(t) sigma_d). 1 (the paper's sampler): fresh noise
            only; 0: deterministic, the first noise carried through.
        cfg_interval: [t_min, t_max] in TrigFlow time: guidance in training and the sampler's guidance only there;
            null: at every t.
        alpha_steps: (start, end) of the consistency curriculum (flm.objectives.curriculum; the module docstring):
            before end the discrete target of a step alpha t back along the trajectory, no JVP; None: off.
        alpha_min: alpha at alpha_steps[1], where the JVP target takes over.
        velocity_estimate: dx_t/dt of the data: "sample" (cos t z - sin t x0, the paper's) or "batch" (its posterior mean
            over the batch's images, flm.objectives.posterior: far less noisy near t_max, yet on the toy it trained sCM
            1.8x further from the exact map, as sCD's exact velocity does; docs/quality.md).
        velocity_references: with velocity_estimate=batch, this many earlier training images as further references
            (flm.objectives.posterior.ReferenceBank, saved with the objective); 0: the batch alone.
    """

    time_inputs = 1
    sample_steps = 2
    predictions = ("velocity", "data")  # F itself, or the clean image that F is built from (network_output)
    networks = NO_NETWORKS

    def __init__(
        self,
        *,
        sigma_d: float = 0.5,
        p_mean: float = -1.0,
        p_std: float = 1.4,
        tangent_c: float = 0.1,
        hf_weight: float = 0.0,
        warmup_steps: int = 10_000,
        logvar_channels: int = 128,
        adaptive_weighting: bool = True,
        logvar_loss: str = "mean",
        label_dropout: float = 0.1,
        cfg_omega: float = 1.0,
        velocity_weight: float = 0.0,
        jvp_mode: str = "dual",
        sigma_max: float = 80.0,
        mid_t: tuple[float, ...] = (1.1,),
        gamma: float = 1.0,
        cfg_interval: tuple[float, float] | None = None,
        alpha_steps: tuple[int, int] | None = None,
        alpha_min: float = 5e-3,
        velocity_estimate: str = "sample",
        velocity_references: int = 0,
    ):
        super().__init__()
        check_std("sigma_d", sigma_d)
        self.velocity_estimate, self.data_velocity = velocity_estimate, DataVelocity(velocity_estimate, velocity_references)
        check_std("p_std", p_std)
        check_std("sigma_max", sigma_max)
        check_probability("label_dropout", label_dropout)
        if tangent_c < 0 or warmup_steps < 0:
            raise ValueError(f"tangent_c and warmup_steps must be >= 0, got {tangent_c!r} and {warmup_steps!r}")
        self.t_max = math.atan(sigma_max / sigma_d)
        if any(not 0 < t < self.t_max for t in mid_t):
            raise ValueError(f"mid_t values must lie in (0, t_max={self.t_max:.4f}), got {tuple(mid_t)}")
        self.sigma_d, self.p_mean, self.p_std = sigma_d, p_mean, p_std
        self.tangent_c, self.warmup_steps, self.label_dropout = tangent_c, warmup_steps, label_dropout
        self.hf_weight = check_hf_weight(hf_weight)
        if not 0 < cfg_omega < math.inf:
            raise ValueError(f"cfg_omega must be > 0 (guidance in training; 1.0 turns it off), got {cfg_omega!r}")
        self.cfg_omega = float(cfg_omega)
        if not 0 <= velocity_weight < math.inf:
            raise ValueError(f"velocity_weight must be >= 0 (0: no velocity head), got {velocity_weight!r}")
        self.velocity_weight = float(velocity_weight)
        self.jvp_mode = check_jvp_mode(jvp_mode)
        self.mid_t = tuple(float(t) for t in mid_t)
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must lie in [0, 1] (1: fresh noise at each re-noising, 0: none), got {gamma!r}")
        self.gamma = float(gamma)
        self.cfg_interval = check_interval(cfg_interval)
        self.path = TrigFlowPath(sigma_d)
        # None: the plain mean of ||F - F- - g||^2 / D (no learned weight, no parameters)
        self.logvar = LogVar(logvar_channels, logvar_loss) if adaptive_weighting else None
        self.curriculum = build_curriculum(alpha_steps, alpha_min, type(self), SCM)

    @property
    def velocity_head(self) -> bool:
        """Whether the model needs its velocity head (the loop builds it so)."""
        return self.velocity_weight > 0

    def warmup(self, step):
        """min(1, step / warmup_steps); step is an int, or a 0-dim tensor (a CUDA-graph step reads it on the GPU)."""
        return ramp(step, self.warmup_steps)

    def network_output(self, model, x_in, t, y, cfg_scale: float = 1.0):
        """F(x_t / sigma_d, t) at x_in = x_t / sigma_d: the model itself, or built from a data-predicting model's clean
        image (the module docstring; sCD converts a flow-matching network, flm.objectives.distillation)."""
        out = guided(model, x_in, t, None, y, cfg_scale, self.cfg_interval)
        if getattr(unwrap(model), "prediction", "velocity") != "data":
            return out
        x_hat = data_from_velocity(x_in, out, t)  # the DiT returns x^ as the linear path's velocity at (x_in, t)
        return (bcast(torch.cos(t), x_in) * x_in - x_hat) / bcast(torch.sin(t).clamp_min(SIN_MIN), x_in)

    def loss(self, model, x, y=None, *, step=0, phase=None):
        y, y_data = drop_labels(model, y, self.label_dropout), y
        t = lognormal_trigflow(x.shape[0], self.p_mean, self.p_std, self.sigma_d, device=x.device)
        s = self.path.sample(x, torch.randn_like(x), t)
        s.dx_t = self.data_velocity(self.path, x, s, y, y_data, num_classes(model), step)
        dx_t = s.dx_t if self.cfg_omega == 1.0 else self.guided_dxdt(model, s.x_t, t, s.dx_t, y)
        velocity_target = s.dx_t if self.velocity_head else None
        alpha = self.alpha(step, phase)
        return self.consistency_loss(model, s.x_t, t, dx_t, y, step, velocity_target=velocity_target, alpha=alpha)

    @torch.no_grad()
    def guided_dxdt(self, model, x_t, t, dx_t, y):
        """omega dx_t/dt + (1 - omega) sigma_d F(x_t / sigma_d, t | null) (cfg_omega; not the guided flow's velocity,
        see the class docstring), where y (after label dropout) is not the null class and t lies in cfg_interval;
        dx_t/dt elsewhere."""
        if y is None or num_classes(model) == 0:
            raise ValueError(
                f"guidance in training (cfg_omega={self.cfg_omega}) needs a class-conditional model and labels; "
                "set objective.cfg_omega=1.0"
            )
        null = null_labels(model, y)
        if self.velocity_head:
            v_null = self.sigma_d * model(x_t / self.sigma_d, t, None, null, head="velocity").float()
        else:
            v_null = self.sigma_d * self.network_output(model, x_t / self.sigma_d, t, null).float()
        v = self.cfg_omega * dx_t + (1 - self.cfg_omega) * v_null
        keep = bcast((y == null) | ~in_interval(t, self.cfg_interval), v)
        return torch.where(keep, dx_t, v)

    def consistency_loss(
        self, model, x_t, t, dx_t, y, step, target=None, hf_weight=None, velocity_target=None, alpha=None, boundary=None
    ):
        """Algorithm 1's loss at (x_t, t) with dx_t/dt = dx_t: the data's (sCT) or a teacher's (sCD). target: F's
        explicit target for the batch's first len(target) samples (sCD's one_step_frac), in place of F- + g.
        hf_weight: squared_error's, a number or one per sample, in place of self.hf_weight. velocity_target: the
        velocity head's flow-matching target (velocity_weight > 0), from the same forward as F. alpha: the consistency
        curriculum's (g from a step alpha t back, no JVP); None: the JVP's g. boundary: sCD's (weight, mask, f_target)
        (flm.objectives.distillation.SCD.boundary): weight x the masked samples' mean ||f - f_target||^2 / D is added,
        with the same pixel-scale weight as the consistency term."""
        sigma_d = self.sigma_d
        if velocity_target is None:
            fn = lambda x_in, t_in: self.network_output(model, x_in, t_in, y)  # noqa: E731
        else:  # F and the velocity head stacked on the channels: one forward, one JVP (the head's tangent unused)
            fn = lambda x_in, t_in: model(x_in, t_in, None, y, head="both")  # noqa: E731
        F, cs_dFdt = self.jvp_F(fn, x_t, t, dx_t) if alpha is None else (fn(x_t / sigma_d, t), None)
        if velocity_target is not None:
            F, V = F.chunk(2, dim=1)
            cs_dFdt = None if cs_dFdt is None else cs_dFdt.chunk(2, dim=1)[0]
        F_minus = F.detach().float()
        if alpha is None:
            g = self.tangent(F_minus, cs_dFdt.float(), x_t, t, dx_t, step)
        else:
            g = self.discrete_tangent(model, F_minus, x_t, t, dx_t, y, alpha)
        g_norm = g.flatten(1).norm(dim=1)
        g = g / bcast(g_norm + self.tangent_c, g)

        err = F.float() - F_minus - g
        metrics = {}
        if target is not None:
            k = len(target)
            err = torch.cat([F[:k].float() - target, err[k:]])
            metrics["one_step_mse"] = err[:k].detach().square().mean()
        hf_weight = self.hf_weight if hf_weight is None else hf_weight
        sq = squared_error(err, hf_weight) / err[0].numel()  # ||.||^2 / D per sample (pixel-scale part weighted)
        loss = sq.mean() if self.logvar is None else self.logvar.weigh(sq, t, err[0].numel()).mean()
        if velocity_target is not None:
            velocity_mse = (sigma_d * V.float() - velocity_target).square().mean()
            loss = loss + self.velocity_weight * velocity_mse
            metrics["velocity_mse"] = velocity_mse.detach()
        if boundary is not None:
            weight, mask, f_target = boundary
            # measured as the consistency term is (its pixel-scale weight too), so hf_weight keeps their balance
            diff = consistency_value(x_t, t, sigma_d * F) - f_target
            per_sample = squared_error(diff, hf_weight) / diff[0].numel()
            boundary_mse = (mask * per_sample).sum() / mask.sum().clamp_min(1)
            loss = loss + weight * boundary_mse
            metrics["boundary_mse"] = boundary_mse.detach()
        mse = err.detach().square().mean()
        if alpha is not None:
            metrics["alpha"] = alpha_metric(alpha, x_t.device)
        return loss, {"loss": loss.detach(), "mse": mse, "tangent_norm": g_norm.detach().mean(), **metrics}

    def jvp_F(self, fn, x_t, t, dx_t):
        """(F, cos t sin t dF/dt) of F = fn(x_t / sigma_d, t) along dx_t/dt = dx_t, by the JVP rearrangement: tangents
        pre-multiplied by cos t sin t give cos t sin t dF/dt directly."""
        cos_sin = torch.cos(t) * torch.sin(t)
        tangents = (bcast(cos_sin, x_t) * dx_t / self.sigma_d, cos_sin)
        return jvp(fn, (x_t / self.sigma_d, t), tangents, mode=self.jvp_mode)

    def tangent(self, F_minus, cs_dFdt, x_t, t, dx_t, step):
        """Algorithm 1's g before its normalisation, from F- and cos t sin t dF-/dt (fp32)."""
        flow, consistency = self.tangent_parts(F_minus, cs_dFdt, x_t, t, dx_t)
        return flow - self.warmup(step) * consistency

    @torch.no_grad()
    def discrete_tangent(self, model, F_minus, x_t, t, dx_t, y, alpha):
        """The curriculum's g = cos t (f-(x_t, t) - f-(x_s, s)) / (t - s) at s = (1 - alpha) t: g is cos t df-/dt
        (Algorithm 1's g at full warm-up), here by a finite difference. x_s is the DDIM step from x_t along dx_t, x_s =
        cos s x0' + sin s z' with the x0' = cos t x_t - sin t dx_t and z' = sin t x_t + cos t dx_t that (x_t, dx_t)
        imply: the sample's own path point for the data's dx_t/dt, the guided trajectory with guidance in training. At
        alpha = 1, s = 0 and f(x_0, 0) = x0': the clean image itself."""
        x_t32, v = x_t.float(), dx_t.float()
        cos_t, sin_t = bcast(torch.cos(t), v), bcast(torch.sin(t), v)
        s = (1 - alpha) * t
        cos_s, sin_s = bcast(torch.cos(s), v), bcast(torch.sin(s), v)
        x_s = cos_s * consistency_value(x_t32, t, v) + sin_s * (sin_t * x_t32 + cos_t * v)
        F_s = self.network_output(model, (x_s / self.sigma_d).to(x_t.dtype), s, y).float()
        # at s = 0 (alpha = 1) the boundary condition f(x, 0) = x, whatever F does there (a 1 / sin s of its own)
        f_s = torch.where(bcast(s > 0, v), consistency_value(x_s, s, self.sigma_d * F_s), x_s)
        f_t = consistency_value(x_t32, t, self.sigma_d * F_minus)
        return cos_t * (f_t - f_s) / bcast(t - s, v)

    def tangent_parts(self, F_minus, cs_dFdt, x_t, t, dx_t):
        """g's flow-matching part -cos^2 t (sigma_d F- - dx_t/dt) and its consistency part cos t sin t x_t + sigma_d
        cos t sin t dF-/dt, which the warm-up scales: g = flow - warmup * consistency."""
        cos_t, sin_t = bcast(torch.cos(t), x_t), bcast(torch.sin(t), x_t)
        flow = -cos_t.square() * (self.sigma_d * F_minus - dx_t)
        return flow, cos_t * sin_t * x_t + self.sigma_d * cs_dFdt

    def consistency_fn(self, model, x_t, t, y, cfg_scale: float = 1.0):
        """f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t), t a python float."""
        F = self.network_output(model, x_t / self.sigma_d, torch.full((x_t.shape[0],), t, device=x_t.device), y, cfg_scale)
        return math.cos(t) * x_t - math.sin(t) * self.sigma_d * F.float()

    def sample_times(self, steps: int) -> list[float]:
        if not (isinstance(steps, int) and steps >= 1):
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        if steps == len(self.mid_t) + 1:
            return [self.t_max, *self.mid_t]
        return torch.linspace(self.t_max, 0.0, steps + 1)[:-1].tolist()

    @torch.no_grad()
    def sample(self, model, noise, y=None, *, steps: int, cfg_scale: float = 1.0, generators=None):
        """x0 from noise ~ N(0, I) in `steps` consistency steps.

        generators: one torch.Generator per image for the re-noising of multi-step sampling (image k's
        noise then depends only on generators[k]); None draws it from the global RNG.
        """
        check_cfg(model, y, cfg_scale)
        if generators is not None and len(generators) != noise.shape[0]:
            raise ValueError(f"got {len(generators)} generators for {noise.shape[0]} images; pass one per image")
        times = self.sample_times(steps)
        x_t = self.sigma_d * noise.float()
        x0 = self.consistency_fn(model, x_t, times[0], y, cfg_scale)
        for t_prev, t in zip(times, times[1:]):
            if self.gamma > 0:
                eps = (
                    torch.randn(noise.shape, device=noise.device)
                    if generators is None
                    else randn_per_image(generators, noise.shape[1:], device=noise.device)
                )
            if self.gamma < 1:
                implied = (x_t - math.cos(t_prev) * x0) / (math.sin(t_prev) * self.sigma_d)
                eps = implied if self.gamma == 0 else math.sqrt(1 - self.gamma**2) * implied + self.gamma * eps
            x_t = math.cos(t) * x0 + math.sin(t) * self.sigma_d * eps
            x0 = self.consistency_fn(model, x_t, t, y, cfg_scale)
        return x0
