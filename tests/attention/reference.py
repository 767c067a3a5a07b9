"""Oracles for attention tests: float64 math attention, its JVP and its gradients.

bias and key_padding_mask are passed through to math attention (the bias in float64); math's own
treatment of them is checked against explicit formulas in test_bias.py.
"""

import torch

from flm.attention import math as math_backend


def _double(x):
    return None if x is None else x.double()


def attention64(q, k, v, *, causal=False, scale=None, bias=None, key_padding_mask=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return math_backend.attention(
        q.double(), k.double(), v.double(), causal=causal, scale=scale, bias=_double(bias), key_padding_mask=key_padding_mask
    )


def jvp64(q, k, v, tq, tk, tv, *, causal=False, scale=None, bias=None, tbias=None, key_padding_mask=None):
    """(o, to) in float64 via torch.func.jvp over math attention; tbias: the bias's tangent (None: 0)."""
    kw = dict(causal=causal, scale=scale, key_padding_mask=key_padding_mask)
    if tbias is None:
        f = lambda a, b, c: attention64(a, b, c, bias=bias, **kw)  # noqa: E731
        return torch.func.jvp(f, (q.double(), k.double(), v.double()), (tq.double(), tk.double(), tv.double()))
    f = lambda a, b, c, d: attention64(a, b, c, bias=d, **kw)  # noqa: E731
    primals, tangents = (tuple(x.double() for x in xs) for xs in ((q, k, v, bias), (tq, tk, tv, tbias)))
    return torch.func.jvp(f, primals, tangents)


def grads64(q, k, v, do, *, causal=False, scale=None, bias=None, key_padding_mask=None):
    """(dq, dk, dv) in float64 by autograd over math attention, and dbias after them when a bias is given."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    bias = None if bias is None else bias.detach().double().requires_grad_()
    attention64(q, k, v, causal=causal, scale=scale, bias=bias, key_padding_mask=key_padding_mask).backward(do.double())
    return (q.grad, k.grad, v.grad) if bias is None else (q.grad, k.grad, v.grad, bias.grad)


def randn(*shape, dtype=torch.float32, device="cpu", generator=None):
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


def qkv_and_tangents(b, h, lq, lkv, d, dtype=torch.float32, seed=0, device="cpu"):
    """(q, k, v, tq, tk, tv), standard normal in (B, H, L, D), from a generator seeded with `seed` on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, tq = (randn(b, h, lq, d, dtype=dtype, device=device, generator=g) for _ in range(2))
    k, v, tk, tv = (randn(b, h, lkv, d, dtype=dtype, device=device, generator=g) for _ in range(4))
    return q, k, v, tq, tk, tv


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere fails every comparison."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
