"""A small stand-in for the Inception network, so FID's pipeline runs in CI (which has no Inception file)."""

import pytest
import torch
from torch import nn

from flm.metrics.fid import FeatureNet


class StandIn(nn.Module):
    """(N, 3, 32, 32) in [-1, 1] -> (N, 32): a fixed random conv, pooled to 2 x 2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 5, stride=2)

    def forward(self, x):
        return nn.functional.adaptive_avg_pool2d(torch.tanh(self.conv(x)), 2).flatten(1)


@pytest.fixture
def standin():
    return FeatureNet(net=StandIn().eval(), name="standin", size=32)


@pytest.fixture
def standin_file(tmp_path):
    """The stand-in as a TorchScript file, as the Inception network is stored."""
    path = tmp_path / "standin.torchscript.pt"
    torch.jit.save(torch.jit.script(StandIn().eval()), str(path))
    return str(path)
