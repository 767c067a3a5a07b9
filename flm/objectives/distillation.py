"""Distilling a flow-matching teacher into a 1-2-step student on TrigFlow: sCD (continuous-time
consistency distillation, Lu & Song 2024, arXiv 2410.11081) and rCM (sCD plus a DMD score regulariser).

The student is a flow-matching network like its teacher (the same model_args, time_inputs=1) and starts
from the teacher's weights (its EMA). sCM's TrigFlow network output is read through the time conversion
of flm.objectives.teacher:

    F(x_t / sigma_d, t) = trigflow_velocity(v_theta, x_t, t, sigma_d) / sigma_d

so at initialisation the student's consistency function f(x_t, t) = cos(t) x_t - sin(t) sigma_d F is the
teacher's x-prediction x_s - s v at s = s(t), and sampling with sCM's sampler works on a student as on
an sCM model.

sCD: sCM's loss (flm.objectives.consistency.SCM.consistency_loss) at x_t = cos(t) x + sin(t) sigma_d eps
with dx_t/dt from the teacher, sigma_d F_teacher(x_t / sigma_d, t), in place of the data's cos(t) z -
sin(t) x; the teacher's velocity carries its classifier-free guidance (teacher_cfg_scale), which the
student thereby learns to produce at cfg_scale = 1. Labels dropped to the null class get the unguided
null velocity.

The 1-step sampler's own time (`one_step_frac`, off by default): sCD's proposal almost never draws t near t_max,
where the 1-step sampler starts, and there sCM's tangent g carries the factor cos t (~0.006 at t_max), so the
continuous loss hardly trains the map the 1-step FID comes from. A fixed share of each batch (its first samples) takes
t = t_max and an explicit target instead, a long-jump consistency distillation step: the teacher's ODE from x_t down
to s (`one_step_mid`, the MNIST preset's 2-step sampler's time 0.8 by default) in `teacher_steps` Euler steps of its
flow-matching velocity (uniform in flow-matching time; an Euler step there is DDIM's step in TrigFlow,
x_s = cos(t - s) x_t - sin(t - s) dx_t/dt), then the student's own consistency function there, without gradient:

    f(x_t, t_max) -> sg(f(x_s, s)),   i.e. F -> F_tgt = (cos t x_t - sg(f(x_s, s))) / (sin t sigma_d)

under the same adaptive weight exp(-logvar(t)). It costs teacher_steps - 1 teacher forwards and one student forward
on those samples (the first teacher step reuses dx_t/dt). `one_step_ema` takes f(x_s, s) from the student's EMA, a
target network: the student's own f feeds its errors back (on the H200 the samples turned to speckle noise).

rCM: sCD's loss plus dmd_weight times DMD's score regulariser on the student's one-step samples
x_g = f(sigma_d eps, t_max), with a fake-score network trained online on them (flm.objectives.dmd, which
MeanFlow's student shares: flm.objectives.meanflow.MeanFlowDMD).

    from flm.objectives import SCD, RCM
    scd = SCD(teacher="outputs/fm-run", teacher_cfg_scale=2.0)   # the loop builds scd.networks
    loss, metrics = scd.loss(model, x, y, step=step, teacher=teacher)
    images = scd.sample(model, torch.randn_like(x), y, steps=2)      # needs no teacher file
"""

import functools
import math

import torch

from flm.objectives.adversarial import AdversarialRegularised
from flm.objectives.checks import (
    check_hf_weight_one_step,
    check_probability,
    check_sampler_shares,
    check_target_ema,
    check_teacher_steps,
)
from flm.objectives.consistency import SCM, consistency_value
from flm.objectives.dmd import DMDRegularised
from flm.objectives.frequency import first_k_hf_weight
from flm.objectives.guidance import drop_labels, guided
from flm.objectives.paths import lognormal_trigflow
from flm.objectives.protocol import Network
from flm.objectives.teacher import check_teacher_ema, flow_time, load_teacher, teacher_velocity, trigflow_velocity


def check_teacher_cfg(cfg_scale: float) -> float:
    if not cfg_scale >= 1.0:
        raise ValueError(f"teacher_cfg_scale must be >= 1.0 (1.0: no guidance), got {cfg_scale!r}")
    return float(cfg_scale)


class SCD(SCM):
    """sCD: sCM's loss with the teacher's dx_t/dt; sCM's sampler.

    Args:
        teacher: a flow-matching run folder (its latest checkpoint) or checkpoint file; read when
            training starts, never by sample.py or evaluate.py.
        teacher_cfg_scale: the teacher's classifier-free guidance baked into the student (1.0: none).
        teacher_ema: which of the teacher run's EMAs the teacher (and the student's start) takes: a decay such as
            0.99 or a name; None: the run's first (0.999 for the mnist presets, whose FIDs are quoted at 0.99).
        one_step_frac: this fraction of each batch (a fixed count, its first samples) takes t = t_max, the 1-step
            sampler's time, with one_step_target's target; 0 (the default) is sCD's loss.
        one_step_target: "jump", the long-jump target of the module docstring, or "consistency", sCD's own loss
            there: the 1-step sampler's time trained as often as one_step_frac says (sCD's proposal draws t within
            0.05 of t_max for ~1 % of a batch), with no teacher ODE.
        two_step_frac: the next fraction of each batch takes the 2-step sampler's second time mid_t (each of mid_t
            in turn when it holds several), with sCD's own loss; 0: off.
        one_step_mid: the time s the teacher's ODE runs down to for that target (on the CPU 0.3-0.8 did equally
            well; at 1.1 one of two seeds degraded: docs/quality.md).
        teacher_steps: Euler steps of the teacher from t_max down to one_step_mid.
        one_step_ema: the consistency function at one_step_mid from the model's EMA at this decay (one of
            trainer.ema_decays; consistency distillation's target network) instead of the model itself (None).
        hf_weight_one_step: hf_weight (flm.objectives.frequency) for the one_step_frac samples alone; None: hf_weight.
        one_step_solver: the teacher's ODE solver for that target: "euler" (teacher_steps - 1 teacher forwards) or
            "heun" (second order, 2 teacher_steps - 1 forwards).
        boundary_weight: x the mean over the samples at flow-matching time below boundary_time of ||f(x_t, t) -
            f_teacher(x_t, t)||^2 / D, added to the loss: the student's consistency function regressed on the teacher's
            x-prediction where the two coincide (at s -> 0 both are x_s). It gives a data-predicting student
            (model.prediction=data, which needs it and adaptive_weighting=False) the boundary condition f(x, 0) = x that
            a velocity student has by construction. With the adaptive weighting on, the student's x^ drifted from the
            teacher's at any weight tried (up to 100): the learned weight scales sCM's loss up where it is small. 0: off.
        boundary_time: that flow-matching time s.
        **kwargs: SCM's (sigma_d, p_mean, p_std, tangent_c, warmup_steps, ...); logvar_loss defaults to "sum" here
            (its CPU student landed 21-38 % closer to the teacher's solution than with the paper's "mean",
            docs/quality.md, thirtieth day).
    """

    # a data-predicting student's consistency function x_s - s v is its output x^ at every t, so nothing ties f(x, 0) to x:
    # the loss (df/dt = 0 alone) let x^ drift (|x^| 4 -> 54 in 400 CPU steps; H200 1-step FID 368, docs/quality.md,
    # fifteenth day). A velocity student has f -> x_s as s -> 0 by construction; a data-predicting one takes the
    # boundary condition back from boundary_weight's regression, without the adaptive weighting, which outruns it (the
    # instance's predictions then include "data"; docs/quality.md, thirty-sixth day).
    predictions = ("velocity",)

    def __init__(
        self,
        *,
        teacher: str,
        teacher_cfg_scale: float = 1.0,
        teacher_ema: float | str | None = None,
        one_step_frac: float = 0.0,
        one_step_target: str = "jump",
        two_step_frac: float = 0.0,
        one_step_mid: float = 0.8,
        teacher_steps: int = 8,
        one_step_ema: float | None = None,
        hf_weight_one_step: float | None = None,
        one_step_solver: str = "euler",
        boundary_weight: float = 0.0,
        boundary_time: float = 0.05,
        **kwargs,
    ):
        if kwargs.get("alpha_steps") is not None:
            # the finite difference over the teacher's DDIM step left the toy's student 2-4x further from the exact map
            # in 2 of 3 seeds (docs/quality.md, twenty-eighth day)
            raise ValueError(
                "alpha_steps (the consistency curriculum) is sCM's and MeanFlow's, not sCD's: on the toy it drove the "
                "distilled student away from the exact map (docs/quality.md); set objective.alpha_steps=null"
            )
        if kwargs.get("velocity_estimate", "sample") != "sample" or kwargs.get("velocity_references"):
            raise ValueError(
                "velocity_estimate estimates the data's dx_t/dt from the batch, and sCD takes the teacher's: set "
                "objective.velocity_estimate=sample"
            )
        super().__init__(**{"logvar_loss": "sum", **kwargs})
        check_sampler_shares(one_step_frac, two_step_frac)
        if one_step_target not in ("jump", "consistency"):
            raise ValueError(
                f"one_step_target must be 'jump' (the teacher's ODE, then the student's map) or 'consistency' (sCD's "
                f"own loss at t_max), got {one_step_target!r}"
            )
        self.one_step_target_kind, self.two_step_frac = one_step_target, float(two_step_frac)
        if not (isinstance(one_step_mid, (int, float)) and 0 < one_step_mid < self.t_max):
            raise ValueError(f"one_step_mid must lie in (0, t_max={self.t_max:.4f}), got {one_step_mid!r}")
        self.one_step_frac, self.one_step_mid = float(one_step_frac), float(one_step_mid)
        self.teacher_steps = check_teacher_steps(teacher_steps)
        if one_step_ema is not None and not (isinstance(one_step_ema, float) and 0 < one_step_ema < 1):
            raise ValueError(f"one_step_ema must be an EMA decay in (0, 1) or null (the model itself), got {one_step_ema!r}")
        # the loop passes the EMA of this decay to loss() as `ema` (flm.train.loop.build_state)
        self.target_ema_decay = one_step_ema if self.one_step_frac and one_step_target == "jump" else None
        self.hf_weight_one_step = check_hf_weight_one_step(hf_weight_one_step, one_step_frac)
        if one_step_solver not in ("euler", "heun"):
            raise ValueError(f"one_step_solver must be 'euler' or 'heun', got {one_step_solver!r}")
        self.one_step_solver = one_step_solver
        if not (isinstance(boundary_weight, (int, float)) and boundary_weight >= 0):
            raise ValueError(f"boundary_weight must be a number >= 0 (0: off), got {boundary_weight!r}")
        if not (isinstance(boundary_time, (int, float)) and 0 < boundary_time < 1):
            raise ValueError(f"boundary_time must be a flow-matching time in (0, 1), got {boundary_time!r}")
        self.boundary_weight, self.boundary_time = float(boundary_weight), float(boundary_time)
        if self.boundary_weight and self.logvar is None:
            self.predictions = ("velocity", "data")
        if self.cfg_omega != 1.0 or self.velocity_weight:
            raise ValueError(
                "a teacher's guidance (objective.teacher_cfg_scale) replaces guidance in training and its velocity "
                f"head; keep objective.cfg_omega=1.0 and objective.velocity_weight=0 with a teacher, got "
                f"{self.cfg_omega} and {self.velocity_weight}"
            )
        if not teacher:
            raise ValueError("objective.teacher is not set; pass objective.teacher=<flow-matching run folder or .pt>")
        self.teacher, self.teacher_cfg_scale = str(teacher), check_teacher_cfg(teacher_cfg_scale)
        self.teacher_ema = check_teacher_ema(teacher_ema)
        build = functools.partial(load_teacher, self.teacher, ema=self.teacher_ema)
        self.networks = {"teacher": Network(build=build, model_init=True, bf16_on_cuda=True)}

    def network_output(self, model, x_in, t, y, cfg_scale: float = 1.0):
        """F of a flow-matching network (the module docstring; guidance is linear, so it commutes). The guidance
        interval is in TrigFlow time, as sCM's: the network sees it at the flow-matching times it maps to."""
        interval = (
            None
            if self.cfg_interval is None
            else tuple(flow_time(torch.tensor(v, dtype=torch.float64), self.sigma_d).item() for v in self.cfg_interval)
        )
        velocity = lambda x_s, s: guided(model, x_s, s, None, y, cfg_scale, interval)  # noqa: E731
        return trigflow_velocity(velocity, self.sigma_d * x_in, t, self.sigma_d) / self.sigma_d

    def teacher_dxdt(self, teacher, x_t, t, y):
        """The teacher's dx_t/dt at (x_t, t) (guided, no gradient)."""
        velocity = lambda x_s, s: teacher_velocity(teacher, x_s, s, y, self.teacher_cfg_scale)  # noqa: E731
        return trigflow_velocity(velocity, x_t, t, self.sigma_d)

    def loss(self, model, x, y=None, *, step=0, teacher, ema=None):
        y = drop_labels(model, y, self.label_dropout)
        t = self.sampler_times(lognormal_trigflow(x.shape[0], self.p_mean, self.p_std, self.sigma_d, device=x.device))
        k = round(self.one_step_frac * len(t))
        x_t = self.path.sample(x, torch.randn_like(x), t).x_t
        dx_t = self.teacher_dxdt(teacher, x_t, t, y)
        target = None
        if k and self.one_step_target_kind == "jump":
            target_net = model
            if self.target_ema_decay is not None:
                check_target_ema(ema, self.target_ema_decay, f"objective.one_step_ema={self.target_ema_decay:g}")
                target_net = ema
            target = self.one_step_target(target_net, teacher, x_t[:k], dx_t[:k], None if y is None else y[:k])
        hf_weight = first_k_hf_weight(len(t), k, self.hf_weight, self.hf_weight_one_step, x.device)
        return self.consistency_loss(
            model, x_t, t, dx_t, y, step, target=target, hf_weight=hf_weight, boundary=self.boundary(x_t, t, dx_t)
        )

    def sampler_times(self, t: torch.Tensor) -> torch.Tensor:
        """t with its first round(one_step_frac n) entries at t_max and the next round(two_step_frac n) at mid_t (cycled):
        fixed counts, so every step has the same shapes (a CUDA graph replays it)."""
        n = len(t)
        k1, k2 = round(self.one_step_frac * n), round(self.two_step_frac * n)
        if not (k1 or k2):
            return t
        t = t.clone()  # filled in place from python floats: no host-to-device copy inside a CUDA-graph capture
        t[:k1] = self.t_max
        for i, mid in enumerate(self.mid_t):
            t[k1 + i : k1 + k2 : len(self.mid_t)] = mid
        return t

    def boundary(self, x_t, t, dx_t):
        """(weight, mask, f_teacher) of boundary_weight's regression: the samples below boundary_time (a float mask:
        no host sync) and the teacher's consistency function there, cos t x_t - sin t dx_t/dt (its x-prediction);
        None when off."""
        if not self.boundary_weight:
            return None
        mask = (flow_time(t, self.sigma_d) < self.boundary_time).float()
        return self.boundary_weight, mask, consistency_value(x_t, t, dx_t)

    def one_step_flow_times(self) -> torch.Tensor:
        """The flow-matching times s(t_max), ..., s(one_step_mid) of the teacher's ODE steps, uniform (float64)."""
        ends = flow_time(torch.tensor([self.t_max, self.one_step_mid], dtype=torch.float64), self.sigma_d)
        return torch.linspace(ends[0].item(), ends[1].item(), self.teacher_steps + 1, dtype=torch.float64)

    def one_step_times(self) -> list[float]:
        """The same steps' TrigFlow times t_max, ..., one_step_mid."""
        s = self.one_step_flow_times()
        return torch.atan(s / (self.sigma_d * (1 - s))).tolist()  # tan t = s / (sigma_d (1 - s)) inverts flow_time

    @torch.no_grad()
    def one_step_target(self, model, teacher, x_t, dx_t, y):
        """F_tgt of the samples at t_max: the teacher's ODE to one_step_mid, then model's f there (module docstring);
        model: the student or its EMA (one_step_ema). The ODE runs in flow-matching coordinates z = x / c(t),
        c(t) = cos t + sigma_d sin t, at the flow-matching times s(t), uniform; its first velocity is read off dx_t."""
        sigma_d, t_max, s = self.sigma_d, self.t_max, self.one_step_flow_times().tolist()
        c = lambda t: math.cos(t) + sigma_d * math.sin(t)  # noqa: E731
        x_t = x_t.float()
        z = x_t / c(t_max)
        v = dx_t.float() * c(t_max) / sigma_d - (math.cos(t_max) - math.sin(t_max) / sigma_d) * x_t  # inverts trigflow_velocity
        velocity = lambda z, s_: teacher_velocity(teacher, z, z.new_full((len(z),), s_), y, self.teacher_cfg_scale)  # noqa: E731
        for i in range(self.teacher_steps):
            h = s[i + 1] - s[i]
            if i:
                v = velocity(z, s[i])
            z_next = z + h * v  # Euler (DDIM's step in TrigFlow)
            if self.one_step_solver == "heun":  # the trapezoid with Euler's end: second order, one more forward
                z_next = z + h * (v + velocity(z_next, s[i + 1])) / 2
            z = z_next
        f_mid = self.consistency_fn(model, c(self.one_step_mid) * z, self.one_step_mid, y)
        return (math.cos(t_max) * x_t - f_mid) / (math.sin(t_max) * sigma_d)


class RCM(DMDRegularised, SCD):
    """rCM: sCD plus the DMD score regulariser (flm.objectives.dmd), with an online fake-score network.

    Args:
        dmd_two_step_frac: the share of the generated samples (DMD's and the fake score's) that the 2-step sampler
            draws, the batch's first round(frac B): the jump from t_max without gradient, fresh noise to mid_t[0], then
            the jump from there with it (DMD2's backward simulation). DMD then matches the distribution the 2-step FID
            is taken on too; 0 (the default): every sample one step.
        DMDRegularised's (dmd_weight, dmd_t_mean, dmd_t_std, fake_updates, fake_lr, fake_betas, fake_weight_decay,
        dmd_start) and SCD's (teacher, teacher_cfg_scale: the DMD's real score is the guided teacher too, and sCM's).
    """

    def __init__(self, *, dmd_two_step_frac: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        check_probability("dmd_two_step_frac", dmd_two_step_frac)
        if dmd_two_step_frac and not self.mid_t:
            raise ValueError(
                "dmd_two_step_frac > 0 draws samples with the 2-step sampler, which needs its intermediate time: set "
                "objective.mid_t=[t] (a TrigFlow time in (0, t_max)) or objective.dmd_two_step_frac=0"
            )
        self.dmd_two_step_frac = dmd_two_step_frac

    def generate(self, model, x, y):
        """The student's samples x_g, with the model's gradient in their last jump: f(sigma_d eps, t_max), and for the
        first round(dmd_two_step_frac B) f(cos m x0 + sin m sigma_d eps', m) after x0 = sg(f(sigma_d eps, t_max)),
        m = mid_t[0]. One network call with the gradient either way: fixed shapes (a CUDA graph replays it)."""
        eps = self.sigma_d * torch.randn_like(x)
        k = round(self.dmd_two_step_frac * len(x))
        if not k:
            return self.consistency_fn(model, eps, self.t_max, y)
        mid = self.mid_t[0]
        with torch.no_grad():
            x0 = self.consistency_fn(model, eps[:k], self.t_max, None if y is None else y[:k])
        x_mid = math.cos(mid) * x0 + math.sin(mid) * self.sigma_d * torch.randn_like(x0)
        x_in = torch.cat([x_mid.to(eps.dtype), eps[k:]])
        t = torch.full((len(x),), self.t_max, device=x.device)
        t[:k] = mid  # from a python float: no host-to-device copy inside a capture
        return consistency_value(x_in, t, self.sigma_d * self.network_output(model, x_in / self.sigma_d, t, y))


class RCMGAN(AdversarialRegularised, RCM):
    """rCM plus an adversarial loss on the student's one-step samples against the data, with an online discriminator
    (flm.objectives.adversarial): DMD2's two regularisers on the sCD student. The adversarial term and the
    discriminator's updates run in rCM's student steps with DMD (from dmd_start; not in the fake score's steps).

    Args: AdversarialRegularised's (adv_weight, adv_frac, disc_lr, r1_gamma, disc_backbone, ...) and RCM's.
    """
