"""An adversarial loss on a distilled student's one-step samples, with the discriminator it trains online
(adversarial distillation: the GAN term that ADD and DMD2 give their few-step students). MeanFlow's student
takes it (flm.objectives.meanflow.MeanFlowGAN).

The distillation loss pulls the student towards its teacher's flow map; the adversarial loss pulls its
one-step samples towards the data, which the teacher's map only approximates. On the one-step samples
x_g = generate(model, ...) of k = ceil(adv_frac B) fresh noises with the batch's first k labels:

    L_G = softplus(-D(x_g, y))                                                  (non-saturating; the student's)
    L_D = softplus(D(sg(x_g), y)) + softplus(-D(x, y)) + r1_gamma / 2 ||grad_x D(x, y)||^2      (x: the batch)

The student's loss gains adv_weight * mean L_G; the discriminator takes mean L_D with its own optimizer
(disc_lr) in the same step. The student's term reaches the student only: its gradient in x_g is taken
through D with D's weights held (a surrogate (x_g . sg(g)) whose gradient is g), so D is never trained to
help the student. D is a small convolutional network on the images (or latents), conditioned on the class by
a projection (flm.objectives.adversarial.Discriminator), saved in the checkpoint; it is built from the
model's image size, channels and classes.
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from flm.objectives.guidance import unwrap
from flm.objectives.protocol import Network


class Discriminator(nn.Module):
    """Strided 4x4 convolutions (width, 2 width, ...) with LeakyReLU, summed over space, and a linear logit
    plus a class projection <embed(y), h> (the projection discriminator); any image size."""

    def __init__(self, in_channels: int, num_classes: int = 0, width: int = 64, depth: int = 3):
        super().__init__()
        layers, c = [], in_channels
        for i in range(depth):
            layers += [nn.Conv2d(c, width * 2**i, 4, stride=2, padding=1), nn.LeakyReLU(0.2)]
            c = width * 2**i
        self.features = nn.Sequential(*layers)
        self.logit = nn.Linear(c, 1)
        self.embed = nn.Embedding(num_classes, c) if num_classes else None

    def forward(self, x, y=None):
        h = self.features(x).sum((2, 3))
        out = self.logit(h).squeeze(1)
        if self.embed is not None and y is not None:
            out = out + (self.embed(y) * h).sum(1)
        return out


def build_discriminator(model_args: dict, *, width: int, depth: int) -> Discriminator:
    return Discriminator(model_args["in_channels"], model_args.get("num_classes", 0), width=width, depth=depth)


class AdversarialRegularised:
    """Mixin before a distillation objective (one with a loss(model, x, y, *, step, teacher)): adds the adversarial
    term and the discriminator. The class that mixes it in defines generate(model, x, y): the student's one-step
    samples from fresh noise, shaped like x, with the model's gradient.

    Args:
        adv_weight: weight of the student's adversarial loss (its distillation loss is ~1 with MeanFlow's
            adaptive weight).
        adv_frac: the fraction of the batch that the student generates for it (a one-step forward and backward of
            the student on that many samples: its cost).
        disc_lr: the discriminator's learning rate (its other optimizer settings are optim.*'s).
        r1_gamma: weight of the R1 penalty on the discriminator's gradient at the data (0: none).
        disc_width, disc_depth: the discriminator's first width and number of strided convolutions.
        **kwargs: the distillation objective's.
    """

    def __init__(
        self,
        *,
        adv_weight: float = 0.3,
        adv_frac: float = 0.25,
        disc_lr: float = 2e-4,
        r1_gamma: float = 0.1,
        disc_width: int = 64,
        disc_depth: int = 3,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not (0 <= adv_weight < math.inf and 0 < adv_frac <= 1 and 0 < disc_lr < math.inf and 0 <= r1_gamma < math.inf):
            raise ValueError(
                f"the adversarial loss needs adv_weight >= 0, adv_frac in (0, 1], disc_lr > 0 and r1_gamma >= 0, got "
                f"adv_weight={adv_weight!r}, adv_frac={adv_frac!r}, disc_lr={disc_lr!r}, r1_gamma={r1_gamma!r}"
            )
        for name, v in (("disc_width", disc_width), ("disc_depth", disc_depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.adv_weight, self.adv_frac, self.r1_gamma = adv_weight, adv_frac, r1_gamma
        build = functools.partial(build_discriminator, width=disc_width, depth=disc_depth)
        self.networks = {**self.networks, "discriminator": Network(build=build, trainable=True, optim={"lr": disc_lr})}

    def loss(self, model, x, y=None, *, step=0, teacher, discriminator):
        if self.r1_gamma and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "objective.r1_gamma > 0 takes a double backward through the discriminator, which DDP does not "
                "support; set objective.r1_gamma=0 for a multi-process run"
            )
        student_loss, metrics = super().loss(model, x, y, step=step, teacher=teacher)
        k = max(1, math.ceil(self.adv_frac * x.shape[0]))
        y_g = None if y is None else y[:k]
        x_g = self.generate(model, x[:k], y_g)

        # the student's term, through D with its weights held: g = d mean L_G / d x_g (the module under DDP: no
        # gradient hooks, as no weight gradient is taken)
        x_in = x_g.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(F.softplus(-unwrap(discriminator)(x_in, y_g).float()).mean(), x_in)

        # the discriminator's: data against the student's samples, in one forward (one DDP forward per step)
        real = x.detach().requires_grad_(bool(self.r1_gamma))
        both = torch.cat([real, x_g.detach().to(real.dtype)])
        labels = None if y is None else torch.cat([y, y_g])
        logits = discriminator(both, labels).float()
        d_real, d_fake = logits[: x.shape[0]], logits[x.shape[0] :]
        disc_loss = F.softplus(-d_real).mean() + F.softplus(d_fake).mean()
        if self.r1_gamma:
            (grad_real,) = torch.autograd.grad(d_real.sum(), real, create_graph=True)
            r1 = grad_real.float().square().flatten(1).sum(1).mean()
            disc_loss = disc_loss + 0.5 * self.r1_gamma * r1
            metrics["r1"] = r1.detach()
        surrogate = (x_g.float() * g.float()).sum()  # its gradient in x_g is g; its value is L_G's below
        adv = surrogate - surrogate.detach() + F.softplus(-d_fake).mean().detach()
        loss = student_loss + self.adv_weight * adv
        with torch.no_grad():
            metrics.update(
                loss=loss.detach(),
                adv=adv.detach(),
                disc_loss=disc_loss.detach(),
                d_real=d_real.mean().detach(),
                d_fake=d_fake.mean().detach(),
            )
        return {"model": loss, "discriminator": disc_loss}, metrics
