"""A tiny DiT with random weights everywhere (DiT's zero init would hide most of the network)."""

import torch

from flm.models import build_model


def tiny_dit(*, attention="math", num_classes=10, time_inputs=1, size="DiT-T/2", input_size=8, channels=3, seed=0):
    model = build_model(
        size, input_size=input_size, in_channels=channels, num_classes=num_classes,
        time_inputs=time_inputs, attention=attention,
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
