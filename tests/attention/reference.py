"""Oracles for attention tests: float64 math attention, its JVP and its gradients."""

import torch

from flm.attention import math as math_backend


def attention64(q, k, v, *, causal=False, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return math_backend.attention(q.double(), k.double(), v.double(), causal=causal, scale=scale)


def jvp64(q, k, v, tq, tk, tv, *, causal=False, scale=None):
    """(o, to) in float64 via torch.func.jvp over math attention."""
    f = lambda a, b, c: attention64(a, b, c, causal=causal, scale=scale)  # noqa: E731
    return torch.func.jvp(f, (q.double(), k.double(), v.double()), (tq.double(), tk.double(), tv.double()))


def grads64(q, k, v, do, *, causal=False, scale=None):
    """(dq, dk, dv) in float64 by autograd over math attention."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    attention64(q, k, v, causal=causal, scale=scale).backward(do.double())
    return q.grad, k.grad, v.grad


def randn(*shape, dtype=torch.float32, device="cpu", generator=None):
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere fails every comparison."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
