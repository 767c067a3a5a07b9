"""The JVP every consistency objective takes, in one of two modes (`jvp_mode`):

- "dual": one forward pass on forward-AD dual tensors; the primal output keeps its graph for the
  gradient, the tangent has none (flm.nn and the triton_jvp attention compute it under no_grad).
- "two_pass": a no-grad dual pass for the tangent, then an ordinary forward pass for the gradient.
  One more forward's worth of work, no dual tensors in the gradient pass.
- "func": torch.func.jvp, the one a compiled step needs (trainer.compile: Dynamo traces functorch's
  jvp, not forward-AD duals); the primal output keeps its graph, as in "dual".

All three give the same output, tangent and gradients (tests/objectives/test_jvp_modes.py).
`record_tangents` keeps the first tangents an objective computes (flm.ablate compares them across
attention backends).
"""

import contextlib

import torch
from torch.autograd import forward_ad

JVP_MODES = ("dual", "two_pass", "func")
_recorders: list[tuple[list, int]] = []  # (found, limit) of each open record_tangents block


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
        tangent = tangent.detach()
    elif mode == "func":
        out, tangent = torch.func.jvp(fn, primals, tangents)
        tangent = tangent.detach()
    else:
        with torch.no_grad():
            _, tangent = _dual_call(fn, primals, tangents)
        out = fn(*primals)
    for found, limit in _recorders:
        if len(found) < limit:
            found.append(tangent.float().cpu())
    return out, tangent


@contextlib.contextmanager
def record_tangents(limit: int = 1):
    """Collect (float32, on the CPU) the tangents of the first `limit` jvp() calls inside the block.

    with record_tangents() as tangents:
        loss, _ = objective.loss(model, x, y)    # tangents[0]: MeanFlow's du/dt on this batch
    """
    entry = ([], limit)
    _recorders.append(entry)
    try:
        yield entry[0]
    finally:
        _recorders.remove(entry)
