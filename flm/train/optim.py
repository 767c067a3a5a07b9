"""AdamW with a linear learning-rate warm-up, then constant (as MeanFlow and sCM train) or decaying (cosine or
linear, to min_lr_ratio x lr at decay_steps: short distillation runs)."""

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.experimental import implicit_replication

from flm import dist
from flm.train import checkpoint
from flm.train.parallel import clip_grad_norm_, local
from flm.typed import check_fields


DECAYS = ("none", "cosine", "linear")


@dataclass
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 0  # lr rises linearly from lr/warmup_steps to lr over this many steps
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off (the norm is still logged)
    decay: str = "none"  # after the warm-up: none (constant lr), cosine or linear, down to min_lr_ratio x lr
    decay_steps: int | None = None  # the step the decay ends at (null: trainer.max_steps); held there after it
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        check_fields(self, "optim")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optim.lr must be a finite number > 0, got {self.lr}; pass e.g. optim.lr=1e-4")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in DECAYS:
            raise ValueError(f"optim.decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if self.decay != "none" and self.decay_steps is not None and not self.decay_steps > self.warmup_steps:
            raise ValueError(
                f"optim.decay={self.decay} needs optim.decay_steps (default: trainer.max_steps) > optim.warmup_steps "
                f"({self.warmup_steps}), got {self.decay_steps}; raise it or lower optim.warmup_steps"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")


def with_decay_steps(cfg: OptimConfig, max_steps: int) -> OptimConfig:
    """cfg with decay_steps set: the run's max_steps when it is null (a resumed run with a new max_steps decays
    to that one)."""
    return cfg if cfg.decay_steps is not None else dataclasses.replace(cfg, decay_steps=max_steps)


def warmup_factor(cfg: OptimConfig, step: int) -> float:
    """The learning rate at scheduler step `step` is cfg.lr times this: the warm-up, then the decay."""
    warmup = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    if cfg.decay == "none":
        return warmup
    if cfg.decay_steps is None:
        raise ValueError("optim.decay_steps is null; the loop sets it to trainer.max_steps (with_decay_steps)")
    progress = min(1.0, max(0, step - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return warmup * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


def build_optimizer(params, cfg: OptimConfig):
    """(AdamW, LambdaLR warm-up scheduler) over `params`; the fused AdamW kernel, which optimizer_step needs."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_factor(cfg, step))
    return opt, sched


def load_schedule(opt: torch.optim.Optimizer, sched, state: dict, cfg: OptimConfig) -> None:
    """Resume the schedule at its saved position with this run's settings: after loading the optimizer's
    state (which holds the old run's hyperparameters), lr, warm-up, betas, weight decay and eps are
    `cfg`'s, so a resume with a new optim.lr trains with it."""
    sched.load_state_dict({k: state[k] for k in sched.state_dict() if k in state})  # the scheduler's own keys only
    lr = cfg.lr * warmup_factor(cfg, sched.last_epoch)
    for group in opt.param_groups:
        group.update(lr=lr, initial_lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps)
    sched.base_lrs = [cfg.lr] * len(opt.param_groups)
    sched._last_lr = [lr] * len(opt.param_groups)  # what get_last_lr() reports until the next step


def optimizer_step(opt: torch.optim.Optimizer, sched, skip: torch.Tensor) -> None:
    """One optimizer and scheduler step that leaves the weights and the Adam moments (and step count) as
    they are where `skip` (a 0-dim float tensor on the parameters' device) is 1.

    The fused AdamW kernel reads `skip` on the device (the found_inf flag torch.amp.GradScaler uses), so
    the host does not wait for the step's loss: it issues the next step while the GPU works. The
    learning-rate schedule counts every step, skipped ones included.
    """
    opt.found_inf = skip
    with implicit_replication():  # plain parameters (an objective's) next to FSDP2's DTensors in one fused call
        opt.step()
    sched.step()


class Optimizer:
    """AdamW and its warm-up schedule over the trainable parameters of `modules`, whose names key the
    checkpoint's optimizer state (flm.train.checkpoint.optimizer_state).

    replicated: the parameters outside any DDP / FSDP2 wrapper (an objective's own; all of them in a CUDA-
    graphed DDP run, flm.train.parallel.wrap), whose gradients are averaged over the ranks here, in one
    flat all-reduce, so that every rank steps alike. state_dict() gathers whole
    tensors and must be called on every rank; `schedule` is the scheduler's checkpoint part.
    """

    def __init__(self, modules: nn.ModuleDict, cfg: OptimConfig, replicated=()):
        self.modules, self.cfg, self.replicated = modules, cfg, list(replicated)
        self.params = [p for p in modules.parameters() if p.requires_grad]
        self.opt, self.sched = build_optimizer(self.params, cfg)
        self.schedule = Schedule(self)

    def clip(self) -> torch.Tensor:
        """Average the replicated gradients, clip all to optim.grad_clip; the total norm before clipping."""
        dist.all_mean_([p.grad for p in self.replicated if p.grad is not None])
        return clip_grad_norm_(self.params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf)

    @torch.no_grad()
    def grad_peaks(self) -> dict[str, float]:
        """Each parameter's largest gradient magnitude now (this rank's shard; inf or nan where it is not
        finite), by name; one host sync. max |g| cannot overflow where the norm can: float32's sum of squares
        overflows from |g| ~ 1e19 on, with every gradient finite."""
        named = [(name, p.grad) for name, p in self.modules.named_parameters() if p.grad is not None]
        if not named:
            return {}
        shards = [local(g).detach() for _, g in named]  # an FSDP2 shard may be empty on this rank
        peaks = [g.abs().amax().float() if g.numel() else g.new_zeros((), dtype=torch.float) for g in shards]
        peaks = torch.stack(peaks).tolist()
        return {name: peak for (name, _), peak in zip(named, peaks)}

    def step(self, skip: torch.Tensor) -> None:
        optimizer_step(self.opt, self.sched, skip)
        self.opt.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def state_dict(self) -> dict:
        return checkpoint.optimizer_state(self.modules, self.opt)

    def load_state_dict(self, state: dict) -> None:
        checkpoint.load_optimizer_state(self.modules, self.opt, state)


class Schedule:
    """The learning-rate schedule's checkpoint part: resumed at its position with this run's optim.*."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return self.optimizer.sched.state_dict()

    def load_state_dict(self, state: dict) -> None:
        o = self.optimizer
        load_schedule(o.opt, o.sched, state, o.cfg)
