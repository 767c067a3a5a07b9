"""Sample quality of a checkpoint: FID of its objective's own sampler against the dataset's reference
statistics, per step count, and the digit classifier's label accuracy on MNIST-like data (compose, build, run).

    python evaluate.py ckpt=outputs/2025-01-01/12-00-00 n=10000 steps=1            # EMA weights
    python evaluate.py ckpt=RUN steps=[1,2] cfg_scale=1.5 weights=raw data.root=data
    python evaluate.py ckpt=SCD_RUN steps=2 mid_t=[0.9]                               # sCM's 2-step time (MeanFlow: mid_t=[0.6])
    FLM_FID_INCEPTION=data/fid/inception-2015-12-05-fid.torchscript.pt python evaluate.py ckpt=RUN
    torchrun --standalone --nproc_per_node=8 evaluate.py ckpt=RUN n=50000           # ranks split the images
    python evaluate.py ckpt=LATENT_RUN n=50000 ref=VIRTUAL_imagenet256_labeled.npz   # ADM's reference batch
    python evaluate.py ckpt=EXPORTED_FOLDER n=10000                                 # export.py's folder
    python evaluate.py ckpt=MNIST_RUN n=1000 steps=[1,2] fid=false                   # CPU: the digit metrics alone
    python evaluate.py ckpt=RUN 'sigma_rel=[0.05,0.07,0.1]'                          # post-hoc EMAs (flm.train.posthoc)
    python evaluate.py ckpt=SCD_RUN steps=2 'mid_t=[[1.2],[1.1],[1.0]]' 'gamma=[1,0.5]'  # samplers swept in one call

The reference is the run's dataset (test split for MNIST and Fashion-MNIST, train for CIFAR-10), its
statistics cached in fid_cache ($FLM_FID_CACHE, default ~/.cache/flm/fid) after the first use; a latent run's
are those of the images its latents were encoded from (data.root= names their folder), its samples decoded
through its VAE. Prints a
table and writes a JSON (default <run folder>/eval/<checkpoint>-<weights>-cfg<s>-seed<seed>-n<n>.json).
Bad input ends with one line `error: ...` and exit code 1.
"""

import os

import hydra
from omegaconf import DictConfig, OmegaConf

from flm import dist
from flm.data import DataConfig, stored_data
from flm.files import write_json
from flm.latents import decoder_of, reference_source
from flm.cli import report_user_errors
from flm.train.config import plain
from flm.train.evaluation import Evaluator, check_n, parse_steps
from flm.train.export import is_export
from flm.train.generator import (
    build_objective_from,
    generator_state,
    load_generator,
    mid_t_tag,
    open_generator,
    output_base,
    sampler_steps,
    sampler_variants,
)
from flm.train.posthoc import posthoc_bundle, run_of, widths_of
from flm.train.settings import amp_dtype


def run_data(run_cfg: dict, root: str | None) -> DataConfig:
    """The run's dataset from its stored config (plain values only), `root` overriding its folder; for a latent
    run, the images its latents were encoded from."""
    if run_cfg.get("latents"):
        return DataConfig(**reference_source(run_cfg["latents"], root))
    return stored_data(run_cfg.get("data"), root)


def table(results: dict, steps: list[int]) -> str:
    has_fid, acc, fd, faint = (any(k.startswith(m) for k in results) for m in ("fid", "label_acc", "digit_fd", "faint"))
    head = "| steps |" + (" FID |" if has_fid else "") + (" label accuracy |" if acc else "") + (" digit FD |" if fd else "")
    head += " faint pixels |" if faint else ""
    lines = [head, "|---" * head.count("|", 1) + "|"]
    for k in steps:
        row = f"| {k} |" + (f" {results[f'fid_steps{k}']:.2f} |" if has_fid else "")
        row += f" {100 * results[f'label_acc_steps{k}']:.2f} % |" if acc else ""
        row += f" {results[f'digit_fd_steps{k}']:.3f} |" if fd else ""
        lines.append(row + (f" {100 * results[f'faint_steps{k}']:.2f} % |" if faint else ""))
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict:
    n = check_n(cfg.n)
    if not isinstance(cfg.fid, bool):
        raise ValueError(f"fid must be true or false, got {cfg.fid!r}")
    bundle, path = open_generator(str(cfg.ckpt))
    run_cfg = bundle["config"]
    emas = [cfg.ema]  # the EMAs to score, one table and JSON each
    if cfg.sigma_rel is not None:  # post-hoc EMAs put together from the run's saved power EMAs (flm.train.posthoc)
        if cfg.ema is not None or cfg.ema_decay is not None or cfg.weights != "ema":
            raise ValueError("sigma_rel scores post-hoc EMAs; leave ema, ema_decay and weights at their defaults")
        if is_export(path):
            raise ValueError(f"sigma_rel reads a run's checkpoints; {path} is an exported folder: pass the run or a checkpoint")
        bundle, emas = posthoc_bundle(run_of(path), widths_of(cfg.sigma_rel), step=int(bundle["step"]))
    samplers = sampler_variants(plain(cfg.mid_t, "mid_t"), plain(cfg.gamma, "gamma"))  # one, or a sweep scored in turn
    device = dist.init(cfg.device)
    model, objective = load_generator(
        bundle,
        weights=cfg.weights,
        ema_decay=cfg.ema_decay,
        ema=emas[0],
        attention=cfg.attention,
        device=device,
        source=path,
        mid_t=samplers[0][0],
        gamma=samplers[0][1],
    )
    objectives = [objective, *(build_objective_from(bundle, path, m, g).to(device) for m, g in samplers[1:])]
    steps = parse_steps(cfg.steps if cfg.steps is not None else sampler_steps(bundle, objective, path))
    args = bundle["model_args"]
    run_dir, stem = output_base(path)
    tags = [mid_t_tag(o, m, g) for o, (m, g) in zip(objectives, samplers)]

    def out_of(key, tag: str) -> str:
        # a sweep's given out gets each sampler's tag, and post-hoc EMAs one JSON each: <out>-<key>.json
        out = cfg.out or os.path.join(run_dir, "eval", f"{stem}-{cfg.weights}-cfg{cfg.cfg_scale:g}{tag}-seed{cfg.seed}-n{n}.json")
        if cfg.out and len(samplers) > 1:
            out = f"{os.path.splitext(out)[0]}{tag}.json"
        return out if cfg.sigma_rel is None else f"{os.path.splitext(out)[0]}-{key}.json"

    evaluator = Evaluator(
        data=run_data(run_cfg, cfg.data.root),
        shape=(args["in_channels"], args["input_size"], args["input_size"]),
        num_classes=args["num_classes"],
        n=n,
        steps=steps,
        cfg_scale=cfg.cfg_scale,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        device=device,
        amp_dtype=amp_dtype(cfg.precision, device),
        inception=cfg.inception,
        cache=cfg.fid_cache,
        split=cfg.data.split,
        ref=cfg.ref,
        decoder=decoder_of(run_cfg, device, path),
        compute_fid=cfg.fid,
    )
    later = {key: generator_state(bundle, "ema", ema=key) for key in emas[1:]}  # the checkpoint's other parts can go
    del bundle
    results = {}
    for key in emas:
        if key in later:
            model.load_state_dict(later.pop(key))
        for sampler, tag in zip(objectives, tags):
            out = out_of(key, tag)
            evaluator.grid = os.path.splitext(out)[0] if cfg.grid else None
            results[key, tag] = evaluator(model, sampler)
            if dist.is_main():
                report(cfg, evaluator, results[key, tag], path, sampler, n, steps, key, out)
    # one EMA and one sampler: its results; else {EMA: results} (sigma_rel), {sampler's tag: results} (a sweep), or both
    if len(samplers) == 1:
        return results[emas[0], tags[0]] if cfg.sigma_rel is None else {key: results[key, tags[0]] for key in emas}
    if cfg.sigma_rel is None:
        return {tag: results[emas[0], tag] for tag in tags}
    return {key: {tag: results[key, tag] for tag in tags} for key in emas}


def report(cfg, evaluator, results, path, objective, n, steps, ema, out) -> None:
    """One EMA's numbers: a JSON at `out` and a table on the console."""
    ref = evaluator.reference  # None with fid=false
    summary = {
        "checkpoint": os.path.abspath(path),
        "weights": cfg.weights,
        "ema_decay": cfg.ema_decay,
        "ema": ema,
        "n": n,
        "cfg_scale": cfg.cfg_scale,
        "mid_t": list(objective.mid_t) if hasattr(objective, "mid_t") else None,
        "gamma": getattr(objective, "gamma", None),
        "seed": cfg.seed,
        "reference": ref.describe() if ref else None,
        "reference_n": ref.n if ref else None,
        "inception": evaluator.net.name if evaluator.net else None,
        "results": results,
        "options": OmegaConf.to_container(cfg, resolve=True),
    }
    write_json(out, summary)
    against = f" vs {summary['reference']}, {ref.n or '?'} images" if ref else " (no FID)"
    print(
        f"{n} images per step count from {path} ({ema or cfg.weights} weights, cfg {cfg.cfg_scale:g}){against}\n"
        f"{table(results, steps)}\n-> {out}",
        flush=True,
    )


@hydra.main(config_path="configs", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with report_user_errors():
        run(cfg)


if __name__ == "__main__":
    main()
