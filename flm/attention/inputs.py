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
        check_like(f"t{name}", tx, name, x)


def check_like(name: str, x, like_name: str, like: torch.Tensor) -> None:
    """x (a tangent) must have the shape, dtype and device of `like` (its primal)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(like.shape)} (the shape of {like_name})")
    if x.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {x.dtype}, expected {like.dtype} (the dtype of {like_name})")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device}, expected {like.device} (the device of {like_name})")


def check_bias_and_mask(bias, key_padding_mask, q, k) -> None:
    """bias: added to the logits, broadcastable to (B, H, Lq, Lkv), q's dtype or fp32; key_padding_mask:
    bool (B, Lkv), True = attend to the key (SDPA's attn_mask convention), False = padding."""
    b, h, lq, _ = q.shape
    logits = (b, h, lq, k.shape[2])
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        if bias.dim() > 4 or any(n not in (1, m) for n, m in zip(reversed(bias.shape), reversed(logits))):
            raise ValueError(
                f"bias has shape {tuple(bias.shape)}, which does not broadcast to the logits (B, H, Lq, Lkv) = {logits}; "
                "give it shape (B or 1, H or 1, Lq or 1, Lkv or 1)"
            )
        if bias.dtype not in (q.dtype, torch.float32):
            raise ValueError(f"bias has dtype {bias.dtype}, expected {q.dtype} (the dtype of q) or torch.float32; cast it")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device}, expected {q.device} (the device of q)")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask has dtype {key_padding_mask.dtype}, expected torch.bool "
                "(True = attend to the key, False = padding)"
            )
        if key_padding_mask.shape != (b, k.shape[2]):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected (B, Lkv) = ({b}, {k.shape[2]})"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, expected {q.device} (the device of q)")


def as_4d(bias):
    """A checked bias as a 4-dim view (leading dims of size 1 added); None stays None."""
    return None if bias is None else bias[(None,) * (4 - bias.dim())]


def unpack_duals(q, k, v, bias=None):
    """(primals, tangents) of forward-mode dual tensors, each (q, k, v, bias); tangents is None when none
    has one.

    A q, k or v without a tangent (say keys from a t-independent context) gets a zero tangent; a bias
    without one keeps None (the fused kernel then skips the bias tangent).
    """
    # forward AD has one level, 0; naming it spares Dynamo a read of forward_ad's current level, which (torch 2.14) breaks
    # a later torch.func.jvp in the same compiled code: sCD's teacher forward before the student's JVP
    level = 0 if torch.compiler.is_compiling() else None
    unpacked = [forward_ad.unpack_dual(x, level=level) for x in (q, k, v)]
    bias_, tbias = (None, None) if bias is None else forward_ad.unpack_dual(bias, level=level)
    if all(u.tangent is None for u in unpacked) and tbias is None:
        return (q, k, v, bias), None
    primals = tuple(u.primal for u in unpacked)
    tangents = tuple(torch.zeros_like(u.primal) if u.tangent is None else u.tangent for u in unpacked)
    return (*primals, bias_), (*tangents, tbias)


def under_functorch(x: torch.Tensor) -> bool:
    """True inside a torch.func transform (jvp, grad, vmap), where tangents are invisible to us.

    Dynamo cannot trace the probe, so compiled code reports False (it traces transforms itself).
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._functorch.is_functorch_wrapped_tensor(x)
