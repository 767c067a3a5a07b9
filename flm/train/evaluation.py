"""Sample quality of a generator: FID per sampler step count, and label accuracy on MNIST-like data.
One code path for evaluate.py and for the training loop's `trainer.eval_every`.

    evaluator = Evaluator(data=DataConfig(name="mnist", root="data"), shape=(1, 28, 28), num_classes=10,
                          n=10_000, steps=[1, 2], device=device, amp_dtype=torch.bfloat16)
    evaluator(model, objective)     # {"fid_steps1": ..., "label_acc_steps1": ..., "fid_steps2": ..., ...}

Image i is drawn from seed + i with its own generator (flm.train.sampling.generate), with the labels
cycling through the classes, so every evaluation of a run scores the same noise and labels. Under
torchrun the ranks split the images in equal contiguous blocks (every rank runs the same number of
batches, as FSDP2's sharded forward needs), gather the features, and rank 0 computes the numbers;
the other ranks return {}.
"""

from dataclasses import dataclass

import torch

from flm import dist
from flm.data import DataConfig
from flm.metrics import classifier as digits
from flm.metrics import fid
from flm.metrics.pixels import faint_share_per_image
from flm.train.sampling import class_labels, generate, save_grid


def is_mnist_like(shape, num_classes: int, dataset: str = "mnist") -> bool:
    """What the digit classifier reads: 10 classes of 1 x 28 x 28 images of digits (not Fashion-MNIST's clothes)."""
    return num_classes == 10 and tuple(shape) == (1, 28, 28) and dataset in ("mnist", "mnist_shipped")


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and str(value).strip().isdigit() and int(value) > 0


def parse_steps(steps) -> list[int]:
    """One step count or a list of them (steps=2, steps=[1,2]) as a list of positive ints."""
    values = [steps] if isinstance(steps, (int, float, str)) else list(steps)
    if not values or not all(_positive_int(v) for v in values):
        raise ValueError(f"steps must be a positive integer or a list of them (steps=[1,2]), got {steps!r}")
    return [int(v) for v in values]


def check_n(n) -> int:
    """The number of images to score: an integer >= 2 (a covariance needs two)."""
    if not _positive_int(n) or int(n) < 2:
        raise ValueError(f"n must be an integer >= 2 (FID fits a covariance; 10000 is usual), got {n!r}")
    return int(n)


@dataclass
class Evaluator:
    """Reference statistics and networks loaded once (at construction, so a missing file fails early);
    called with (model, objective) as often as needed.

    data: the dataset to compare with (its split: `split`, default test for MNIST and Fashion-MNIST,
    train otherwise). ref: an .npz of statistics (flm's or ADM's) instead of computing them.
    inception: the TorchScript file (default $FLM_FID_INCEPTION); cache: the statistics folder
    (default $FLM_FID_CACHE, else ~/.cache/flm/fid).
    """

    data: DataConfig
    shape: tuple
    num_classes: int
    n: int = 10_000
    steps: tuple = (1,)
    cfg_scale: float = 1.0
    seed: int = 0
    batch_size: int = 256
    device: torch.device = torch.device("cpu")
    amp_dtype: torch.dtype | None = None
    inception: str | None = None
    cache: str | None = None
    split: str | None = None
    ref: str | None = None
    features: fid.FeatureNet | None = None  # a ready feature network (tests use a small stand-in)
    decoder: object | None = None  # a latent run's flm.latents.Decoder: `shape` is the latents', images are decoded
    grid: str | None = None  # a path prefix: rank 0 writes its first 100 images of k steps to <grid>-steps<k>.png
    compute_fid: bool = True  # False: the digit metrics alone (an MNIST-like run), no Inception network or reference statistics

    def __post_init__(self):
        self.n, self.steps = check_n(self.n), parse_steps(self.steps)
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {self.batch_size}")
        self.shape, self.device = tuple(self.shape), torch.device(self.device)
        self.resolution = self.shape[-1] if self.decoder is None else self.decoder.resolution
        mnist_like = self.decoder is None and is_mnist_like(self.shape, self.num_classes, self.data.name)
        if not (self.compute_fid or mnist_like):
            raise ValueError(
                f"fid=false leaves only the digit classifier's metrics, which need an MNIST run (10 classes of 1 x 28 x "
                f"28 digits); this one has {self.num_classes} classes of {' x '.join(map(str, self.shape))} "
                f"({self.data.name}): keep fid=true"
            )
        self.net = (self.features or fid.load_inception(self.inception, device=self.device)) if self.compute_fid else None
        self.classifier = digits.load_classifier(self.device) if mnist_like else None
        self.reference = self._reference() if self.compute_fid and dist.is_main() else None  # only rank 0 computes the numbers
        self.digit_reference = digits.reference_moments(self.classifier) if mnist_like and dist.is_main() else None

    def _reference(self) -> fid.Stats:
        split = self.split or fid.default_split(self.data.name)
        if self.ref:
            stats, source = fid.read_stats(self.ref, self.net, batch_size=self.batch_size), self.ref
        else:
            stats = fid.reference_stats(
                self.net,
                self.data.name,
                split=split,
                root=self.data.root,
                resolution=self.data.resolution,
                channels=self.data.channels,
                cache=self.cache,
                batch_size=self.batch_size,
            )
            source = f"{self.data.name} {split}"
        fid.check_stats(
            stats,
            source=source,
            dataset=fid.dataset_name(self.data.name, self.data.root),
            split=split,
            resolution=self.resolution,
            network=self.net.name,
        )
        return stats

    @torch.no_grad()
    def __call__(self, model, objective) -> dict:
        """{"fid_steps<k>": ... (unless compute_fid=False), and on MNIST "label_acc_steps<k>", "digit_fd_steps<k>" and
        "faint_steps<k>" (the share of faint pixels, flm.metrics.pixels)} for every step count, on rank 0 ({} elsewhere)."""
        world, rank = dist.world_size(), dist.rank()
        per_rank = -(-self.n // world)  # equal blocks; the few images past n are dropped after the gather
        labels = class_labels(per_rank * world, self.num_classes)
        results = {}
        for steps in self.steps:
            feats, correct, digit_feats, faint = [], [], [], []
            for lo in range(rank * per_rank, (rank + 1) * per_rank, self.batch_size):
                hi = min(lo + self.batch_size, (rank + 1) * per_rank)
                y = None if labels is None else labels[lo:hi]
                images = generate(
                    model,
                    objective,
                    seeds=list(range(self.seed + lo, self.seed + hi)),
                    labels=y,
                    shape=self.shape,
                    steps=steps,
                    cfg_scale=self.cfg_scale,
                    batch_size=self.batch_size,
                    device=self.device,
                    amp_dtype=self.amp_dtype,
                    decode=self.decoder,
                )
                if self.compute_fid:
                    feats.append(fid.features(images, self.net, batch_size=self.batch_size))
                if self.grid and lo == 0:  # labels cycle 0..9: ten per row
                    save_grid(images[:100], f"{self.grid}-steps{steps}.png", nrow=self.num_classes if self.num_classes else None)
                if self.classifier is not None:
                    digit_f, predicted = digits.read(images, classifier=self.classifier, batch_size=self.batch_size)
                    correct.append((predicted == y.to(predicted.device)).float())
                    digit_feats.append(digit_f)
                    faint.append(faint_share_per_image(images))
            feats = dist.all_gather_cat(torch.cat(feats))[: self.n] if self.compute_fid else None
            if self.classifier is not None:
                accuracy = dist.all_gather_cat(torch.cat(correct))[: self.n].mean()
                digit_feats = dist.all_gather_cat(torch.cat(digit_feats))[: self.n]
                faint = dist.all_gather_cat(torch.cat(faint).to(self.device))[: self.n].mean()
            if dist.is_main():
                if self.compute_fid:
                    mu, sigma = fid.moments(feats)
                    results[f"fid_steps{steps}"] = fid.frechet_distance(mu, sigma, self.reference.mu, self.reference.sigma)
                if self.classifier is not None:
                    results[f"label_acc_steps{steps}"] = accuracy.item()
                    results[f"digit_fd_steps{steps}"] = fid.frechet_distance(*fid.moments(digit_feats), *self.digit_reference)
                    results[f"faint_steps{steps}"] = faint.item()
        return results


class InTraining:
    """`trainer.eval_every`: the EMA weights' sample quality every N steps and at the end, logged with the
    run's metrics (metrics.jsonl, console, wandb). Off (calls do nothing) when eval_every is 0."""

    def __init__(
        self,
        trainer,
        data: DataConfig,
        *,
        shape,
        num_classes: int,
        device,
        amp_dtype,
        batch_size: int,
        sample_steps: int,
        decoder=None,
    ):
        self.every, self.last = trainer.eval_every, trainer.max_steps
        self.evaluator = None
        if self.every:
            self.evaluator = Evaluator(
                data=data,
                shape=shape,
                num_classes=num_classes,
                n=trainer.eval_n,
                steps=trainer.eval_steps or [sample_steps],
                cfg_scale=trainer.sample_cfg_scale,
                batch_size=trainer.eval_batch_size or batch_size,
                device=device,
                amp_dtype=amp_dtype,
                inception=trainer.eval_inception,
                cache=trainer.eval_cache,
                decoder=decoder,
            )

    def due(self, step: int) -> bool:
        return self.evaluator is not None and (step == self.last or step % self.every == 0)

    def __call__(self, step: int, model, objective, run_log) -> None:
        if not self.due(step):
            return
        results = self.evaluator(model, objective)  # every rank samples; rank 0 gets the numbers
        if results:
            dist.info0(
                f"eval at step {step} ({self.evaluator.n} images): " + " | ".join(f"{k} {v:.4g}" for k, v in results.items())
            )
            run_log.log(step, results)
