"""Input checks shared by every backend, and detection of forward-mode tangents."""

import torch
from torch.autograd import forward_ad

_NAMES = ("q", "k", "v")


def check_qkv(q, k, v, *, causal: bool) -> None:
    """Raise ValueError naming the offending tensor; nothing is launched before this passes."""
    for name, x in zip(_NAMES, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, tokens, head_dim), got shape {tuple(x.shape)}")
    b, h, lq, d = q.shape
    if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected ({b}, {h}, Lkv, {d}) to match q {tuple(q.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}, expected {tuple(k.shape)} (the shape of k)")
    for name, x in zip(_NAMES[1:], (k, v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, expected {q.dtype} (the dtype of q)")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, expected {q.device} (the device of q)")
    if causal and lq != k.shape[2]:
        raise ValueError(
            f"causal=True needs self-attention (as many queries as keys), got {lq} queries and "
            f"{k.shape[2]} keys; use causal=False for cross-attention"
        )


def check_tangents(primals, tangents) -> None:
    for name, x, tx in zip(_NAMES, primals, tangents):
        if not isinstance(tx, torch.Tensor):
            raise TypeError(f"t{name} must be a torch.Tensor, got {type(tx).__name__}")
        if tx.shape != x.shape:
            raise ValueError(f"t{name} has shape {tuple(tx.shape)}, expected {tuple(x.shape)} (the shape of {name})")
        if tx.dtype != x.dtype:
            raise ValueError(f"t{name} has dtype {tx.dtype}, expected {x.dtype} (the dtype of {name})")
        if tx.device != x.device:
            raise ValueError(f"t{name} is on {tx.device}, expected {x.device} (the device of {name})")


def unpack_duals(q, k, v):
    """(primals, tangents) of forward-mode dual tensors; tangents is None when none has one.

    A primal without a tangent (say keys from a t-independent context) gets a zero tangent.
    """
    unpacked = [forward_ad.unpack_dual(x) for x in (q, k, v)]
    if all(u.tangent is None for u in unpacked):
        return (q, k, v), None
    primals = tuple(u.primal for u in unpacked)
    tangents = tuple(torch.zeros_like(u.primal) if u.tangent is None else u.tangent for u in unpacked)
    return primals, tangents


def under_functorch(x: torch.Tensor) -> bool:
    """True inside a torch.func transform (jvp, grad, vmap), where tangents are invisible to us.

    Dynamo cannot trace the probe, so compiled code reports False (it traces transforms itself).
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._functorch.is_functorch_wrapped_tensor(x)
