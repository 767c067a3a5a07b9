"""Diffusion Transformer (Peebles & Xie 2023, arXiv 2212.09748) built from flm.nn layers.

Patchify, 2-D sin-cos position embedding, adaLN-Zero blocks, a final adaLN layer, zero-initialised
outputs, as in facebookresearch/DiT, with:
- any image size and channel count (pixels or VAE latents), output shaped like the input;
- class conditioning with a null class (index `num_classes`) for classifier-free guidance;
- a time embedding of t, or of (t, t - r) for MeanFlow (`time_inputs=2`, the paper's choice), or with
  `decoder_depth` k > 0 a decoupled one (Decoupled MeanFlow): the first blocks see t, the last k blocks and the output
  layer see r through the same embedder, so the network at r = t is a flow-matching network of the same weights and a
  flow-map student can start as its teacher with nothing new to learn at r = t; all with
  sinusoids of `time_scale * t`: 1 by default, t in the objective's own units (SiT's choice; sCM's
  c_noise(t) = t, arXiv 2410.11081 section 4.1). DiT's 1000 t multiplies d/dt of every time feature by
  1000, and the JVP objectives put d/dt into their targets: MeanFlow's (t - r) du/dt then swings by
  orders of magnitude and training does not settle;
- optionally (`cond_norm`) the conditioning embedding RMS-normalised (pixel norm) before the adaLN layers, as sCM
  normalises its time embedding: the modulations then cannot grow with the embedders' weights, whose gradients
  overflowed in sCM at lr 1e-3 (docs/quality.md, twenty-first day);
- attention through `flm.attention.attention` with the backend as a constructor argument;
- what the network predicts (`prediction`): the velocity itself, or the clean image x^ (JiT's x-prediction; pMF's
  for MeanFlow), returned as the linear path's velocity (x_t - x^) / t (t = 1 noise, flm.objectives.paths.LinearPath)
  so that every linear-path objective and sampler reads it unchanged. A one-step sample z - u(z, 0, 1) is then x^
  itself: the network need not reproduce its input noise to cancel it, which a velocity network must to within a
  grey level on every background pixel;
- optionally (`bounded`, the clean-image prediction only) x^ = tanh(output): inside the data range [-1, 1] of pixels,
  where most of MNIST's pixels sit at the bound. A linear head must hit -1 to within a grey level on every
  background pixel; through tanh an error in the output moves the pixel by (1 - x^^2) of it, ~0 at the bound, so
  background errors stop showing as faint grey speckle (what FID charges a 1-step sample for, docs/quality.md).

Nothing here knows about JVPs: dual tensors (forward AD) and torch.func.jvp flow through, and the
flm.nn layers keep the tangent path free of a reverse-mode graph.

    from flm.models import build_model
    model = build_model("DiT-B/2", input_size=32, in_channels=4, num_classes=1000, attention="triton_jvp")
    out = model(x, t, y=y)          # x (B, C, H, W), t (B,) -> (B, C, H, W)
"""

import math

import torch
from torch import nn

from flm import nn as fnn
from flm.attention import attention as attention_fn

# name: (depth, hidden size, heads, patch size)
MODEL_SIZES = {
    f"DiT-{size}/{patch}": (depth, hidden, heads, patch)
    for size, (depth, hidden, heads) in {
        "S": (12, 384, 6),
        "B": (12, 768, 12),
        "L": (24, 1024, 16),
        "XL": (28, 1152, 16),
    }.items()
    for patch in (2, 4, 8)
}
# tiny sizes for CPU tests; head dim 32 so the Triton JVP kernel runs them
MODEL_SIZES["DiT-T/2"] = (2, 64, 2, 2)
MODEL_SIZES["DiT-T/4"] = (2, 64, 2, 4)
# the default CPU run's size (python train.py): 28 x 28 MNIST as 16 tokens of 7 x 7 pixels, which buys
# depth 4 and width 128 (head dim 32) at the step time of DiT-T/4's 49 tokens (about 120 ms at batch 64)
MODEL_SIZES["DiT-Ti/7"] = (4, 128, 4, 7)

PREDICTIONS = ("velocity", "data")
# the data prediction's velocity divides by max(t, T_MIN), exact at every time a sampler visits (a 1000-step grid's last
# is 0.001) and finite at t = 0. A larger floor makes (x_t - x^) / T_MIN the velocity below it: the network must then
# copy part of its input noise there, and on the H200 a floor of 0.05 left noise in 50-step samples (FID 41 against 2-step
# 21). The loss's weight of small t is the objective's (flow matching's loss_t_min).
T_MIN = 1e-4


def velocity_from_data(x: torch.Tensor, x_hat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The linear path's velocity (x_t - x^) / max(t, T_MIN) of a clean-image prediction x^ at x_t = x (t (B,) or a scalar)."""
    return (x - x_hat) / t.to(x.dtype).clamp_min(T_MIN).reshape(-1, 1, 1, 1)


def data_from_velocity(x: torch.Tensor, u: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x^ back from a data-predicting DiT's output u = velocity_from_data(x, x^, t) (an objective on another path, sCM,
    reads the clean image itself)."""
    return x - t.to(x.dtype).clamp_min(T_MIN).reshape(-1, 1, 1, 1) * u


# --------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------


def sincos_pos_embed_2d(dim: int, grid: int) -> torch.Tensor:
    """(grid * grid, dim) fixed 2-D sin-cos embedding, half the channels per axis (MAE / DiT)."""
    assert dim % 4 == 0, "hidden size must be divisible by 4 for the 2-D sin-cos embedding"
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    coords = torch.arange(grid, dtype=torch.float64)
    gy, gx = torch.meshgrid(coords, coords, indexing="ij")

    def embed(pos):  # (grid * grid,) -> (grid * grid, dim // 2)
        angles = pos.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([embed(gy), embed(gx)], dim=1).float()


class TimestepEmbedder(nn.Module):
    """Scalar -> sinusoidal features of `time_scale * t` -> MLP (DiT's TimestepEmbedder)."""

    def __init__(self, hidden: int, freq_dim: int = 256, time_scale: float = 1.0):
        super().__init__()
        half = freq_dim // 2
        self.register_buffer("freqs", time_scale * torch.exp(-math.log(10000) * torch.arange(half) / half), persistent=False)
        self.fc1 = fnn.Linear(freq_dim, hidden)
        self.fc2 = fnn.Linear(hidden, hidden)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        args = t[:, None] * fnn.joins(self.freqs, t)[None]  # (B, freq_dim / 2)
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.fc2(fnn.silu(self.fc1(emb)))  # (B, hidden)


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, backend: str):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.qkv = fnn.Linear(hidden, 3 * hidden)
        self.proj = fnn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        # q, k, v as strided (B, H, N, D) views of one (B, N, 3, H, D) projection, cut along its own dim 2: the backward
        # then stacks their gradients straight into the projection's layout (cut along a permuted dim 0, it needed a
        # second copy to make the stack contiguous)
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, D // self.heads)
        q_BHND, k_BHND, v_BHND = (t.transpose(1, 2) for t in qkv.unbind(2))
        o_BHND = attention_fn(q_BHND, k_BHND, v_BHND, backend=self.backend)
        return self.proj(o_BHND.transpose(1, 2).reshape(B, N, D))


class Mlp(nn.Module):
    def __init__(self, hidden: int, mlp_ratio: float):
        super().__init__()
        self.fc1 = fnn.Linear(hidden, int(hidden * mlp_ratio))
        self.fc2 = fnn.Linear(int(hidden * mlp_ratio), hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(fnn.gelu_tanh(self.fc1(x)))


class DiTBlock(nn.Module):
    """adaLN-Zero block: x + gate * f(LN(x) * (1 + scale) + shift) for f in (attention, MLP)."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float, backend: str):
        super().__init__()
        self.attn = Attention(hidden, heads, backend)
        self.mlp = Mlp(hidden, mlp_ratio)
        self.adaLN_modulation = fnn.Linear(hidden, 6 * hidden)

    def forward(self, x: torch.Tensor, c_act: torch.Tensor, modulation: torch.Tensor | None = None) -> torch.Tensor:
        # x (B, N, D); c_act = SiLU(conditioning) (B, D); modulation: adaLN_modulation(c_act) (B, 6 D) when the caller
        # computed it (DiT.forward, with every block's in one matmul); each of the six (B, 1, D)
        modulation = self.adaLN_modulation(c_act) if modulation is None else modulation
        mods = modulation.unsqueeze(1).chunk(6, dim=-1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        dtype = fnn.matmul_dtype(x)  # the dtype qkv and fc1 compute in: modulate writes it (no cast in between)
        x = fnn.gated_residual(x, gate_msa, self.attn(fnn.modulate(x, shift_msa, scale_msa, dtype=dtype)))
        x = fnn.gated_residual(x, gate_mlp, self.mlp(fnn.modulate(x, shift_mlp, scale_mlp, dtype=dtype)))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, patch: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = fnn.Linear(hidden, 2 * hidden)
        self.linear = fnn.Linear(hidden, patch * patch * out_channels)

    def forward(self, x: torch.Tensor, c_act: torch.Tensor, modulation: torch.Tensor | None = None) -> torch.Tensor:
        modulation = self.adaLN_modulation(c_act) if modulation is None else modulation
        shift, scale = modulation.unsqueeze(1).chunk(2, dim=-1)
        return self.linear(fnn.modulate(x, shift, scale, dtype=fnn.matmul_dtype(x)))  # (B, N, p * p * C)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def check_prediction(prediction: str) -> str:
    if prediction not in PREDICTIONS:
        raise ValueError(
            f"unknown prediction {prediction!r}; valid: {', '.join(PREDICTIONS)} (the network's output: the velocity, "
            f"or the clean image returned as the linear path's velocity)"
        )
    return prediction


class DiT(nn.Module):
    """forward(x, t, r=None, y=None) -> tensor shaped like x (the velocity, or MeanFlow's average velocity).

    x (B, C, H, W); t (B,) (or a scalar) in the objective's time units (embedded as time_scale * t);
    r (B,) second time for MeanFlow (`time_inputs=2`: the embedding is of t and t - r);
    y (B,) integer labels in [0, num_classes], `num_classes` being the null (unconditional) class;
    y=None on a conditional model means the null class for every sample.
    """

    def __init__(
        self,
        *,
        input_size: int,
        in_channels: int,
        patch_size: int,
        hidden_size: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        num_classes: int = 0,
        time_inputs: int = 1,
        time_scale: float = 1.0,
        attention: str = "auto",
        prediction: str = "velocity",
        velocity_head: bool = False,
        cond_norm: bool = False,
        bounded: bool = False,
        decoder_depth: int = 0,
    ):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(
                f"input_size {input_size} is not divisible by the patch size {patch_size}; "
                f"use an image size that is a multiple of {patch_size} or a model with a smaller patch"
            )
        if time_inputs not in (1, 2):
            raise ValueError(f"time_inputs must be 1 (t) or 2 (t, r for MeanFlow), got {time_inputs!r}")
        if isinstance(decoder_depth, bool) or not isinstance(decoder_depth, int) or not 0 <= decoder_depth <= depth:
            raise ValueError(f"decoder_depth must be an integer in [0, {depth}] (the blocks that see r), got {decoder_depth!r}")
        if decoder_depth and time_inputs != 2:
            raise ValueError(
                f"decoder_depth={decoder_depth} conditions the last blocks on r, and this model takes t alone "
                f"(time_inputs=1: flow matching, sCM); set decoder_depth=0 or use a two-time objective (MeanFlow)"
            )
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0 (1: t as the objective gives it), got {time_scale!r}")
        if num_classes < 0:
            raise ValueError(f"num_classes must be >= 0 (0: unconditional), got {num_classes}")
        check_prediction(prediction)
        if velocity_head and prediction != "velocity":
            raise ValueError(
                f"velocity_head=True is a second output beside a velocity-predicting model's (sCM's guidance in "
                f"training), and this model predicts {prediction!r}; build it with prediction='velocity'"
            )
        if bounded and prediction != "data":
            raise ValueError(
                f"bounded=True squashes the clean-image prediction into [-1, 1], and this model predicts {prediction!r}; "
                f"build it with prediction='data' (model.prediction=data) or leave bounded off"
            )
        self.prediction, self.velocity_head, self.cond_norm = prediction, bool(velocity_head), bool(cond_norm)
        self.bounded = bool(bounded)
        self.input_size, self.in_channels, self.patch_size = input_size, in_channels, patch_size
        self.num_classes, self.time_inputs, self.decoder_depth = num_classes, time_inputs, decoder_depth
        self.grid = input_size // patch_size

        self.x_embedder = fnn.Linear(in_channels * patch_size**2, hidden_size)  # patchify as a linear
        self.register_buffer("pos_embed", sincos_pos_embed_2d(hidden_size, self.grid)[None], persistent=False)
        self.t_embedder = TimestepEmbedder(hidden_size, time_scale=time_scale)
        interval = time_inputs == 2 and not decoder_depth  # the (t, t - r) embedding; the decoupled one reuses t's
        self.dt_embedder = TimestepEmbedder(hidden_size, time_scale=time_scale) if interval else None
        self.y_embedder = nn.Embedding(num_classes + 1, hidden_size) if num_classes > 0 else None
        self.blocks = nn.ModuleList(DiTBlock(hidden_size, num_heads, mlp_ratio, attention) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, in_channels)
        # the flow's velocity beside an output that is not one (a consistency model's F), from the same trunk
        self.velocity_layer = FinalLayer(hidden_size, patch_size, in_channels) if velocity_head else None
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """DiT's init: xavier linears, N(0, 0.02) embeddings, zero adaLN and output layers."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        for emb in (self.t_embedder, self.dt_embedder):
            if emb is not None:
                nn.init.normal_(emb.fc1.weight, std=0.02)
                nn.init.normal_(emb.fc2.weight, std=0.02)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation.weight)
            nn.init.zeros_(block.adaLN_modulation.bias)
        for final in (self.final_layer, self.velocity_layer):
            for layer in () if final is None else (final.adaLN_modulation, final.linear):
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(self, x, t, r=None, y=None, *, features=None, head: str = "output"):
        """features: block indices; returns the hidden states (B, N, D) after those blocks, in that order, instead of
        the output, and runs no block after the last of them (a discriminator's features, flm.objectives.adversarial;
        through forward so that FSDP's and DDP's hooks run).
        head (a model built with velocity_head): "output" (the default), "velocity" (the velocity head's output), or
        "both" (the two concatenated along the channels, (B, 2C, H, W): one tensor for a JVP)."""
        B, C, H, W = x.shape
        if head != "output" and (head not in ("velocity", "both") or not self.velocity_head):
            raise ValueError(
                f"head must be 'output', or 'velocity' / 'both' on a model built with velocity_head=True (this one: "
                f"velocity_head={self.velocity_head}), got {head!r}"
            )
        if features is not None and (not features or any(not 0 <= i < len(self.blocks) for i in features)):
            raise ValueError(
                f"feature blocks must be indices in [0, {len(self.blocks)}) of this model's blocks, got {list(features)}"
            )
        h, c_act, c_out = self._embed(x, t, r, y)
        first = len(self.blocks) - self.decoder_depth  # the blocks from here on (the decoder) see r's conditioning
        if features is not None:
            blocks = self.blocks[: max(features) + 1]
            mods = self._modulations(c_act, c_out, blocks, [])
            hidden = []
            for i, block in enumerate(blocks):
                h = block(h, c_act if i < first else c_out, mods[block])
                hidden.append(h)
            return [hidden[i] for i in features]
        both = [self.final_layer, self.velocity_layer]
        heads = {"output": both[:1], "velocity": both[1:]}.get(head, both)
        mods = self._modulations(c_act, c_out, self.blocks, heads)
        for i, block in enumerate(self.blocks):
            h = block(h, c_act if i < first else c_out, mods[block])
        if head != "output":
            velocity = self.velocity_layer(h, c_out, mods[self.velocity_layer])
            velocity = self._unpatchify(velocity, x.shape).to(x.dtype)
            if head == "velocity":
                return velocity
        out = self._unpatchify(self.final_layer(h, c_out, mods[self.final_layer]), x.shape)
        if head == "both":
            return torch.cat([out.to(x.dtype), velocity], dim=1)
        if self.prediction == "data":  # out is x^; the velocity (x_t - x^) / t, in x's precision (t (B,) or a scalar)
            if self.bounded:  # in float32: tanh's slope near the bound is what bf16 would round away
                out = torch.tanh(out.float())
            return velocity_from_data(x, out.to(x.dtype), t)
        return out.to(x.dtype)

    def _unpatchify(self, out, shape):
        """(B, N, p * p * C) -> (B, C, H, W)"""
        B, C, H, W = shape
        p, gh, gw = self.patch_size, H // self.patch_size, W // self.patch_size
        return out.reshape(B, gh, gw, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)

    def _embed(self, x, t, r, y):
        """The patch tokens (B, N, D) with their positions, SiLU of the conditioning (B, D), and that of the decoder's
        blocks and output layer (the same tensor unless decoder_depth: there of r in place of t)."""
        B, C, H, W = x.shape
        self._check_inputs(x, r, y)
        p, gh, gw = self.patch_size, H // self.patch_size, W // self.patch_size
        # patchify: (B, C, H, W) -> (B, N, C * p * p)
        patches = x.reshape(B, C, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C * p * p)
        h = self.x_embedder(patches)
        h = h + fnn.joins(self.pos_embed, h)  # (B, N, D)

        t = t.expand(B) if t.dim() == 0 else t
        r = None if r is None else fnn.joins(r.expand(B) if r.dim() == 0 else r, t)
        c = self.t_embedder(t)  # (B, D)
        if self.dt_embedder is not None:
            c = c + self.dt_embedder(t - r)
        labels = None
        if self.y_embedder is not None:
            if y is None:
                y = torch.full((B,), self.num_classes, dtype=torch.long, device=x.device)
            labels = self.y_embedder(y)
        c_act = self._activate(c, labels)
        return h, c_act, self._activate(self.t_embedder(r), labels) if self.decoder_depth else c_act

    def _modulations(self, c_act, c_out, blocks, heads) -> dict:
        """Each of `blocks` and `heads` (final layers) -> its adaLN modulation, those that read the same conditioning in
        one matmul (fnn.linears; each its own under FSDP2); the encoder's blocks read c_act, the decoder's blocks and the
        heads c_out."""
        first = len(self.blocks) - self.decoder_depth
        layers = [*blocks, *heads]
        if any(fnn.sharded(layer.adaLN_modulation.weight) for layer in layers):
            return dict.fromkeys(layers)  # FSDP2: a block's parameters are whole only inside its own forward
        groups = [layers] if c_out is c_act else [layers[:first], layers[first:]]
        mods = {}
        for group, c in zip(groups, (c_act, c_out)):
            if group:
                mods.update(zip(group, fnn.linears(c, [layer.adaLN_modulation for layer in group])))
        return mods

    def _activate(self, c, labels):
        """SiLU of a time embedding plus the labels' (B, D), after the optional RMS norm."""
        if labels is not None:
            c = c + fnn.joins(labels, c)
        if self.cond_norm:  # pixel norm: c / rms(c), in float32 (plain ops: dual tensors and torch.func pass through)
            c32 = c.float()
            c = (c32 * torch.rsqrt(c32.square().mean(-1, keepdim=True) + 1e-8)).to(c.dtype)
        return fnn.silu(c)

    def _check_inputs(self, x, r, y) -> None:
        expected = (self.in_channels, self.input_size, self.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"x has shape {tuple(x.shape)}, expected (B, {', '.join(map(str, expected))}); build the "
                f"model with the data's input_size and in_channels"
            )
        if (r is None) != (self.time_inputs == 1):
            raise ValueError(
                f"this model takes {self.time_inputs} time input(s); "
                + ("pass r (MeanFlow) or build it with time_inputs=1" if r is None else "drop r or build it with time_inputs=2")
            )
        if y is None:
            return
        if self.num_classes == 0:
            raise ValueError("labels y were given to an unconditional model; build it with num_classes > 0 or pass y=None")
        if y.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"labels y must be integers, got dtype {y.dtype}")
        # range-checked on the host only: on a GPU the check would stall every forward until the
        # device catches up; there the embedding's own bounds check still stops a bad label
        if y.device.type == "cpu" and not torch.compiler.is_compiling() and bool(((y < 0) | (y > self.num_classes)).any()):
            raise ValueError(
                f"labels y must lie in [0, {self.num_classes}] ({self.num_classes} is the null class), "
                f"got values from {int(y.min())} to {int(y.max())}"
            )
