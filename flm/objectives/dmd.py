"""DMD's score regulariser (distribution matching distillation, Yin et al. 2024) for a distilled few-step
student, with the online fake-score network it needs: rCM (sCD + DMD, flm.objectives.distillation.RCM)
and MeanFlow + DMD (flm.objectives.distillation.MeanFlowDMD) share it.

On the student's one-step samples x_g (its `generate`, with the model's gradient), in flow-matching time:

    x_s = (1 - s) x_g + s eps',   s ~ logit-normal(dmd_t_mean, dmd_t_std)
    x_real = x_s - s v_teacher(x_s, s),   x_fake = x_s - s v_fake(x_s, s)          (x-predictions, no gradient)
    grad = (x_fake - x_real) / mean|x_g - x_real|                                   (DMD's normalisation)
    L_dmd = ||x_g - sg(x_g - grad)||^2 / (2 D),   whose gradient in x_g is grad / D

added to the student's loss times dmd_weight (the distillation loss itself times distill_weight). The fake
score (the teacher at the start) learns the student's distribution by flow matching on sg(x_g):
||v_fake(x_s, s) - (eps' - x_g)||^2, either in steps of
its own (`fake_updates` >= 1 of them, then one student step: `phase`) or, with fake_updates = 0, in the
student's step itself, from the same forward pass at x_s whose value the DMD gradient uses. The fake score
has its own optimizer (fake_lr) and is saved in the checkpoint; the teacher is not.
"""

import functools
import math
from collections.abc import Sequence

import torch

from flm.objectives.checks import check_std
from flm.objectives.paths import LinearPath, bcast, logit_normal
from flm.objectives.protocol import Network
from flm.objectives.teacher import load_teacher, teacher_velocity


def fake_score_optim(lr, betas=None, weight_decay=None) -> dict:
    """The fake score's optimizer settings that differ from optim.*'s (None: optim.*'s), checked."""
    if not 0 < lr < math.inf:
        raise ValueError(f"fake_lr must be a finite number > 0, got {lr!r}")
    optim = {"lr": lr}
    if betas is not None:
        betas = tuple(betas) if isinstance(betas, Sequence) and not isinstance(betas, str) else (betas,)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"fake_betas must be two numbers in [0, 1) (AdamW's betas), got {betas!r}")
        optim["betas"] = tuple(float(b) for b in betas)
    if weight_decay is not None:
        if not 0 <= weight_decay < math.inf:
            raise ValueError(f"fake_weight_decay must be a number >= 0, got {weight_decay!r}")
        optim["weight_decay"] = float(weight_decay)
    return optim


def dmd_gradient(x_g: torch.Tensor, x_real: torch.Tensor, x_fake: torch.Tensor) -> torch.Tensor:
    """DMD's gradient in the samples x_g: (x_fake - x_real) over each sample's mean |x_g - x_real| (no gradient)."""
    return (x_fake - x_real) / bcast((x_g.detach() - x_real).abs().flatten(1).mean(1), x_g)


class DMDRegularised:
    """Mixin before a distillation objective (one with a `teacher` network and a loss(model, x, y, *, step,
    teacher)): adds the DMD term, the fake-score network and the alternation. The class that mixes it in
    defines generate(model, x, y): the student's one-step samples from fresh noise, shaped like x, with the
    model's gradient.

    Args:
        dmd_weight: weight of the DMD surrogate in the student's loss.
        dmd_t_mean, dmd_t_std: logit-normal time of the noised student samples (DMD and fake score).
        fake_updates: fake-score updates per student update (they alternate, the fake score first); 0 updates
            the fake score in every student step instead, at no extra student forward.
        dmd_start: steps of the distillation alone before DMD and the fake score's updates start (as rCM trains: its
            fake score and DMD term wait for the consistency warm-up): no DMD forwards and no fake-score steps, so
            every step updates the student; the fake score starts from the teacher then.
        distill_weight: the distillation loss's weight in the student's steps with DMD (those before dmd_start take
            it whole). 0: DMD alone from then on (DMD2's student, warm-started by the distillation before dmd_start),
            whose steps skip the distillation loss's passes (sCD's JVP, MeanFlow's).
        fake_lr: the fake score's learning rate.
        fake_betas, fake_weight_decay: its AdamW's betas and weight decay; None: optim.*'s (its other settings are
            always optim.*'s).
        **kwargs: the distillation objective's (teacher, teacher_cfg_scale, ...).
    """

    def __init__(
        self,
        *,
        dmd_weight: float = 0.01,
        dmd_t_mean: float = 0.0,
        dmd_t_std: float = 1.0,
        fake_updates: int = 1,
        fake_lr: float = 1e-4,
        fake_betas: tuple[float, float] | None = None,
        fake_weight_decay: float | None = None,
        dmd_start: int = 0,
        distill_weight: float = 1.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_std("dmd_t_std", dmd_t_std)
        if not (dmd_weight >= 0 and isinstance(fake_updates, int) and fake_updates >= 0):
            raise ValueError(
                f"DMD needs dmd_weight >= 0 and an integer fake_updates >= 0 (0: the fake score updates in the "
                f"student's step), got {dmd_weight!r} and {fake_updates!r}"
            )
        if isinstance(dmd_start, bool) or not isinstance(dmd_start, int) or dmd_start < 0:
            raise ValueError(
                f"dmd_start must be an integer >= 0 (steps of distillation alone; 0: DMD from the start), got {dmd_start!r}"
            )
        if not 0 <= distill_weight < math.inf or not (distill_weight or dmd_weight):
            raise ValueError(
                f"distill_weight must be a finite weight >= 0 (0: DMD alone after dmd_start), and it and dmd_weight "
                f"cannot both be 0 (nothing would train the student), got {distill_weight!r} and {dmd_weight!r}"
            )
        self.dmd_start, self.distill_weight = dmd_start, distill_weight
        self.dmd_weight, self.dmd_t_mean, self.dmd_t_std = dmd_weight, dmd_t_mean, dmd_t_std
        self.fake_updates = fake_updates
        build = functools.partial(load_teacher, self.teacher, ema=self.teacher_ema)  # the fake score starts as the teacher
        optim = fake_score_optim(fake_lr, fake_betas, fake_weight_decay)
        self.networks = {**self.networks, "fake_score": Network(build=build, trainable=True, optim=optim)}

    def phase(self, step: int) -> str:
        """The kind of step `step` is: "distill" (the student's distillation loss alone) before dmd_start, then
        fake_updates fake-score steps ("fake_score"), then a student step with DMD ("model"), and again."""
        step = int(step)
        if step < self.dmd_start:
            return "distill"
        return "fake_score" if (step - self.dmd_start) % (self.fake_updates + 1) < self.fake_updates else "model"

    def noised(self, x_g):
        """x_s on the flow-matching path from x_g, with its time s and conditional velocity eps' - x_g."""
        s = logit_normal(x_g.shape[0], self.dmd_t_mean, self.dmd_t_std, device=x_g.device)
        return LinearPath().sample(x_g, torch.randn_like(x_g), s)

    def loss(self, model, x, y=None, *, step=0, phase=None, teacher, fake_score, ema=None):
        phase = phase or self.phase(step)
        if phase == "distill":
            loss, metrics = super().loss(model, x, y, step=step, teacher=teacher, ema=ema)
            return {"model": loss}, metrics
        if phase == "fake_score":
            with torch.no_grad():
                x_g = self.generate(model, x, y)
            p = self.noised(x_g.float())
            fake_loss = (fake_score(p.x_t, p.t, None, y).float() - p.dx_t).square().mean()
            return {"fake_score": fake_loss}, {"fake_loss": fake_loss.detach()}

        student_loss, metrics = 0.0, {}
        if self.distill_weight:  # 0: DMD alone, without the distillation loss's passes
            student_loss, metrics = super().loss(model, x, y, step=step, teacher=teacher, ema=ema)
            if self.distill_weight != 1:
                student_loss = self.distill_weight * student_loss
        x_g = self.generate(model, x, y).float()
        p = self.noised(x_g.detach())
        s = bcast(p.t, x_g)
        with torch.no_grad():
            x_real = p.x_t - s * teacher_velocity(teacher, p.x_t, p.t, y, self.teacher_cfg_scale)
        with torch.set_grad_enabled(self.fake_updates == 0):  # fake_updates 0: this forward trains it too
            v_fake = fake_score(p.x_t, p.t, None, y).float()
        x_fake = p.x_t - s * v_fake.detach()
        grad = dmd_gradient(x_g, x_real, x_fake)
        dmd = 0.5 * (x_g - (x_g - grad).detach()).square().mean()
        loss = student_loss + self.dmd_weight * dmd
        losses, metrics = {"model": loss}, {**metrics, "loss": loss.detach(), "dmd": dmd.detach()}
        if self.fake_updates == 0:
            fake_loss = (v_fake - p.dx_t).square().mean()
            losses["fake_score"], metrics["fake_loss"] = fake_loss, fake_loss.detach()
        return losses, metrics
