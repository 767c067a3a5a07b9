"""The training loop: one code path for one process and for torchrun (DDP, or FSDP2 with
`trainer.parallel=fsdp`; see flm.train.parallel). It reads as setup -> for each step (micro-batches:
batch -> objective.loss -> backward; then clip -> optimizer steps -> EMA; then log / sample / save)
-> close, and everything a checkpoint holds lives in one flm.train.state.TrainState.

The loop knows neither the loss nor the sampler: it calls `objective.loss(model, x, y, step=...)`
(with the networks the objective declares as keywords, flm.objectives.Objective) and, for sample
grids, `objective.sample(...)`. A loss given per network ({"model": ..., "fake_score": ...}) steps
only the networks it names: how rCM alternates its student and fake-score updates.

Non-finite steps: when the loss or a gradient norm is NaN/inf on any rank, the optimizer steps (and
the EMA update) are skipped on every rank with a warning, and the count is logged; after
`trainer.max_nonfinite` such steps in a row training stops with an error (the last checkpoint is
left as it was). Data and RNG still advance, so a resumed run skips the same steps. An update can
also overflow from a finite loss and gradient (a huge learning rate): the weights (the EMAs included)
are checked at every step that logs or saves, and training stops before non-finite weights are saved.
No host sync per step: a step's outcome is read one step late (flm.train.outcome).

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

import contextlib
import dataclasses
import functools
import operator
import os
import time

import torch
from torch import nn

from flm import dist
from flm import nn as fnn
from flm.data import DataConfig, Loader, mix_seed
from flm.files import lock_folder, unlock_folder
from flm.latents import Decoder, LatentFiles, reference_source
from flm.log import LoggerConfig, RunLogger, progress_line
from flm.models import ModelConfig, build_model
from flm.objectives import Network, Objective
from flm.objectives.teacher import matmuls_in_bf16
from flm.train import checkpoint
from flm.train.ema import EMA, ema_key
from flm.train.evaluation import InTraining
from flm.train.graphs import CaptureFailed, GraphedStep
from flm.train.optim import OptimConfig, Optimizer, with_decay_steps
from flm.train.parallel import grad_sync, sharded, wrap, wrap_copy, wrapper_syncs
from flm.train.sampling import class_labels, generate, save_grid
from flm.train.settings import (
    TrainerConfig,
    amp_dtype,
    check_compile,
    check_cuda_graph,
    check_prediction,
    local_batch_size,
    resolve_cuda_graph,
    takes_jvp,
)
from flm.train.state import TrainState, key


def total_loss(losses: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a step backwards: the sum of its networks' losses (one network's loss is itself: no extra kernel)."""
    return functools.reduce(operator.add, losses.values())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting: through pinned memory on CUDA (a copy from pageable
    memory may wait for the GPU to catch up)."""
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@torch.no_grad()
def start_from(model: nn.Module, source: nn.Module) -> None:
    """`source`'s weights into `model`: every tensor `model` has by that name (and shape). A MeanFlow student
    of a flow-matching teacher has one more, its embedding of t - r: its output layer starts at zero, so the
    student is its teacher exactly (u(z, r, t) = v(z, t) for every r) and learns the dependence on r."""
    keys = model.load_state_dict(source.state_dict(), strict=False)
    assert not keys.unexpected_keys, f"the model lacks {keys.unexpected_keys}"  # flm.objectives.teacher checked it
    if any(k.startswith("dt_embedder.") for k in keys.missing_keys):
        nn.init.zeros_(model.dt_embedder.fc2.weight)
        nn.init.zeros_(model.dt_embedder.fc2.bias)


def frozen(net: nn.Module, network: Network, device: torch.device, parallel: str) -> nn.Module:
    """An objective's frozen network (a teacher) as the loop runs it: no gradients, eval mode, and on a GPU its linear
    weights in bf16 where it runs under bf16 autocast only and is not sharded (Network.bf16_on_cuda). Called after the
    trained model has started from it (start_from), which takes the float32 weights."""
    if network.bf16_on_cuda and device.type == "cuda" and not sharded(parallel):
        matmuls_in_bf16(net)
    return net.requires_grad_(False).eval()


def build_state(
    model_args: dict, objective, optim: OptimConfig, trainer: TrainerConfig, loader: Loader, device: torch.device, config: dict
) -> TrainState:
    """The networks placed and wrapped, their EMAs and optimizers, in a TrainState at step 0."""
    optim = with_decay_steps(optim, trainer.max_steps)
    torch.manual_seed(trainer.seed)  # the same initial weights on every rank
    raw = build_model(**model_args).to(device)
    objective.to(device)
    nets = {name: network.build(model_args).to(device) for name, network in objective.networks.items()}
    for name in [name for name, network in objective.networks.items() if network.model_init]:
        start_from(raw, nets[name])  # a distillation's student starts as its teacher
    # the EMA copies first: under FSDP2, wrap() shards raw in place (and wrap_copy shards the copies alike)
    ema = EMA(raw, trainer.ema_decays, wrap=lambda m: wrap_copy(m, device, trainer.parallel), sigma_rels=trainer.ema_sigma_rels)
    model = wrap(raw, device, trainer.parallel, cuda_graph=trainer.cuda_graph)
    if trainer.compile and not takes_jvp(objective):  # a JVP objective's whole loss is compiled instead (train)
        model = torch.compile(model, mode=trainer.compile_mode)

    def unsynced(net: nn.Module):  # the parameters whose gradients the optimizer averages over the ranks
        return () if wrapper_syncs(trainer.parallel, cuda_graph=trainer.cuda_graph) else net.parameters()

    optimizers = {
        "model": Optimizer(
            nn.ModuleDict({"model": raw, "objective": objective}), optim, replicated=[*objective.parameters(), *unsynced(raw)]
        )
    }
    trainable, extras = {}, {}
    for name, network in objective.networks.items():  # a distillation's teacher and fake score
        net = nets[name]
        if network.trainable:
            trainable[name], extras[name] = net, wrap(net, device, trainer.parallel, cuda_graph=trainer.cuda_graph)
            optimizers[name] = Optimizer(
                nn.ModuleDict({name: net}), dataclasses.replace(optim, **network.optim), replicated=unsynced(net)
            )
        else:
            extras[name] = wrap_copy(frozen(net, network, device, trainer.parallel), device, trainer.parallel)
    decay = getattr(objective, "target_ema_decay", None)  # an objective's target network: an EMA of the model
    if decay is not None:
        if ema_key(decay) not in ema.models:
            raise ValueError(
                f"the objective builds its target with the EMA at decay {decay:g}, but trainer.ema_decays is "
                f"{list(trainer.ema_decays)}; add {decay:g} to trainer.ema_decays"
            )
        extras["ema"] = ema.models[ema_key(decay)]
    return TrainState(
        model=raw,
        wrapped=model,
        ema=ema,
        objective=objective,
        optimizers=optimizers,
        loader=loader,
        device=device,
        model_args=model_args,
        config=config,
        max_nonfinite=trainer.max_nonfinite,
        trainable=trainable,
        extras=extras,
    )


def accumulate(
    state: TrainState, loss_and_backward, trainer: TrainerConfig, device, *, conditional: bool, keep_metrics: bool
) -> tuple[dict[str, torch.Tensor], dict, tuple[str, ...]]:
    """One step's micro-batches: batch -> loss -> backward. ({network: its mean loss}, the objective's mean
    metrics, the networks the step updates)."""
    losses_step, metrics, updates = {}, {}, None
    for micro in range(trainer.grad_accum):
        # per step and per micro-batch, numbered over the whole step (the loader's order): resumes
        # exactly, and N ranks x A accumulation steps draw what one rank with N x A steps draws
        torch.manual_seed(mix_seed(trainer.seed, state.step, micro * dist.world_size() + dist.rank()))
        x, y = state.loader.next()
        x, y = to_device(x, device), (to_device(y, device) if conditional else None)
        with grad_sync(state.wrapped, micro == trainer.grad_accum - 1):
            losses, extra, step_updates = loss_and_backward(x, y, state.step)
        assert updates in (None, step_updates), "an objective's updates must depend on the step alone"
        updates = step_updates
        for name, loss in losses.items():  # new tensors: a graph's outputs are overwritten by its next replay
            losses_step[name] = losses_step.get(name, 0.0) + loss.detach().float() / trainer.grad_accum
        for k, v in extra.items() if keep_metrics else ():  # only the logged steps' metrics are read
            metrics[k] = metrics.get(k, 0.0) + torch.as_tensor(v).detach().float() / trainer.grad_accum
    return losses_step, metrics, updates


class Meter:
    """Throughput since the last log, and the time since the run (re)started. The grids, evaluations and
    checkpoints between steps are left out of the window (`paused`), and so is each kind of step's first run in this
    process (`warming`: compilation, CUDA-graph capture, autotuning; logged apart as warmup_s), so step_ms is the
    steps' steady time. A window of warm-ups alone reports theirs."""

    def __init__(self, step: int):
        self.t_start = self.t_window = time.perf_counter()
        self.step_start, self.steps = step, 0
        self.warmups, self.warmup_s = 0, 0.0

    def metrics(
        self, state: TrainState, trainer: TrainerConfig, device, objective_metrics: dict, grad_norms: dict[str, torch.Tensor]
    ) -> dict:
        """The logged step's metrics (means over ranks), and a new window."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - self.t_window
        steps = self.steps
        if not steps:  # the window's steps were all warm-ups
            seconds, steps = self.warmup_s, self.warmups
        losses = state.outcomes.mean_losses()
        metrics = {
            # the objective's, of the last step: the mean over its micro-batches and ranks, as one rank logs it
            **{k: dist.all_mean(v).item() for k, v in objective_metrics.items()},
            # each network's mean loss over the window's steps that trained it: "loss" the model's, "fake_score.loss" ...
            **{key(name, "loss"): dist.all_mean(torch.tensor(v, device=device)).item() for name, v in losses.items()},
            **{key(name, "grad_norm"): norm.item() for name, norm in grad_norms.items()},  # the step's updated networks
            "lr": state.optimizers["model"].lr,
            "images_per_s": trainer.batch_size * steps / seconds,
            "step_ms": 1000 * seconds / steps,
            "nonfinite_steps": state.outcomes.nonfinite.total,
            "epoch": state.loader.epoch,
        }
        if device.type == "cuda":
            metrics["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if self.warmups:
            metrics["warmup_s"] = self.warmup_s
        self.t_window, self.steps, self.warmups, self.warmup_s = time.perf_counter(), 0, 0, 0.0
        return metrics

    @contextlib.contextmanager
    def paused(self, device):
        if device.type == "cuda":  # the queued step's work belongs to the window
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t_window += time.perf_counter() - t0

    @contextlib.contextmanager
    def warming(self, device):
        """A step that compiles or captures: paused, its own GPU work included, and its time into warmup_s."""
        window_start = self.t_window
        with self.paused(device):
            yield
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        self.warmup_s += self.t_window - window_start  # what `paused` moved the window's start by
        self.warmups += 1

    def progress(self, step: int, max_steps: int, metrics: dict) -> str:
        elapsed = time.perf_counter() - self.t_start
        return progress_line(step, max_steps, metrics, elapsed, elapsed / (step - self.step_start) * (max_steps - step))


def sample_grid(state: TrainState, trainer: TrainerConfig, run_dir: str, run_log: RunLogger, **generate_args) -> None:
    """The EMA's samples of fixed seeds and labels; every rank samples (FSDP2 gathers), rank 0 writes."""
    images = generate(
        state.sampled, state.objective, seeds=list(range(trainer.sample_n)), cfg_scale=trainer.sample_cfg_scale, **generate_args
    )
    if dist.is_main():
        path = os.path.join(run_dir, "samples", f"step-{state.step:08d}.png")
        save_grid(images, path, nrow=10 if state.model_args["num_classes"] == 10 else None)
        run_log.log_image(state.step, "samples", path)


@dataclasses.dataclass
class RunData:
    """What the run trains on: the dataset and its loader, and for latents the VAE decoder, the images FID
    compares against and the run config with the latents' record (it goes with every checkpoint)."""

    dataset: object
    loader: Loader
    num_classes: int
    reference: DataConfig
    config: dict
    decoder: Decoder | None = None


def open_data(data: DataConfig, trainer: TrainerConfig, micro_batch: int, device, config: dict) -> RunData:
    dataset = data.build()
    decoder, reference = None, data
    if isinstance(dataset, LatentFiles):  # samples are decoded by the folder's VAE
        config = {**config, "latents": dataset.info.as_dict()}
        decoder = Decoder(dataset.info, device)
        reference = dataclasses.replace(data, **reference_source(dataset.info.as_dict()))  # FID: the source images
    loader = Loader(
        dataset,
        batch_size=micro_batch,
        rank=dist.rank(),
        world_size=dist.world_size(),
        seed=trainer.seed,
        grad_accum=trainer.grad_accum,
        hflip=data.hflip,
        num_workers=data.num_workers,
    )
    num_classes = dataset.num_classes if trainer.class_conditional else 0
    return RunData(dataset, loader, num_classes, reference, config, decoder)


def data_scale_warning(objective, run: RunData) -> str | None:
    """A warning when a TrigFlow objective's sigma_d (the data's scale, by its definition) is off the latents' RMS
    by more than 2x: the proposal and the preconditioning would then be those of another noise scale."""
    sigma_d = getattr(objective, "sigma_d", None)
    if sigma_d is None or not isinstance(run.dataset, LatentFiles):
        return None
    rms = run.dataset.info.rms()
    if 0.5 <= sigma_d / rms <= 2.0:
        return None
    return (
        f"warning: objective.sigma_d={sigma_d:g}, but the latents' RMS is {rms:.3g} (the folder's meta.json); TrigFlow "
        f"takes sigma_d as the data's scale: set objective.sigma_d={rms:.2g}, and add ln({rms:.2g} / {sigma_d:g}) to "
        f"objective.p_mean and scale objective.sigma_max alike to keep the distribution of t"
    )


def banner(
    run_dir, state: TrainState, objective, dataset, trainer: TrainerConfig, device, dtype, micro_batch, resume_from
) -> str:
    """The run's first log line: folder, model, objective, data, devices, precision, batch split, resume point."""
    world, n_params = dist.world_size(), sum(p.numel() for p in state.model.parameters())
    return (
        f"run folder {os.path.abspath(run_dir)} | {state.model_args['name']} {n_params / 1e6:.2f}M params | "
        f"{type(objective).__name__} | {len(dataset)} images {dataset.channels}x{dataset.resolution}x{dataset.resolution} | "
        f"device {device} x {world}{f' ({trainer.parallel})' if world > 1 else ''} | precision {dtype or torch.float32} | "
        f"batch {trainer.batch_size} = {world} ranks x {trainer.grad_accum} accum x {micro_batch}"
        + (f" | resumed from {resume_from} at step {state.step}" if resume_from else "")
    )


def train(
    *,
    run_dir: str,
    model: ModelConfig,
    objective: Objective,
    data: DataConfig,
    optim: OptimConfig,
    trainer: TrainerConfig,
    logger: LoggerConfig,
    config: dict | None = None,
) -> dict:
    """Train until trainer.max_steps; returns the last logged metrics.

    The data and the objective complete the model's build arguments (model.args); config is the
    resolved run config stored in every checkpoint (sample.py rebuilds from it).
    """
    device = dist.init(trainer.device, timeout_s=trainer.collective_timeout_s)
    world = dist.world_size()
    run_dir = dist.broadcast_object(run_dir)  # ranks may have resolved ${now:...} a second apart
    if dist.is_main():
        lock_folder(run_dir)  # one run per folder: a second process is refused before it writes anything
        checkpoint.remove_temporary(run_dir)  # of a killed run
    micro_batch = local_batch_size(trainer.batch_size, trainer.grad_accum, world)
    dtype = amp_dtype(trainer.precision, device)
    model.check_runs(device, dtype)
    if trainer.cuda_graph is True:
        check_cuda_graph(trainer, device, world)
    auto_graph = trainer.cuda_graph == "auto"
    graphed, why_eager = resolve_cuda_graph(trainer, device, world, objective)
    trainer = dataclasses.replace(trainer, cuda_graph=graphed)  # a bool from here on
    check_compile(trainer, objective, world, model.attention)
    resume_from = checkpoint.resolve_resume(trainer.resume, run_dir)
    if model.prediction == "auto":  # a resumed run keeps its own; a distilled student predicts as its teacher
        saved = resume_from or getattr(objective, "teacher", None)
        model = model.resolve_prediction(objective.predictions, saved and checkpoint.saved_prediction(saved))
    check_prediction(objective, model.prediction)

    run = open_data(data, trainer, micro_batch, device, config or {})
    dataset, decoder, num_classes, config = run.dataset, run.decoder, run.num_classes, run.config
    model_args = model.args(
        input_size=dataset.resolution,
        in_channels=dataset.channels,
        num_classes=num_classes,
        time_inputs=objective.time_inputs,
        velocity_head=getattr(objective, "velocity_head", False),
    )
    state = build_state(model_args, objective, optim, trainer, run.loader, device, config)
    if warning := data_scale_warning(objective, run):
        dist.info0(warning)
    if resume_from:
        state.load_state_dict(checkpoint.load(resume_from), source=resume_from)
        if state.step >= trainer.max_steps:
            raise ValueError(
                f"checkpoint {resume_from!r} is at step {state.step}, and trainer.max_steps={trainer.max_steps}: "
                f"nothing to train; pass trainer.max_steps > {state.step} to continue the run"
            )
    dist.info0(banner(run_dir, state, objective, dataset, trainer, device, dtype, micro_batch, resume_from))
    if auto_graph:
        dist.info0("trainer.cuda_graph=auto: " + ("CUDA-graph steps" if graphed else f"eager steps, since {why_eager}"))
    shape = (dataset.channels, dataset.resolution, dataset.resolution)
    steps = trainer.sample_steps or objective.sample_steps
    per_rank = micro_batch * trainer.grad_accum  # images per rank per step: the sampling batch
    grid = dict(
        labels=class_labels(trainer.sample_n, num_classes),
        shape=shape,
        steps=steps,
        batch_size=per_rank,
        device=device,
        amp_dtype=dtype,
        decode=decoder,
    )
    in_loop_eval = InTraining(
        trainer,
        run.reference,
        shape=shape,
        num_classes=num_classes,
        device=device,
        amp_dtype=dtype,
        batch_size=per_rank,
        sample_steps=steps,
        decoder=decoder,
    )
    run_log = RunLogger(run_dir, logger, run_config=config, resumed_at=state.step if resume_from else None)

    phase_of = getattr(objective, "phase", None)  # alternating objectives (rCM) name each step's kind

    def phase_at(step: int) -> str | None:
        return phase_of(step) if phase_of else None

    # a compiled JVP objective: its whole loss (torch.func.jvp included) is one graph per phase; the step goes in as a
    # tensor, as into a CUDA graph, so that a new step number does not recompile it
    compiled = trainer.compile and takes_jvp(objective)
    objective_loss = torch.compile(objective.loss, mode=trainer.compile_mode) if compiled else objective.loss

    # reduce-overhead replays CUDA graphs whose outputs the next replay overwrites: each call starts a new step
    marks_steps = trainer.compile and trainer.compile_mode == "reduce-overhead"

    # one cast of each parameter per loss (flm.nn.cast_cache); FSDP2 gathers its parameters anew for every forward.
    # trainer.bulk_casts: the trainable ones all in one op, unless a wrapper reduces gradients as they arrive (DDP) or
    # compiled code casts them itself
    params = [p for opt in state.optimizers.values() for p in opt.params]
    casts_shared = not (trainer.parallel == "fsdp" and dist.world_size() > 1)
    bulk = trainer.bulk_casts and casts_shared and not trainer.compile
    in_bulk = params if bulk and not wrapper_syncs(trainer.parallel, cuda_graph=trainer.cuda_graph) else ()

    def loss_and_backward(x, y, step, phase=None):
        if marks_steps:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None), fnn.cast_cache(casts_shared, in_bulk):
            phase_arg = {} if phase is None else {"phase": phase}
            step = to_device(torch.tensor(step), device) if compiled and isinstance(step, int) else step
            loss, extra = objective_loss(state.wrapped, x, y, step=step, **phase_arg, **state.extras)
        losses, updates = state.losses(loss)
        if trainer.cuda_graph and phase is None and updates != tuple(state.optimizers):
            raise ValueError(
                f"trainer.cuda_graph=true replays one captured step, and {type(objective).__name__} alternates the "
                f"networks it updates without a phase(step) method to capture each kind of step by; set trainer.cuda_graph=false"
            )
        (total_loss(losses) / trainer.grad_accum).backward()
        return losses, extra, updates

    eager_in_window = 0  # the log window's micro-batches that ran eagerly, for its metrics' cuda_graph

    def eager_step(x, y, step):
        nonlocal eager_in_window
        eager_in_window += 1
        return loss_and_backward(x, y, step, phase_at(step))

    # a graph replays what it captured: the step (sCM's tangent warm-up) goes in as a tensor, and an
    # alternating objective's kinds of step are one graph each
    graphs, eager_phases = {}, set()

    def graphed_step(x, y, step):
        phase = phase_at(step)
        if phase in eager_phases:
            return eager_step(x, y, step)
        if phase not in graphs:
            graphs[phase] = GraphedStep(lambda x, step, y=None: loss_and_backward(x, y, step, phase), params)
        try:
            return graphs[phase](x, to_device(torch.tensor(step), device), *(() if y is None else (y,)))
        except CaptureFailed as err:
            if not auto_graph:
                raise
            # auto: what cannot be captured runs as it would eagerly (the failed capture left .grad and the random
            # generators as they were)
            dist.info0(
                f"trainer.cuda_graph=auto: the step{'' if phase is None else f' of kind {phase!r}'} could not be "
                f"captured as a CUDA graph ({err.reason}): eager steps for it from here on"
            )
            del graphs[phase]
            eager_phases.add(phase)
            return eager_step(x, y, step)

    step_fn = graphed_step if trainer.cuda_graph else eager_step

    metrics, meter, step_start, kinds_run = {}, Meter(state.step), state.step, set()
    state.wrapped.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        while state.step < trainer.max_steps:
            logs = (state.step + 1) % trainer.log_every == 0 or state.step + 1 == trainer.max_steps
            saves = state.step + 1 == trainer.max_steps or (trainer.ckpt_every and (state.step + 1) % trainer.ckpt_every == 0)
            # each kind of step compiles, captures or autotunes on its first run in this process: timed apart
            kind = phase_at(state.step)
            warms = kind not in kinds_run
            kinds_run.add(kind)
            with meter.warming(device) if warms else contextlib.nullcontext():
                losses, objective_metrics, updates = accumulate(
                    state, step_fn, trainer, device, conditional=num_classes > 0, keep_metrics=logs
                )
                state.outcomes.settle()  # the previous step's outcome, long computed by now: the GPU has this step's work queued
                grad_norms = state.update(losses, updates)
            if not warms:
                meter.steps += 1
            if trainer.sync_check_every and (state.step == step_start + 1 or state.step % trainer.sync_check_every == 0):
                dist.check_in_sync(state.step, *state.modules())
            if logs or saves:
                state.outcomes.settle()
                state.check_finite_weights(run_dir)
            if logs:
                metrics = meter.metrics(state, trainer, device, objective_metrics, grad_norms)
                # whether every step of the window replayed a CUDA graph: step_ms means graphed or eager steps
                metrics["cuda_graph"] = bool(trainer.cuda_graph) and eager_in_window == 0
                eager_in_window = 0
                dist.info0(meter.progress(state.step, trainer.max_steps, metrics))
                run_log.log(state.step, metrics)
            grids = state.step == trainer.max_steps or (trainer.sample_every and state.step % trainer.sample_every == 0)
            if grids or saves or in_loop_eval.due(state.step):
                with meter.paused(device):
                    if grids:
                        sample_grid(state, trainer, run_dir, run_log, **grid)
                    in_loop_eval(state.step, state.sampled, objective, run_log)
                    if saves:
                        state.save(run_dir, trainer.keep_last)
    finally:
        run_log.close()
        unlock_folder(run_dir)
    dist.info0(f"done: {state.step} steps; checkpoint {checkpoint.checkpoint_path(run_dir, state.step)}")
    return metrics
