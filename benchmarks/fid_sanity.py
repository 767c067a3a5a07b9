"""FID between real image sets, to check the FID pipeline against known values.

    PYTHONPATH=. python benchmarks/fid_sanity.py --data DATA --inception DATA/fid/inception-2015-12-05-fid.torchscript.pt --n 1000

Prints FID of n MNIST training digits vs n MNIST test digits (small: the two splits are one
distribution; n = 1000 leaves a bias of ~15) and of n Fashion-MNIST test images vs n MNIST test digits
(large). With --full, also n training digits against the whole test split's cached statistics.
"""

import argparse
import time

import torch

from flm.data import build_dataset
from flm.metrics.fid import features, frechet_distance, load_inception, moments, reference_stats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data")
    p.add_argument("--inception", default=None)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--full", action="store_true", help="also vs the whole MNIST test split (cached statistics)")
    p.add_argument("--cache", default=None)
    p.add_argument("--subset", choices=("random", "first"), default="random", help="n random images (seed 0) or the first n")
    args = p.parse_args()
    net = load_inception(args.inception, device=args.device)

    def stats(name, split):
        data = build_dataset(name, root=args.data, download=False, split=split)
        order = (
            torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
            if args.subset == "random"
            else torch.arange(len(data))
        )
        idx = order[: args.n]
        t = time.perf_counter()
        s = moments(features(data.__getitems__(idx.tolist())[0], net))
        print(f"{name} {split}: {args.n} images in {time.perf_counter() - t:.0f} s", flush=True)
        return s

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
