"""The few layers the DiT is built from, with tangents that build no reverse-mode graph.

A consistency step takes a forward-mode JVP through the network (dual tensors or torch.func.jvp)
and never differentiates through the tangent. With plain PyTorch ops that costs ~2.7x the memory
of a flow-matching step (measured on DiT-B/2; docs/train_step.md): every activation autograd saves keeps its tangent alive, and
tangent ops that touch weights requiring grad record a graph. Each layer here is an
autograd.Function (setup_context style, so forward-AD duals and torch.func.jvp both work) that

- saves *detached* tensors, so a saved activation does not keep its tangent alive;
- computes its tangent in `jvp` under `no_grad`, so the tangent has no grad_fn;
- has an exact `backward` (tests: gradcheck in float64, against autograd of the plain ops).

Layers: `linear`, `layer_norm` (optional affine, per-channel or per-sample; `modulate` is DiT's adaLN
`x_hat * (1 + scale) + shift`), `gelu_tanh`, `silu` and the
gated residual `x + gate * h`. Everything else in the DiT is linear in its inputs (reshape, add,
chunk), saves nothing, and needs no special care. Under autocast the wrappers cast matmul inputs
to the autocast dtype before the Function, as autocast would. On CUDA (unless $FLM_FUSED_ADALN=0), the layer
norm's passes and the gated residual's JVP and backward run flm.kernels.adaln's fused kernels instead of several
PyTorch ops.

    from flm import nn as fnn
    y = fnn.linear(x, w, b)
    lin = fnn.Linear(64, 128)   # drop-in for torch.nn.Linear

Under torch.compile each layer is its plain PyTorch ops instead (`_compiling`): Dynamo does not trace an
autograd.Function with a `jvp` rule (it breaks the graph at each one), and a compiled step takes its
JVP with torch.func.jvp over the plain ops (jvp_mode="func", flm.objectives.jvp), where the compiler,
not the Function, decides what is saved. Where no forward-AD level is open, `linear` and the activations are their
plain ops as well (`_plain_ops`): without tangents the Functions only add host time.
"""

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

from flm.kernels import adaln


def _save(ctx, *tensors) -> None:
    """Save tensors for both backward and jvp (the same storage: no extra memory), detached while a forward-AD level is
    open, where they may carry tangents. Outside one no tensor has a tangent, and the detaches were a seventh of a
    flow-matching step's aten ops (317 of 2376 in a DiT-B/2 loss + backward; cheap ones: docs/train_step.md)."""
    if _dual_level_open():
        tensors = tuple(None if t is None else t.detach() for t in tensors)
    ctx.save_for_backward(*tensors)
    ctx.save_for_forward(*tensors)


def _dual_level_open() -> bool:
    """A forward-AD level is open (forward_ad.dual_level, which torch.func.jvp enters too): only then can a tensor carry a
    tangent. forward_ad.unpack_dual reads the same module state; a torch without it counts as open (always detach)."""
    return getattr(forward_ad, "_current_level", 0) >= 0


def _sum_to(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reduce a broadcast gradient back to the shape and dtype of `like`."""
    return g.sum_to_size(like.shape).to(like.dtype)


class _PositionalSignature(inspect.Signature):
    """A forward's signature whose `bind` of exactly its positional arguments skips inspect's general binding: the
    call Function.apply makes on every use (torch 2.14): 3-4 us of host time less per layer call on the CPU
    (benchmarks/host_time.py). Any other call (keywords, missing or extra arguments) binds as inspect does, errors
    included."""

    __slots__ = ()

    def bind(self, *args, **kwargs):
        if kwargs or len(args) != len(self.parameters):
            return super().bind(*args, **kwargs)
        return _Bound(args)


class _Bound:
    """What Signature.bind returns, for positional arguments that fill every parameter: no defaults to apply."""

    __slots__ = ("args",)

    def __init__(self, args):
        self.args = args

    @property
    def kwargs(self):
        return {}

    def apply_defaults(self):
        pass


def signed(cls):
    """The autograd Function with its forward's signature stored on it: Function.apply binds the arguments to
    that signature on every call, and inspect builds it anew each time unless `__signature__` is set (about a
    tenth of the host time of an eager JVP step through 12 DiT blocks on the CPU); a _PositionalSignature, so that
    the binding itself is cheap when every argument is passed by position, as flm's callers do. Also its old-style twin
    (`eager`), which `apply` calls in eager code and which binds nothing."""
    sig = inspect.signature(cls.forward)
    cls.forward.__signature__ = _PositionalSignature(list(sig.parameters.values()))
    cls.eager = _old_style(cls)
    return cls


def _old_style(cls):
    """cls as an old-style Function (forward(ctx, ...) runs cls's forward and setup_context): the same outputs, saved
    tensors, tangent and gradient, without the argument binding that Function.apply does for a setup_context Function on
    every call (3.7 us less per call on the CPU, torch 2.14). torch.func's transforms and torch.compile take
    setup_context Functions only: `apply` chooses."""

    def forward(ctx, *args):
        output = cls.forward(*args)
        cls.setup_context(ctx, args, output)
        return output

    methods = {"forward": staticmethod(forward), "backward": staticmethod(cls.backward)}
    if cls.jvp is not torch.autograd.Function.jvp:
        methods["jvp"] = staticmethod(cls.jvp)
    return type(cls.__name__, (torch.autograd.Function,), methods)  # its backward node keeps cls's name


def apply(fn, *args):
    """fn.apply(*args) for a `signed` Function fn: through its old-style twin in eager code, through fn itself under a
    torch.func transform or torch.compile."""
    if _compiling() or torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    twin = fn.__dict__.get("eager")  # (a subclass of a signed Function is not signed itself)
    return fn.apply(*args) if twin is None else twin.apply(*args)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _plain_ops() -> bool:
    """The linear and activation layers run as their plain ops: under torch.compile, or where no forward-AD level is
    open, so no tensor has a tangent and aten's own nodes save what the Functions would (~25 us less host time per
    layer on the CPU: a flow-matching step, the gradient pass of jvp_mode=two_pass, a teacher's forward). The layer
    norms and the gated residual keep their Functions there: on CUDA they run flm.kernels.adaln's fused kernels."""
    return _compiling() or not _dual_level_open()


def _is_dual(x: torch.Tensor) -> bool:
    """x is a forward-AD dual tensor (not under torch.compile, which takes its JVP with torch.func.jvp)."""
    return not _compiling() and forward_ad.unpack_dual(x).tangent is not None


def joins(x: torch.Tensor, dual: torch.Tensor) -> torch.Tensor:
    """x, given a zero tangent when `dual` is a forward-AD dual tensor: for a plain tensor (a buffer, an embedding)
    that an elementwise op meets with a dual one. Left plain, x gets a ZeroTensor tangent, whose arithmetic torch
    runs through a Python decomposition: 200-400 us of host time per op on the CPU (torch 2.14), against ~15 for a
    real zero tangent (docs/train_step.md)."""
    return forward_ad.make_dual(x, torch.zeros_like(x)) if _is_dual(dual) else x


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x * scale; for a dual x with the scale as a 0-dim tensor of zero tangent, since a Python number meeting a dual
    tensor takes the same slow path (~430 us against ~27 on the CPU). The same product either way."""
    if not _is_dual(x):
        return x * scale
    return x * joins(torch.full((), scale, dtype=x.dtype, device=x.device), x)


def _affine(x_hat, weight, bias, dtype=None):
    """x_hat * weight + bias, either optional (broadcast against x_hat); written in `dtype` by the same kernel when
    given (what a matmul after it would cast it to under autocast)."""
    out = None if dtype is None else torch.empty(x_hat.shape, dtype=dtype, device=x_hat.device)
    if weight is not None:
        return torch.addcmul(bias, x_hat, weight, out=out) if bias is not None else torch.mul(x_hat, weight, out=out)
    if bias is not None:
        return torch.add(x_hat, bias, out=out)
    return x_hat if dtype is None else x_hat.to(dtype)


def _plain_layer_norm(x, weight, bias, eps):
    return _affine(F.layer_norm(x, x.shape[-1:], None, None, eps), weight, bias)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype for x's device, None when autocast is off there."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _autocast(*tensors):
    """Cast floating tensors to the autocast dtype when autocast is on (what F.linear would do)."""
    dtype = _autocast_dtype(tensors[0])
    if dtype is None:
        return tensors
    return tuple(None if t is None else _cast(t, dtype) for t in tensors)


_casts: dict | None = None  # inside cast_cache(): id(parameter) -> (parameter, its version, its cast)


@contextlib.contextmanager
def cast_cache(enabled: bool = True, params=()):
    """Within it, a parameter is cast to the autocast dtype once and the cast reused until it changes in place (its
    version), as torch.autocast caches the casts of its own ops within a region. A JVP objective's loss runs the
    network two or three times (MeanFlow: the tangent's no-grad forward, the r = t forward, the dual forward), and the
    casts of every weight and bias, one kernel each and again for their gradients, made most of the 1260 casts of the
    MeanFlow preset's eager step (658 with this; docs/train_step.md). A parameter's uses then share one cast: their
    gradients add up in the autocast dtype before the one cast back, as under torch.autocast's own cache. The training
    loop opens it around each loss (not under FSDP2, whose parameters are re-gathered for every forward); nested calls
    share the outer cache.

    `params` (the trainable ones, under autocast) are cast at once, all in one op, and their gradients cast back all
    in one op when the last of them is ready: two ops in place of two per parameter (_BulkCast). The same values and
    gradients to the bit; but no parameter's gradient exists before the whole backward's end, so DDP, which reduces
    each bucket as its gradients arrive, would lose its overlap: the loop passes none under DDP."""
    global _casts
    if not enabled or _casts is not None:
        yield
        return
    _casts = {}
    try:
        _cast_in_bulk(params)
        yield
    finally:
        _casts = None


def _cast_in_bulk(params) -> None:
    """Fill the cache with one _BulkCast of the floating `params` not yet in the autocast dtype (none when autocast is
    off, under torch.compile, which casts plainly, or in inference mode, which keeps no casts)."""
    params = list(params)
    dtype = _autocast_dtype(params[0]) if params else None
    if dtype is None or _compiling() or torch.is_inference_mode_enabled():
        return
    params = [p for p in params if p.is_floating_point() and p.dtype != dtype]
    if not params:
        return
    with torch.enable_grad():  # the casts carry the gradients of the forwards that use them, no-grad ones included
        casts = _BulkCast.apply(dtype, *params)
    for p, cast in zip(params, casts):
        _casts[id(p)] = (p, p._version, cast)


class _BulkCast(torch.autograd.Function):
    """Parameters to `dtype` in one foreach copy, and their gradients back to each parameter's dtype in another: one
    autograd node and two ops in place of two of each per parameter."""

    @staticmethod
    def forward(ctx, dtype, *params):
        ctx.set_materialize_grads(False)  # a parameter this loss leaves unused gets no gradient, not zeros
        ctx.dtypes = [p.dtype for p in params]
        casts = [torch.empty_like(p, dtype=dtype) for p in params]
        torch._foreach_copy_(casts, params)
        return tuple(casts)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        used = [i for i, g in enumerate(grads) if g is not None]
        out = [None] * len(grads)
        if used:
            wide = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in used]
            torch._foreach_copy_(wide, [grads[i] for i in used])
            for i, g in zip(used, wide):
                out[i] = g
        return (None, *out)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Compiled code casts plainly: the cache's dict and version checks broke Dynamo's graph at every linear under
    # bf16 autocast (a compiled step then ran ~3x slower than the graphed one), and inductor shares repeated casts.
    plain = _casts is None or _compiling() or t.dtype == dtype or not isinstance(t, nn.Parameter)
    if plain or torch.is_inference_mode_enabled():
        return t.to(dtype)
    hit = _casts.get(id(t))
    if hit is not None and hit[0] is t and hit[1] == t._version and hit[2].dtype == dtype:
        return hit[2]
    with torch.enable_grad():  # made in a no-grad forward, it still carries the gradient of a later one
        cast = t.to(dtype)
    _casts[id(t)] = (t, t._version, cast)
    return cast


# --------------------------------------------------------------------------------------------
# Linear: y = x W^T + b
# --------------------------------------------------------------------------------------------


@signed
class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.set_materialize_grads(False)
        ctx.has_bias = bias is not None
        _save(ctx, x, weight)

    @staticmethod
    def jvp(ctx, tx, tweight, tbias):
        x, weight = ctx.saved_tensors
        with torch.no_grad():
            out = None if tx is None else F.linear(tx, weight)
            if tweight is not None:
                out = F.linear(x, tweight) if out is None else out + F.linear(x, tweight)
            if tbias is not None:
                out = tbias.expand(*x.shape[:-1], -1).clone() if out is None else out + tbias
            return out

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        if gy is None:
            return None, None, None
        gx = gy @ weight if ctx.needs_input_grad[0] else None
        gw = gb = None
        if ctx.needs_input_grad[1]:
            gw = gy.reshape(-1, gy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.reshape(-1, gy.shape[-1]).sum(0)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a graph-free tangent; x (..., in), weight (out, in), bias (out,)."""
    if _plain_ops():
        return F.linear(*_autocast(x, weight, bias))
    return apply(_Linear, *_autocast(x, weight, bias))


class Linear(nn.Linear):
    """torch.nn.Linear (same parameters and init) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linears(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """The outputs of several Linear layers that read the same x, from one matmul of their weights stacked (their
    autocast casts stacked, under autocast): the DiT's adaLN modulations, one per block from one conditioning, were a
    matmul, a tangent matmul, two gradient matmuls, a bias sum and a cast of x per block and forward (~100 of the
    ~840 kernel-launching ops of a DiT-S/2 MeanFlow step; docs/train_step.md). The layers keep their own parameters
    (checkpoints are unchanged); outputs are views of one (..., sum of out_features) tensor. Each layer's own call
    where the stack cannot be built: sharded weights (`sharded`), or biases on some layers only."""
    weights, biases = [layer.weight for layer in layers], [layer.bias for layer in layers]
    with_bias = [b is not None for b in biases]
    if len(layers) < 2 or any(sharded(w) for w in weights) or any(with_bias) != all(with_bias):
        return [layer(x) for layer in layers]
    dtype = _autocast_dtype(x)
    if dtype is not None:  # each cast once (cast_cache), then stacked: the stack is of bf16, not of float32, weights
        weights, biases = [_cast(w, dtype) for w in weights], [None if b is None else _cast(b, dtype) for b in biases]
    stacked = torch.cat(biases) if all(with_bias) else None
    return list(linear(x, torch.cat(weights), stacked).split([w.shape[0] for w in weights], dim=-1))


def sharded(t: torch.Tensor) -> bool:
    """A DTensor: FSDP2's parameters outside their unit's forward hold only this rank's shard."""
    return hasattr(t, "device_mesh")


# --------------------------------------------------------------------------------------------
# Layer norm over the last dim, optional affine y = x_hat * weight + bias; weight and bias
# broadcast against x: (D,) parameters, or (B, 1, D) per-sample for adaLN. The Jacobian of
# x -> x_hat is symmetric, so PyTorch's fused layer-norm backward also gives its JVP.
# --------------------------------------------------------------------------------------------


def _ln_vjp(g, x, mean, rstd):
    """(dx_hat/dx)^T g = (dx_hat/dx) g, in one fused kernel."""
    return torch.ops.aten.native_layer_norm_backward(g, x, (x.shape[-1],), mean, rstd, None, None, (True, False, False))[0]


@signed
class _LayerNorm(torch.autograd.Function):
    # forward also returns mean and rstd, and the 1 + s it multiplies by with one_plus (non-differentiable), so that
    # backward and jvp reuse them; out_dtype: the output's dtype (None: the affine's own), written by the affine's kernel
    @staticmethod
    def forward(x, weight, bias, eps, one_plus, out_dtype):
        plan = adaln.plan(x, weight, bias) if adaln.enabled(x) else None
        if plan is not None:  # one kernel (flm.kernels.adaln); the backward and the JVP then take its kernels too
            return (*adaln.forward(x, weight, bias, eps, one_plus, out_dtype, plan), None)
        x_hat, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), None, None, eps)
        w = _affine_weight(weight, one_plus)
        return _affine(x_hat, w, bias, out_dtype), mean, rstd, w if one_plus else None

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, eps, one_plus, _ = inputs
        _, mean, rstd, one_plus_weight = output
        # what the forward did (the kernels' mean has no trailing 1), not a new choice: under torch.func the forward
        # sees plain tensors and this, the JVP and the backward see the transform's wrappers
        ctx.plan = adaln.plan(x, weight, bias) if mean.dim() < x.dim() else None
        ctx.one_plus = one_plus
        if one_plus and ctx.plan is None:
            weight = one_plus_weight  # the tangent and gradient of 1 + s are those of s
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for t in (mean, rstd, one_plus_weight) if t is not None))
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        ctx.out_dtype = output[0].dtype
        _save(ctx, x, mean, rstd, weight, bias)

    @staticmethod
    def jvp(ctx, tx, tweight, tbias, _eps, _one_plus, _out_dtype):
        x, mean, rstd, weight, _ = ctx.saved_tensors
        if ctx.plan is not None:
            if not adaln.traced(x):
                ty = adaln.jvp(x, mean, rstd, weight, tx, tweight, tbias, ctx.one_plus, ctx.out_dtype, ctx.plan)
                return ty, None, None, None
            mean, rstd, weight = _as_plain_ops_saved(ctx, mean, rstd, weight)
        with torch.no_grad():
            # ty = (dx_hat/dx) tx * weight + x_hat * tweight + tbias, in few kernels
            out = torch.zeros((), dtype=ctx.out_dtype, device=x.device) if tbias is None else tbias
            if tweight is not None:
                out = torch.addcmul(out, (x - mean) * rstd, tweight)
            if tx is not None:
                jx = _ln_vjp(tx, x, mean, rstd)
                if weight is None:
                    out = jx + out
                else:  # the last kernel writes the output's dtype
                    out = torch.addcmul(out, jx, weight, out=torch.empty(x.shape, dtype=ctx.out_dtype, device=x.device))
            return out.to(ctx.out_dtype).expand(x.shape).contiguous(), None, None, None

    @staticmethod
    def backward(ctx, gy, _gmean, _grstd, _gweight):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        if gy is None:
            return None, None, None, None, None, None
        if ctx.plan is not None:
            if not adaln.traced(x):
                need = ctx.needs_input_grad
                gx, gw, gb = adaln.backward(gy, x, mean, rstd, weight, bias, ctx.one_plus, need[1], need[2], ctx.plan)
                return gx if need[0] else None, gw, gb, None, None, None
            mean, rstd, weight = _as_plain_ops_saved(ctx, mean, rstd, weight)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:  # (the product in x's dtype: gy may be the lower out_dtype)
            g = (
                gy.to(x.dtype)
                if weight is None
                else torch.mul(gy, weight, out=torch.empty(gy.shape, dtype=x.dtype, device=x.device))
            )
            gx = _ln_vjp(g, x, mean, rstd)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = _sum_to(gy * ((x - mean) * rstd), weight)
        if ctx.bias_meta is not None and ctx.needs_input_grad[2]:
            shape, dtype = ctx.bias_meta
            gb = gy.sum_to_size(shape).to(dtype)
        return gx, gw, gb, None, None, None


def _as_plain_ops_saved(ctx, mean, rstd, weight):
    """What the kernels' forward saved, as PyTorch's ops path reads it (mean and rstd with a trailing 1, the weight as
    1 + s): for a JVP or backward inside torch.func, whose wrapped tensors cannot reach a kernel."""
    return mean.unsqueeze(-1), rstd.unsqueeze(-1), _affine_weight(weight, ctx.one_plus)


def _affine_weight(weight, one_plus: bool):
    return 1 + weight if one_plus and weight is not None else weight


def layer_norm(x, weight=None, bias=None, eps: float = 1e-6) -> torch.Tensor:
    """Layer norm over the last dim, then `x_hat * weight + bias` when given (broadcast against x).

    Computed in x's dtype (keep the residual stream in float32 under autocast, as DiT does).
    """
    if _compiling():
        return _plain_layer_norm(x, weight, bias, eps)
    return apply(_LayerNorm, x, weight, bias, eps, False, None)[0]


def modulate(x, shift, scale, eps: float = 1e-6, dtype: torch.dtype | None = None) -> torch.Tensor:
    """DiT's adaLN: layer_norm(x) * (1 + scale) + shift, with shift and scale (B, 1, D) per sample.

    Same as layer_norm(x, 1 + scale, shift), with the `1 +` inside the Function: under forward-mode AD an
    op between a dual tensor and a plain number costs ~40x a plain op on the host (torch gives the
    number a zero tangent through its Python reference implementations), once per block and branch.
    dtype: the output's (and its tangent's) dtype, written by the affine's own kernel; the DiT passes the dtype of
    the matmul that follows (`matmul_dtype`), which saves that matmul's cast of the output, of its tangent and of
    their gradient.
    """
    if _compiling():
        y = _plain_layer_norm(x, 1 + scale, shift, eps)
        return y if dtype is None else y.to(dtype)
    return apply(_LayerNorm, x, scale, shift, eps, True, dtype)[0]


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x computes in: the autocast dtype when autocast is on for x's device, else x's own."""
    return _autocast_dtype(x) or x.dtype


# --------------------------------------------------------------------------------------------
# Pointwise activations; the Jacobian is diagonal, so PyTorch's fused backward kernel gives
# both the gradient and the tangent in one kernel.
# --------------------------------------------------------------------------------------------

_ACTIVATIONS = {
    "gelu_tanh": (
        lambda x: F.gelu(x, approximate="tanh"),
        lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    ),
    "silu": (F.silu, torch.ops.aten.silu_backward),
}


@signed
class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(x, name):
        return _ACTIVATIONS[name][0](x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, name = inputs
        ctx.set_materialize_grads(False)
        ctx.name = name
        _save(ctx, x)

    @staticmethod
    def jvp(ctx, tx, _):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            return _ACTIVATIONS[ctx.name][1](tx.to(x.dtype), x)

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        return (None if gy is None else _ACTIVATIONS[ctx.name][1](gy.to(x.dtype), x)), None


def _activation(x: torch.Tensor, name: str) -> torch.Tensor:
    return _ACTIVATIONS[name][0](x) if _plain_ops() else apply(_Activation, x, name)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (DiT's MLP activation)."""
    return _activation(x, "gelu_tanh")


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU / swish, x * sigmoid(x)."""
    return _activation(x, "silu")


# --------------------------------------------------------------------------------------------
# Gated residual y = x + gate * h (adaLN-Zero); gate broadcasts against h, e.g. (B, 1, D).
# --------------------------------------------------------------------------------------------


@signed
class _GatedResidual(torch.autograd.Function):
    @staticmethod
    def forward(x, gate, h):
        return torch.addcmul(x, gate, h)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gate, h = inputs
        ctx.set_materialize_grads(False)
        ctx.x_dtype, ctx.out_dtype = x.dtype, output.dtype
        ctx.plan = adaln.gate_plan(x, gate, h) if adaln.enabled(h) else None
        _save(ctx, gate, h)

    @staticmethod
    def jvp(ctx, tx, tgate, th):
        gate, h = ctx.saved_tensors
        if ctx.plan is not None:  # one kernel (flm.kernels.adaln)
            return adaln.gate_jvp(gate, h, tx, tgate, th, ctx.out_dtype, ctx.plan)
        with torch.no_grad():
            out = torch.zeros((), dtype=ctx.out_dtype, device=h.device) if tx is None else tx
            if tgate is not None:
                out = torch.addcmul(out, tgate, h)
            if th is not None:
                out = torch.addcmul(out, gate, th)
            shape = h.shape if out.shape == h.shape else torch.broadcast_shapes(out.shape, h.shape)  # DiT: always h's
            return out.to(ctx.out_dtype).expand(shape).contiguous()

    @staticmethod
    def backward(ctx, gy):
        gate, h = ctx.saved_tensors
        if gy is None:
            return None, None, None
        gx = gy.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if ctx.plan is not None:
            ggate, gh = adaln.gate_backward(gy, gate, h, *ctx.needs_input_grad[1:], ctx.plan)
            return gx, ggate, gh
        ggate = _sum_to(gy * h, gate) if ctx.needs_input_grad[1] else None
        gh = _sum_to(gy * gate, h) if ctx.needs_input_grad[2] else None
        return gx, ggate, gh


def gated_residual(x: torch.Tensor, gate: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x + gate * h with a graph-free tangent."""
    if _compiling():
        return torch.addcmul(x, gate, h)
    return apply(_GatedResidual, x, gate, h)
