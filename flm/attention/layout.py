"""The layout PyTorch's cuDNN attention backward expects of O and dO: dense in q's stride order.

PyTorch caches each cuDNN backward graph under q, k and v's sizes and strides alone, built with the O and dO strides of
its first call, and since PyTorch 2.6 (cuDNN >= 9.5.1) it no longer moves dO to O's layout. A later call at the same q,
k, v with O or dO laid out otherwise reuses that graph and reads them wrongly (gradients 20x off on an H200, fifty-first
day). So every cuDNN backward that flm makes, SDPA's own and the fused attention's, gets both in q's order: SDPA lays
out its own O so, and these helpers bring dO (and the fused forward's O) there.
"""

import sys

import torch
from torch import Tensor

from flm.nn import apply, signed


def stride_order(q: Tensor) -> list[int]:
    """q's dims from the outermost in memory to the innermost; a zero (broadcast) stride counts as the outermost. SDPA
    lays its own output out dense in this order (contiguous for a contiguous q, (B, L, H, D) storage for the DiT's
    views of one projection, (L, B, H, D) for a sequence-first one)."""
    return sorted(range(q.dim()), key=lambda i: q.stride(i) or sys.maxsize, reverse=True)


def q_order(q: Tensor) -> tuple[int, ...]:
    """The dim order SDPA lays its O out in for this q: contiguous for a contiguous q (whatever its size-1 dims'
    strides), else q's stride order. Remembered per size and strides (`_remembered`): asked four times per attention
    forward + backward, where working it out took ~5 us each on the CPU."""
    return _remembered(_ORDERS, (q.shape, q.stride()), _q_order, q)


def _q_order(q: Tensor) -> tuple[int, ...]:
    return tuple(range(q.dim())) if q.is_contiguous() else tuple(stride_order(q))


def dense_in_order(x: Tensor, order: tuple[int, ...]) -> Tensor:
    """x dense with its dims laid out outermost-first as `order` says; a copy only if it is not so already. x with
    exactly the strides of that layout returns at once (what cuDNN's gradients and flm's O come with); otherwise (a
    size-1 dim's stride may differ and still be dense) the permuted view decides."""
    shape = x.shape
    if x.stride() == _remembered(_DENSE, (shape, order), _dense_strides, shape, order):
        return x
    t = x.permute(order)
    return x if t.is_contiguous() else t.contiguous().permute([order.index(i) for i in range(x.dim())])


def _dense_strides(shape, order: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a tensor of `shape` dense in `order`, outermost first."""
    strides, step = [0] * len(shape), 1
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    return tuple(strides)


def _remembered(cache: dict, key, fn, *args):
    """fn(*args), kept in `cache` under key: sizes and strides, a handful per training run (the cache is emptied if it
    ever holds 4096). Symbolic sizes (torch.compile's dynamic shapes) cannot be keys: those are worked out each time."""
    try:
        found = cache.get(key)
    except TypeError:  # an unhashable SymInt
        return fn(*args)
    if found is None:
        if len(cache) >= 4096:
            cache.clear()
        found = cache[key] = fn(*args)
    return found


_ORDERS: dict = {}  # (size, stride) -> q_order
_DENSE: dict = {}  # (size, order) -> the dense strides


def in_q_order(x: Tensor, q: Tensor) -> Tensor:
    """x (B, H, L, D) dense in q's stride order, as SDPA's own forward lays out its O."""
    return dense_in_order(x, q_order(q))


@signed
class GradInQOrder(torch.autograd.Function):
    """Identity on SDPA's output whose backward hands dO on dense in q's stride order, so that SDPA's cached cuDNN
    backward graphs see one dO layout per q, k, v whatever the consumer of O does (a copy only where dO arrives
    otherwise; the DiT's output projection sends it so already)."""

    @staticmethod
    def forward(o: Tensor, order: tuple[int, ...]) -> Tensor:
        return o.view_as(o)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.order = inputs[1]

    @staticmethod
    def backward(ctx, do):
        return dense_in_order(do, ctx.order), None


def grad_in_q_order(o: Tensor, q: Tensor) -> Tensor:
    """o, whose gradient reaches its producer dense in q's stride order (GradInQOrder); o itself when no gradient
    flows."""
    if not o.requires_grad:  # also False for an output made under no_grad
        return o
    return apply(GradInQOrder, o, q_order(q))
