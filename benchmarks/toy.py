"""A toy with a known answer: every objective trained on a 2-D Gaussian mixture, scored against the
exact flow map.

Data: K Gaussians N(mu_k, s^2 I) in 2-D. On any path x_t = a(t) x0 + b(t) n (n ~ N(0, sigma_n^2 I)) the
marginal velocity E[a' x0 + b' n | x_t] is a posterior-weighted sum of per-component Gaussian posteriors
(`GMM.velocity`), so the probability-flow ODE, and with it the exact flow map between any two times, is
known up to the error of a fine RK4 solver (`flow_map`). Two paths:
- linear (flow matching, MeanFlow): x_t = (1 - t) x0 + t eps, t = 1 noise;
- TrigFlow (sCM): x_t = cos t x0 + sin t z, z ~ N(0, sigma_d^2 I), t = pi/2 noise.

A small MLP (`ToyNet`, the objectives' call model(x, t, r, y), the DiT's time embedding with its
`time_scale`) is trained with an unchanged objective from flm.objectives. Reported against steps:
- err1 / err2: mean squared distance of the 1- / 2-step sample to the exact flow map of the same noise
  (sCM's 2-step sampler re-noises: its second jump is scored against the exact map of its own input);
- ed1 / ed2: energy distance of 1- / 2-step samples to fresh GMM samples, in the plane of the modes
  (noise floor: `ed_floor`).

    PYTHONPATH=. python benchmarks/toy.py --objective meanflow --steps 3000
    PYTHONPATH=. python benchmarks/toy.py --objective scm --steps 3000 --set warmup_steps=1000 --time-scale 1000
    PYTHONPATH=. python benchmarks/toy.py --objective flow_matching --steps 3000
    PYTHONPATH=. python benchmarks/toy.py --objective scd --steps 3000     # distilled from the exact velocity
    PYTHONPATH=. python benchmarks/toy.py --objective meanflow --set adaptive_p=0 --set alpha_steps=[0,1000]  # curriculum
    PYTHONPATH=. python benchmarks/toy.py --objective meanflow --cosine    # the lr decays to 0 at the last step
    PYTHONPATH=. python benchmarks/toy.py --objective meanflow --set adaptive_p=0 --set velocity_estimate=batch
    PYTHONPATH=. python benchmarks/toy.py --objective scm --set warmup_steps=200 --set velocity_estimate=batch \
        --set adaptive_weighting=false --set tangent_c=1.0      # the batch velocity without the adaptive weighting

sCD and rCM distil the exact marginal velocity of the linear path (`ExactTeacher`: the best teacher there
is), so their 1-step map must converge to the exact flow map; their student and rCM's fake score start
from the same fresh ToyNet (there are no teacher weights to start from). With `--teacher-steps N` a
flow-matching ToyNet trained for N steps is the teacher instead, and the student starts from its weights,
as a distillation in flm does:

    PYTHONPATH=. python benchmarks/toy.py --objective meanflow --set teacher=exact --set tangent=sample \
        --set r_neq_t=1.0 --teacher-steps 2000 --steps 1000          # objective=meanflow_distill's choices

With `--classes` the toy is class-conditional: each mixture component is a class (label dropout 0.1 by default, for
the null class), and guidance in training (`--set cfg_omega=W`) has an exact answer too: the guided velocity
W v(x, t | k) + (1 - W) v(x, t), the class's own Gaussian velocity and the mixture's, both closed form. The scores are
then taken against the exact map of the guided flow (of the conditional flow at W = 1), labels 0..K-1 cycling:

    PYTHONPATH=. python benchmarks/toy.py --objective scm --classes --set cfg_omega=2.0
    PYTHONPATH=. python benchmarks/toy.py --objective scm --classes --set cfg_omega=2.0 --set velocity_weight=1.0

For sCM the scores add err1_sg, the distance to the map of the field its guidance targets with sigma_d F(null) as the
null velocity (scm_guided_velocity), which is what it learns without the velocity head (velocity_weight 0).
"""

import argparse
import ast
import copy
import json
import math
import time

import torch
from torch import nn

from flm.models.dit import TimestepEmbedder
from flm.objectives import build_objective
from flm.train.loop import start_from


# --------------------------------------------------------------------------------------------
# Data with an exact velocity
# --------------------------------------------------------------------------------------------


class GMM:
    """K weighted isotropic Gaussians N(mu_k, s^2 I) in any dimension (float64)."""

    def __init__(self, means: torch.Tensor, s: float, weights: torch.Tensor | None = None):
        self.means = means.double()  # (K, 2)
        self.s = s
        k = means.shape[0]
        self.weights = (torch.full((k,), 1.0 / k) if weights is None else weights / weights.sum()).double()

    def sample(self, n: int, generator=None) -> torch.Tensor:
        return self.sample_labeled(n, generator)[0]

    def sample_labeled(self, n: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, the component each x was drawn from)."""
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        return self.means[k] + self.s * torch.randn(n, self.dim, generator=generator, dtype=torch.float64), k

    @property
    def num_classes(self) -> int:
        return self.means.shape[0]

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    def velocity(self, x, a, b, da, db, sigma_n, classes=None):
        """E[da x0 + db n | x_t = x] for x_t = a x0 + b n; a, b, da, db broadcast as (B, 1). classes: (B,) components
        to condition on (the velocity of that Gaussian alone), None for the mixture's."""
        var = a**2 * self.s**2 + b**2 * sigma_n**2  # (B, 1): per-component variance of x_t
        diff = x[:, None, :] - a[:, None] * self.means[None]  # (B, K, 2): x - a mu_k
        # (B, K); the shared normaliser var^(-dim/2) cancels in the softmax
        logp = -0.5 * diff.square().sum(-1) / var + torch.log(self.weights)
        w = torch.softmax(logp, dim=1)[..., None]  # (B, K, 1) responsibilities
        if classes is not None:
            w = nn.functional.one_hot(classes, self.num_classes).to(w)[..., None]
        x0 = self.means[None] + (a * self.s**2 / var)[:, None] * diff  # E[x0 | x_t, k]
        n = (b * sigma_n**2 / var)[:, None] * diff  # E[n | x_t, k]
        return (w * (da[:, None] * x0 + db[:, None] * n)).sum(1)


def guided_velocity(gmm: GMM, coefficients, classes, omega: float):
    """omega v(x, t | classes) + (1 - omega) v(x, t) (the conditional velocity alone at omega = 1; the mixture's
    without classes), on the path that coefficients(t) = (a, b, da, db, sigma_n) describes."""

    def v(x, t):
        coef = coefficients(t.reshape(-1, 1).double())
        if classes is None:
            return gmm.velocity(x, *coef)
        cond = gmm.velocity(x, *coef, classes=classes)
        return cond if omega == 1.0 else omega * cond + (1 - omega) * gmm.velocity(x, *coef)

    return v


def linear_velocity(gmm: GMM, classes=None, omega: float = 1.0):
    """Marginal velocity of x_t = (1 - t) x0 + t eps (the flow-matching target's conditional mean); with classes,
    the guided one (`guided_velocity`)."""
    return guided_velocity(gmm, lambda t: (1 - t, t, -torch.ones_like(t), torch.ones_like(t), 1.0), classes, omega)


def trig_velocity(gmm: GMM, sigma_d: float, classes=None, omega: float = 1.0):
    """Marginal velocity of x_t = cos t x0 + sin t z, z ~ N(0, sigma_d^2 I); with classes, the guided one."""
    return guided_velocity(gmm, lambda t: (torch.cos(t), torch.sin(t), -torch.sin(t), torch.cos(t), sigma_d), classes, omega)


def scm_guided_velocity(gmm: GMM, sigma_d: float, classes, omega: float, steps: int = 40):
    """The field that sCM's guidance in training (flm.objectives.consistency, cfg_omega) targets where its null-class
    model is exact: omega v(x, t | k) + (1 - omega) sigma_d F(x, t | null), F the exact consistency model's
    (cos t x - sin t sigma_d F = the flow map to t = 0). sigma_d F is not the flow's velocity at t > 0 (d/dt of the
    consistency function gives v = sigma_d F + tan t (x + sigma_d dF/dt)), so this is not the guided flow."""
    v_null, v_cond = trig_velocity(gmm, sigma_d), trig_velocity(gmm, sigma_d, classes)

    def v(x, t):
        t = t.reshape(-1).double()
        f = flow_map(v_null, x, t, 0.0, steps=steps)
        sigma_d_F = (torch.cos(t)[:, None] * x - f) / torch.sin(t)[:, None]
        return omega * v_cond(x, t) + (1 - omega) * sigma_d_F

    return v


def flow_map(velocity, x, t_from, t_to, steps: int = 100):
    """Integrate dx/dt = velocity(x, t) from t_from to t_to (floats or (B,) tensors) with RK4, float64."""
    x = x.double()
    t_from = torch.as_tensor(t_from, dtype=torch.float64).expand(x.shape[0])
    t_to = torch.as_tensor(t_to, dtype=torch.float64).expand(x.shape[0])
    h = ((t_to - t_from) / steps)[:, None]
    t = t_from.clone()
    for _ in range(steps):
        k1 = velocity(x, t)
        k2 = velocity(x + 0.5 * h * k1, t + 0.5 * h[:, 0])
        k3 = velocity(x + 0.5 * h * k2, t + 0.5 * h[:, 0])
        k4 = velocity(x + h * k3, t + h[:, 0])
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        t = t + h[:, 0]
    return x


def energy_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """2 E|X - Y| - E|X - X'| - E|Y - Y'| (0 iff the distributions agree)."""
    x, y = x.double(), y.double()
    return float(2 * torch.cdist(x, y).mean() - torch.cdist(x, x).mean() - torch.cdist(y, y).mean())


def default_gmm(dim: int = 2) -> GMM:
    """8 modes on a ring of radius 1 (std 0.1), uneven weights: a few-step map must bend to hit them.

    dim > 2 pads the means with zeros: dim - 2 more coordinates, N(0, 0.1^2) in every mode. The exact
    answer stays known, and per-sample losses then sum over many noisy coordinates, as over an image's
    pixels (a low-dimensional toy exaggerates any weighting that depends on the sample's own error).
    """
    angles = torch.arange(8) * (2 * math.pi / 8)
    means = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    means = torch.cat([means, torch.zeros(8, dim - 2)], dim=1)
    return GMM(means, s=0.1, weights=torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.5]))


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class ToyNet(nn.Module):
    """model(x, t, r=None, y=None) -> (B, dim): an MLP with the DiT's time embedding (of t, and t - r when
    time_inputs=2) and, with num_classes, a label embedding (index num_classes: the null class), the conditioning
    added before every hidden layer; velocity_head: a second output layer (the DiT's head="velocity" / "both")."""

    def __init__(
        self,
        time_inputs: int = 1,
        time_scale: float = 1.0,
        hidden: int = 128,
        depth: int = 3,
        dim: int = 2,
        num_classes: int = 0,
        velocity_head: bool = False,
    ):
        super().__init__()
        self.time_inputs, self.num_classes = time_inputs, num_classes
        self.y_embedder = nn.Embedding(num_classes + 1, hidden) if num_classes else None
        self.t_embedder = TimestepEmbedder(hidden, time_scale=time_scale)
        self.dt_embedder = TimestepEmbedder(hidden, time_scale=time_scale) if time_inputs == 2 else None
        self.inp = nn.Linear(dim, hidden)
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.cond = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, dim)
        self.velocity_out = nn.Linear(hidden, dim) if velocity_head else None

    def forward(self, x, t, r=None, y=None, head: str = "output"):
        t = t.expand(x.shape[0]) if t.dim() == 0 else t
        c = self.t_embedder(t)
        if self.dt_embedder is not None:
            c = c + self.dt_embedder(t - r)
        if self.y_embedder is not None and y is not None:
            c = c + self.y_embedder(y)
        c = nn.functional.silu(c)
        h = self.inp(x)
        for lin, cond in zip(self.hidden, self.cond):
            h = h + lin(nn.functional.silu(h + cond(c)))
        h = nn.functional.silu(h)
        if head == "output":
            return self.out(h)
        if head == "velocity":
            return self.velocity_out(h)
        return torch.cat([self.out(h), self.velocity_out(h)], dim=1)


class ExactTeacher(nn.Module):
    """A flow-matching teacher whose velocity is the exact marginal one, called as a model(x, t, r, y)."""

    num_classes = 0

    def __init__(self, gmm: GMM):
        super().__init__()
        self.velocity = linear_velocity(gmm)

    def forward(self, x, t, r=None, y=None):
        return self.velocity(x, t.expand(x.shape[0]) if t.dim() == 0 else t).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Scoring against the exact map
# --------------------------------------------------------------------------------------------


class Scorer:
    """Fixed evaluation noise, its exact flow map to t = 0 and fresh data for the energy distance."""

    def __init__(self, objective, gmm: GMM, n: int = 1000, seed: int = 1234, classes: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.objective, self.gmm = objective, gmm
        self.noise = torch.randn(n, gmm.dim, generator=g, dtype=torch.float64)
        # labels cycle over the classes; the energy distance is then to data of the same labels (unguided: guidance
        # sharpens the samples away from it by design, err1 / err2 score the guided map)
        self.labels = torch.arange(n) % gmm.num_classes if classes else None

        def draw():
            if not classes:
                return gmm.sample(n, generator=g)
            return gmm.means[self.labels] + gmm.s * torch.randn(n, gmm.dim, generator=g, dtype=torch.float64)

        self.data = draw()[:, :2]  # energy distances in the plane of the modes
        self.ed_floor = energy_distance(draw()[:, :2], self.data)
        self.scm = hasattr(objective, "sigma_d")
        omega = getattr(objective, "cfg_omega", 1.0)
        self.scm_guided = None  # where sCM's guidance in training leads instead (err1_sg)
        if self.scm:
            self.velocity = trig_velocity(gmm, objective.sigma_d, self.labels, omega)
            self.t_start = objective.t_max
            self.x_start = objective.sigma_d * self.noise
            if classes and omega != 1.0:
                field = scm_guided_velocity(gmm, objective.sigma_d, self.labels, omega)
                self.scm_guided = flow_map(field, self.x_start, self.t_start, 0.0, steps=50)
        else:
            self.velocity = linear_velocity(gmm, self.labels, omega)
            self.t_start, self.x_start = 1.0, self.noise
        self.exact = flow_map(self.velocity, self.x_start, self.t_start, 0.0)

    @torch.no_grad()
    def __call__(self, model) -> dict:
        noise, y = self.noise.float(), self.labels
        x1 = self.objective.sample(model, noise, y, steps=1).double()
        out = {"err1": float((x1 - self.exact).square().sum(1).mean()), "ed1": energy_distance(x1[:, :2], self.data)}
        if y is not None:  # guidance pushes samples out of the ring: the 1-step samples' mean radius, and the exact map's
            out.update(rad1=float(x1[:, :2].norm(dim=1).mean()), rad_exact=float(self.exact[:, :2].norm(dim=1).mean()))
        if self.scm_guided is not None:
            out["err1_sg"] = float((x1 - self.scm_guided).square().sum(1).mean())
            out["rad_sg"] = float(self.scm_guided[:, :2].norm(dim=1).mean())
        if self.scm:  # the second jump from its own re-noised input at mid_t
            t_mid = self.objective.mid_t[0]
            eps = torch.randn(noise.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
            x_mid = math.cos(t_mid) * x1 + math.sin(t_mid) * self.objective.sigma_d * eps
            x2 = self.objective.consistency_fn(model, x_mid.float(), t_mid, y).double()
            exact2 = flow_map(self.velocity, x_mid, t_mid, 0.0)
        else:
            x2 = self.objective.sample(model, noise, y, steps=2).double()
            exact2 = self.exact
        out.update(err2=float((x2 - exact2).square().sum(1).mean()), ed2=energy_distance(x2[:, :2], self.data))
        return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def train(objective_name: str, **kwargs) -> list[dict]:
    """fit()'s history: the scores of the EMA model, every eval_every steps."""
    return fit(objective_name, **kwargs)[0]


def fit(
    objective_name: str,
    *,
    steps: int = 2000,
    batch: int = 256,
    lr: float = 1e-3,
    lr_warmup: int = 100,
    cosine: bool = False,
    ema: float = 0.99,
    time_scale: float = 1.0,
    hidden: int = 128,
    depth: int = 3,
    eval_every: int = 500,
    seed: int = 0,
    dim: int = 2,
    n_eval: int = 1000,
    fit_teacher_steps: int = 0,
    classes: bool = False,
    log=print,
    **objective_kwargs,
) -> tuple[list[dict], nn.Module]:
    """Train ToyNet with an objective from flm.objectives; (the scores of the EMA model every eval_every
    steps, the EMA model).

    fit_teacher_steps: 0 distils (sCD, rCM, MeanFlow with teacher=...) the exact velocity into a fresh student;
    N > 0 first trains a flow-matching ToyNet for N steps, which is then the teacher and the student's (and
    rCM's fake score's) initialisation, as a distillation in flm starts (flm.train.loop.start_from).
    classes: each component is a class (the labels go to the objective; scored against the guided flow's map).
    """
    settings = dict(
        batch=batch, lr=lr, lr_warmup=lr_warmup, cosine=cosine, ema=ema, time_scale=time_scale, hidden=hidden, depth=depth
    )
    gmm = default_gmm(dim)
    teacher = ExactTeacher(gmm)
    if fit_teacher_steps:
        log(f"flow-matching teacher, {fit_teacher_steps} steps:")
        every = dict(eval_every=fit_teacher_steps, seed=seed, dim=dim, n_eval=n_eval, fit_teacher_steps=0, log=log)
        teacher = fit("flow_matching", steps=fit_teacher_steps, **settings, **every)[1]
    torch.manual_seed(seed)
    objective_kwargs.setdefault("label_dropout", 0.1 if classes else 0.0)
    if objective_name in ("scd", "rcm", "meanflow_dmd"):
        objective_kwargs.setdefault("teacher", "exact")  # a name only: `teacher` above is the teacher
    objective = build_objective(objective_name, **objective_kwargs)
    k = gmm.num_classes if classes else 0
    model = ToyNet(
        objective.time_inputs,
        time_scale,
        hidden,
        depth,
        dim,
        num_classes=k,
        velocity_head=getattr(objective, "velocity_head", False),
    )
    declared = getattr(objective, "networks", {})  # distillation: the teacher, and rCM's fake score
    if classes and (declared or objective_kwargs.get("teacher")):
        raise ValueError("classes=True: the toy's teachers are unconditional; distil without classes")
    if fit_teacher_steps and any(network.model_init for network in declared.values()):
        start_from(model, teacher)
    ema_model = copy.deepcopy(model).requires_grad_(False)
    # an objective's target network (MeanFlow's split_target=ema, sCD's one_step_ema): an EMA at its own decay
    target_decay = getattr(objective, "target_ema_decay", None)
    averages = {ema: ema_model}
    if target_decay and target_decay not in averages:
        averages[target_decay] = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(list(model.parameters()) + list(objective.parameters()), lr=lr)

    def lr_factor(s):  # linear warm-up, then constant or (cosine) a cosine decay to 0 at the last step
        decay = 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))) if cosine else 1.0
        return min(1.0, (s + 1) / max(1, lr_warmup)) * decay

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    networks, optimizers = {}, {"model": (model, opt)}
    fresh = lambda: ToyNet(1, time_scale, hidden, depth, dim)  # noqa: E731
    for name, network in declared.items():
        networks[name] = fake_score_start(teacher, model, fit_teacher_steps, fresh) if network.trainable else teacher
        if network.trainable:
            optimizers[name] = (networks[name], torch.optim.Adam(networks[name].parameters(), **{"lr": lr, **network.optim}))
    scorer = Scorer(objective, gmm, n=n_eval, classes=classes)
    data_gen = torch.Generator().manual_seed(seed + 1)
    history, t0 = [], time.perf_counter()
    for step in range(steps):
        x, y = gmm.sample_labeled(batch, generator=data_gen)
        target = {"ema": averages[target_decay]} if target_decay else {}
        loss, _ = objective.loss(model, x.float(), y if classes else None, step=step, **networks, **target)
        losses = loss if isinstance(loss, dict) else {"model": loss}  # {network: its loss}
        for name, value in losses.items():
            net, net_opt = optimizers[name]
            net_opt.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            net_opt.step()
        if "model" in losses:  # rCM's fake-score steps leave the student (and its warm-up) alone
            sched.step()
        with torch.no_grad():
            for decay, average in averages.items():
                for p_ema, p in zip(average.parameters(), model.parameters()):
                    p_ema.lerp_(p, 1 - decay)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            row = {"step": step + 1, **scorer(ema_model), "s": round(time.perf_counter() - t0, 1)}
            history.append(row)
            log(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}))
    history[-1]["ed_floor"] = scorer.ed_floor
    return history, ema_model


def fake_score_start(teacher, student, fit_teacher_steps, fresh):
    """A fake score (rCM, MeanFlow + DMD) is a flow-matching network: the trained teacher's copy, else the fresh
    student's where it is one (time_inputs 1), else fresh() (a flow-matching ToyNet of the student's shape)."""
    if fit_teacher_steps:
        return copy.deepcopy(teacher).requires_grad_(True)
    return copy.deepcopy(student) if student.time_inputs == 1 else fresh()


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.startswith("["):  # a list, e.g. alpha_steps=[500,2000]
        return ast.literal_eval(text)
    return {"true": True, "false": False}.get(text, text)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objective", default="meanflow", choices=["flow_matching", "meanflow", "scm", "scd", "rcm", "meanflow_dmd"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--cosine", action="store_true", help="decay the lr to 0 at the last step (a cosine), as the MNIST presets do")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=2, help="data dimension (> 2: zero-mean padding coordinates)")
    p.add_argument("--classes", action="store_true", help="class-conditional: each component a class (see above)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="objective keyword argument")
    p.add_argument(
        "--teacher-steps", type=int, default=0, help="distillation: train a flow-matching teacher this long first (0: exact)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    kwargs = dict(kv.split("=", 1) for kv in args.set)
    history = train(
        args.objective,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        cosine=args.cosine,
        ema=args.ema,
        time_scale=args.time_scale,
        eval_every=args.eval_every,
        seed=args.seed,
        dim=args.dim,
        fit_teacher_steps=args.teacher_steps,
        classes=args.classes,
        **{k: _value(v) for k, v in kwargs.items()},
    )
    print(f"energy-distance floor (two GMM samples): {history[-1]['ed_floor']:.5f}")


if __name__ == "__main__":
    main()
