"""How closely a distilled student reproduces its teacher's flow map: the mean squared distance, per element,
between the student's few-step sample and the teacher's many-step ODE solution from the same noise and label.

A student distilled from a flow-matching teacher (MeanFlow distillation, sCD, rCM) learns the teacher's map from
noise to data, so this is the distillation's own error, as the 2-D toy's err1 / err2 (benchmarks/toy.py) but on
the run's real model. It needs no dataset and no Inception network, and it separates runs whose FIDs are too
noisy to tell apart at the CPU's sample counts. The teacher's own few-step Euler samples are scored the same way
for scale.

    PYTHONPATH=. python benchmarks/flow_map_error.py --ckpt STUDENT_RUN                    # teacher from the run
    PYTHONPATH=. python benchmarks/flow_map_error.py --ckpt STUDENT_RUN --teacher FM_RUN --n 512 --steps 1 2 4

The student's weights: its first EMA by default, `--ema 0.99` or `--ema sigma_rel0.1` for one by name, `--weights raw` for the trained ones;
the teacher's: its first EMA, the weights the student was distilled from. Noise and labels come from `--seed`.
A student whose sampler re-noises between steps (sCD, rCM) is deterministic only at 1 step.
"""

import argparse

import torch

from flm.objectives.frequency import high_pass
from flm.objectives.guidance import num_classes
from flm.train.generator import load_generator, open_generator
from flm.train.sampling import class_labels


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="the student: a run folder, checkpoint or exported folder")
    p.add_argument("--teacher", default=None, help="the flow-matching teacher (default: the student's objective.teacher)")
    p.add_argument("--weights", default="ema", choices=["raw", "ema"], help="the student's (the teacher: its first EMA)")
    p.add_argument(
        "--ema", default=None, help="the student's EMA by name: a decay (0.99) or a power EMA (sigma_rel0.1); default its first"
    )
    p.add_argument("--n", type=int, default=256, help="noises (and labels, cycling over the classes)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2], help="the student's and the teacher's few-step counts")
    p.add_argument("--teacher-steps", type=int, default=100, help="Euler steps of the teacher's reference solution")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def sample(model, objective, noise, y, steps: int, batch_size: int) -> torch.Tensor:
    """objective.sample over batches; each batch's re-noising (if any) from a seeded generator per image."""
    parts = []
    for i in range(0, len(noise), batch_size):
        z, labels = noise[i : i + batch_size], None if y is None else y[i : i + batch_size]
        gens = [torch.Generator().manual_seed(1_000_000 + i + k) for k in range(len(z))]
        parts.append(objective.sample(model, z, labels, steps=steps, generators=gens).float())
    return torch.cat(parts)


def flow_map_errors(student, teacher, noise, y, *, steps, teacher_steps: int, batch_size: int) -> list[dict]:
    """One row per (who, steps): mean squared distance per element to the teacher's teacher_steps solution, and of
    its high-pass (pixel-scale) part, flm.objectives.frequency.high_pass."""
    reference = sample(*teacher, noise, y, teacher_steps, batch_size)
    rows = []
    for who, (model, objective) in (("student", student), ("teacher", teacher)):
        for n in steps:
            e = sample(model, objective, noise, y, n, batch_size) - reference
            rows.append({"model": who, "steps": n, "mse": float(e.square().mean()), "hf": float(high_pass(e).square().mean())})
    return rows


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    bundle, path = open_generator(args.ckpt)
    student = load_generator(bundle, weights=args.weights, ema=args.ema, device=device, source=path)
    teacher_path = args.teacher or getattr(student[1], "teacher", None)
    if not teacher_path:
        raise SystemExit(f"error: {path} has no objective.teacher; pass --teacher <flow-matching run>")
    t_bundle, t_path = open_generator(teacher_path)
    teacher = load_generator(t_bundle, weights="ema", device=device, source=t_path)  # what the student learnt from
    image = lambda m: (m.in_channels, m.input_size, m.input_size, num_classes(m))  # noqa: E731
    if image(student[0]) != image(teacher[0]):
        raise SystemExit(
            f"error: {t_path} and {path} differ in image shape or classes: {image(teacher[0])} and {image(student[0])}"
        )
    g = torch.Generator().manual_seed(args.seed)
    model = student[0]
    shape = (args.n, *image(model)[:3])
    noise = torch.randn(shape, generator=g).to(device)
    y = class_labels(args.n, num_classes(model))
    y = None if y is None else y.to(device)
    rows = flow_map_errors(
        student, teacher, noise, y, steps=args.steps, teacher_steps=args.teacher_steps, batch_size=args.batch_size
    )
    print(
        f"student {path} ({args.weights}{'' if args.ema is None else f' {args.ema}'} weights) and teacher {t_path} "
        f"(its first EMA), {args.n} noises; reference: the teacher's "
        f"{args.teacher_steps}-step Euler solution"
    )
    print("| model | steps | mean squared distance per element | its high-pass part | high-pass share |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['steps']} | {row['mse']:.5f} | {row['hf']:.5f} | {row['hf'] / row['mse']:.2f} |")


if __name__ == "__main__":
    main()
