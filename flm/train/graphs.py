"""A training step's loss and backward replayed as one CUDA graph.

At DiT-B sizes an eager step is bound by Python issuing kernels, not by the GPU (benchmarks/train_step.py
prints both times), and a JVP step issues about twice the kernels of a flow-matching step. torch.compile
cannot take the JVP path (Dynamo refuses autograd.Functions with a `jvp` rule), so flm captures the eager
step instead: PyTorch's "whole-network capture" (torch.cuda.graphs), with the optimizer left outside so
that the loop can still check the gradients and clip them before stepping.

    graphed = GraphedStep(step_fn, params)          # step_fn(x, y) -> (loss, metrics); calls backward
    loss, metrics = graphed(x, y)                    # copies x, y into the graph's inputs and replays
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

A replay adds into .grad as an eager backward does, so gradient accumulation is replaying once per
micro-batch: the graph's backward adds into gradient buffers of its own (captured with the gradients
already allocated, so that autograd adds in place instead of allocating new ones inside the graph),
and each replay first makes those buffers hold what .grad holds: zero where it is None (after
zero_grad), a copy where the caller put another tensor. The loop's gradient all-reduce under DDP
happens after the replays (flm.train.parallel.wrap says why).

Constraints (checked where they can be): CUDA; fixed input shapes; everything inside step_fn on the
GPU with no host synchronisation; Python values read inside step_fn (say a warm-up factor that depends
on the step) are frozen at capture, so pass such values as tensor inputs (the loop passes the step).
Random ops draw fresh numbers on every replay from the default CUDA generator's
state at replay time, so seeding before a replay works as it does before an eager step.
"""

import torch


def _end_failed_capture(cuda_rng: torch.Tensor) -> None:
    """A capture that raised leaves the CUDA generator marked as capturing, and every later random op in the
    process fails ("Offset increment outside graph capture"): give it a fresh state (not capturing), then the
    state from before the warm-up."""
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.graphsafe_set_state(generator.clone_state())
    torch.cuda.set_rng_state(cuda_rng)


class CaptureFailed(RuntimeError):
    """The step could not be captured: it synchronises with the host or uses another stream. `reason`: CUDA's error.
    .grad and both random generators are as before the warm-up, so the caller may run the step eagerly instead."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"the training step could not be captured as a CUDA graph ({reason}); something in the step synchronises "
            f"with the host or uses another stream. Set trainer.cuda_graph=false to train eagerly"
        )


class GraphedStep:
    def __init__(self, step_fn, params, *, warmup: int = 3):
        """step_fn(*inputs) -> (loss, metrics dict of tensors), with the backward inside.

        warmup: eager calls on a side stream before capture (Triton autotuning, cuDNN and allocator
        warm-up must not happen inside the graph); their gradients are discarded, and .grad is as before.
        """
        self.step_fn, self.params, self.warmup = step_fn, [p for p in params if p.requires_grad], warmup
        self.graph = self.static_inputs = self.static_out = self.grads = None

    def _capture(self, inputs) -> None:
        for i, x in enumerate(inputs):
            if not x.is_cuda:
                raise ValueError(f"CUDA-graph steps need CUDA inputs, got input {i} on {x.device}; set trainer.cuda_graph=false")
        self.static_inputs = [x.clone() for x in inputs]
        before = [p.grad for p in self.params]
        # the warm-up calls draw random numbers; restore the state so that the first replay draws what
        # an eager step would (a graphed run then follows the eager run and resumes exactly)
        rng = torch.get_rng_state(), torch.cuda.get_rng_state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._zero_grads()
                self.step_fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        # the buffers the graph adds into: one for each parameter the step gives a gradient, None for the others
        self.grads = [None if p.grad is None else torch.zeros_like(p.grad) for p in self.params]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self.static_out = self.step_fn(*self.static_inputs)
        except RuntimeError as err:  # torch.AcceleratorError included
            _end_failed_capture(rng[1])
            torch.set_rng_state(rng[0])
            self.graph = None
            raise CaptureFailed(str(err).splitlines()[0]) from err
        finally:
            for p, g in zip(self.params, before):
                p.grad = g
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state(rng[1])

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def __call__(self, *inputs):
        if self.graph is None:
            self._capture(inputs)
        else:
            for i, (x, static) in enumerate(zip(inputs, self.static_inputs)):
                if x.shape != static.shape or x.dtype != static.dtype:
                    raise ValueError(
                        f"input {i} has shape {tuple(x.shape)} and dtype {x.dtype}, but the CUDA graph was captured for "
                        f"{tuple(static.shape)} and {static.dtype}; keep the batch shape fixed (drop the last partial batch)"
                    )
                static.copy_(x, non_blocking=True)
        take_grads(self.params, self.grads)
        self.graph.replay()
        return self.static_out


def take_grads(params, buffers) -> None:
    """Point each parameter's .grad at its buffer (None: the graph gives it no gradient, leave it), holding what
    .grad held: zeros where it was None, a copy where it was another tensor; the replay then adds into it, as an
    eager backward adds into .grad."""
    zero = []
    for p, g in zip(params, buffers):
        if g is None or p.grad is g:
            continue
        if p.grad is None:
            zero.append(g)
        else:
            g.copy_(p.grad)
        p.grad = g
    if zero:
        torch._foreach_zero_(zero)
