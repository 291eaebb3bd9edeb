"""The budget is the device: fold the whole training step into a profile.

A profile measures one micro-batch's forward and backward. The device holds
more (:mod:`gradckpt.profiling.training_step`), and the peak to hold is the
largest over the step's phases:

* **forward/backward**: parameters and buffers, the optimizer's state (from the
  first step on), and what the micro-batch makes (activations, recompute,
  workspace, gradients as backward makes them);
* **forward/backward, gradients resident** (micro-batches 2..K under
  accumulation, or ``set_to_none=False``): the same with every gradient held
  from the start; each new gradient lives only until it is added into the
  resident one (autograd accumulates in place), so in the profile it becomes a
  storage freed right after the op that made it. This phase dominates the
  first one wherever it occurs, so one profile holds it;
* **optimizer step**: parameters, gradients and the optimizer's step peak
  (state made on the first step, temporaries of foreach/fused kernels). No
  checkpointing plan changes it: it is the profile's ``floor_bytes``, which the
  simulator takes as a lower bound of every plan's peak.

:func:`with_training_step` returns the profile with these in it
(``resident_bytes``, transient gradients, ``floor_bytes``, ``step``); every
solver, the DP, the simulator and the budget checks then plan the whole step
without knowing it. :func:`~gradckpt.planning.solving.step_phases.step_parts`
splits a prediction into the parts a person reads (``plan.step``).

Example:
    >>> step = TrainingStep(optimizer_memory(model, "adamw"), accumulation_steps=4)
    >>> whole = with_training_step(gradckpt.profile(model, loss_fn), step)
    >>> gradckpt.Planner(whole).plan("12GiB").step.phase
"""

from __future__ import annotations

from dataclasses import replace

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.baselines import none_plan
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.profiling.records import Profile
from gradckpt.profiling.training_step import TrainingStep

__all__ = ["check_floor", "optimizer_phase_bytes", "with_training_step"]


def optimizer_phase_bytes(profile: Profile, step: TrainingStep) -> int:
    """The optimizer step's peak: parameters, gradients and what the step adds (0: not counted).

    Example:
        >>> optimizer_phase_bytes(prof, TrainingStep(optimizer_memory(model, "adamw")))
    """
    if step.optimizer is None:
        return 0
    return profile.param_bytes + profile.grad_bytes + step.optimizer.step_peak_bytes


def check_floor(profile: Profile, budget: int) -> None:
    """A one-line BudgetError when what no plan changes already exceeds ``budget``.

    Parameters and optimizer state alone, or the optimizer step's peak
    (parameters, gradients, state, temporaries): checkpointing lowers neither.

    Example:
        >>> check_floor(whole, 12 << 30)
    """
    step = profile.step
    if step is None:
        return
    params, state = profile.param_bytes, step.state_bytes
    if params + state > budget:
        raise BudgetError(
            f"the parameters ({format_bytes(params)}) and the optimizer state "
            f"({format_bytes(state)}) alone exceed the budget of {format_bytes(budget)}: no "
            "checkpointing plan fits; shard them (FSDP), or use a smaller or lower-precision "
            "optimizer",
            least_peak_bytes=params + state,
        )
    if profile.floor_bytes > budget:
        extra = profile.floor_bytes - params - profile.grad_bytes - state
        raise BudgetError(
            f"the optimizer step alone peaks at {format_bytes(profile.floor_bytes, round_up=True)} "
            f"(parameters {format_bytes(params)} + gradients {format_bytes(profile.grad_bytes)} + "
            f"optimizer state {format_bytes(state)} + its temporaries {format_bytes(extra)}), "
            f"over the budget of {format_bytes(budget)}; no checkpointing plan lowers it",
            least_peak_bytes=profile.floor_bytes,
        )


def with_training_step(profile: Profile, step: TrainingStep | None) -> Profile:
    """``profile`` as the whole training ``step`` sees it (see the module docstring).

    A profile already folded with the same step is returned as it is; one folded
    with another step is refused (profile again: the fold is not undone).

    Example:
        >>> whole = with_training_step(prof, TrainingStep(None, accumulation_steps=4))
        >>> whole.resident_bytes == prof.grad_bytes
        True
    """
    if profile.step is not None:
        if profile.step == step:
            return profile
        raise ValueError(
            f"this profile already counts a training step ({profile.step.describe()}); "
            "profile the model again to plan for another"
        )
    if step is None:
        return profile
    storages = profile.storages
    grads = 0
    if step.grads_resident:
        grads = profile.grad_bytes
        made = set(profile.grad_storages)
        # Added into the resident gradient by the next op, then freed.
        storages = tuple(replace(s, free=s.alloc + 1) if s.id in made else s for s in storages)
    folded = replace(profile, storages=storages, resident_bytes=step.state_bytes + grads, step=step)
    # The plain step's allocator-level peak, moved by what the fold moved at the tensor level.
    plain = none_plan(profile)
    moved = simulate(folded, plain).peak_bytes - simulate(profile, plain).peak_bytes
    floor = optimizer_phase_bytes(profile, step)
    return replace(
        folded,
        floor_bytes=floor,
        measured_peak_bytes=max(profile.measured_peak_bytes + moved, floor),
        tracker_peak_bytes=max(profile.tracker_peak_bytes + moved, floor),
    )
