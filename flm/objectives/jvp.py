"""The JVP every consistency objective takes, in one of two modes (`jvp_mode`):

- "dual": one forward pass on forward-AD dual tensors; the primal output keeps its graph for the
  gradient, the tangent has none (flm.nn and the triton_jvp attention compute it under no_grad).
- "two_pass": a no-grad dual pass for the tangent, then an ordinary forward pass for the gradient.
  One more forward's worth of work, no dual tensors in the gradient pass.

Both give the same output, tangent and gradients (tests/objectives/test_jvp_modes.py).
"""

import torch
from torch.autograd import forward_ad

JVP_MODES = ("dual", "two_pass")


def check_jvp_mode(mode: str) -> str:
    if mode not in JVP_MODES:
        raise ValueError(f"unknown jvp_mode {mode!r}; valid modes: {', '.join(JVP_MODES)}")
    return mode


def _dual_call(fn, primals, tangents):
    with forward_ad.dual_level():
        out = fn(*(forward_ad.make_dual(p, t) for p, t in zip(primals, tangents)))
        out_p, out_t = forward_ad.unpack_dual(out)
    if out_t is None:  # the output does not depend on the inputs
        out_t = torch.zeros_like(out_p)
    return out_p, out_t


def jvp(fn, primals: tuple, tangents: tuple, *, mode: str):
    """(fn(*primals), d fn(*primals) along tangents); the tangent is detached."""
    if mode == "dual":
        out, tangent = _dual_call(fn, primals, tangents)
        return out, tangent.detach()
    with torch.no_grad():
        _, tangent = _dual_call(fn, primals, tangents)
    return fn(*primals), tangent
