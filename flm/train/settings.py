"""The loop's settings (`trainer.*`) and what follows from them and the machine: the micro-batch size,
the autocast dtype, what a CUDA graph can capture. No training here: sample.py, evaluate.py and the
ablation read these too."""

from dataclasses import dataclass, field

import torch

from flm.train.parallel import PARALLEL
from flm.typed import check_fields


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's modes


@dataclass
class TrainerConfig:
    max_steps: int = 2000
    batch_size: int = 64  # global: images per optimizer step, summed over ranks and accumulation steps
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    compile: bool = False  # torch.compile: the model, or a JVP objective's loss (jvp_mode=func, math/triton_jvp, one process)
    compile_mode: str = "default"  # torch.compile's mode: default | reduce-overhead (CUDA graphs over the compiled code) | ...
    cuda_graph: bool | str = "auto"  # replay loss + backward as one CUDA graph (one GPU or DDP, not FSDP2; flm.train.graphs);
    # auto: where it can run (resolve_cuda_graph), eager elsewhere
    bulk_casts: bool = True  # bf16 casts of the trainable parameters in one op per loss (flm.nn.cast_cache); not under DDP
    parallel: str = "ddp"  # under torchrun: ddp | fsdp (FSDP2: parameters, gradients, optimizer state and EMA sharded)
    class_conditional: bool = True  # condition on the dataset's labels (enables cfg_scale when sampling)
    ema_decays: list[float] = field(default_factory=lambda: [0.999])
    ema_sigma_rels: list[float] = field(default_factory=list)  # power-function EMAs (EDM2), by relative width
    log_every: int = 50
    sample_every: int = 0  # 0: a grid at the end only
    sample_n: int = 64
    sample_steps: int | None = None  # sampler steps of the grids; null: the objective's own (objective.sample_steps)
    sample_cfg_scale: float = 1.0
    ckpt_every: int = 0  # 0: a checkpoint at the end only
    keep_last: int = 2
    resume: str | None = None  # null (new run) | auto (latest checkpoint in the run folder) | a path
    max_nonfinite: int = 10  # stop after this many skipped (non-finite) steps in a row
    sync_check_every: int = 1000  # compare a parameter checksum across ranks after step 1 and every N steps; 0: never
    eval_every: int = 0  # FID (and label accuracy on MNIST-like data) of the EMA weights every N steps and at the end; 0: never
    eval_n: int = 10000  # images per step count
    eval_steps: list[int] | None = None  # sampler step counts to score; null: [the grids' sampler steps]
    eval_batch_size: int | None = None  # images per sampling batch on each rank; null: the training micro-batch
    eval_inception: str | None = None  # the FID Inception TorchScript; null: $FLM_FID_INCEPTION
    eval_cache: str | None = None  # reference statistics folder; null: $FLM_FID_CACHE, else ~/.cache/flm/fid
    collective_timeout_s: float = 600.0  # a rank that waits this long for a stalled one ends the run with an error

    def __post_init__(self):
        check_fields(self, "trainer")
        positive = ("max_steps", "batch_size", "grad_accum", "log_every", "sample_n", "max_nonfinite", "collective_timeout_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.{name} must be > 0, got {getattr(self, name)}")
        if self.sample_steps is not None and self.sample_steps <= 0:
            raise ValueError(f"trainer.sample_steps must be > 0 (or null: the objective's own), got {self.sample_steps}")
        for name in ("sample_every", "ckpt_every", "keep_last", "sync_check_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0 (0 = at the end only / keep all), got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"trainer.eval_every must be >= 0 (0: no evaluation), got {self.eval_every}")
        if self.eval_batch_size is not None and not self.eval_batch_size > 0:
            raise ValueError(
                f"trainer.eval_batch_size must be > 0 (or null: the training micro-batch), got {self.eval_batch_size}"
            )
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"trainer.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"trainer.parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        if isinstance(self.cuda_graph, str) and self.cuda_graph != "auto":
            raise ValueError(f"trainer.cuda_graph must be true, false or auto, got {self.cuda_graph!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"trainer.compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")


def local_batch_size(batch_size: int, grad_accum: int, world: int) -> int:
    """Images per rank per micro-batch: the global batch cut into world x grad_accum equal parts."""
    if batch_size % (world * grad_accum):
        raise ValueError(
            f"trainer.batch_size={batch_size} is not divisible by world size x grad_accum = {world} x {grad_accum}; "
            f"pick a multiple of {world * grad_accum}"
        )
    return batch_size // (world * grad_accum)


def amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `precision` on `device`; None: fp32, no autocast."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def check_cuda_graph(trainer: TrainerConfig, device: torch.device, world: int) -> None:
    """trainer.cuda_graph=true captures each process's loss + backward of one micro-batch (replayed once per
    micro-batch; under DDP the gradients are averaged after the replays, flm.train.parallel.wrap); refuse what
    it cannot capture."""
    problems = cuda_graph_problems(trainer, device, world)
    if problems:
        raise ValueError("trainer.cuda_graph=true cannot run here: " + "; ".join(problems) + ". Set trainer.cuda_graph=false")


def resolve_cuda_graph(trainer: TrainerConfig, device: torch.device, world: int, objective) -> tuple[bool, str | None]:
    """trainer.cuda_graph as true or false, and why `auto` chose eager steps (None otherwise). auto graphs the step
    where true would run (cuda_graph_problems) and the objective updates every network each step or says which it
    updates at each step (`phase`, flm.objectives.protocol), so that no case it picks is refused later."""
    if trainer.cuda_graph != "auto":
        return bool(trainer.cuda_graph), None
    problems = cuda_graph_problems(trainer, device, world)
    if not problems and _alternates_without_phase(objective):
        problems.append(f"{type(objective).__name__} alternates the networks it updates without a phase(step) method")
    return not problems, "; ".join(problems) or None


def _alternates_without_phase(objective) -> bool:
    """An objective with trainable networks of its own (a fake score) and no phase(step): its steps may differ in the
    networks they update, which one captured graph cannot replay."""
    networks = getattr(objective, "networks", {})
    return any(network.trainable for network in networks.values()) and not hasattr(objective, "phase")


def cuda_graph_problems(trainer: TrainerConfig, device: torch.device, world: int) -> list[str]:
    """What keeps a CUDA graph from capturing this run's step, one phrase each; empty where it can."""
    problems = []
    if device.type != "cuda":
        problems.append(f"it needs a CUDA device, and this run is on {device}")
    if world > 1 and trainer.parallel == "fsdp":
        problems.append(
            f"FSDP2 ({world} processes, trainer.parallel=fsdp) all-gathers and reduce-scatters from hooks on streams of "
            f"its own and frees each block's gathered weights after use, which a replay cannot repeat (trainer.parallel=ddp "
            f"can be graphed)"
        )
    if trainer.compile:
        problems.append("it replaces torch.compile, and trainer.compile=true")
    return problems


def takes_jvp(objective) -> bool:
    """Whether the objective's loss takes a JVP through the model (MeanFlow, sCM and its students)."""
    return hasattr(objective, "jvp_mode")


def check_prediction(objective, prediction: str) -> None:
    """An objective takes the model outputs it lists (`predictions`); a distilled sCD/rCM student takes the data one only with
    its boundary regression (objective.boundary_weight, adaptive_weighting off)."""
    if prediction not in objective.predictions:
        restores = hasattr(objective, "boundary_weight")  # sCD and rCM: the regression that restores f(x, 0) = x
        raise ValueError(
            f"model.prediction={prediction} does not fit objective {type(objective).__name__}, whose model predicts "
            f"{' or '.join(objective.predictions)} (docs/quality.md: a "
            f"data-predicting sCD/rCM student has no boundary condition f(x, 0) = x and drifts); pass "
            f"model.prediction=velocity (a distilled student: and a velocity teacher)"
            + (
                ", or objective.boundary_weight > 0 with objective.adaptive_weighting=false (sCD's regression that restores it)"
                if restores
                else ""
            )
        )


def check_compile(trainer: TrainerConfig, objective, world: int, attention: str) -> None:
    """trainer.compile=true compiles a JVP objective's loss, which Dynamo traces only through torch.func.jvp, and
    with math attention or the fused kernel (its JVP op has an autograd formula for compiled code); `auto` could
    pick SDPA, whose JVP under compile was not tested."""
    if not (trainer.compile and takes_jvp(objective)):
        return
    if attention not in ("math", "triton_jvp"):
        raise ValueError(
            f"trainer.compile=true compiles {type(objective).__name__}'s loss, JVP included, with math or triton_jvp "
            f"attention only, and this run has attention={attention}; pass attention=triton_jvp (a GPU) or "
            f"attention=math, or trainer.compile=false to keep {attention}"
        )
    if objective.jvp_mode != "func":
        raise ValueError(
            f"trainer.compile=true compiles {type(objective).__name__}'s loss, JVP included, and Dynamo traces torch.func.jvp, "
            f"not forward-AD duals (jvp_mode={objective.jvp_mode}); pass objective.jvp_mode=func"
        )
    if world > 1:
        raise ValueError(
            f"trainer.compile=true with a JVP objective runs on one process (a compiled JVP through DDP/FSDP2 is not "
            f"tested), and this run has {world}; set trainer.compile=false"
        )
