"""The consistency curriculum that MeanFlow and sCM share (`objective.alpha_steps`, `objective.alpha_min`).

A consistency objective's JVP target is the limit of a discrete one: the model's own output a step alpha along the
trajectory away, divided by the step. Before `end` the objective trains on that discrete target (no JVP: one more
forward without gradient), with alpha = 1 (the longest step: the velocity for MeanFlow, the clean image for sCM) until
`start`, then falling geometrically to alpha_min at `end`; from `end` on it trains on the JVP target, alpha's limit.
The two kinds of step are the loop's phases ("alpha", "jvp"), so a CUDA-graph run captures each once.
"""

import inspect
from collections.abc import Sequence

import torch

PHASES = ("alpha", "jvp")


class Curriculum:
    """alpha over the training steps: 1 until start, geometric to alpha_min at end, then the JVP target."""

    def __init__(self, alpha_steps, alpha_min: float):
        steps = tuple(alpha_steps) if isinstance(alpha_steps, Sequence) and not isinstance(alpha_steps, str) else ()
        ints = all(isinstance(k, int) and not isinstance(k, bool) for k in steps)
        if not (len(steps) == 2 and ints and 0 <= steps[0] < steps[1]):
            raise ValueError(
                f"alpha_steps must be [start, end], steps with 0 <= start < end (alpha = 1 until start, alpha_min at end), "
                f"or null (off), got {alpha_steps!r}"
            )
        if not 0 < alpha_min < 1:
            raise ValueError(f"alpha_min must be in (0, 1) (alpha where the JVP target takes over), got {alpha_min!r}")
        (self.start, self.end), self.alpha_min = steps, float(alpha_min)

    def phase(self, step) -> str:
        """The step's kind: "alpha" (the discrete target) before end, then "jvp"; step an int (the loop asks on the host)."""
        return "alpha" if int(step) < self.end else "jvp"

    def alpha(self, step, phase: str | None = None):
        """alpha at `step` (an int, or a 0-dim tensor under CUDA graphs, which comes with its phase); None in the JVP's
        steps."""
        if (phase or self.phase(step)) != "alpha":
            return None
        if isinstance(step, torch.Tensor):
            frac = ((step.float() - self.start) / (self.end - self.start)).clamp(0.0, 1.0)
            return torch.pow(self.alpha_min, frac)
        return self.alpha_min ** min(1.0, max(0.0, (step - self.start) / (self.end - self.start)))


class Curricular:
    """The objective's side of the curriculum: its `curriculum` (None: off) names the kinds of step and their alpha."""

    curriculum: Curriculum | None = None

    def phase(self, step) -> str | None:
        """The step's kind: "alpha" before alpha_steps[1], then "jvp"; None without the curriculum (one kind of step)."""
        return None if self.curriculum is None else self.curriculum.phase(step)

    def alpha(self, step, phase: str | None = None):
        """alpha at `step`; None in the JVP's steps and without the curriculum (then no phase is asked for: a subclass's
        own phase(step) reads its step on the host)."""
        return None if self.curriculum is None else self.curriculum.alpha(step, phase)


def build_curriculum(alpha_steps, alpha_min: float, owner: type, base: type) -> Curriculum | None:
    """The curriculum of alpha_steps (None: off). Refused for a subclass of `base` whose steps have kinds of their own
    (a phase of its own: rCM, MeanFlow + DMD) or whose loss takes no phase (MeanFlow + an adversarial loss)."""
    if alpha_steps is None:
        return None
    if owner.phase is not base.phase or "phase" not in inspect.signature(owner.loss).parameters:
        raise ValueError(
            f"alpha_steps is not an option of {owner.__name__} (its steps have kinds of their own); "
            "set objective.alpha_steps=null"
        )
    return Curriculum(alpha_steps, alpha_min)


def alpha_metric(alpha, device) -> torch.Tensor:
    """alpha as a metric on the batch's device (the loop all-reduces every metric; NCCL takes no CPU tensor): a fill,
    no copy from the host."""
    return alpha.detach() if isinstance(alpha, torch.Tensor) else torch.full((), alpha, device=device)
