"""How much of sCM's tangent is rounding: Algorithm 1's g (before its normalisation) from the same draws in fp32 and
under bf16 autocast, binned by TrigFlow time t.

The normalisation g / (||g|| + c) gives every sample a unit update whatever ||g|| is, so if bf16 changed g by a
large part of itself the update would point where the rounding does. The table gives, per bin, the median ||g||,
its flow-matching part -cos^2 t (sigma_d F - dx_t/dt) and its consistency part -cos t sin t (x_t + sigma_d dF/dt),
the median relative change of g under bf16 and the mean cosine between the two.

    PYTHONPATH=. python benchmarks/scm_bf16_gap.py --ckpt RUN                      # the run's data, EMA weights
    PYTHONPATH=. python benchmarks/scm_bf16_gap.py --ckpt RUN --device cuda --n 2048

The times, noise and labels are drawn as in training (the objective's proposal, with label dropout off); `--seed`
fixes them. A distilled student (sCD, rCM) takes dx_t/dt from its teacher (`--teacher`, default the run's
objective.teacher), computed once as training does (the teacher in bf16), so both precisions see the same dx_t/dt. On
the CPU, bf16 autocast runs PyTorch's CPU kernels and math attention, not the GPU's.

    PYTHONPATH=. python benchmarks/scm_bf16_gap.py --ckpt SCD_RUN [--teacher FM_RUN]
"""

import argparse
import dataclasses

import torch

from flm.data import stored_data
from flm.objectives import SCD, SCM
from flm.objectives.paths import lognormal_trigflow
from flm.objectives.teacher import load_teacher
from flm.train.generator import load_generator, open_generator

EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.58)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="an sCM run folder or checkpoint")
    p.add_argument("--weights", default="ema", choices=["raw", "ema"])
    p.add_argument("--data-root", default=None, help="the dataset folder (default: the run's data.root)")
    p.add_argument("--n", type=int, default=512, help="samples (one batch)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--teacher", default=None, help="a distilled student's teacher (default: the run's objective.teacher)")
    return p.parse_args(argv)


def tangents(scm: SCM, model, x, y, seed: int, device: torch.device, teacher=None) -> dict:
    """{precision: (g, its flow-matching part)} in fp32 and bf16 from the same draws, and the draws' t; dx_t/dt the
    data's, or with a teacher (a distilled student) the teacher's."""
    torch.manual_seed(seed)
    t = lognormal_trigflow(len(x), scm.p_mean, scm.p_std, scm.sigma_d, device=device)
    s = scm.path.sample(x, torch.randn_like(x), t)
    if teacher is not None:
        with torch.no_grad():
            s = dataclasses.replace(s, dx_t=scm.teacher_dxdt(teacher, s.x_t, t, y).float())
    out = {"t": t}
    for precision, enabled in (("fp32", False), ("bf16", True)):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled), torch.no_grad():
            F, cs_dFdt = scm.jvp_F(lambda x_in, t_in: scm.network_output(model, x_in, t_in, y), s.x_t, t, s.dx_t)
        flow, consistency = scm.tangent_parts(F.float(), cs_dFdt.float(), s.x_t, t, s.dx_t)
        out[precision] = (flow - consistency, flow)  # g at the full warm-up
    return out


def table(found: dict, edges=EDGES) -> list[str]:
    t, (g32, flow32), (g16, _) = found["t"], found["fp32"], found["bf16"]
    norm = lambda v: v.flatten(1).norm(dim=1)  # noqa: E731
    rel = norm(g16 - g32) / norm(g32)
    cos = torch.nn.functional.cosine_similarity(g16.flatten(1), g32.flatten(1))
    lines = [
        "| t | samples | median ||g|| | its flow-matching part | its consistency part | bf16 change / ||g|| | cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    for lo, hi in zip(edges[:-1], edges[1:]):
        i = (t >= lo) & (t < hi)
        if not i.any():
            continue
        lines.append(
            f"| [{lo:g}, {hi:g}) | {int(i.sum())} | {norm(g32[i]).median():.3f} | {norm(flow32[i]).median():.3f} | "
            f"{norm(g32[i] - flow32[i]).median():.3f} | {rel[i].median():.4f} | {cos[i].mean():.4f} |"
        )
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    bundle, _ = open_generator(args.ckpt)
    model, scm = load_generator(bundle, weights=args.weights, device=device)
    if not isinstance(scm, SCM):
        raise SystemExit(f"error: {args.ckpt} is a {type(scm).__name__} run; this benchmark takes sCM (and its students)")
    data = dataclasses.replace(stored_data((bundle.get("config") or {}).get("data"), args.data_root), download=False).build()
    g = torch.Generator().manual_seed(args.seed)
    idx = torch.randperm(len(data), generator=g)[: args.n]
    x, y = data.__getitems__(idx.tolist())
    x, y = x.to(device), y.to(device)
    model.eval()
    teacher = None
    if isinstance(scm, SCD):
        teacher = load_teacher(args.teacher or scm.teacher, bundle["model_args"]).to(device).eval()
    print("\n".join(table(tangents(scm, model, x, y, args.seed, device, teacher))))


if __name__ == "__main__":
    main()
