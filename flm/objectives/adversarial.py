"""An adversarial loss on a distilled student's one-step samples, with the discriminator it trains online
(adversarial distillation: the GAN term that ADD and DMD2 give their few-step students). MeanFlow's student
takes it (flm.objectives.meanflow.MeanFlowGAN), and rCM's (flm.objectives.distillation.RCMGAN: DMD2's pair of
regularisers, DMD and the GAN term, on the sCD student; the term waits for DMD's start and skips the fake score's
steps).

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

With disc_backbone="teacher" D is instead small trainable heads on the frozen teacher's hidden states
(FeatureDiscriminator), as latent adversarial diffusion distillation does: D(x, y) = heads(teacher(x_s, s,
y, features=blocks)) at x_s = (1 - s) x + s eps, s ~ logit-normal(disc_t_mean, disc_t_std), one draw per image. The teacher's
features separate real from generated images from the first step (no discriminator to learn from scratch), and the
noise makes D smooth in x. Its cost: the teacher's trunk up to the last feature block, forward and backward on the
k generated images and forward on k data images.

With adv_loss="feature_matching" (teacher backbone only) there is no discriminator to train: the student's term is
feature matching on the same features, the squared distance between the batch means of each feature block's
per-image statistics (the mean and standard deviation of its hidden states over the tokens) for the k generated
images and k data images noised to the same s, each statistic scaled by its spread over both batches. An online
discriminator learns too slowly for a run of a few hundred steps (docs/distillation.md: flm's heads sit at chance,
while a linear probe on these statistics tells the student's samples from the data); the batch statistics are
there from the first step.
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from flm.models import MODEL_SIZES
from flm.objectives.guidance import unwrap
from flm.objectives.paths import logit_normal
from flm.objectives.protocol import Network
from flm.objectives.teacher import feature_blocks, teacher_features

BACKBONES = ("cnn", "teacher")
ADV_LOSSES = ("gan", "feature_matching")


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


class FeatureHead(nn.Module):
    """One block's head: LayerNorm, a linear to `width` and LeakyReLU per token, then a linear logit plus a class
    projection <embed(y), h> per token, averaged over the tokens."""

    def __init__(self, hidden: int, num_classes: int, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.proj = nn.Linear(hidden, width)
        self.logit = nn.Linear(width, 1)
        self.embed = nn.Embedding(num_classes, width) if num_classes else None

    def forward(self, f, y=None):
        h = F.leaky_relu(self.proj(self.norm(f)), 0.2)  # (B, N, width)
        out = self.logit(h).squeeze(-1)  # (B, N)
        if self.embed is not None and y is not None:
            out = out + (h * self.embed(y)[:, None]).sum(-1)
        return out.mean(1)


class FeatureDiscriminator(nn.Module):
    """Heads on a frozen network's hidden states after the blocks `blocks`: forward(features, y) -> (B, heads) logits,
    features the list the DiT returns for those blocks (its forward's `features=`)."""

    def __init__(self, hidden: int, num_classes: int, blocks, width: int = 256):
        super().__init__()
        self.feature_blocks = tuple(blocks)  # not `blocks`: FSDP2 shards a module's `blocks` one by one
        self.heads = nn.ModuleList(FeatureHead(hidden, num_classes, width) for _ in self.feature_blocks)

    def forward(self, features, y=None):
        return torch.stack([head(f.float(), y) for head, f in zip(self.heads, features)], 1)


def pooled_statistics(hidden: torch.Tensor) -> torch.Tensor:
    """(B, N, D) hidden states -> (B, 2D): each image's mean and standard deviation over its tokens."""
    hidden = hidden.float()
    return torch.cat([hidden.mean(1), hidden.std(1)], 1)


def build_feature_discriminator(model_args: dict, *, width: int, blocks) -> FeatureDiscriminator:
    depth, hidden = MODEL_SIZES[model_args["name"]][:2]
    blocks = feature_blocks(depth, blocks, "objective.disc_blocks")
    return FeatureDiscriminator(hidden, model_args.get("num_classes", 0), blocks, width=width)


class AdversarialRegularised:
    """Mixin before a distillation objective (one with a loss(model, x, y, *, step, teacher, ...) giving the student's
    loss, or a dict of losses per network with the student's under "model"): adds the adversarial term and the
    discriminator. The class that mixes it in defines generate(model, x, y): the student's one-step samples from fresh
    noise, shaped like x, with the model's gradient. Before another regulariser (DMD) it passes that one's networks
    and phase on, and takes its term in the phase "model" alone.

    Args:
        adv_weight: weight of the student's adversarial loss (its distillation loss is ~1 with MeanFlow's
            adaptive weight).
        adv_frac: the fraction of the batch that the student generates for it (a one-step forward and backward of
            the student on that many samples: its cost).
        disc_lr: the discriminator's learning rate (its other optimizer settings are optim.*'s).
        r1_gamma: weight of the R1 penalty on the discriminator's gradient at the data (0: none).
        disc_backbone: "cnn" (a small convolutional D on the images) or "teacher" (heads on the frozen teacher's
            features of the noised images).
        disc_width: the CNN's first width, or the width of each head.
        disc_depth: the CNN's number of strided convolutions.
        disc_blocks: the teacher's blocks the heads read (null: four evenly spaced ones, the last included).
        disc_t_mean, disc_t_std: the logit-normal of the noise level s of the teacher backbone's input.
        adv_loss: "gan" (the discriminator above) or "feature_matching" (the teacher backbone's feature statistics,
            no discriminator).
        adv_from_start: with a phased objective (rCM's dmd_start), the term in its distillation-alone steps too.
        **kwargs: the distillation objective's.
    """

    def __init__(
        self,
        *,
        adv_weight: float = 0.3,
        adv_frac: float = 0.25,
        disc_lr: float = 2e-4,
        r1_gamma: float = 0.1,
        disc_backbone: str = "cnn",
        disc_width: int = 64,
        disc_depth: int = 3,
        disc_blocks=None,
        disc_t_mean: float = -1.0,
        disc_t_std: float = 1.0,
        adv_loss: str = "gan",
        adv_from_start: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if adv_loss not in ADV_LOSSES:
            raise ValueError(f"objective.adv_loss must be one of {', '.join(ADV_LOSSES)}, got {adv_loss!r}")
        if adv_loss == "feature_matching" and disc_backbone != "teacher":
            raise ValueError(
                "objective.adv_loss=feature_matching matches the teacher's features; set objective.disc_backbone=teacher"
            )
        if not (0 <= adv_weight < math.inf and 0 < adv_frac <= 1 and 0 < disc_lr < math.inf and 0 <= r1_gamma < math.inf):
            raise ValueError(
                f"the adversarial loss needs adv_weight >= 0, adv_frac in (0, 1], disc_lr > 0 and r1_gamma >= 0, got "
                f"adv_weight={adv_weight!r}, adv_frac={adv_frac!r}, disc_lr={disc_lr!r}, r1_gamma={r1_gamma!r}"
            )
        for name, v in (("disc_width", disc_width), ("disc_depth", disc_depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if disc_backbone not in BACKBONES:
            raise ValueError(f"objective.disc_backbone must be one of {', '.join(BACKBONES)}, got {disc_backbone!r}")
        if disc_backbone == "teacher" and r1_gamma:
            raise ValueError(
                "objective.r1_gamma > 0 would take a double backward through the teacher; the teacher backbone's noised "
                "input keeps D smooth instead: set objective.r1_gamma=0 with objective.disc_backbone=teacher"
            )
        if not (math.isfinite(disc_t_mean) and 0 < disc_t_std < math.inf):
            raise ValueError(f"disc_t_mean must be finite and disc_t_std > 0, got {disc_t_mean!r} and {disc_t_std!r}")
        self.adv_weight, self.adv_frac, self.r1_gamma = adv_weight, adv_frac, r1_gamma
        self.disc_backbone, self.disc_t_mean, self.disc_t_std = disc_backbone, disc_t_mean, disc_t_std
        self.adv_loss, self.disc_blocks, self.adv_from_start = adv_loss, disc_blocks, bool(adv_from_start)
        if adv_loss == "feature_matching":
            return  # no discriminator network
        if disc_backbone == "cnn":
            build = functools.partial(build_discriminator, width=disc_width, depth=disc_depth)
        else:
            build = functools.partial(build_feature_discriminator, width=disc_width, blocks=disc_blocks)
        self.networks = {**self.networks, "discriminator": Network(build=build, trainable=True, optim={"lr": disc_lr})}

    def seen(self, x, y, teacher, discriminator):
        """What D takes for images x: x itself (cnn), or the teacher's features of x noised to s (teacher), with the
        gradient in x where x has one."""
        if self.disc_backbone == "cnn":
            return x
        s = logit_normal(x.shape[0], self.disc_t_mean, self.disc_t_std, device=x.device)
        eps = torch.randn_like(x, dtype=torch.float32)
        return teacher_features(teacher, x, s, eps, y, unwrap(discriminator).feature_blocks)

    def feature_matching(self, x_g, x, y, teacher):
        """Feature matching: for each block, the squared distance between the generated and the data images' batch
        means of the per-image token mean and std of its hidden states, over each statistic's spread in the two batches;
        image i of each batch noised with the same s and noise, both batches with the labels y."""
        blocks = feature_blocks(len(unwrap(teacher).blocks), self.disc_blocks, "objective.disc_blocks")
        s = logit_normal(x_g.shape[0], self.disc_t_mean, self.disc_t_std, device=x_g.device)
        eps = torch.randn_like(x_g, dtype=torch.float32)
        fake = teacher_features(teacher, x_g, s, eps, y, blocks)
        with torch.no_grad():
            real = teacher_features(teacher, x, s, eps, y, blocks)
        loss = 0.0
        for f, r in zip(fake, real):
            f, r = pooled_statistics(f), pooled_statistics(r)
            scale = torch.cat([f.detach(), r]).std(0, correction=0) + 1e-3  # defined for one image of each too
            loss = loss + ((f.mean(0) - r.mean(0)) / scale).square().mean()
        return loss / len(fake)

    def loss(self, model, x, y=None, *, step=0, teacher, discriminator=None, **networks):
        if self.r1_gamma and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError(
                "objective.r1_gamma > 0 takes a double backward through the discriminator, which DDP does not "
                "support; set objective.r1_gamma=0 for a multi-process run"
            )
        out, metrics = super().loss(model, x, y, step=step, teacher=teacher, **networks)
        losses = dict(out) if isinstance(out, dict) else {"model": out}
        # a phased objective (rCM) takes the term in its student steps with DMD (and with adv_from_start in its
        # distillation-alone steps before them), never in its fake score's steps (phase is given with a CUDA graph's
        # tensor step)
        phase = networks.get("phase") or (self.phase(step) if hasattr(self, "phase") else None)
        if phase not in (None, "model") and not (phase == "distill" and self.adv_from_start):
            return losses, metrics
        student_loss = losses["model"]
        k = max(1, math.ceil(self.adv_frac * x.shape[0]))
        y_g = None if y is None else y[:k]
        x_g = self.generate(model, x[:k], y_g)
        if self.adv_loss == "feature_matching":
            fm = self.feature_matching(x_g, x[:k], y_g, teacher)  # the generated images take the batch's labels
            losses.update(model=student_loss + self.adv_weight * fm)
            metrics.update(loss=losses["model"].detach(), adv=fm.detach())
            return losses, metrics

        # the student's term, through D with its weights held: g = d mean L_G / d x_g (the module under DDP: no
        # gradient hooks, as no weight gradient is taken)
        x_in = x_g.detach().requires_grad_(True)
        seen_fake = self.seen(x_in, y_g, teacher, discriminator)
        (g,) = torch.autograd.grad(F.softplus(-unwrap(discriminator)(seen_fake, y_g).float()).mean(), x_in)

        # the discriminator's: data against the student's samples, in one forward (one DDP forward per step); the
        # teacher backbone sees as many data images as generated ones (its forward is the cost)
        n_real = x.shape[0] if self.disc_backbone == "cnn" else k
        y_real = None if y is None else y[:n_real]
        real = x[:n_real].detach().requires_grad_(bool(self.r1_gamma))
        with torch.no_grad():
            seen_real = self.seen(real, y_real, teacher, discriminator)
        if self.disc_backbone == "cnn":
            both = torch.cat([real, x_g.detach().to(real.dtype)])
        else:
            both = [torch.cat([r, f.detach()]) for r, f in zip(seen_real, seen_fake)]
        labels = None if y is None else torch.cat([y_real, y_g])
        logits = discriminator(both, labels).float()
        d_real, d_fake = logits[:n_real], logits[n_real:]
        disc_loss = F.softplus(-d_real).mean() + F.softplus(d_fake).mean()
        if self.r1_gamma:
            (grad_real,) = torch.autograd.grad(d_real.sum(), real, create_graph=True)
            r1 = grad_real.float().square().flatten(1).sum(1).mean()
            disc_loss = disc_loss + 0.5 * self.r1_gamma * r1
            metrics["r1"] = r1.detach()
        surrogate = (x_g.float() * g.float()).sum()  # its gradient in x_g is g; its value is L_G's below
        adv = surrogate - surrogate.detach() + F.softplus(-d_fake).mean().detach()
        loss = student_loss + self.adv_weight * adv
        losses.update(model=loss, discriminator=disc_loss)
        with torch.no_grad():
            metrics.update(
                loss=loss.detach(),
                adv=adv.detach(),
                disc_loss=disc_loss.detach(),
                d_real=d_real.mean().detach(),
                d_fake=d_fake.mean().detach(),
            )
        return losses, metrics
