"""MeanFlow (Geng et al. 2025, arXiv 2505.13447): one-step generation from an average velocity.

Path as flow matching (LinearPath): z_t = (1 - t) x + t eps, v = eps - x, t = 1 noise.
The model u(z, r, t) is the average velocity over [r, t] (called model(z, t, r, y); the DiT embeds
t and t - r, the paper's best choice). The MeanFlow identity (eq. 6) gives the target

    u_tgt = v - (t - r) du/dt,   du/dt = JVP of u along (dz, dr, dt) = (v, 0, 1)   (eq. 8)

with a stop-gradient on u_tgt; loss sg(w) ||u - sg(u_tgt)||^2 (sum over dims) with the adaptive weight
w = 1 / (||u - u_tgt||^2 + c)^p (section 4.3). Sampling: z_r = z_t - (t - r) u(z_t, r, t) (eq. 12).

Tangent (`tangent`): "sample" is the paper's, the conditional velocity v = eps - x in the JVP
(unbiased, since u_tgt is linear in v, but as noisy as v); "model" puts the model's own instantaneous
velocity sg(u(z_t, t, t)) there instead (one more forward without gradient): the same fixed point
(u(z, t, t) is the marginal velocity there) with a less noisy target. The loss stays
||u - sg(v - (t - r) du/dt)||^2 = ||u + (t - r) sg(du/dt) - v||^2, the "velocity loss" form.

Target velocity (`target_velocity`): "sample" keeps v in the target's first term; "model" puts the same
sg(u(z_t, t, t)) there on the r != t samples, u_tgt = sg(u(z_t, t, t)) - (t - r) du/dt (Eulerian self-distillation:
the flow map learns from the model's own marginal velocity, which the r = t samples keep training on v); "ema" takes
that velocity from an EMA of the model (`split_ema`, one of trainer.ema_decays; one more forward without gradient), a
target network that lags the model. The target of a long interval then carries none of v's noise, at the price of
the velocity's own error; with guidance in training u(z_t, t, t | y) is already the guided velocity the r = t samples
learn. Any field's own flow map satisfies this target exactly, a constant image too, so only the r = t samples
anchor it to the data: with the adaptive weight at p = 1 (a log-like loss, which lets the exactly-met samples
outweigh the anchor) the CPU run collapses to one grey image, at 0.5 still with the model's velocity; at p = 0 it
trains (docs/quality.md, twenty-second day), and p >= 0.5 is refused.

The Lagrangian identity (`identity="lagrangian"`; "eulerian", the default, is the one above): the flow map
X(z_t) = z_t - (t - r) u(z_t, r, t) must move with the velocity at its own end point, dX/dr = v(X, r), so

    u_tgt = v(X, r) + (t - r) du/dr,   du/dr = JVP of u along (dz, dr, dt) = (0, 1, 0)

(the Lagrangian map distillation of flow map matching, against the Eulerian one above, which MeanFlow and
consistency distillation share). v is the teacher's velocity at the student's end point X (no gradient), or
without a teacher the model's own sg(u(X, r, r)) (Lagrangian self-distillation), while the r = t samples learn the
data's v by flow matching (with guidance in training: its guided v, so the map follows the guided flow). That
anchor is what ties the field to the data: any field's own flow map meets the r != t target exactly. The target
corrects the point the jump lands on, where the Eulerian target only sees the start, and it carries no sample's
noisy v. The same number of forwards as the Eulerian target with tangent="model" (or with a teacher); the second
forward waits for the first's output.

Interval splitting (`split_above`, off by default): intervals longer than it take the target of two half
jumps of the model itself, u_tgt = (u(z_t, s, t) + u(z_s, r, s)) / 2 at the midpoint s = (t + r) / 2 with
z_s = z_t - (t - s) u(z_t, s, t), both without gradient (the interval-splitting consistency of SplitMeanFlow and
of shortcut models), in place of the identity's v - (t - r) du/dt: a long interval's target is then built from
shorter ones, not from the derivative of the long one. Two more forwards without gradient per step.
`split_point="uniform"` splits each interval at s drawn uniformly in (r, t) instead (SplitMeanFlow's random
split), u_tgt = ((t - s) u(z_t, s, t) + (s - r) u(z_s, r, s)) / (t - r): the same consistency at every s.
`split_target="ema"` takes the two half jumps with an EMA of the model (`split_ema`, one of trainer.ema_decays)
in place of the model being trained: a target network that lags the student, so an error the student makes
is not fed back into its own target at once (the bootstrapped target of DQN and of the first consistency
models). With a teacher, `split_target="teacher"` gives those intervals the teacher's own solution instead,
u_tgt = (z_t - z_r) / (t - r) with z_r from teacher_steps Euler steps of its velocity from t down to r (the
velocity of the identity's target, its guidance included): teacher_steps more forwards without gradient.

The samplers' intervals (`one_step_frac`, `two_step_frac`, off by default): fixed shares of each batch at the
1-step sampler's (r, t) = (0, 1) and at the 2-step sampler's (s, 1) and (0, s), which the logit-normal proposal
almost never draws, though the samplers evaluate nothing else. With the split target on, the one-step samples
learn the model's own 2-step sample (on MNIST: 1-step FID 17.35 against 19.52, docs/quality.md).

The JVP on the r != t samples alone (`jvp_subset`, on in configs/objective/meanflow.yaml): a sample with r = t
has u_tgt = v exactly (its JVP is multiplied by t - r = 0), so it needs one plain forward, not a tangent forward and
a JVP. The r != t samples are then a fixed count, the batch's first round(r_neq_t n) (after the samplers' intervals),
in place of a random share: the same loss in expectation, a step that costs about (1 - r_neq_t) flow-matching steps
plus r_neq_t MeanFlow steps, and static shapes for CUDA graphs.

The interval warm-up (`interval_warmup`, off by default): the r != t samples' intervals are shortened to
g (t - r) with g = min(1, step / interval_warmup), r = t - g (t - r), so training starts on short intervals, where
u is close to the instantaneous velocity and the identity's target needs little of the model's own du/dt, and reaches
the full proposal after interval_warmup steps: a curriculum from the velocity to long jumps, after the finding that
long-interval targets are learnt well only once the velocity and short intervals are. The samplers' intervals
(one_step_frac, two_step_frac) are not shortened. Same shapes and cost at every step (a CUDA-graph step reads the
step on the GPU).

The consistency curriculum (`alpha_steps`, off by default; the alpha-Flow family of MeanFlow objectives): during the
first alpha_steps[1] steps the r != t samples take a discrete target in place of the identity's derivative,

    u_tgt = alpha v + (1 - alpha) sg(u(z_s, r, s)),   s = t - alpha (t - r),   z_s = z_t - alpha (t - r) dz

(dz the JVP's tangent: v, or sg(u(z_t, t, t)) with tangent="model"): a jump of alpha (t - r) along the velocity, then
the model's own jump from s to r. alpha = 1 is the velocity itself (u learns v whatever r: flow matching along the
trajectory); alpha -> 0 is the MeanFlow identity (u(z_s, r, s) = u - alpha (t - r) du/dt + O(alpha^2)). alpha stays 1
until alpha_steps[0], then falls geometrically to alpha_min at alpha_steps[1], after which the identity's target (the
JVP) takes over (flm.objectives.curriculum, which sCM shares). The loss is MeanFlow's on the residual divided by
alpha, times alpha: its gradient at small alpha is MeanFlow's, at alpha = 1 flow matching's, under the same adaptive
weight. The curriculum's steps take no JVP: a plain forward and one (two with tangent="model") without gradient. Two
kinds of step ("alpha", "jvp"), so `phase(step)` names them and a CUDA-graph run captures each once.

Guidance in training (section 4.2, eqs. 13-19, off by default): v is replaced, in the target and in
the JVP tangent, by v~ = omega v + kappa u(z_t, t, t | y) + (1 - omega - kappa) u(z_t, t, t | null),
the two u's without gradient; samples whose label was dropped to the null class keep v~ = v.

Distillation (`teacher`, off by default): v is a frozen flow-matching teacher's velocity at (z_t, t),
with its classifier-free guidance at teacher_cfg_scale (flm.objectives.teacher), in place of eps - x;
the student starts as its teacher (flm.train.loop.start_from: the output of its embedding of t - r at
zero). The teacher's velocity is the exact dz_t/dt of the marginal flow, so `tangent="sample"` (v itself)
is the right JVP tangent there, and r_neq_t=1.0 spends no loss on r = t, which the student satisfies
from the start (configs/objective/meanflow_distill.yaml; on MNIST its 2-step FID is 1.31x the teacher's
50-step one, docs/quality.md).

    from flm.objectives import MeanFlow
    mf = MeanFlow(jvp_mode="dual")          # build the model with time_inputs=mf.time_inputs (2)
    loss, metrics = mf.loss(model, x, y)
    images = mf.sample(model, torch.randn_like(x), y, steps=1)
"""

import functools
import math

import torch
from torch import nn

from flm.objectives.guidance import (
    check_cfg,
    check_interval,
    drop_labels,
    guided,
    in_interval,
    null_labels,
    num_classes,
    unwrap,
)
from flm.objectives.jvp import check_jvp_mode, jvp
from flm.objectives.checks import (
    check_hf_weight,
    check_hf_weight_one_step,
    check_probability,
    check_sampler_shares,
    check_std,
    check_target_ema,
    check_teacher_steps,
)
from flm.objectives.adversarial import AdversarialRegularised
from flm.objectives.curriculum import Curricular, alpha_metric, build_curriculum
from flm.objectives.dmd import DMDRegularised
from flm.objectives.frequency import first_k_hf_weight, squared_error
from flm.objectives.paths import LinearPath, bcast, logit_normal, ramp, time_grid
from flm.objectives.posterior import DataVelocity
from flm.objectives.protocol import NO_NETWORKS, Network
from flm.objectives.teacher import check_teacher_ema, feature_blocks, load_teacher, teacher_features, teacher_velocity


TANGENTS = ("sample", "model")
TARGET_VELOCITIES = ("sample", "model", "ema")
IDENTITIES = ("eulerian", "lagrangian")
SPLIT_TARGETS = ("student", "ema", "teacher", "teacher_student")
SPLIT_POINTS = ("mid", "uniform")


def _rows(a: torch.Tensor | None, i) -> torch.Tensor | None:
    """a[i], or None for no labels."""
    return None if a is None else a[i]


class MeanFlow(Curricular, nn.Module):
    """MeanFlow loss and its 1- or few-step sampler.

    Args:
        t_mean, t_std: logit-normal distribution of t and r (paper: -0.4, 1.0).
        r_neq_t: fraction of samples with r != t (paper: 0.25); the others have r = t (plain FM).
        split_above: intervals t - r longer than this take the interval-splitting target (see the module
            docstring); None: every sample takes the MeanFlow identity's.
        split_frac: at most this fraction of a batch, its longest intervals, takes it: a fixed number of extra
            forwards keeps the step's cost and shapes fixed (CUDA graphs); longer intervals beyond that number
            keep the identity's target.
        split_target: what those intervals take: "student" (two half jumps of the model), "ema" (two half
            jumps of the model's EMA at decay split_ema), "teacher" (the teacher's Euler solution over the
            interval; needs a teacher) or "teacher_student" (the teacher's Euler steps over the first jump, t -> s,
            the model's own jump s -> r: the recipe of sCD's one_step_frac; needs a teacher).
        split_ema: the EMA decay whose weights make the split target for split_target="ema"; the run must keep
            that EMA (trainer.ema_decays).
        split_point: where the two half jumps meet: "mid" (s = (t + r) / 2) or "uniform" (s uniform in (r, t) per
            sample, the jumps weighted by their lengths).
        teacher_steps: Euler steps of the teacher over an interval (split_target="teacher") or over the first
            jump (split_target="teacher_student").
        interval_warmup: the r != t intervals are scaled by min(1, step / interval_warmup) (see the module
            docstring); 0: off, the full proposal from the first step.
        alpha_steps: (start, end) of the consistency curriculum (see the module docstring): alpha = 1 until start,
            then geometric to alpha_min at end, then the identity; None: off.
        alpha_min: alpha at alpha_steps[1], where the curriculum hands over to the identity's target.
        r_zero: fraction of samples with r = 0, drawn before r_neq_t applies: the interval [0, t] of a
            consistency model, whose t = 1 end is the 1-step sampler's. Two logit-normal draws rarely span
            it (t - r >= 0.7 for ~1 % of samples, docs/quality.md); 0 is the paper's proposal.
        one_step_frac: this fraction of each batch (a fixed count, the batch's first samples) takes (r, t) = (0, 1),
            the one-step sampler's own interval, which the logit-normal proposal never draws (t > 0.95 for 0.04 %
            of its draws). They are the batch's longest intervals, so with split_above set and split_frac at least
            this fraction they take the split target: the model's own two half jumps 1 -> 1/2 -> 0 (its 2-step
            sample with the default mid_t), distilled into its one step.
        two_step_frac: the next fraction of each batch (a fixed count) takes the 2-step sampler's two intervals, (s, 1)
            and (0, s) in turn, s its intermediate time (mid_t, or 1/2): the jumps the 2-step sampler (and the
            split target of the one-step samples) makes, which the proposal draws rarely too.
        adaptive_p, adaptive_c: adaptive weight 1 / (||err||^2 + c)^p (paper: p = 1.0, c = 1e-3);
            p = 0 is the plain squared error.
        hf_weight: the squared error becomes ||err||^2 + hf_weight ||high_pass(err)||^2 (flm.objectives.frequency):
            the pixel-scale part of the error, which FID on MNIST charges most (docs/quality.md), counts
            (1 + hf_weight) times; 0 (the default) is the paper's loss. Needs image-shaped data.
        hf_weight_one_step: hf_weight for the one_step_frac samples (the one-step sampler's interval) alone; null:
            hf_weight. On MNIST the 2-step FID fell up to hf_weight 256 while the 1-step FID was best at 16-64
            (docs/quality.md, tenth day): one network, two samplers.
        perceptual_weight: a perceptual part of the one_step_frac samples' error (needs a teacher): the distance of
            their one-step sample z - u to its target z - sg(u_tgt) measured in the teacher's hidden states after
            perceptual_blocks, both noised to perceptual_t with one noise (flm.objectives.teacher.teacher_features),
            added to the sample's squared error times perceptual_weight, under the one adaptive weight; 0: off. (As
            a term of its own, adaptive-weighted apart, it diverged at lr 8e-4: docs/quality.md, eleventh day.)
        perceptual_t: the noise level (flow-matching time) at which the teacher sees both images.
        perceptual_blocks: the teacher's blocks (null: four evenly spaced ones, the last included).
        cfg_omega, cfg_kappa: guidance in training (paper eq. 19); 1.0 and 0.0 turn it off.
        label_dropout: probability of the null label (CFG training); classes read from the model.
        tangent: "sample" (v, the paper's) or "model" (sg(u(z_t, t, t)), see the module docstring).
        target_velocity: "sample" (v, the paper's), "model" (sg(u(z_t, t, t)) in the r != t samples' target) or "ema"
            (the same from the split_ema EMA); see the module docstring. Eulerian identity, no teacher.
        identity: "eulerian" (the MeanFlow identity, the paper's) or "lagrangian" (the velocity at the jump's end
            point, see the module docstring; its JVP is along r alone, so the tangent option does not apply).
        jvp_mode: "dual" (one dual pass) or "two_pass" (no-grad JVP pass + gradient pass).
        jvp_subset: the JVP (and the model tangent's forward) on the r != t samples alone, a fixed count of them
            (see the module docstring); False: on the whole batch, r != t drawn per sample (the paper's).
        teacher: a flow-matching run folder or checkpoint whose velocity replaces v (null: none).
        teacher_cfg_scale: the teacher's classifier-free guidance (1.0: none).
        teacher_ema: which of the teacher run's EMAs the teacher (and the student's start) takes (sCD's option).
        cfg_interval: [t_min, t_max]: guidance in training and the sampler's guidance only for t in it
            (flm.objectives.guidance); null: at every t.
        mid_t: intermediate times of few-step sampling, decreasing in (0, 1), used when steps == len(mid_t) + 1
            (e.g. (0.6,) for 2 steps); other step counts, and () (the default), space the jumps uniformly.
        velocity_estimate: v of the data: "sample" (eps - x, the conditional velocity, the paper's) or "batch" (its
            posterior mean over the batch's images, flm.objectives.posterior: far less noisy near t = 1, where the long
            intervals start), in the target, the tangent and guidance in training alike.
        velocity_references: with velocity_estimate=batch, this many earlier training images as further references
            (flm.objectives.posterior.ReferenceBank, saved with the objective); 0: the batch alone.

    No parameters or state.
    """

    time_inputs = 2
    predictions = ("data", "velocity")  # the first is model.prediction=auto's (without a teacher)
    sample_steps = 2  # 1 is the one-step sampler; 2 is visibly cleaner on small models
    networks = NO_NETWORKS

    def __init__(
        self,
        *,
        t_mean: float = -0.4,
        t_std: float = 1.0,
        r_neq_t: float = 0.25,
        interval_warmup: int = 0,
        alpha_steps: tuple[int, int] | None = None,
        alpha_min: float = 5e-3,
        r_zero: float = 0.0,
        one_step_frac: float = 0.0,
        two_step_frac: float = 0.0,
        split_above: float | None = None,
        split_frac: float = 0.125,
        split_target: str = "student",
        teacher_steps: int = 4,
        split_ema: float = 0.99,
        split_point: str = "mid",
        adaptive_p: float = 1.0,
        adaptive_c: float = 1e-3,
        hf_weight: float = 0.0,
        hf_weight_one_step: float | None = None,
        perceptual_weight: float = 0.0,
        perceptual_t: float = 0.1,
        perceptual_blocks=None,
        cfg_omega: float = 1.0,
        cfg_kappa: float = 0.0,
        label_dropout: float = 0.1,
        tangent: str = "sample",
        target_velocity: str = "sample",
        identity: str = "eulerian",
        jvp_mode: str = "dual",
        jvp_subset: bool = False,
        teacher: str | None = None,
        teacher_cfg_scale: float = 1.0,
        teacher_ema: float | str | None = None,
        cfg_interval: tuple[float, float] | None = None,
        mid_t: tuple[float, ...] = (),
        velocity_estimate: str = "sample",
        velocity_references: int = 0,
    ):
        super().__init__()
        check_std("t_std", t_std)
        self.velocity_estimate, self.data_velocity = velocity_estimate, DataVelocity(velocity_estimate, velocity_references)
        if velocity_estimate != "sample" and teacher:
            raise ValueError(
                f"velocity_estimate={velocity_estimate} estimates v from the batch's images, and a teacher's velocity "
                "replaces v: set objective.velocity_estimate=sample with objective.teacher"
            )
        mid_t = tuple(float(t) for t in mid_t)
        if any(not 0 < t < 1 for t in mid_t) or any(a <= b for a, b in zip(mid_t, mid_t[1:])):
            raise ValueError(f"mid_t must be decreasing times in (0, 1) (1 is noise), got {mid_t}")
        self.mid_t = mid_t
        # the 2-step sampler's intermediate time as a number: sample_times writes it into the batch's times without a
        # host-to-device copy (a captured step allows none)
        self.two_step_s = float(self.sampler_times(2, "cpu")[1])
        check_probability("r_neq_t", r_neq_t)
        check_probability("r_zero", r_zero)
        check_sampler_shares(one_step_frac, two_step_frac)
        if split_above is not None and not 0 <= split_above < 1:
            raise ValueError(f"split_above must be an interval length in [0, 1) or null (off), got {split_above!r}")
        if not 0 < split_frac <= 1:
            raise ValueError(f"split_frac must be a fraction of the batch in (0, 1], got {split_frac!r}")
        self.split_above, self.split_frac = split_above, split_frac
        check_probability("label_dropout", label_dropout)
        if adaptive_p < 0 or adaptive_c <= 0:
            raise ValueError(f"adaptive weighting needs p >= 0 and c > 0, got p={adaptive_p!r}, c={adaptive_c!r}")
        if not (cfg_omega > 0 and 0 <= cfg_kappa < 1):
            raise ValueError(
                f"guidance in training needs cfg_omega > 0 and 0 <= cfg_kappa < 1, got "
                f"cfg_omega={cfg_omega!r}, cfg_kappa={cfg_kappa!r}; 1.0 and 0.0 turn it off"
            )
        self.t_mean, self.t_std, self.r_neq_t, self.r_zero = t_mean, t_std, r_neq_t, r_zero
        if not (isinstance(interval_warmup, int) and interval_warmup >= 0):
            raise ValueError(f"interval_warmup must be a number of steps >= 0 (0: off), got {interval_warmup!r}")
        self.interval_warmup = interval_warmup
        if alpha_steps is not None and (split_above is not None or identity != "eulerian" or target_velocity != "sample"):
            raise ValueError(
                "alpha_steps replaces the Eulerian identity's target during the curriculum; it does not combine with "
                f"split_above={split_above!r}, identity={identity!r}, target_velocity={target_velocity!r}: "
                "set objective.alpha_steps=null or those to null / eulerian / sample"
            )
        self.curriculum = build_curriculum(alpha_steps, alpha_min, type(self), MeanFlow)
        self.one_step_frac, self.two_step_frac = one_step_frac, two_step_frac
        self.adaptive_p, self.adaptive_c = adaptive_p, adaptive_c
        self.hf_weight = check_hf_weight(hf_weight)
        self.hf_weight_one_step = check_hf_weight_one_step(hf_weight_one_step, one_step_frac)
        self.cfg_omega, self.cfg_kappa = cfg_omega, cfg_kappa
        if tangent not in TANGENTS:
            raise ValueError(f"unknown tangent {tangent!r}; valid tangents: {', '.join(TANGENTS)}")
        self.label_dropout, self.tangent = label_dropout, tangent
        if identity not in IDENTITIES:
            raise ValueError(f"unknown identity {identity!r}; valid identities: {', '.join(IDENTITIES)}")
        if identity == "lagrangian" and tangent == "model":
            raise ValueError(
                "identity=lagrangian takes its JVP along r alone, so tangent=model does not apply; set objective.tangent=sample"
            )
        if identity == "lagrangian" and teacher and (cfg_omega != 1.0 or cfg_kappa != 0.0):
            raise ValueError(
                "identity=lagrangian with a teacher takes the teacher's velocity at the jump's end point, so guidance "
                "in training does not apply; keep cfg_omega=1.0 and cfg_kappa=0.0 and set objective.teacher_cfg_scale"
            )
        self.identity = identity
        if target_velocity not in TARGET_VELOCITIES:
            raise ValueError(f"unknown target_velocity {target_velocity!r}; valid: {', '.join(TARGET_VELOCITIES)}")
        if target_velocity != "sample" and (identity != "eulerian" or teacher):
            raise ValueError(
                f"target_velocity={target_velocity} puts the model's own velocity in the Eulerian identity's target in place "
                f"of v, and this objective has identity={identity!r}, teacher={teacher!r} (the Lagrangian target already "
                "takes the model's velocity, a teacher's is better); set objective.target_velocity=sample"
            )
        # self-distillation in either identity: the r != t target is the model's own output
        if target_velocity != "sample":
            self_target = f"target_velocity={target_velocity}"
        elif identity == "lagrangian" and not teacher:
            self_target = "identity=lagrangian without a teacher (self-distillation)"
        else:
            self_target = None
        if self_target and adaptive_p >= 0.5:
            raise ValueError(
                f"{self_target} with adaptive_p={adaptive_p}: the r != t samples' target is the model's own output, which "
                "a degenerate field meets exactly (a constant image the Eulerian one, any field's own flow the Lagrangian "
                "one), and a large p lets those samples outweigh the r = t ones that tie it to the data (the CPU run "
                "collapsed or diverged at p = 1, and at 0.5 with the model's velocity; docs/quality.md); set "
                "objective.adaptive_p=0"
            )
        self.target_velocity = target_velocity
        self.jvp_mode = check_jvp_mode(jvp_mode)
        if jvp_subset and r_zero:
            raise ValueError(
                "r_zero draws r = 0 for any sample, so the r != t samples are not a fixed count: set "
                "objective.jvp_subset=false with objective.r_zero"
            )
        self.jvp_subset = bool(jvp_subset)
        self.path = LinearPath()
        if teacher and (cfg_omega != 1.0 or cfg_kappa != 0.0):
            raise ValueError(
                "a teacher's guidance (teacher_cfg_scale) replaces guidance in training; keep cfg_omega=1.0 "
                "and cfg_kappa=0.0 with objective.teacher"
            )
        if not teacher_cfg_scale >= 1.0:
            raise ValueError(f"teacher_cfg_scale must be >= 1.0 (1.0: no guidance), got {teacher_cfg_scale!r}")
        self.teacher, self.teacher_cfg_scale, self.teacher_ema = teacher, teacher_cfg_scale, check_teacher_ema(teacher_ema)
        if teacher_ema is not None and not teacher:
            raise ValueError(f"teacher_ema={teacher_ema!r} names a teacher's EMA, and there is no teacher; set objective.teacher")
        self.cfg_interval = check_interval(cfg_interval)
        if split_target not in SPLIT_TARGETS:
            raise ValueError(f"unknown split_target {split_target!r}; valid split targets: {', '.join(SPLIT_TARGETS)}")
        if split_target.startswith("teacher") and not (teacher and split_above is not None):
            raise ValueError(
                f"split_target={split_target} needs objective.teacher (a flow-matching run folder or .pt) and "
                f"objective.split_above (which intervals take it), got teacher={teacher!r}, split_above={split_above!r}"
            )
        if split_target == "ema" and split_above is None:
            raise ValueError("split_target=ema needs objective.split_above (which intervals take the split target)")
        self.split_target, self.teacher_steps = split_target, check_teacher_steps(teacher_steps)
        if split_point not in SPLIT_POINTS:
            raise ValueError(f"unknown split_point {split_point!r}; valid split points: {', '.join(SPLIT_POINTS)}")
        self.split_point = split_point
        if not 0 < split_ema < 1:
            raise ValueError(f"split_ema must be an EMA decay in (0, 1), got {split_ema!r}")
        # the loop passes the EMA of this decay to loss() as `ema` (flm.train.loop.build_state)
        self.target_ema_decay = split_ema if "ema" in (split_target, target_velocity) else None
        if teacher:
            build = functools.partial(load_teacher, teacher, ema=self.teacher_ema)
            self.networks = {"teacher": Network(build=build, model_init=True, bf16_on_cuda=True)}
        if not (0 <= perceptual_weight < math.inf and 0 <= perceptual_t < 1):
            raise ValueError(
                f"perceptual_weight must be a finite weight >= 0 and perceptual_t a time in [0, 1), got "
                f"{perceptual_weight!r} and {perceptual_t!r}"
            )
        if perceptual_weight and not (teacher and one_step_frac):
            raise ValueError(
                "perceptual_weight measures the one_step_frac samples in the teacher's features: it needs "
                f"objective.teacher and objective.one_step_frac > 0, got teacher={teacher!r}, one_step_frac={one_step_frac!r}"
            )
        self.perceptual_weight, self.perceptual_t, self.perceptual_blocks = perceptual_weight, perceptual_t, perceptual_blocks

    def sample_times(self, n: int, device, step=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(t, r) with t >= r: two logit-normal draws sorted; a fraction r_zero gets r = 0, and of the others
        a fraction 1 - r_neq_t gets r = t (with jvp_subset: all but the first jvp_count(n)); at a training step the
        intervals are shortened by the interval warm-up (step None: the full proposal); then the first
        round(one_step_frac n) samples get (r, t) = (0, 1) and the next round(two_step_frac n) the 2-step sampler's
        (s, 1) and (0, s) in turn."""
        a = logit_normal(n, self.t_mean, self.t_std, device=device)
        b = logit_normal(n, self.t_mean, self.t_std, device=device)
        t, r = torch.maximum(a, b), torch.minimum(a, b)
        if self.jvp_subset:
            m = self.jvp_count(n)
            r = torch.cat([r[:m], t[m:]])
        else:
            r = torch.where(torch.rand(n, device=device) < self.r_neq_t, r, t)
        if self.r_zero:  # no extra draw at 0: the paper's proposal keeps its random stream
            r = torch.where(torch.rand(n, device=device) < self.r_zero, torch.zeros_like(r), r)
        if step is not None and self.interval_warmup:
            r = t - ramp(step, self.interval_warmup) * (t - r)
        # fixed counts: static shapes, and the random stream is unchanged
        k1, k2 = self.one_step_count(n), round(self.two_step_frac * n)
        if k1 or k2:
            t, r = t.clone(), r.clone()
            t[:k1], r[:k1] = 1.0, 0.0
            s = self.two_step_s
            t[k1 : k1 + k2 : 2], r[k1 : k1 + k2 : 2] = 1.0, s
            t[k1 + 1 : k1 + k2 : 2], r[k1 + 1 : k1 + k2 : 2] = s, 0.0
        return t, r

    def jvp_count(self, n: int) -> int:
        """How many of a batch of n take the JVP: all of them, or with jvp_subset its first ones, the samplers'
        intervals and round(r_neq_t x) of the other x (sample_times)."""
        if not self.jvp_subset:
            return n
        k = self.one_step_count(n) + round(self.two_step_frac * n)
        return k + round(self.r_neq_t * (n - k))

    @torch.no_grad()
    def _guided_velocity(self, model, s, y, y_in):
        """v~ of the paper's eq. 19 (guidance in training); y are the labels before dropout."""
        if y is None or num_classes(model) == 0:
            raise ValueError(
                f"guidance in training (cfg_omega={self.cfg_omega}, cfg_kappa={self.cfg_kappa}) needs a "
                "class-conditional model and labels; set cfg_omega=1.0 and cfg_kappa=0.0"
            )
        t = s.t
        u_null = model(s.x_t, t, t, null_labels(model, y)).float()
        v = self.cfg_omega * s.dx_t + (1 - self.cfg_omega - self.cfg_kappa) * u_null
        if self.cfg_kappa:
            v = v + self.cfg_kappa * model(s.x_t, t, t, y).float()
        keep = bcast((y_in == null_labels(model, y)) | ~in_interval(t, self.cfg_interval), v)
        return torch.where(keep, s.dx_t, v)

    def errors(self, model, x, y=None, *, step=None, teacher=None, ema=None):
        """(t, r, u - sg(u_tgt)) of a batch: each sample's times and its error against the target (eq. 8), fp32;
        step: the training step (the interval warm-up's), None: the full proposal."""
        return self._errors(model, x, y, step=step, teacher=teacher, ema=ema)[:3]

    def _errors(self, model, x, y=None, *, step=None, teacher=None, ema=None, alpha=None):
        """errors' (t, r, u - sg(u_tgt)), then z_t and u; alpha: the consistency curriculum's (None: the identity)."""
        y_in = drop_labels(model, y, self.label_dropout)
        t, r = self.sample_times(x.shape[0], x.device, step)
        s = self.path.sample(x, torch.randn_like(x), t)
        s.dx_t = self.data_velocity(self.path, x, s, y_in, y, num_classes(model), step)
        if self.cfg_omega != 1.0 or self.cfg_kappa != 0.0:  # guidance in training (refused with a teacher): every
            s.dx_t = self._guided_velocity(model, s, y, y_in)  # target's v is the guided one, the map follows its flow
        if self.identity == "lagrangian":
            # at r = t the end point X is z_t itself: u_tgt is the velocity there, the teacher's or, without one, the
            # data's v (flow matching: the anchor of self-distillation; the model's own velocity there would be
            # met by any field)
            def diagonal(u, i):
                if teacher is None:
                    return s.dx_t[i].float()
                return teacher_velocity(teacher, s.x_t[i], t[i], _rows(y_in, i), self.teacher_cfg_scale).float()

            lagrangian = functools.partial(self._lagrangian_target, model, teacher=teacher)
            u_tgt, u = self._on_subset(model, s.x_t, t, r, y_in, lagrangian, diagonal, s.dx_t)
        else:
            u_tgt, u = self._eulerian_target(model, s, r, y_in, teacher, ema, alpha)
        if self.split_above is not None:
            u_tgt = self._with_split_targets(model, s.x_t, t, r, y_in, u_tgt, teacher, ema)
        return t, r, u.float() - u_tgt, s.x_t, u

    def _eulerian_target(self, model, s, r, y_in, teacher=None, ema=None, alpha=None):
        """(sg(u_tgt), u) of the MeanFlow identity (eq. 8) at the path sample s (its dx_t the guided v with guidance in
        training), or with alpha the consistency curriculum's discrete target."""
        t = s.t
        v = s.dx_t
        if teacher is not None:
            v = teacher_velocity(teacher, s.x_t, t, y_in, self.teacher_cfg_scale)

        def identity(z, t, r, y, v):  # u and u_tgt = v - (t - r) du/dt of the samples that take the JVP
            with torch.no_grad():
                u_tt = model(z, t, t, y) if "model" in (self.tangent, self.target_velocity) else None
                if self.target_velocity == "ema":
                    check_target_ema(ema, self.target_ema_decay, "objective.target_velocity=ema")
                    v_self = ema(z, t, t, y)
                else:
                    v_self = u_tt
            dz = u_tt if self.tangent == "model" else v.to(z.dtype)
            # du/dt along (dz, dr, dt) = (v, 0, 1) (eq. 8; dz = sg(u(z_t, t, t)) for tangent="model"): r has none
            u, dudt = jvp(lambda z_, t_: model(z_, t_, r, y), (z, t), (dz, torch.ones_like(t)), mode=self.jvp_mode)
            if self.target_velocity != "sample":  # r = t keeps v: the velocity's own training signal
                v = torch.where(bcast(t != r, v), v_self.float(), v)
            return v - bcast(t - r, v) * dudt.float(), u

        def discrete(z, t, r, y, v):  # u and u_tgt = alpha v + (1 - alpha) sg(u(z_s, r, s)) (the curriculum)
            a = torch.where(t != r, alpha, 1.0)  # r = t: alpha 1, the velocity itself
            with torch.no_grad():
                dz = model(z, t, t, y).float() if self.tangent == "model" else v
                h = a * (t - r)  # the velocity's jump t -> s
                u_sr = model((z.float() - bcast(h, dz) * dz).to(z.dtype), t - h, r, y).float()
            a = bcast(a, v)
            return a * v + (1 - a) * u_sr, model(z, t, r, y)

        target = identity if alpha is None else discrete
        u_tgt, u = self._on_subset(model, s.x_t, t, r, y_in, target, lambda u, i: v[i].float(), v)
        return u_tgt.detach(), u

    def _on_subset(self, model, z, t, r, y, target, diagonal, *per_sample):
        """(u_tgt, u) of a batch: target(z, t, r, y, *per_sample) on its first jvp_count samples; the others (r = t,
        with jvp_subset) take one forward u = model(z, t, t, y) and u_tgt = diagonal(u, their rows)."""
        n, m = len(t), self.jvp_count(len(t))
        parts = []
        if m:
            head = slice(None, m)
            # the JVP's primals as tensors of their own, not views of the batch: inductor fails on dual views (torch 2.14)
            z_head, t_head = (z[head].clone(), t[head].clone()) if m < n else (z, t)
            parts.append(target(z_head, t_head, r[head], _rows(y, head), *(a[head] for a in per_sample)))
        if m < n:
            tail = slice(m, None)
            u = model(z[tail], t[tail], t[tail], _rows(y, tail))
            parts.append((diagonal(u, tail), u))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(pair) for pair in zip(*parts))

    def _lagrangian_target(self, model, z, t, r, y, v_data, teacher=None):
        """(sg(u_tgt), u) of the Lagrangian identity: u_tgt = v(X, r) + (t - r) du/dr at X = z - (t - r) u; without a
        teacher the samples with r = t take the data's velocity v_data (flow matching), the others the model's own."""
        u, dudr = jvp(lambda r_: model(z, t, r_, y), (r,), (torch.ones_like(r),), mode=self.jvp_mode)
        with torch.no_grad():
            x_r = (z.float() - bcast(t - r, u) * u.float()).to(z.dtype)
            if teacher is not None:
                v = teacher_velocity(teacher, x_r, r, y, self.teacher_cfg_scale).float()
            else:
                v = torch.where(bcast(t == r, v_data), v_data.float(), model(x_r, r, r, y).float())
        return (v + bcast(t - r, v) * dudr.float()).detach(), u

    def _with_split_targets(self, model, z, t, r, y, u_tgt, teacher=None, ema=None):
        """u_tgt with the split (or teacher) target on the batch's longest intervals (at most split_frac of it)
        above split_above."""
        k = max(1, math.ceil(self.split_frac * len(t)))
        i = torch.topk(t - r, k).indices  # no host sync: capturable
        if self.split_target == "ema":
            check_target_ema(ema, self.target_ema_decay, "objective.split_target=ema")
        target, net = {
            "student": (self._split_target, model),
            "ema": (self._split_target, ema),
            "teacher": (self._teacher_target, teacher),
            "teacher_student": (self._teacher_student_target, (teacher, model)),
        }[self.split_target]
        split = target(net, z[i], t[i], r[i], None if y is None else y[i])
        u_tgt = u_tgt.clone()
        u_tgt[i] = torch.where(bcast(t[i] - r[i] > self.split_above, split), split, u_tgt[i])
        return u_tgt

    @torch.no_grad()
    def _split_target(self, model, z, t, r, y):
        """((t - s) u(z_t, s, t) + (s - r) u(z_s, r, s)) / (t - r): the average velocity over [r, t] from two jumps
        that meet at s (split_point)."""
        lam, s = self._split_point(t, r)
        return self._two_jumps(model(z, t, s, y).float(), model, z, t, s, r, y, lam)

    @torch.no_grad()
    def _teacher_student_target(self, nets, z, t, r, y):
        """The split target with the teacher's teacher_steps Euler steps for the first jump, t -> s, and the
        student's own jump s -> r: the recipe of sCD's one_step_frac (flm.objectives.distillation)."""
        teacher, model = nets
        lam, s = self._split_point(t, r)
        return self._two_jumps(self._teacher_target(teacher, z, t, s, y), model, z, t, s, r, y, lam)

    def _split_point(self, t, r):
        """(lam, s): where the two jumps meet, lam = (t - s) / (t - r) (split_point)."""
        if self.split_point == "uniform":
            lam = torch.rand_like(t)  # drawn on the device: no host sync
            return lam, t - lam * (t - r)
        return torch.full_like(t, 0.5), (t + r) / 2

    def _two_jumps(self, u_ts, model, z, t, s, r, y, lam):
        """lam u_ts + (1 - lam) u(z_s, r, s), z_s = z - (t - s) u_ts: the average velocity over [r, t] from the first
        jump's u_ts and the model's second jump."""
        z_s = z.float() - bcast(t - s, u_ts) * u_ts
        u_sr = model(z_s.to(z.dtype), s, r, y).float()
        lam = bcast(lam, u_ts)
        return lam * u_ts + (1 - lam) * u_sr  # weights, not a division by t - r: the cap may select r = t

    @torch.no_grad()
    def _teacher_target(self, teacher, z, t, r, y):
        """(z_t - z_r) / (t - r) with z_r from teacher_steps Euler steps of the teacher from t to r: the mean of
        the steps' velocities, which needs no division by a short t - r."""
        h = (t - r) / self.teacher_steps
        z_k, u = z.float(), 0.0
        for k in range(self.teacher_steps):
            v = teacher_velocity(teacher, z_k.to(z.dtype), t - k * h, y, self.teacher_cfg_scale)
            z_k, u = z_k - bcast(h, v) * v, u + v / self.teacher_steps
        return u

    def adaptive_weight(self, sq):
        """sg(w) = 1 / (||u - u_tgt||^2 + c)^p per sample (section 4.3), from sq = ||u - u_tgt||^2."""
        return (sq.detach() + self.adaptive_c).pow(-self.adaptive_p)

    def one_step_count(self, n: int) -> int:
        """How many of a batch of n are the one-step sampler's interval (0, 1): its first ones (sample_times)."""
        return round(self.one_step_frac * n)

    def hf_weights(self, n: int, device) -> float | torch.Tensor:
        """squared_error's hf_weight for a batch of n: hf_weight_one_step on its one-step samples, hf_weight on the
        others; a number when they are alike."""
        return first_k_hf_weight(n, self.one_step_count(n), self.hf_weight, self.hf_weight_one_step, device)

    def perceptual(self, teacher, z, u, err, y):
        """Per one-step sample, the squared distance of its sample z - u to its target z - sg(u_tgt) = z - u + err in
        the teacher's features (mean over tokens and channels, summed over the blocks); z, u, err of those samples."""
        x_g = z.float() - u.float()  # t - r = 1
        x_tgt = (x_g + err).detach()
        s = torch.full((x_g.shape[0],), self.perceptual_t, device=x_g.device)  # a fill on the device: capturable
        eps = torch.randn_like(x_g)
        blocks = feature_blocks(len(unwrap(teacher).blocks), self.perceptual_blocks, "objective.perceptual_blocks")
        with torch.no_grad():
            f_tgt = teacher_features(teacher, x_tgt, s, eps, y, blocks)
        f_g = teacher_features(teacher, x_g, s, eps, y, blocks)
        return sum((a.float() - b.float()).square().flatten(1).mean(1) for a, b in zip(f_g, f_tgt))

    def loss(self, model, x, y=None, *, step: int = 0, phase: str | None = None, teacher=None, ema=None):
        n = x.shape[0]
        alpha = self.alpha(step, phase)
        t, r, err, z, u = self._errors(model, x, y, step=step, teacher=teacher, ema=ema, alpha=alpha)
        metrics = {"mse": err.detach().square().mean()}
        # the curriculum: MeanFlow's loss of the residual / alpha, times alpha (its gradient tends to MeanFlow's)
        a = None if alpha is None else torch.where(t != r, alpha, 1.0)
        if a is not None:
            metrics["alpha"] = alpha_metric(alpha, x.device)
        # ||u - u_tgt||^2 per sample (pixel-scale part weighted)
        sq = squared_error(err if a is None else err / bcast(a, err), self.hf_weights(n, x.device))
        k1 = self.one_step_count(n)
        if self.perceptual_weight and k1:
            d = self.perceptual(teacher, z[:k1], u[:k1], err[:k1], None if y is None else y[:k1])
            # a part of the one-step samples' error, so that the adaptive weight bounds the sum's gradient as it
            # does the pixel error's; a term weighted apart, sg(1 / d) d, let grad log d drive the step
            sq = torch.cat([sq[:k1] + self.perceptual_weight * d, sq[k1:]])
            metrics["perceptual"] = d.detach().mean()
        loss = self.adaptive_weight(sq) * sq
        loss = (loss if a is None else a * loss).mean()
        return loss, {"loss": loss.detach(), **metrics}

    def generate(self, model, x, y):
        """The one-step sampler on fresh noise (t = 1 to r = 0), with the model's gradient (the regularisers of
        flm.objectives.dmd and flm.objectives.adversarial train through it)."""
        eps = torch.randn_like(x)
        n = x.shape[0]
        return eps - model(eps, eps.new_ones(n), eps.new_zeros(n), y)

    def sampler_times(self, steps: int, device) -> torch.Tensor:
        """The `steps` + 1 times of the few-step sampler, 1 to 0: through mid_t when steps == len(mid_t) + 1, else
        uniform."""
        if steps == len(self.mid_t) + 1:
            return torch.tensor([1.0, *self.mid_t, 0.0], device=device)
        return time_grid(steps, 1.0, 0.0, device=device)

    @torch.no_grad()
    def sample(self, model, noise, y=None, *, steps: int, cfg_scale: float = 1.0, generators=None):
        """z_r = z_t - (t - r) u(z_t, r, t) from t = 1 to 0 in `steps` jumps (eq. 12): through mid_t when
        steps == len(mid_t) + 1, else uniform.

        cfg_scale != 1 doubles the evaluations; models trained with guidance in training are
        meant for cfg_scale = 1. Deterministic: `generators` (the shared sampler signature) go unused.
        """
        check_cfg(model, y, cfg_scale)
        ts = self.sampler_times(steps, noise.device)
        z = noise
        for t, r in zip(ts[:-1], ts[1:]):
            n = z.shape[0]
            u = guided(model, z, t.expand(n), r.expand(n), y, cfg_scale, self.cfg_interval).float()
            z = z - (t - r) * u
        return z


class _Distilled:
    """A MeanFlow student whose teacher is required."""

    def __init__(self, *, teacher: str, **kwargs):
        if not teacher:
            raise ValueError("objective.teacher is not set; pass objective.teacher=<flow-matching run folder or .pt>")
        super().__init__(teacher=str(teacher), **kwargs)


class MeanFlowDMD(DMDRegularised, _Distilled, MeanFlow):
    """MeanFlow distilled from a teacher (MeanFlow's teacher option) plus the DMD score regulariser on its
    one-step samples x_g = eps - u(eps, 0, 1).

    Args: DMDRegularised's and MeanFlow's; teacher is required.
    """


class MeanFlowGAN(AdversarialRegularised, _Distilled, MeanFlow):
    """MeanFlow distilled from a teacher plus an adversarial loss on its one-step samples x_g = eps - u(eps, 0, 1)
    against the data, with an online discriminator (flm.objectives.adversarial).

    Args: AdversarialRegularised's and MeanFlow's; teacher is required.
    """
