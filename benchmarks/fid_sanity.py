"""FID between real image sets, to check the FID pipeline against known values.

    PYTHONPATH=. python benchmarks/fid_sanity.py --data DATA --inception DATA/fid/inception-2015-12-05-fid.torchscript.pt --n 1000

Prints FID of n MNIST training digits vs n MNIST test digits (small: the two splits are one
distribution; n = 1000 leaves a bias of ~15) and of n Fashion-MNIST test images vs n MNIST test digits
(large). With --full, also n training digits against the whole test split's cached statistics. With --perturb, the
same n training digits against the test split's statistics after pixel-scale damage of known size: Gaussian noise
(pixel-scale damage), its high-pass part only (flm.objectives.frequency.high_pass), and a
3 x 3 blur; how much FID charges for each says which errors of a generator it weighs. With --perturb faint, faint
pixels alone (8-bit levels 5-15, flm.metrics.pixels), where the few-step samples have them: speckle on the black
background at a few rates, and a halo on the black pixels next to a stroke.
"""

import argparse
import time

import torch

from flm.data import build_dataset
from flm.metrics.fid import features, frechet_distance, load_inception, moments, reference_stats
from flm.metrics.images import as_float_images, to_levels
from flm.metrics.pixels import faint_share
from flm.objectives.frequency import high_pass

NOISE_STDS = (0.02, 0.05, 0.1)


def perturbations(x: torch.Tensor, seed: int = 0):
    """(name, images) of x in [-1, 1] (N, C, H, W): clean, + Gaussian noise, + high-passed noise, blurred."""
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    yield "clean", x
    for std in NOISE_STDS:
        yield f"+ noise, std {std}", (x + std * noise).clamp(-1, 1)
    noise = high_pass(noise)
    for std in NOISE_STDS:
        yield f"+ high-passed noise, std {std}", (x + std * noise).clamp(-1, 1)
    yield "3 x 3 binomial blur", x - high_pass(x)


SPECKLE_RATES = (0.02, 0.05, 0.1)


def faint_perturbations(x: torch.Tensor, seed: int = 0):
    """(name, images) of x in [-1, 1] (N, 1, H, W) with black pixels (level 0) raised to a random level in 5-15:
    clean; speckle, each black pixel with probability p; a halo, the black pixels next to a stroke (level >= 128,
    3 x 3 neighbourhood); half of that halo."""
    gen = torch.Generator().manual_seed(seed)
    levels = to_levels(x)
    black = levels == 0
    faint = torch.randint(5, 16, x.shape, generator=gen).float()
    coin = torch.rand(x.shape, generator=gen)

    def raised(mask):
        return torch.where(mask, faint, levels) / 127.5 - 1

    yield "clean", x
    for p in SPECKLE_RATES:
        yield f"faint speckle, {100 * p:g} % of the black pixels", raised(black & (coin < p))
    halo = black & (torch.nn.functional.max_pool2d((levels >= 128).float(), 3, stride=1, padding=1) > 0)
    yield "faint halo, every black pixel next to a stroke", raised(halo)
    yield "faint halo, half of them", raised(halo & (coin < 0.5))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data")
    p.add_argument("--inception", default=None)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--full", action="store_true", help="also vs the whole MNIST test split (cached statistics)")
    p.add_argument("--cache", default=None)
    p.add_argument("--subset", choices=("random", "first"), default="random", help="n random images (seed 0) or the first n")
    p.add_argument(
        "--perturb",
        nargs="?",
        const="noise",
        choices=("noise", "faint"),
        help="only: n training digits, damaged (noise and blur, or faint pixels), vs the test split",
    )
    args = p.parse_args()
    net = load_inception(args.inception, device=args.device)

    def images(name, split):
        data = build_dataset(name, root=args.data, download=False, split=split)
        order = (
            torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
            if args.subset == "random"
            else torch.arange(len(data))
        )
        return data.__getitems__(order[: args.n].tolist())[0]

    def stats(name, split):
        t = time.perf_counter()
        s = moments(features(images(name, split), net))
        print(f"{name} {split}: {args.n} images in {time.perf_counter() - t:.0f} s", flush=True)
        return s

    if args.perturb:
        ref = reference_stats(net, "mnist", split="test", root=args.data, cache=args.cache)
        damaged = perturbations if args.perturb == "noise" else faint_perturbations
        print(f"| MNIST train digits ({args.n}) vs the test split ({ref.n}) | FID | faint pixels |\n|---|---|---|")
        for name, x in damaged(as_float_images(images("mnist", "train"))):
            fid = frechet_distance(*moments(features(x, net)), ref.mu, ref.sigma)
            print(f"| {name} | {fid:.2f} | {100 * faint_share(x):.2f} % |", flush=True)
        return

    mnist_test = stats("mnist", "test")
    mnist_train = stats("mnist", "train")
    fashion = stats("fashion_mnist", "test")
    print(f"{args.subset} subsets")
    print(f"FID MNIST train vs test ({args.n} vs {args.n}): {frechet_distance(*mnist_train, *mnist_test):.2f}")
    print(f"FID Fashion-MNIST vs MNIST test ({args.n} vs {args.n}): {frechet_distance(*fashion, *mnist_test):.2f}")
    if args.full:
        ref = reference_stats(net, "mnist", split="test", root=args.data, cache=args.cache)
        print(f"FID MNIST train ({args.n}) vs the test split ({ref.n}): {frechet_distance(*mnist_train, ref.mu, ref.sigma):.2f}")


if __name__ == "__main__":
    main()
