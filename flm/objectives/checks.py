"""Checks of objective options at construction, so a wrong value fails when the run starts, naming its option."""


def check_std(name: str, std: float) -> None:
    """A standard deviation: > 0."""
    if not std > 0:
        raise ValueError(f"{name} must be > 0, got {std!r}")


def check_probability(name: str, p: float) -> None:
    """A probability: in [0, 1]."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")


def check_sampler_shares(one_step_frac: float, two_step_frac: float) -> None:
    """The shares of a batch at the 1- and 2-step samplers' times: probabilities that fit in one batch together."""
    check_probability("one_step_frac", one_step_frac)
    check_probability("two_step_frac", two_step_frac)
    if one_step_frac + two_step_frac > 1:
        raise ValueError(
            f"one_step_frac + two_step_frac must be at most 1 (fractions of one batch), got {one_step_frac} + {two_step_frac}"
        )


def check_hf_weight(hf_weight: float) -> float:
    """flm.objectives.frequency's weight of the pixel-scale error: finite, >= 0."""
    if not 0 <= hf_weight < float("inf"):
        raise ValueError(f"hf_weight must be a finite weight >= 0 (0: the plain squared error), got {hf_weight!r}")
    return hf_weight


def check_hf_weight_one_step(hf_weight_one_step: float | None, one_step_frac: float) -> float | None:
    """hf_weight for the one_step_frac samples alone: None (hf_weight), or a weight, which needs one_step_frac > 0."""
    if hf_weight_one_step is None:
        return None
    if not one_step_frac:
        raise ValueError(
            f"hf_weight_one_step={hf_weight_one_step!r} weighs the one_step_frac samples, and one_step_frac is 0; "
            "set objective.one_step_frac > 0 or objective.hf_weight_one_step=null"
        )
    return check_hf_weight(hf_weight_one_step)


def check_teacher_steps(teacher_steps: int) -> int:
    """Steps of a teacher's ODE solver over an interval: an int >= 1."""
    if isinstance(teacher_steps, bool) or not isinstance(teacher_steps, int) or teacher_steps < 1:
        raise ValueError(f"teacher_steps must be an int >= 1 (steps of the teacher's ODE solver), got {teacher_steps!r}")
    return teacher_steps


def check_target_ema(ema, decay: float, option: str) -> None:
    """An objective whose target comes from the model's EMA (`option` names the setting) was handed that EMA."""
    if ema is None:
        raise ValueError(
            f"{option} needs the model's EMA at decay {decay:g} passed to the loss as `ema` "
            "(the training loop does this when trainer.ema_decays holds that decay)"
        )
