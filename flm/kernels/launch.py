"""Launching a compiled Triton kernel directly, once Triton has compiled it for the arguments' specialisation.

A launch through `kernel[grid](...)` binds every argument to the kernel's signature and works out its specialisation
(each int's being 1 or a multiple of 16, each pointer's 16-byte alignment) before it finds the compiled kernel: for the
fused attention's ~50 arguments, most of the forward's host time. `DirectLaunch` keys the compiled kernel on the same
properties, computed in one pass, and calls its launcher. The first call for a key, a profiler's launch hook, or a
Triton without these internals take the ordinary path; a launcher that refuses the arguments (another Triton's) turns
direct launches off for good, with a warning.
"""

import warnings

import torch
import triton

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: always the ordinary path
    knobs = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton < 3.4: no host-built descriptors
    TensorDescriptor = None


@torch.compiler.assume_constant_result  # a constant of the device: torch.compile folds it, no graph break
def hopper_or_later(device: torch.device) -> bool:
    """CUDA of compute capability 9 or more: cuDNN's attention is SDPA's first choice there, and tensor descriptors
    (TMA) exist. Cached: asked on every attention call."""
    known = _HOPPER.get(device)
    if known is None:
        known = _HOPPER[device] = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return known


_HOPPER: dict[torch.device, bool] = {}


def specialization(args) -> tuple:
    """What Triton compiles a kernel for, per runtime argument: a tensor's dtype and 16-byte alignment, an int's type
    (i32, i64 or u64) and its being 1 or a multiple of 16, a tensor descriptor's dtype and block shape; floats are not
    specialised. Written for speed (~8 us for the forward's 50 arguments on the CPU, against ~18 for the plain form): it
    runs on every launch."""
    key = []
    put = key.append
    for a in args:
        kind = type(a)
        if kind is int:
            if -(2**31) <= a < 2**31:
                put(1 if a == 1 else 2 if a & 15 == 0 else 3)
            else:  # i64, or u64 from 2**63
                put((a >= 2**63, a & 15 == 0))
        elif kind is float:
            put(0)
        elif kind is bool:
            put((bool, a))
        elif kind is TensorDescriptor:  # compiled for its dtype and block shape
            put((kind, a.base.dtype, tuple(a.block_shape)))
        else:  # a tensor
            put((a.dtype, a.data_ptr() & 15 == 0))
    return tuple(key)


def tracing() -> bool:
    """A fake, proxy or functional tensor mode is active: torch.compile is tracing (torch 2.11's is_compiling() is
    False while AOTAutograd traces a custom op's registered backward). A Triton launch there would meet tensors
    without storage."""
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


def traced(x: torch.Tensor) -> bool:
    """x cannot reach a kernel launch: a functorch wrapper (torch.func's transforms), or a tracing mode is active."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x) or tracing()


_TRACING_MODES = (
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.PROXY,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
)


def _hooked() -> bool:
    """A profiler has set a launch hook (Triton keeps them in chains, empty unless one has)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class DirectLaunch:
    """`launch(grid, args, constexprs, num_warps, num_stages)` runs `fn` as `fn[grid](*args, **constexprs, num_warps=,
    num_stages=)` does. `args` are the kernel's runtime arguments in signature order (they come first in the
    signature); `constexprs` name all the others."""

    def __init__(self, fn: triton.JITFunction):
        self.fn = fn
        self.compiled: dict[tuple, tuple] = {}  # key -> (compiled kernel, constexpr values in signature order)
        self.disabled: str | None = None  # why direct launches stopped, if they did

    def __call__(self, grid, args: list, constexprs: dict, num_warps: int, num_stages: int) -> None:
        device = torch.cuda.current_device()
        key = (specialization(args), *constexprs.items(), num_warps, num_stages, device)
        usable = knobs is not None and self.disabled is None
        entry = self.compiled.get(key) if usable else None
        if entry is None or _hooked():
            kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            names = self.fn.arg_names
            if entry is None and usable and sorted(names[len(args) :]) == sorted(constexprs):
                self.compiled[key] = (kernel, tuple(constexprs[n] for n in names[len(args) :]))
            return
        kernel, tail = entry
        stream = triton.runtime.driver.active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        try:
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
        except (TypeError, ValueError, AttributeError) as err:  # a Triton whose launcher takes other arguments
            self.compiled.clear()
            self.disabled = f"{type(err).__name__}: {err}"
            name = getattr(self.fn, "__name__", "a Triton kernel")
            warnings.warn(
                f"launching {name} directly failed ({self.disabled}); Triton {triton.__version__} launches it from now "
                "on, at its usual host cost",
                stacklevel=2,
            )
            self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
