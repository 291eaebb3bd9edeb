"""The model's calls in one training step, as the shape guard follows them.

A step may call the model several times (a bi-encoder's anchors and positives,
a DPO step's chosen and rejected answers run separately): its plan is a plan
for that sequence of calls, keyed by a
:class:`~gradckpt.planning.plans.call_key.CallsKey`. The guard must therefore
know which call of the step it is looking at. :class:`StepCalls` records the
keys of the calls made so far; the step ends when a backward through one of its
calls' outputs finishes (:func:`arm`), so the next call with grad is the first
of a new step. A forward left without backward (an exception, a call whose
output needs no grad) does not end it: such a call is dropped from the step
(:meth:`StepCalls.drop_last`) when its output cannot be backpropagated.

The inputs of each call are kept while the step runs: a step that turns out to
be a combination of shapes no plan foresaw is planned from them once it ended,
before the next step's first call runs (never in the middle of a step, where
re-planning would touch state an earlier call saved for backward).

Example:
    >>> step = StepCalls()
    >>> step.add(key, args, kwargs); arm(step, out)
    >>> loss.backward()  # step.ended is now True
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.call_key import Key, ShapeKey, calls_of, step_key
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.solving.budget import BudgetError

if TYPE_CHECKING:
    from gradckpt.apply.guard_routing import ShapeGuard

__all__ = [
    "ShapeError",
    "StepCalls",
    "StepRouting",
    "arm",
    "bounding",
]


class ShapeError(ValueError):
    """A guarded model was called with a shape it has no plan for (policy ``"error"``)."""


def bounding(plans: dict[Key | None, Plan], key: Key) -> tuple[Key, Plan] | None:
    """The smallest planned shape that bounds ``key`` in every dimension, with its plan."""
    found = [(k, p) for k, p in plans.items() if k is not None and key.bounded_by(k)]
    return min(found, key=lambda kp: kp[0].numel()) if found else None


@dataclass(eq=False)
class StepCalls:
    """The keys of the model calls in one step so far, their inputs, and what ran."""

    keys: list[ShapeKey] = field(default_factory=list)
    inputs: list[tuple[tuple, dict]] = field(default_factory=list)
    #: The key of the plan the step's first call ran under (None: none recorded).
    plan_key: Key | None = None
    #: A later call did not match the plan the step began under.
    off_plan: bool = False
    ended: bool = False

    @property
    def key(self) -> Key:
        return step_key(self.keys)

    def add(self, key: ShapeKey, args: tuple, kwargs: dict) -> int:
        """Record a call; returns its index in the step."""
        self.keys.append(key)
        self.inputs.append((args, kwargs))
        return len(self.keys) - 1

    def drop_last(self) -> None:
        """The last call is not part of the step (its output needs no gradient)."""
        self.keys.pop()
        self.inputs.pop()

    def end(self) -> None:
        """The step's backward finished: its inputs are kept only to plan it again."""
        self.ended = True
        if not self.off_plan:
            self.inputs.clear()


class _EndStep:
    """A pre-hook on the node that made a call's output: the step ends with the backward
    that reaches it. (On the node, not the tensor: a node's pre-hook costs a third less
    to register, and the guard registers one every step.)"""

    __slots__ = ("queued", "step")

    def __init__(self, step: StepCalls) -> None:
        self.step = step
        self.queued = False

    def __call__(self, grads: Any) -> None:
        if not self.queued:  # one callback per step, however many outputs get a gradient
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.step.end)


def arm(step: StepCalls, out: Any) -> bool:
    """End ``step`` when a backward through ``out`` (a call's output) finishes.

    Returns False when nothing in ``out`` can be backpropagated (no tensor with a
    ``grad_fn``): the call is then no part of a training step.
    """
    if type(out) is torch.Tensor:  # the usual output: no walk
        node = out.grad_fn
        if node is None:
            return False
        node.register_prehook(_EndStep(step))
        return True
    leaves, _ = tree_flatten(out)
    if hasattr(out, "values") and not leaves:  # a ModelOutput-like mapping
        leaves, _ = tree_flatten(list(out.values()))
    # Every output that can be backpropagated: the loss may use any of them (a DPO
    # step reads per-token log-probabilities, not the logits).
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.grad_fn is not None]
    end = _EndStep(step)
    for node in {id(t.grad_fn): t.grad_fn for t in tensors}.values():
        node.register_prehook(end)
    return bool(tensors)


class StepRouting:
    """What the shape guard does with a step's calls beyond the first (a mixin of
    :class:`~gradckpt.apply.guard_routing.ShapeGuard`): the plan for a first call, a
    later call off its plan, a step settled once it ended."""

    def _plan_for_first(self: ShapeGuard, key: ShapeKey) -> Key | None:
        """The planned step key for a step whose first call is at ``key``, or None.

        The step that last began at ``key`` first (steps repeat their pattern), then
        the active plan, the one-call plan, any plan that begins there; with
        ``round_up``, the smallest planned key that bounds it.
        """
        for candidate in (self.preferred.get(key), self.active, key):
            if candidate is not None and candidate in self.plans and calls_of(candidate)[0] == key:
                return candidate
        found = [k for k in self.plans if k is not None and calls_of(k)[0] == key]
        if found:
            return found[0]
        if self.round_up:
            bound = bounding(self.plans, key)
            if bound is not None:
                return bound[0]
        return None

    def _later_call(self: ShapeGuard, step: StepCalls, index: int, key: ShapeKey) -> None:
        """Call ``index`` of a step: on its plan, or the step is off-plan (planned once it ends)."""
        if self.active is None or step.off_plan:
            return
        planned = calls_of(self.active)
        if self.learning_calls and index == len(planned):
            # A plan applied alone, whose step calls the model again: learn that call too.
            grown = step_key([*planned, key])
            self.plans[grown] = self.plans.pop(self.active)
            self.active = step.plan_key = grown
            return
        expected = planned[index] if index < len(planned) else None
        if expected is not None and (
            key == expected or (self.round_up and key.bounded_by(expected))
        ):
            return
        if self.policy == "error":
            raise ShapeError(
                f"gradckpt: call {index + 1} of this step has inputs {key.describe()}, but the "
                f"step's plan was made for {self.active.describe()}; plan this combination "
                "(gradckpt.fit(..., shapes=[[...one entry per call...]])), or fit with "
                "on_new_shape='replan' or 'warn'"
            )
        step.off_plan = True

    def _settle(self: ShapeGuard, step: StepCalls) -> None:
        """An ended step: plan a combination of shapes no plan foresaw (or warn), once."""
        inputs, step.inputs = list(step.inputs), []
        if not step.off_plan:
            return
        key = step.key
        self.unforeseen += 1
        ran = self.plans.get(step.plan_key) if step.plan_key in self.plans else None
        unplanned = ""
        if key not in self.plans and self.policy == "replan":
            try:
                self._replan(key, inputs, switch=False)
            except BudgetError as exc:  # said below; the next step is not refused for it
                unplanned = f" No plan fits it: {exc}"
        if key in self.plans:
            self.preferred[step.keys[0]] = key
        if key in self.warned:
            return
        self.warned.add(key)
        peak = None
        if ran is not None and self.predictor is not None:
            peak = self._busy_call(self.predictor, ran, inputs)
        made = self.plans.get(key)
        then = (
            f"It is planned now (predicted peak {format_bytes(made.predicted_peak_bytes)}); "
            "the next steps that begin like it run that plan."
            if made is not None
            else unplanned
            or "To plan it, fit with on_new_shape='replan' or pass "
            "shapes=[[...one entry per call...]]."
        )
        ran_for = step.plan_key.describe() if step.plan_key is not None else "?"
        at = (
            f"predicted to peak at {format_bytes(peak)} at these shapes"
            if peak is not None
            else "its peak at these shapes not known"
        )
        warnings.warn(
            f"gradckpt: a training step called the model at {key.describe()}, a "
            f"combination of shapes its plans did not foresee; that step ran under the "
            f"plan for {ran_for}, {at}, against the budget of {self._budget_text()}. "
            f"{then}{self.note}",
            stacklevel=6,
        )

    def _budget_text(self: ShapeGuard) -> str:
        return format_bytes(self.budget_bytes) if self.budget_bytes else "none"
