"""Which phase of the training step sets a predicted peak, and the peak in parts.

A profile folded with its training step
(:func:`gradckpt.planning.solving.whole_step.with_training_step`) predicts the
whole step's peak; :func:`step_parts` splits a prediction into what a person
reads (``plan.step``): parameters, optimizer state, gradients, activations,
the optimizer step's own peak, and the phase that sets it.

Example:
    >>> step_parts(whole, simulate(whole, plan)).phase
"""

from __future__ import annotations

from gradckpt.planning.plans.step_parts import StepParts
from gradckpt.planning.simulation.simulate import Prediction
from gradckpt.profiling.records import Profile

__all__ = ["PHASE_FWD_BWD", "PHASE_OPTIMIZER", "PHASE_RESIDENT", "step_parts"]

PHASE_FWD_BWD = "forward/backward"
PHASE_RESIDENT = "forward/backward, gradients resident"
PHASE_OPTIMIZER = "optimizer step"


def step_parts(profile: Profile, pred: Prediction) -> StepParts | None:
    """``pred``'s peak in parts and the phase that sets it; None for a profile with no step.

    Example:
        >>> step_parts(whole, simulate(whole, plan)).phase
        'forward/backward, gradients resident'
    """
    step = profile.step
    if step is None:
        return None
    state = step.state_bytes
    common = {
        "params": profile.param_bytes,
        "optimizer_state": state,
        "optimizer": step.optimizer.name if step.optimizer is not None else "",
        "accumulation_steps": step.accumulation_steps,
        "set_to_none": step.set_to_none,
    }
    if pred.fwd_bwd_peak_bytes < profile.floor_bytes:
        grads = profile.grad_bytes
        rest = profile.floor_bytes - profile.param_bytes - grads - state
        return StepParts(gradients=grads, optimizer_step=rest, activations=0,
                         phase=PHASE_OPTIMIZER, **common)  # fmt: skip
    if step.grads_resident:
        grads, phase = profile.grad_bytes, PHASE_RESIDENT
    else:  # made by backward so far
        grads = sum(
            profile.storages[i].nbytes for i in profile.grad_storages
            if profile.storages[i].alloc <= pred.peak_position
        )  # fmt: skip
        phase = PHASE_FWD_BWD
    made = pred.fwd_bwd_peak_bytes - profile.param_bytes - state - grads
    return StepParts(gradients=grads, optimizer_step=0, activations=max(0, made), phase=phase,
                     **common)  # fmt: skip
