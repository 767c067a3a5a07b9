import pytest

from flm.metrics.fid import FeatureNet

from .standin import StandIn, save_standin


@pytest.fixture
def standin():
    return FeatureNet(net=StandIn().eval(), name="standin", size=32)


@pytest.fixture
def standin_file(tmp_path):
    return save_standin(tmp_path / "standin.torchscript.pt")
