"""How much of a DMD student's gradient is bf16 rounding: the DMD gradient (flm.objectives.dmd) of the same samples,
noise and times, with the real score (the teacher) and the fake score evaluated in fp32 and under bf16 autocast.

x_fake - x_real is a difference of two close predictions, so rounding could swamp it; this measures it on a trained
run (rCM or MeanFlow + DMD), whose checkpoint holds the fake score.

    PYTHONPATH=. python benchmarks/dmd_precision.py --ckpt RCM_RUN --n 256

The student's samples come from its raw weights (those DMD trains); noise, labels and times from `--seed`.
"""

import argparse
import copy

import torch

from flm.objectives.guidance import guided, num_classes
from flm.objectives.dmd import dmd_gradient
from flm.objectives.paths import bcast
from flm.objectives.teacher import load_teacher
from flm.train.generator import load_generator, open_generator
from flm.train.sampling import class_labels


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="an rCM or MeanFlow + DMD run folder or checkpoint")
    p.add_argument("--n", type=int, default=256, help="student samples (labels cycling over the classes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def gradient(objective, teacher, fake, p, x_g, y, autocast: bool):
    """DMD's gradient in x_g for the noised samples p, both scores' forwards under bf16 autocast or not."""
    s = bcast(p.t, x_g)
    with torch.autocast(x_g.device.type, dtype=torch.bfloat16, enabled=autocast):
        # guided, not teacher_velocity, which takes bf16 on CUDA whatever the context
        x_real = p.x_t - s * guided(teacher, p.x_t, p.t, None, y, objective.teacher_cfg_scale).float()
        x_fake = p.x_t - s * fake(p.x_t, p.t, None, y).float()
    return dmd_gradient(x_g, x_real, x_fake)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    bundle, path = open_generator(args.ckpt)
    if "fake_score" not in bundle:
        raise SystemExit(f"error: {path} holds no fake score; pass an rCM or MeanFlow + DMD run")
    model, objective = load_generator(bundle, weights="raw", device=device, source=path)
    student_args = {**bundle["model_args"], "attention": "auto"}
    teacher = load_teacher(objective.teacher, student_args).to(device).eval()
    fake = copy.deepcopy(teacher)  # the fake score has the teacher's architecture, and its own weights
    fake.load_state_dict(bundle["fake_score"])
    torch.manual_seed(args.seed)
    y = class_labels(args.n, num_classes(model))
    y = None if y is None else y.to(device)
    x = torch.zeros(args.n, model.in_channels, model.input_size, model.input_size, device=device)
    with torch.no_grad():
        x_g = objective.generate(model, x, y).float()
        p = objective.noised(x_g)
        g32 = gradient(objective, teacher, fake, p, x_g, y, autocast=False).flatten(1)
        g16 = gradient(objective, teacher, fake, p, x_g, y, autocast=True).flatten(1)
    error = (g16 - g32).norm(dim=1) / g32.norm(dim=1)
    cosine = torch.nn.functional.cosine_similarity(g16, g32)
    print(f"{path}: {args.n} samples, {device}; the DMD gradient with both scores in bf16 against fp32")
    print("| DMD time s | samples | bf16 error / norm, median | cosine, median |")
    print("|---|---|---|---|")
    bands = {
        "[0, 0.2)": (0.0, 0.2),
        "[0.2, 0.5)": (0.2, 0.5),
        "[0.5, 0.8)": (0.5, 0.8),
        "[0.8, 1]": (0.8, 2.0),
        "all": (0.0, 2.0),
    }
    for name, (lo, hi) in bands.items():
        m = (p.t >= lo) & (p.t < hi)
        if m.any():
            print(f"| {name} | {int(m.sum())} | {error[m].median():.4f} | {cosine[m].median():.5f} |")


if __name__ == "__main__":
    main()
