"""The data's velocity as its posterior mean over a batch of images (objective.velocity_estimate=batch).

Flow matching, MeanFlow and sCM regress on the conditional velocity of one image (eps - x0 on the linear path), whose
scatter around the marginal velocity E[dx_t/dt | x_t] is as large as the data's own variance near noise (on MNIST,
benchmarks/velocity_variance.py). `batch_velocity` replaces it by its posterior mean over the batch's images, a stable
target field: each x_t is scored against every image as its clean image. `ReferenceBank` adds earlier batches' images
as further references (objective.velocity_references), which the batch alone lacks at mid times.
"""

import torch
from torch import nn

from flm.objectives.paths import PathSample

VELOCITY_ESTIMATES = ("sample", "batch")


def check_velocity_estimate(value: str, references: int = 0) -> str:
    if value not in VELOCITY_ESTIMATES:
        raise ValueError(f"unknown velocity_estimate {value!r}; valid: {', '.join(VELOCITY_ESTIMATES)}")
    if not (isinstance(references, int) and references >= 0):
        raise ValueError(f"velocity_references must be a number of images >= 0 (0: the batch alone), got {references!r}")
    if references and value != "batch":
        raise ValueError(
            f"velocity_references={references} adds references to the batch's velocity estimate; set "
            "objective.velocity_estimate=batch or objective.velocity_references=0"
        )
    return value


def batch_velocity(path, x0: torch.Tensor, s: PathSample, y_in=None, y=None, null=None, references=None) -> torch.Tensor:
    """The batch's estimate of the marginal velocity E[dx_t/dt | x_t] (a stable target field), in place of dx_t.

    On a path x_t = alpha_t x0 + sigma_t n, each x_t is scored against every image x0_j of the batch as its clean image
    (batch_posterior), E[x0 | x_t] ~ x^_i = sum_j w_ij x0_j, and as the velocity is linear in x0 at fixed x_t,
    v_i = dx_t_i + k_i (x0_i - x^_i) with k = sigma' alpha / sigma - alpha' (1 / t on the linear path, 1 / sin t on
    TrigFlow). Where the sample's own image dominates (small t) this is the conditional velocity; near noise, where that
    is noisiest, it is the velocity of the batch's mixture (on MNIST: 7-30x closer to the training set's exact marginal
    velocity at t >= 0.9). y_in / y / null: the labels after and before label dropout and the null class; a sample with
    a class label is scored against that class's images alone. references: (images, labels, valid) to score against in
    place of the batch (ReferenceBank.references: the batch first, then earlier ones)."""
    k = path.coefficients(s.t)[2].double()[:, None]
    images, labels, valid = (x0, y, None) if references is None else references
    x_hat = batch_posterior(path, images, s, y_in, labels, null, valid) @ images.flatten(1).double()
    shift = k * (x0.flatten(1).double() - x_hat)  # no cancellation at small t: x0 - x^ -> 0 as fast as k grows
    return s.dx_t + shift.to(s.dx_t.dtype).view_as(s.dx_t)


def batch_posterior(path, images, s: PathSample, y_in=None, labels=None, null=None, valid=None) -> torch.Tensor:
    """(B, R) weights w_ij = softmax_j(batch_logits): how likely each of the R reference images is as x_t_i's clean
    image."""
    return torch.softmax(batch_logits(path, images, s, y_in, labels, null, valid), dim=1)


def batch_logits(path, images, s: PathSample, y_in=None, labels=None, null=None, valid=None) -> torch.Tensor:
    """(B, R) log-likelihoods -||x_t_i - alpha_i x0_j||^2 / (2 sigma_i^2) of the R reference images (up to a constant
    per row), -inf where a reference is of another class than a class label y_in_i (labels: theirs) or not valid.
    Distances in float64: the expansion ||a||^2 - 2 a.b + ||b||^2 is exact enough there, and one (B, R) matmul is cheap."""
    alpha, sigma, _ = (c.double()[:, None] for c in path.coefficients(s.t))
    z, x = s.x_t.flatten(1).double(), images.flatten(1).double()
    dist = z.square().sum(1, keepdim=True) - 2 * alpha * (z @ x.T) + alpha.square() * x.square().sum(1)[None, :]
    logits = -dist / (2 * sigma.square().clamp_min(1e-12))
    if y_in is not None:  # a dropped label sees every image; the sample's own image is always of its class
        same = (y_in[:, None] == labels[None, :]) | (y_in == null)[:, None]
        logits = logits.masked_fill(~same, -torch.inf)
    if valid is not None:
        logits = logits.masked_fill(~valid[None, :], -torch.inf)
    return logits


class ReferenceBank(nn.Module):
    """Earlier batches' images (and labels) as further references for batch_velocity, in blocks of one batch.

    size images of earlier steps, in ceil(size / batch) + 1 blocks: at step s the batch is read with every written block
    but block s mod blocks, then written into that block. So what a step reads does not depend on how often it runs
    (a CUDA graph's warm-up calls, the micro-batches of gradient accumulation, a resumed run) and the bank depends on
    the steps alone. The bank is allocated at the first batch (its shape is the data's) and is part of the objective's
    state, saved in checkpoints; under DDP each rank keeps its own, and a resumed run restores rank 0's to every rank."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.register_buffer("images", torch.empty(0))
        self.register_buffer("labels", torch.empty(0, dtype=torch.long))
        self.register_buffer("written", torch.empty(0, dtype=torch.bool))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("images", "labels", "written"):  # allocated at the first batch: take the saved shapes
            saved = state_dict.get(prefix + name)
            if saved is not None:
                setattr(self, name, torch.empty_like(saved, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def references(self, x0: torch.Tensor, y, step):
        """(images, labels, valid) of the batch followed by the bank's blocks; then, at a training step (not None), the
        batch is written into its block. step: an int, or a 0-dim tensor (a CUDA-graph step reads it on the GPU)."""
        n = len(x0)
        blocks = -(-self.size // n) + 1
        y = torch.zeros(n, dtype=torch.long, device=x0.device) if y is None else y
        if self.images.numel() == 0:
            self.images = x0.new_zeros(blocks * n, *x0.shape[1:])
            self.labels = torch.zeros(blocks * n, dtype=torch.long, device=x0.device)
            self.written = torch.zeros(blocks, dtype=torch.bool, device=x0.device)
        elif self.images.shape[1:] != x0.shape[1:] or len(self.images) != len(self.written) * n:
            raise ValueError(
                f"the reference bank holds blocks of {len(self.images) // max(1, len(self.written))} images of shape "
                f"{tuple(self.images.shape[1:])}, and this batch is {n} of {tuple(x0.shape[1:])}: velocity_references "
                "needs the run's fixed batch size and image shape; keep trainer.batch_size, or start a new run folder"
            )
        written = self.written
        if step is not None:  # the block this step writes is not read
            block = torch.as_tensor(step, device=x0.device).long().remainder(blocks).reshape(1)
            written = written & (torch.arange(blocks, device=x0.device) != block)
        valid = torch.cat([torch.ones(n, dtype=torch.bool, device=x0.device), written.repeat_interleave(n)])
        refs = (torch.cat([x0, self.images.to(x0.dtype)]), torch.cat([y, self.labels]), valid)
        if step is not None:
            rows = block * n + torch.arange(n, device=x0.device)
            self.images.index_copy_(0, rows, x0.detach().to(self.images.dtype))
            self.labels.index_copy_(0, rows, y)
            self.written.index_fill_(0, block, True)
        return refs


class DataVelocity(nn.Module):
    """dx_t/dt of the data for an objective's targets: the path sample's own (estimate "sample", the papers'), or its
    posterior mean over the batch (estimate "batch"; with references > 0 also over a ReferenceBank of that many earlier
    images). Holds the bank, so an objective with it saves the bank in its state."""

    def __init__(self, estimate: str = "sample", references: int = 0):
        super().__init__()
        self.estimate = check_velocity_estimate(estimate, references)
        self.bank = ReferenceBank(references) if references else None

    def forward(self, path, x0, s: PathSample, y_in=None, y=None, null=None, step=None) -> torch.Tensor:
        """dx_t/dt at the path sample s of the batch x0; y_in / y: labels after / before label dropout; step: the
        training step (the bank's block; None reads the bank without writing)."""
        if self.estimate == "sample":
            return s.dx_t
        references = None if self.bank is None else self.bank.references(x0, y, step)
        return batch_velocity(path, x0, s, y_in, y, null, references)
