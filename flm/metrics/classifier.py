"""A small MNIST digit classifier: how often a class-conditional sample shows the digit it was asked for.

    from flm.metrics.classifier import label_accuracy
    acc = label_accuracy(images, labels)   # images in [-1, 1] (N, 1, 28, 28), or uint8 (N, 28, 28, 1) from sample.py's .npz

    python -m flm.metrics.classifier --data /work/data            # test accuracy of the shipped weights
    python -m flm.metrics.classifier --train --data /work/data    # retrain them (MNIST train split, ~1 min on 2 cores)

The weights (flm/assets/mnist-classifier.pt, fp16, ~230 KB) come from `--train`: 60,000 MNIST training
digits under DATA/MNIST/raw, seeded, so they can be reproduced; the test split shipped in flm/assets
(10,000 digits) is left for measuring. A LeNet-sized network is enough: label accuracy is a coarse
check (does a "3" look like a 3), and FID measures the rest. The digit Fréchet distance (`digit_fd_steps<k>` in
evaluate.py's results) is FID's formula on this network's 64 last hidden features against the test digits': a measure
of the same kind that costs no Inception network. It sees the digits' shapes and does not rank H200 runs as FID does
(docs/quality.md, fourteenth day); the share of faint pixels (flm.metrics.pixels) does.
"""

import argparse
import os
from importlib import resources

import torch
from torch import nn

from flm.metrics.images import as_float_images

WEIGHTS = "mnist-classifier.pt"


class DigitClassifier(nn.Sequential):
    """(N, 1, 28, 28) in [-1, 1] -> (N, 10) logits: two 5 x 5 conv + max-pool stages, two linear layers."""

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 16, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),  # (N, 16, 14, 14)
            nn.Conv2d(16, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),  # (N, 32, 7, 7)
            nn.Flatten(),
            nn.Linear(32 * 7 * 7, 64),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(64, 10),
        )


def weights_path() -> str:
    return str(resources.files("flm") / "assets" / WEIGHTS)


def load_classifier(device="cpu", path: str | None = None) -> DigitClassifier:
    """The shipped weights (or `path`), in eval mode and fp32 on `device`."""
    net = DigitClassifier()
    state = torch.load(path or weights_path(), map_location="cpu", weights_only=True)
    net.load_state_dict({k: v.float() for k, v in state.items()})
    return net.eval().to(device)


def check_mnist_like(images: torch.Tensor) -> None:
    if tuple(images.shape[1:]) != (1, 28, 28):
        raise ValueError(f"the digit classifier takes 1 x 28 x 28 images (MNIST), got {tuple(images.shape[1:])}")


@torch.no_grad()
def read(images, *, classifier: DigitClassifier | None = None, batch_size: int = 1000, device=None):
    """(features (N, 64), predicted digits (N,)), on the classifier's device, of images in [-1, 1] (N, 1, 28, 28)
    or uint8 (N, 28, 28, 1). The features are the last hidden layer's activations, what digit_fd compares."""
    x = as_float_images(images)
    check_mnist_like(x)
    if classifier is None:
        classifier = load_classifier(device or x.device)
    device = next(classifier.parameters()).device
    layers = list(classifier)
    trunk, head = nn.Sequential(*layers[:-2]), layers[-1]  # [-2] is the dropout, the identity in eval mode
    feats = torch.cat(
        [trunk(x[lo : lo + batch_size].to(device, torch.float32, non_blocking=True)) for lo in range(0, len(x), batch_size)]
    )
    return feats, head(feats).argmax(1)


def predict(images, *, classifier: DigitClassifier | None = None, batch_size: int = 1000, device=None) -> torch.Tensor:
    """Predicted digits (N,), on the classifier's device, of images in [-1, 1] (N, 1, 28, 28) or uint8 (N, 28, 28, 1)."""
    return read(images, classifier=classifier, batch_size=batch_size, device=device)[1]


def mnist_test_digits() -> torch.Tensor:
    """MNIST's 10,000 test digits as shipped in flm/assets, uint8 (10000, 28, 28, 1)."""
    from flm.data import build_dataset

    data = build_dataset("mnist_shipped", split="test")
    return data.__getitems__(range(len(data)))[0]


def reference_moments(classifier: DigitClassifier) -> tuple:
    """(mu, sigma) of the classifier's features over MNIST's test digits: digit_fd's reference."""
    from flm.metrics.fid import moments

    return moments(read(mnist_test_digits(), classifier=classifier)[0])


def label_accuracy(images, labels, *, classifier: DigitClassifier | None = None, batch_size: int = 1000, device=None) -> float:
    """Fraction of images the classifier reads as their label (labels: (N,) ints)."""
    labels = torch.as_tensor(labels).flatten().long()
    if len(labels) != len(images):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    predicted = predict(images, classifier=classifier, batch_size=batch_size, device=device)
    return (predicted == labels.to(predicted.device)).float().mean().item()  # the one host sync


# ----------------------------------------------------------------------------------------------
# Training (reproduces the shipped weights)
# ----------------------------------------------------------------------------------------------


def train(
    images_u8: torch.Tensor, labels: torch.Tensor, *, epochs: int = 4, batch_size: int = 128, lr: float = 2e-3, seed: int = 0
) -> DigitClassifier:
    """Adam with a cosine schedule on uint8 (N, 1, 28, 28) digits; random shifts of up to 2 pixels, so that
    digits drawn a little off-centre (as generators do) are still read."""
    torch.manual_seed(seed)
    net = DigitClassifier()
    steps = epochs * (len(images_u8) // batch_size)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    net.train()
    for epoch in range(epochs):
        perm = torch.randperm(len(images_u8))
        for lo in range(0, len(perm) - batch_size + 1, batch_size):
            idx = perm[lo : lo + batch_size]
            x = images_u8[idx].float() / 127.5 - 1
            dx, dy = torch.randint(-2, 3, (2,)).tolist()  # one shift per batch: cheap, and enough
            x = torch.roll(x, (dy, dx), dims=(2, 3))
            loss = nn.functional.cross_entropy(net(x), labels[idx].long())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        print(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.4f}", flush=True)
    return net.eval()


def main(argv=None) -> None:
    from flm.data import build_dataset, shipped_mnist

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", action="store_true", help="train on DATA/MNIST/raw and write the weights")
    p.add_argument("--data", default=os.environ.get("FLM_DATA", "data"), help="folder with MNIST/raw (torchvision layout)")
    p.add_argument("--out", default=weights_path(), help="where --train writes the weights")
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    if args.train:
        data = build_dataset("mnist", root=args.data, download=False)
        net = train(data.images, data.labels, epochs=args.epochs)
        torch.save({k: v.half() for k, v in net.state_dict().items()}, args.out)
        print(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KB)")
    test = shipped_mnist()
    classifier = load_classifier(path=args.out)
    acc = label_accuracy(test.images.permute(0, 2, 3, 1), test.labels, classifier=classifier)
    print(f"test accuracy (MNIST test split, 10,000 digits): {100 * acc:.2f} %")


if __name__ == "__main__":
    main()
