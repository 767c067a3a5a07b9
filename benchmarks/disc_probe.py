"""Can a discriminator tell a distilled student's one-step samples from the data? Offline probes.

An adversarial term helps only if its discriminator separates real from generated images. This draws n one-step
samples from a student checkpoint and n data images of its run's dataset, and reports the held-out accuracy (0.5 is
chance) of:
- a linear probe (logistic regression, L-BFGS to convergence, features standardised) on the pixels;
- the same probe on the teacher's hidden states after each block that `objective.disc_blocks` picks (the mean and
  standard deviation over the tokens), at each noise level s of --s (x_s = (1 - s) x + s eps, as the heads see them);
- with --train-updates U: the run's own discriminator (`objective.disc_backbone=teacher`: flm's heads on the teacher's
  features), freshly initialised, trained U updates on batches of --batch real and --batch generated images at
  `objective.disc_lr` (or --disc-lr) and s ~ logit-normal(disc_t_mean, disc_t_std), as the objective trains it, but
  against these fixed samples.
Held-out: 30 % of the images, never trained on.

    PYTHONPATH=. python benchmarks/disc_probe.py --ckpt RUN [--n 2000] [--s 0.05 0.27 0.5] [--train-updates 300]
"""

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from flm.data import stored_data
from flm.models import MODEL_SIZES
from flm.objectives.adversarial import build_feature_discriminator, pooled_statistics
from flm.objectives.paths import logit_normal
from flm.objectives.teacher import feature_blocks, load_teacher, teacher_features
from flm.train.generator import load_generator, open_generator


def linear_probe(features: torch.Tensor, labels: torch.Tensor, train: torch.Tensor, test: torch.Tensor) -> float:
    """Held-out accuracy of an L2-regularised logistic regression on standardised features."""
    mean, std = features[train].mean(0), features[train].std(0) + 1e-6
    f = (features - mean) / std
    w = torch.zeros(f.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(f[train] @ w + b, labels[train]) + 1e-3 * w.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return ((f[test] @ w + b > 0).float() == labels[test]).float().mean().item()


def discriminator_accuracy(d, features, labels, y) -> float:
    """Held-out accuracy of D's mean logit over its heads: real > 0, generated < 0."""
    with torch.no_grad():
        logits = d(features, y).float().mean(1)
    return ((logits > 0).float() == labels).float().mean().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="the student: a run folder or checkpoint of a distillation objective")
    p.add_argument("--n", type=int, default=2000, help="generated images, and as many data images")
    p.add_argument("--s", type=float, nargs="+", default=[0.05, 0.27, 0.5], help="noise levels of the feature probes")
    p.add_argument("--train-updates", type=int, default=0, help="train the run's discriminator this many updates")
    p.add_argument("--batch", type=int, default=32, help="real and generated images per discriminator update")
    p.add_argument("--disc-lr", type=float, default=None, help="default: the run's objective.disc_lr")
    p.add_argument("--data-root", default=None, help="for a torchvision dataset: its root (no download)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n < 10:
        raise SystemExit(f"--n must be >= 10 (30 % of the images are held out), got {args.n}")
    torch.manual_seed(args.seed)

    bundle, path = open_generator(args.ckpt)
    config = bundle.get("config") or {}
    objective_cfg = config.get("objective") or {}
    if not objective_cfg.get("teacher"):
        raise SystemExit(f"{path}: not a distilled student (its objective has no teacher); pass a student's run")
    model, objective = load_generator(bundle)
    model_args = dict(bundle["model_args"])
    teacher = load_teacher(objective_cfg["teacher"], model_args)
    dataset = dataclasses.replace(stored_data(config.get("data"), args.data_root), download=False).build()

    n = args.n
    classes = model_args.get("num_classes", 0)
    y_fake = torch.arange(n) % classes if classes else None
    shape = (model_args["in_channels"], model_args["input_size"], model_args["input_size"])
    with torch.no_grad():
        fake = torch.cat(
            [
                objective.sample(model, torch.randn(len(chunk), *shape), None if y_fake is None else y_fake[chunk], steps=1)
                for chunk in torch.arange(n).split(250)
            ]
        ).float()
    index = torch.randperm(len(dataset))[:n]
    real, y_real = dataset.__getitems__(index.tolist())
    images = torch.cat([real.float(), fake])
    y = None if y_fake is None else torch.cat([y_real, y_fake])
    labels = torch.cat([torch.ones(n), torch.zeros(n)])
    order = torch.randperm(2 * n)
    train, test = order[: int(0.7 * 2 * n)], order[int(0.7 * 2 * n) :]

    blocks = feature_blocks(MODEL_SIZES[model_args["name"]][0], objective_cfg.get("disc_blocks"), "objective.disc_blocks")
    print(f"{path}: {n} one-step samples against {n} data images; held-out accuracy (0.5: chance)")
    print(
        f"| probe | s | accuracy |\n|---|---|---|\n| linear, pixels | - | {linear_probe(images.flatten(1), labels, train, test):.3f} |"
    )
    for s_value in args.s:
        s = torch.full((2 * n,), s_value)
        with torch.no_grad():
            features = teacher_features(teacher, images, s, torch.randn_like(images), y, blocks)
        for block, f in zip(blocks, features):
            print(
                f"| linear, teacher block {block} (token mean and std) | {s_value} | {linear_probe(pooled_statistics(f), labels, train, test):.3f} |"
            )

    if args.train_updates:
        lr = args.disc_lr or objective_cfg.get("disc_lr", 2e-4)
        d = build_feature_discriminator(model_args, width=objective_cfg.get("disc_width", 64), blocks=blocks)
        opt = torch.optim.AdamW(d.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        t_mean, t_std = objective_cfg.get("disc_t_mean", -1.0), objective_cfg.get("disc_t_std", 1.0)
        real_train, fake_train = train[labels[train] == 1], train[labels[train] == 0]
        k = args.batch
        for _ in range(args.train_updates):
            pick = torch.cat([real_train[torch.randint(len(real_train), (k,))], fake_train[torch.randint(len(fake_train), (k,))]])
            yy = None if y is None else y[pick]
            s = logit_normal(2 * k, t_mean, t_std)
            with torch.no_grad():
                features = teacher_features(teacher, images[pick], s, torch.randn_like(images[pick]), yy, blocks)
            logits = d(features, yy).float()
            loss = F.softplus(-logits[:k]).mean() + F.softplus(logits[k:]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        yy = None if y is None else y[test]
        for s_value in args.s:
            s = torch.full((len(test),), s_value)
            with torch.no_grad():
                features = teacher_features(teacher, images[test], s, torch.randn_like(images[test]), yy, blocks)
            acc = discriminator_accuracy(d, features, labels[test], yy)
            print(f"| the run's heads, {args.train_updates} updates of {k} + {k} at lr {lr:g} | {s_value} | {acc:.3f} |")


if __name__ == "__main__":
    main()
