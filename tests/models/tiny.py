"""A tiny DiT with random weights everywhere (DiT's zero init would hide most of the network)."""

import contextlib

import torch
import torch.nn.functional as F

from flm import nn as fnn
from flm.models import build_model


def tiny_dit(
    *,
    attention="math",
    num_classes=10,
    time_inputs=1,
    size="DiT-T/2",
    input_size=8,
    channels=3,
    seed=0,
    velocity_head=False,
    cond_norm=False,
    decoder_depth=0,
):
    model = build_model(
        size,
        input_size=input_size,
        in_channels=channels,
        num_classes=num_classes,
        time_inputs=time_inputs,
        attention=attention,
        velocity_head=velocity_head,
        cond_norm=cond_norm,
        decoder_depth=decoder_depth,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.25)
    return model


def with_backend(model, backend: str):
    """Point every attention layer of `model` at `backend` (same weights)."""
    for block in model.blocks:
        block.attn.backend = backend
    return model


@contextlib.contextmanager
def plain_layers():
    """Swap flm.nn's layers for the plain PyTorch ops they stand for: a reference that shares no
    JVP or backward rule with flm.nn (the DiT looks them up in flm.nn at call time)."""

    def layer_norm(x, weight=None, bias=None, eps=1e-6):
        y = F.layer_norm(x, (x.shape[-1],), eps=eps)
        return (y if weight is None else y * weight) + (0 if bias is None else bias)

    plain = {
        "linear": F.linear,
        "layer_norm": layer_norm,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
        "gated_residual": lambda x, gate, h: x + gate * h,
    }
    saved = {name: getattr(fnn, name) for name in plain}
    for name, fn in plain.items():
        setattr(fnn, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fnn, name, fn)
