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

rCM: sCD's loss plus dmd_weight times DMD's score regulariser on the student's one-step samples
x_g = f(sigma_d eps, t_max), with a fake-score network trained online on them (flm.objectives.dmd, which
MeanFlow's student shares: flm.objectives.meanflow.MeanFlowDMD).

    from flm.objectives import SCD, RCM
    scd = SCD(teacher="outputs/fm-run", teacher_cfg_scale=2.0)   # the loop builds scd.networks
    loss, metrics = scd.loss(model, x, y, step=step, teacher=teacher)
    images = scd.sample(model, torch.randn_like(x), y, steps=2)      # needs no teacher file
"""

import functools

import torch

from flm.objectives.consistency import SCM
from flm.objectives.dmd import DMDRegularised
from flm.objectives.guidance import drop_labels, guided
from flm.objectives.paths import lognormal_trigflow
from flm.objectives.protocol import Network
from flm.objectives.teacher import flow_time, load_teacher, teacher_velocity, trigflow_velocity


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
        **kwargs: SCM's (sigma_d, p_mean, p_std, tangent_c, warmup_steps, ...).
    """

    def __init__(self, *, teacher: str, teacher_cfg_scale: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        if self.cfg_omega != 1.0:
            raise ValueError(
                "a teacher's guidance (objective.teacher_cfg_scale) replaces guidance in training; keep "
                f"objective.cfg_omega=1.0 with a teacher, got {self.cfg_omega}"
            )
        if not teacher:
            raise ValueError("objective.teacher is not set; pass objective.teacher=<flow-matching run folder or .pt>")
        self.teacher, self.teacher_cfg_scale = str(teacher), check_teacher_cfg(teacher_cfg_scale)
        self.networks = {"teacher": Network(build=functools.partial(load_teacher, self.teacher), model_init=True)}

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

    def loss(self, model, x, y=None, *, step=0, teacher):
        y = drop_labels(model, y, self.label_dropout)
        t = lognormal_trigflow(x.shape[0], self.p_mean, self.p_std, self.sigma_d, device=x.device)
        x_t = self.path.sample(x, torch.randn_like(x), t).x_t
        return self.consistency_loss(model, x_t, t, self.teacher_dxdt(teacher, x_t, t, y), y, step)


class RCM(DMDRegularised, SCD):
    """rCM: sCD plus the DMD score regulariser (flm.objectives.dmd), with an online fake-score network.

    Args: DMDRegularised's (dmd_weight, dmd_t_mean, dmd_t_std, fake_updates, fake_lr) and SCD's (teacher,
    teacher_cfg_scale: the DMD's real score is the guided teacher too, and sCM's).
    """

    def generate(self, model, x, y):
        """The student's one-step samples x_g = f(sigma_d eps, t_max), with the model's gradient."""
        return self.consistency_fn(model, self.sigma_d * torch.randn_like(x), self.t_max, y)
