"""The fused forward's output under PyTorch's own C++ attention backward node (FLM_ATTENTION_NATIVE_NODE=1; off by default).

flm's fused attention takes its gradient through a Python autograd.Function, whose node costs the eager step host time
that SDPA's C++ node does not (issue 16). Here aten's own attention op (cuDNN's on CUDA, the CPU flash kernel on the CPU)
is called on q, k, v under a dispatch mode that returns flm's O and log-sum-exp instead of computing them, so autograd
records that op's native backward node around the fused forward's output; the node then runs the same backward flm's
Function calls (cuDNN's on Hopper), fed the same O and log-sum-exp. On the CUDA path the output also passes
GradInQOrder, so cuDNN's cached backward graphs see dO in q's order as flm's own path and its sdpa backend hand it over
(flm.attention.layout). Prototype timings: docs/attention.md, fifty-sixth day.
"""

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from flm.attention.layout import grad_in_q_order, in_q_order
from flm.env import switch

ENV = "FLM_ATTENTION_NATIVE_NODE"
aten = torch.ops.aten


def enabled() -> bool:
    """FLM_ATTENTION_NATIVE_NODE: 1 takes the fused attention's gradient through aten's C++ node, 0 (the default) through
    flm's autograd.Function (flm.env.switch)."""
    return switch(ENV, False, "aten's C++ backward node", "flm's autograd.Function")


class _Returns(TorchDispatchMode):
    """`op` returns `outputs` instead of running; every other op runs."""

    def __init__(self, op, outputs):
        super().__init__()
        self.op, self.outputs = op, outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            return self.outputs
        return func(*args, **(kwargs or {}))


def fits(q: Tensor, backward: str) -> bool:
    """A native node stands for flm's backward here: cuDNN's on CUDA (where flm chose it), the CPU flash kernel's on the
    CPU (the Triton interpreter's tests)."""
    return (q.device.type == "cuda" and backward == "cudnn") or q.device.type == "cpu"


def node(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float) -> Tensor:
    """o (B, H, Lq, D), the fused forward's output for q, k, v, with the backward node of aten's attention op: its
    gradient is that op's backward fed o and lse (B, H, Lq, natural log). Where `fits(q, ...)` holds; no bias or mask."""
    if q.device.type == "cuda":
        op = aten._scaled_dot_product_cudnn_attention.default
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed and offset: no dropout
        # undefined cum_seq tensors (None), as cuDNN's forward returns them: defined ones mark a nested tensor
        outputs = (in_q_order(o, q), lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, seed, None)
        with _Returns(op, outputs):
            o = op(q, k, v, None, True, 0.0, causal, False, scale=scale)[0]
        return grad_in_q_order(o, q)
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    with _Returns(op, (o.contiguous(), lse)):
        return op(q, k, v, 0.0, causal, scale=scale)[0]
