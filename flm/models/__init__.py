"""Models by name.

    from flm.models import build_model, MODEL_SIZES
    model = build_model("DiT-B/2", input_size=32, in_channels=4, num_classes=1000, time_inputs=2)
"""

from flm.models.dit import MODEL_SIZES, DiT


def build_model(
    name: str,
    *,
    input_size: int,
    in_channels: int,
    num_classes: int = 0,
    time_inputs: int = 1,
    time_scale: float = 1.0,
    attention: str = "auto",
) -> DiT:
    """A DiT of size `name` (a key of MODEL_SIZES, e.g. "DiT-B/2").

    input_size: image side in pixels or latent cells (divisible by the patch size);
    num_classes: 0 for unconditional, else labels 0..num_classes-1 plus the null class num_classes;
    time_inputs: 1 (t) or 2 (t, r: MeanFlow); time_scale: the time embedding's sinusoids are of
    time_scale * t (1: the objective's units; DiT's diffusion code used 1000); attention: a flm.attention backend name or "auto".
    """
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown model size {name!r}; valid names: {', '.join(MODEL_SIZES)}")
    depth, hidden, heads, patch = MODEL_SIZES[name]
    return DiT(
        input_size=input_size,
        in_channels=in_channels,
        patch_size=patch,
        hidden_size=hidden,
        depth=depth,
        num_heads=heads,
        num_classes=num_classes,
        time_inputs=time_inputs,
        time_scale=time_scale,
        attention=attention,
    )


__all__ = ["DiT", "MODEL_SIZES", "build_model"]
