"""Models by name.

from flm.models import build_model, MODEL_SIZES, ModelConfig
model = build_model("DiT-B/2", input_size=32, in_channels=4, num_classes=1000, time_inputs=2)
model = ModelConfig(name="DiT-B/2", attention="triton_jvp").build(input_size=32, in_channels=4, num_classes=1000)
"""

import dataclasses
import inspect

import torch

from flm.attention import BACKENDS, get_attention
from flm.models.dit import MODEL_SIZES, PREDICTIONS, DiT, check_prediction
from flm.typed import check_fields

# build_model options that do not change the weights: a resume, sample.py or evaluate.py may choose anew
RUNTIME_OPTIONS = ("attention",)


def build_model(
    name: str,
    *,
    input_size: int,
    in_channels: int,
    num_classes: int = 0,
    time_inputs: int = 1,
    time_scale: float = 1.0,
    attention: str = "auto",
    prediction: str = "velocity",
    velocity_head: bool = False,
    cond_norm: bool = False,
    bounded: bool = False,
    decoder_depth: int = 0,
) -> DiT:
    """A DiT of size `name` (a key of MODEL_SIZES, e.g. "DiT-B/2").

    input_size: image side in pixels or latent cells (divisible by the patch size);
    num_classes: 0 for unconditional, else labels 0..num_classes-1 plus the null class num_classes;
    time_inputs: 1 (t) or 2 (t, r: MeanFlow); time_scale: the time embedding's sinusoids are of
    time_scale * t (1: the objective's units; DiT's diffusion code used 1000); attention: a flm.attention backend name or "auto";
    prediction: "velocity", or "data" (the network predicts the clean image, forward returns the linear path's velocity;
    flm.models.dit); velocity_head: a second output, the flow's velocity, beside a consistency model's (sCM's
    objective.velocity_weight asks for it); cond_norm: the conditioning embedding RMS-normalised before the adaLN layers;
    bounded: the clean-image prediction squashed into the data range [-1, 1] by tanh (prediction="data" only);
    decoder_depth: with time_inputs=2, the last blocks (and the output layer) conditioned on r in place of t and no
    interval embedding (Decoupled MeanFlow; flm.models.dit).
    """
    check_name(name)
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
        prediction=prediction,
        velocity_head=velocity_head,
        cond_norm=cond_norm,
        bounded=bounded,
        decoder_depth=decoder_depth,
    )


def complete_args(args: dict) -> dict:
    """model_args with build_model's defaults for the keys they lack (a checkpoint written before an option existed)."""
    params = inspect.signature(build_model).parameters.values()
    return {**{p.name: p.default for p in params if p.default is not inspect.Parameter.empty}, **args}


def check_name(name: str) -> None:
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown model size {name!r}; valid names: {', '.join(MODEL_SIZES)}")


@dataclasses.dataclass
class ModelConfig:
    """What `model=` and `attention=` select: the size, the time embedding's scale and the attention
    backend of every block. The data (size, channels, classes) and the objective (time inputs) give
    the rest when the model is built."""

    name: str = "DiT-Ti/7"
    time_scale: float = 1.0
    attention: str = "auto"  # a flm.attention backend, or auto (the fastest that runs here)
    prediction: str = "auto"  # velocity | data (the clean image; linear-path objectives) | auto (resolve_prediction)
    cond_norm: bool = False  # RMS-normalise the conditioning embedding before the adaLN layers (sCM's stabiliser)
    bounded: bool = False  # the clean-image prediction through tanh, inside the pixels' range [-1, 1] (prediction=data)
    decoder_depth: int = 0  # MeanFlow: the last blocks see r in place of t (Decoupled MeanFlow); 0: the (t, t - r) embedding

    def __post_init__(self):
        check_fields(self, "model")
        check_name(self.name)
        if self.prediction != "auto":
            check_prediction(self.prediction)
        if self.attention != "auto":
            get_attention(self.attention)  # an unknown name lists the valid ones
        depth = MODEL_SIZES[self.name][0]
        if not 0 <= self.decoder_depth <= depth:
            raise ValueError(
                f"model.decoder_depth must be in [0, {depth}] ({self.name} has {depth} blocks), got {self.decoder_depth}"
            )

    def resolve_prediction(self, predictions: tuple[str, ...], saved: str | None = None) -> "ModelConfig":
        """This config with prediction=auto made concrete: `saved` (what a resumed run or a distilled student's
        teacher predicts) where the objective takes it, else the objective's first: MeanFlow lists the clean
        image first (on MNIST it lowered its 1-step FID 4x, docs/quality.md); flow matching, sCM and the sCD
        students the velocity."""
        if self.prediction != "auto":
            return self
        return dataclasses.replace(self, prediction=saved if saved in predictions else predictions[0])

    def args(self, *, input_size: int, in_channels: int, num_classes: int, time_inputs: int, velocity_head: bool = False) -> dict:
        """build_model's keywords (what a checkpoint records as model_args); prediction resolved first."""
        if self.prediction == "auto":
            raise ValueError("model.prediction=auto has no network yet: resolve_prediction(objective.predictions) first")
        if self.bounded and self.prediction != "data":
            raise ValueError(
                f"model.bounded=true squashes the clean-image prediction into [-1, 1], and this run's model predicts "
                f"{self.prediction!r}; add model.prediction=data or drop model.bounded"
            )
        if self.decoder_depth and time_inputs != 2:
            raise ValueError(
                f"model.decoder_depth={self.decoder_depth} conditions the last blocks on r, and this objective's network "
                f"takes t alone; set model.decoder_depth=0 (it applies to MeanFlow)"
            )
        return dict(
            dataclasses.asdict(self),
            input_size=input_size,
            in_channels=in_channels,
            num_classes=num_classes,
            time_inputs=time_inputs,
            velocity_head=velocity_head,
        )

    def check_runs(self, device: torch.device, dtype: torch.dtype | None) -> None:
        """Fail before training when the attention backend cannot run on this device."""
        if self.attention != "auto":
            _, hidden, heads, _ = MODEL_SIZES[self.name]
            get_attention(self.attention).check_available(device, dtype or torch.float32, hidden // heads)


__all__ = ["BACKENDS", "DiT", "MODEL_SIZES", "PREDICTIONS", "ModelConfig", "RUNTIME_OPTIONS", "build_model", "complete_args"]
