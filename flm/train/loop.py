"""The training loop: one code path for one process and for torchrun (DDP, or FSDP2 with
`trainer.parallel=fsdp`; see flm.train.parallel).

The loop knows neither the loss nor the sampler: it calls `objective.loss(model, x, y, step=...)`
and, for sample grids, `objective.sample(...)`.

Non-finite steps: when the loss or the gradient norm is NaN/inf on any rank, the optimizer step
(and the EMA update) is skipped on every rank with a warning, and the count is logged; after
`trainer.max_nonfinite` such steps in a row training stops with an error (the last checkpoint is
left as it was). Data and RNG still advance, so a resumed run skips the same steps. An update can
also overflow from a finite loss and gradient (a huge learning rate): the weights (the EMAs included)
are checked at every step that logs or saves, and training stops before non-finite weights are saved.

No host sync per step: the skip is decided on the device (flm.train.optim.optimizer_step), and the
host reads a step's loss and finiteness one step late, after it has issued the next step's forward and
backward (or at once on steps that log, save or finish). So the GPU never waits for Python between
steps, and the host runs at most one step ahead.

Several processes: each optimizer step takes `trainer.batch_size` images, cut into world_size x
grad_accum micro-batches in the loader's order, and every micro-batch draws its noise from a seed of
(seed, step, its index in that order). N ranks with A accumulation steps therefore train as one rank
with N x A accumulation steps (up to the rounding of the gradient all-reduce), and a checkpoint
resumes under any world size: it continues exactly when world_size x grad_accum stays the same, and
with the same images per step (other noise draws) otherwise. After the first step of a run, and
every `trainer.sync_check_every` steps, the ranks compare a checksum of their parameters
(flm.dist.check_in_sync), so a skipped gradient all-reduce stops the run instead of going unnoticed.

Under FSDP2 every rank holds a shard of the model, the optimizer state and the EMA: checkpoints,
sample grids and the sync check are collectives that every rank enters (rank 0 alone writes files),
and a checkpoint holds whole tensors, so it resumes under DDP, FSDP2 or one process alike.
"""

import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from flm import dist
from flm.data import DataConfig, Loader, _seed
from flm.files import lock_folder, unlock_folder
from flm.log import LoggerConfig, RunLogger, progress_line
from flm.train import checkpoint
from flm.train.ema import EMA
from flm.train.evaluation import InTraining
from flm.train.graphs import GraphedStep
from flm.train.optim import OptimConfig, build_optimizer, load_schedule, optimizer_step
from flm.train.parallel import PARALLEL, clip_grad_norm_, grad_sync, local, wrap, wrap_copy
from flm.train.sampling import class_labels, generate, save_grid
from flm.typed import check_fields

log = logging.getLogger("flm")


@dataclass
class TrainerConfig:
    max_steps: int = 2000
    batch_size: int = 64  # global: images per optimizer step, summed over ranks and accumulation steps
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    compile: bool = False  # torch.compile the model (see DESIGN.md: JVP steps may not compile)
    cuda_graph: bool = False  # replay loss + backward as one CUDA graph (one GPU; flm.train.graphs)
    parallel: str = "ddp"  # under torchrun: ddp | fsdp (FSDP2: parameters, gradients, optimizer state and EMA sharded)
    class_conditional: bool = True  # condition on the dataset's labels (enables cfg_scale when sampling)
    ema_decays: list[float] = field(default_factory=lambda: [0.999])
    log_every: int = 50
    sample_every: int = 0  # 0: a grid at the end only
    sample_n: int = 64
    sample_steps: int = 1
    sample_cfg_scale: float = 1.0
    ckpt_every: int = 0  # 0: a checkpoint at the end only
    keep_last: int = 2
    resume: str | None = None  # null (new run) | auto (latest checkpoint in the run folder) | a path
    max_nonfinite: int = 10  # stop after this many skipped (non-finite) steps in a row
    sync_check_every: int = 1000  # compare a parameter checksum across ranks after step 1 and every N steps; 0: never
    eval_every: int = 0  # FID (and label accuracy on MNIST-like data) of the EMA weights every N steps and at the end; 0: never
    eval_n: int = 10000  # images per step count
    eval_steps: list[int] | None = None  # sampler step counts to score; null: [sample_steps]
    eval_inception: str | None = None  # the FID Inception TorchScript; null: $FLM_FID_INCEPTION
    eval_cache: str | None = None  # reference statistics folder; null: $FLM_FID_CACHE, else ~/.cache/flm/fid
    collective_timeout_s: float = 600.0  # a rank that waits this long for a stalled one ends the run with an error

    def __post_init__(self):
        check_fields(self, "trainer")
        positive = ("max_steps", "batch_size", "grad_accum", "log_every", "sample_n", "sample_steps", "max_nonfinite",
                "collective_timeout_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        for name in ("sample_every", "ckpt_every", "keep_last", "sync_check_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0 (0 = at the end only / keep all), got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"trainer.eval_every must be >= 0 (0: no evaluation), got {self.eval_every}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"trainer.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"trainer.parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")


# ----------------------------------------------------------------------------------------------
# Pieces
# ----------------------------------------------------------------------------------------------


def local_batch_size(batch_size: int, grad_accum: int, world: int) -> int:
    if batch_size % (world * grad_accum):
        raise ValueError(
            f"trainer.batch_size={batch_size} is not divisible by world size x grad_accum = {world} x {grad_accum}; "
            f"pick a multiple of {world * grad_accum}"
        )
    return batch_size // (world * grad_accum)


def amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def check_attention(name: str, device: torch.device, dtype: torch.dtype | None) -> None:
    """Fail before training when the chosen attention backend cannot run on this device."""
    if name == "auto":
        return
    from flm.attention import get_attention

    probe = torch.zeros(1, 1, 16, 64, device=device, dtype=dtype or torch.float32)
    get_attention(name).check_available(probe)


def check_cuda_graph(trainer: TrainerConfig, device: torch.device, world: int) -> None:
    """trainer.cuda_graph=true captures one process's loss + backward; refuse what it cannot capture."""
    problems = []
    if device.type != "cuda":
        problems.append(f"it needs a CUDA device, and this run is on {device}")
    if world > 1:
        problems.append(f"it runs on one process, and this run has {world} (DDP/FSDP2 communication is not captured)")
    if trainer.grad_accum > 1:
        problems.append(f"it captures one micro-batch per step, and trainer.grad_accum={trainer.grad_accum}")
    if trainer.compile:
        problems.append("it replaces torch.compile, and trainer.compile=true")
    if problems:
        raise ValueError("trainer.cuda_graph=true cannot run here: " + "; ".join(problems) + ". Set trainer.cuda_graph=false")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting: through pinned memory on CUDA (a copy from pageable
    memory may wait for the GPU to catch up)."""
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_host_async(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a small tensor to the host without waiting: (host tensor, event to wait on)."""
    if values.device.type != "cuda":
        return values.cpu(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def resolve_resume(resume: str | None, run_dir: str) -> str | None:
    """The checkpoint to continue from, or None for a new run; clear errors for every bad case."""
    if resume in (None, "", "null", "none", False):
        existing = checkpoint.list_checkpoints(run_dir)
        if existing:
            raise ValueError(
                f"run folder {run_dir!r} already has checkpoints (latest {os.path.basename(existing[-1])}); "
                f"pass trainer.resume=auto to continue it, or choose another run_dir"
            )
        return None
    if resume == "auto":
        found = checkpoint.list_checkpoints(run_dir)
        if not found:
            raise FileNotFoundError(
                f"trainer.resume=auto but run folder {run_dir!r} has no checkpoint; pass run_dir=<folder of the "
                f"run to continue> (or trainer.resume=<checkpoint file>), or drop trainer.resume to start anew"
            )
        return found[-1]
    return checkpoint.find_checkpoint(str(resume))


@torch.no_grad()
def check_finite_weights(step: int, run_dir: str, lr: float, *modules: nn.Module) -> None:
    """Stop before non-finite weights are logged as trained or saved: an update can overflow although
    its loss and gradients were finite (a huge learning rate), and the step skip only sees those."""
    tensors = [local(p) for m in modules for p in m.parameters()]
    finite = dist.all_min(torch.stack(torch._foreach_norm(tensors)).isfinite().all().float())  # one host sync
    if finite.item() != 1.0:
        saved = checkpoint.list_checkpoints(run_dir)
        raise FloatingPointError(
            f"the weights are not finite after step {step} (an update overflowed at learning rate {lr:g}); "
            f"nothing was saved from them ({f'the latest checkpoint is still {saved[-1]}' if saved else 'no checkpoint yet'}). "
            f"Lower optim.lr, then resume from the last checkpoint or start anew"
        )


def load_objective(path: str, bundle: dict, objective, config: dict | None) -> None:
    """The checkpoint's objective state into `objective`; another objective than the run's (flow
    matching resumed as sCM, say) is refused in one line."""
    saved = (bundle.get("config") or {}).get("objective", {}).get("name")
    now = (config or {}).get("objective", {}).get("name")
    try:
        if saved is not None and now is not None and saved != now:
            raise ValueError(f"objective {saved!r} vs {now!r}")
        objective.load_state_dict(bundle["objective"])
    except (ValueError, RuntimeError) as e:  # RuntimeError: state keys of another objective
        raise ValueError(
            f"checkpoint {path!r} was trained with another objective ({str(e).splitlines()[0]}); resume with "
            f"objective={saved or 'the one it was trained with'}, or start a new run folder"
        ) from None


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def train(*, run_dir: str, model_fn, objective, data: DataConfig, optim: OptimConfig, trainer: TrainerConfig,
          logger: LoggerConfig, attention: str = "auto", config: dict | None = None) -> dict:
    """Train until trainer.max_steps; returns the last logged metrics.

    model_fn(input_size=, in_channels=, num_classes=, time_inputs=, attention=) builds the network
    (flm.models.build_model with its name bound); objective is a built flm.objectives objective;
    config is the resolved run config stored in every checkpoint (sample.py rebuilds from it).
    """
    device = dist.init(trainer.device, timeout_s=trainer.collective_timeout_s)
    rank, world = dist.rank(), dist.world_size()
    run_dir = dist.broadcast_object(run_dir)  # ranks may have resolved ${now:...} a second apart
    if dist.is_main():
        lock_folder(run_dir)  # one run per folder: a second process is refused before it writes anything
        checkpoint.remove_temporary(run_dir)  # of a killed run
    micro_batch = local_batch_size(trainer.batch_size, trainer.grad_accum, world)
    dtype = amp_dtype(trainer.precision, device)
    check_attention(attention, device, dtype)
    if trainer.cuda_graph:
        check_cuda_graph(trainer, device, world)
    resume_from = resolve_resume(trainer.resume, run_dir)
    bundle = checkpoint.load(resume_from) if resume_from else None

    dataset = data.build()
    num_classes = dataset.num_classes if trainer.class_conditional else 0
    model_args = dict(input_size=dataset.resolution, in_channels=dataset.channels, num_classes=num_classes,
                      time_inputs=objective.time_inputs, attention=attention)
    torch.manual_seed(trainer.seed)  # the same initial weights on every rank
    raw = model_fn(**model_args)
    # what sample.py and resume rebuild from: the size name and the config's other model options (time_scale)
    model_args = {"name": type(raw).__name__, **getattr(model_fn, "keywords", {}), **model_args}
    if bundle is not None:
        checkpoint.check_model_args(resume_from, bundle["model_args"], model_args)
        raw.load_state_dict(bundle["model"])
        load_objective(resume_from, bundle, objective, config)
    raw.to(device)
    if isinstance(objective, nn.Module):
        objective.to(device)
    objective_params = list(objective.parameters()) if isinstance(objective, nn.Module) else []
    # the EMA copies first: under FSDP2, wrap() shards raw in place (and wrap_copy shards the copies alike)
    ema = EMA(raw, trainer.ema_decays, wrap=lambda m: wrap_copy(m, device, trainer.parallel))
    model = wrap(raw, device, trainer.parallel)
    if trainer.compile:
        model = torch.compile(model)
    params = [p for p in raw.parameters() if p.requires_grad] + objective_params
    opt, sched = build_optimizer(params, optim)
    trained = nn.ModuleDict({"model": raw, "objective": objective})  # names the optimizer's parameters
    loader = Loader(dataset, batch_size=micro_batch, rank=rank, world_size=world, seed=trainer.seed,
                    grad_accum=trainer.grad_accum, hflip=data.hflip, num_workers=data.num_workers)
    step, skipped_total, skipped_run = 0, 0, 0
    loss_sum, loss_steps = 0.0, 0  # the logged loss's window, carried over a resume
    if bundle is not None:
        ema.load_state_dict(bundle["ema"])
        checkpoint.load_optimizer_state(trained, opt, bundle["optimizer"])
        load_schedule(opt, sched, bundle["scheduler"], optim)  # optim.* of this run, not of the checkpoint
        loader.load_state_dict(bundle["data"])
        set_rng_state(bundle["rng"], device)
        step = int(bundle["step"])
        if step >= trainer.max_steps:
            raise ValueError(f"checkpoint {resume_from!r} is at step {step}, and trainer.max_steps={trainer.max_steps}: "
                             f"nothing to train; pass trainer.max_steps > {step} to continue the run")
        skipped_total, skipped_run = bundle["nonfinite"]["total"], bundle["nonfinite"]["in_a_row"]
        window = bundle.get("log_window", {"loss_sum": 0.0, "steps": 0})
        loss_sum, loss_steps = float(window["loss_sum"]), int(window["steps"])
        del bundle

    n_params = sum(p.numel() for p in raw.parameters())
    dist.info0(
        f"run folder {os.path.abspath(run_dir)} | {model_args['name']} {n_params / 1e6:.2f}M params | "
        f"{type(objective).__name__} | {len(dataset)} images {dataset.channels}x{dataset.resolution}x{dataset.resolution} | "
        f"device {device} x {world}{f' ({trainer.parallel})' if world > 1 else ''} | precision {dtype or torch.float32} | "
        f"batch {trainer.batch_size} = {world} ranks x {trainer.grad_accum} accum x {micro_batch}"
        + (f" | resumed from {resume_from} at step {step}" if resume_from else "")
    )
    shape = (dataset.channels, dataset.resolution, dataset.resolution)
    in_loop_eval = InTraining(trainer, data, shape=shape, num_classes=num_classes, device=device, amp_dtype=dtype,
                              batch_size=micro_batch * trainer.grad_accum)
    run_log = RunLogger(run_dir, logger, run_config=config, resumed_at=step if resume_from else None)
    labels = class_labels(trainer.sample_n, num_classes)

    def sample_grid(at_step: int) -> None:
        # every rank samples (under FSDP2 the EMA's forward all-gathers its shards); rank 0 writes
        images = generate(ema.default, objective, seeds=list(range(trainer.sample_n)), labels=labels, shape=shape,
                          steps=trainer.sample_steps, cfg_scale=trainer.sample_cfg_scale,
                          batch_size=micro_batch * trainer.grad_accum, device=device, amp_dtype=dtype)
        if not dist.is_main():
            return
        path = os.path.join(run_dir, "samples", f"step-{at_step:08d}.png")
        save_grid(images, path, nrow=10 if num_classes == 10 else None)
        run_log.log_image(at_step, "samples", path)

    def save_checkpoint(at_step: int) -> None:
        # whole tensors gathered on every rank (collectives under FSDP2), written by rank 0
        state = {"model": checkpoint.model_state(raw), "ema": ema.state_dict(),
                 "optimizer": checkpoint.optimizer_state(trained, opt)}
        if dist.is_main():
            state |= {
                "step": at_step, "scheduler": sched.state_dict(), "objective": objective.state_dict(),
                "rng": rng_state(device), "data": loader.state_dict(), "nonfinite": {"total": skipped_total, "in_a_row": skipped_run},
                "log_window": {"loss_sum": loss_sum, "steps": loss_steps},
                "model_args": model_args, "config": config or {},
            }
            checkpoint.save(state, checkpoint.checkpoint_path(run_dir, at_step), keep_last=trainer.keep_last)
        dist.barrier()

    def loss_and_backward(x, y, at_step):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss, extra = objective.loss(model, x, y, step=at_step)
        (loss / trainer.grad_accum).backward()
        return loss, extra

    # a graph replays what it captured: the step (sCM's tangent warm-up) goes in as a tensor, as x and y do
    graphed = GraphedStep(lambda x, at_step, y=None: loss_and_backward(x, y, at_step), params) if trainer.cuda_graph else None

    metrics: dict = {}
    window_t, window_steps = time.perf_counter(), 0
    t_start, step_start = time.perf_counter(), step
    pending = None  # (step, host copy of [loss, finite, grad norm], event): a step's outcome, read one step late

    def settle() -> None:
        """Read the pending step's outcome: count it, warn about a skip, stop after too many in a row."""
        nonlocal pending, skipped_total, skipped_run, loss_sum
        if pending is None:
            return
        (at_step, values, event), pending = pending, None
        if event is not None:
            event.synchronize()
        loss_value, finite_value, norm_value = values.tolist()
        if finite_value == 1.0:
            skipped_run = 0
        else:
            skipped_total, skipped_run = skipped_total + 1, skipped_run + 1
            log.warning(f"step {at_step}: non-finite loss {loss_value} or grad norm {norm_value}; "
                        f"skipped ({skipped_run} in a row, {skipped_total} in total)")
            if skipped_run >= trainer.max_nonfinite:
                raise FloatingPointError(
                    f"{skipped_run} non-finite steps in a row (last at step {at_step}); training stopped. "
                    f"Lower optim.lr, raise optim.warmup_steps or keep optim.grad_clip > 0, then resume "
                    f"from the last checkpoint"
                )
        loss_sum += loss_value if math.isfinite(loss_value) else 0.0

    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        while step < trainer.max_steps:
            loss_step, extra_step = torch.zeros((), device=device), {}
            logs = (step + 1) % trainer.log_every == 0 or step + 1 == trainer.max_steps
            saves = step + 1 == trainer.max_steps or (trainer.ckpt_every and (step + 1) % trainer.ckpt_every == 0)
            for micro in range(trainer.grad_accum):
                # per step and per micro-batch, numbered over the whole step (the loader's order): resumes
                # exactly, and N ranks x A accumulation steps draw what one rank with N x A steps draws
                torch.manual_seed(_seed(trainer.seed, step, micro * world + rank))
                x, y = loader.next()
                x = to_device(x, device)
                y = to_device(y, device) if num_classes else None
                if graphed is not None:
                    step_t = to_device(torch.tensor(step), device)
                    loss, extra = graphed(x, step_t) if y is None else graphed(x, step_t, y)
                else:
                    with grad_sync(model, micro == trainer.grad_accum - 1):
                        loss, extra = loss_and_backward(x, y, step)
                loss_step += loss.detach().float() / trainer.grad_accum
                for k, v in extra.items() if logs else ():  # only the logged steps' metrics are read
                    extra_step[k] = extra_step.get(k, 0.0) + torch.as_tensor(v).detach().float() / trainer.grad_accum
            settle()  # the previous step's outcome, long computed by now: the GPU has this step's work queued
            for p in objective_params:  # not inside DDP/FSDP: average by hand so ranks agree
                if p.grad is not None:
                    p.grad = dist.all_mean(p.grad)
            grad_norm = clip_grad_norm_(params, optim.grad_clip if optim.grad_clip > 0 else math.inf)
            finite = dist.all_min((torch.isfinite(loss_step) & torch.isfinite(grad_norm)).float())
            optimizer_step(opt, sched, skip=1.0 - finite)
            ema.update(raw, step, apply=finite)
            opt.zero_grad(set_to_none=True)
            pending = (step, *to_host_async(torch.stack([loss_step, finite, grad_norm.detach().float()])))
            step += 1
            if trainer.sync_check_every and (step == step_start + 1 or step % trainer.sync_check_every == 0):
                dist.check_in_sync(step, raw, objective)
            window_steps, loss_steps = window_steps + 1, loss_steps + 1
            if logs or saves:
                settle()
                check_finite_weights(step, run_dir, sched.get_last_lr()[0], trained, *ema.models.values())

            if logs:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.perf_counter()
                seconds = now - window_t
                metrics = {
                    # the objective's, of the last step: the mean over its micro-batches and ranks, as one rank logs it
                    **{k: dist.all_mean(v).item() for k, v in extra_step.items()},
                    "loss": dist.all_mean(torch.tensor(loss_sum / loss_steps, device=device)).item(),
                    "grad_norm": grad_norm.item(),
                    "lr": sched.get_last_lr()[0],
                    "images_per_s": trainer.batch_size * window_steps / seconds,
                    "step_ms": 1000 * seconds / window_steps,
                    "nonfinite_steps": skipped_total,
                    "epoch": loader.epoch,
                }
                if device.type == "cuda":
                    metrics["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                elapsed = now - t_start
                eta = elapsed / (step - step_start) * (trainer.max_steps - step)
                dist.info0(progress_line(step, trainer.max_steps, metrics, elapsed, eta))
                run_log.log(step, metrics)
                window_t, window_steps, loss_sum, loss_steps = time.perf_counter(), 0, 0.0, 0

            if step == trainer.max_steps or (trainer.sample_every and step % trainer.sample_every == 0):
                sample_grid(step)
            in_loop_eval(step, ema.default, objective, run_log)
            if saves:
                save_checkpoint(step)
    finally:
        run_log.close()
        unlock_folder(run_dir)
    dist.info0(f"done: {step} steps; checkpoint {checkpoint.checkpoint_path(run_dir, step)}")
    return metrics
