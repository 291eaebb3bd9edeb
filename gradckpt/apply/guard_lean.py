"""The usual call of a guarded model, run with the least the shape guard must do.

Most calls of a guarded model are the same call again: grad on, the shapes of
the active plan's first call, the last step ended on its plan. For a plan with
no segments and no unit that checks its own input shapes (the root wrapper's
``lean`` flag) such a call needs only what :meth:`ShapeGuard.on_call` would do
for it: begin a step, count the call, and end the step with the backward
through its output. The step-by-step check costs a dozen Python calls per model
call; where ops are short (a GPU's regime) that showed in the step (issue #42),
so this path does the same in one. Any other call (a new shape, a step's second
call, no grad, a copy's first call, a guard busy profiling) is left untouched
here and goes through :func:`gradckpt.apply.guard.check`.

Example:
    >>> out = run_usual(root.forward, args, kwargs)  # root: the model's RootGuard
    >>> if out is NOT_USUAL: ...  # the full check decides
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradckpt.apply.guard import _ATTR
from gradckpt.apply.guard_routing import ShapeGuard, quick_sig
from gradckpt.apply.guard_steps import StepCalls, arm

__all__ = ["NOT_USUAL", "run_usual", "usual_step"]

#: :func:`run_usual`'s answer for a call it did not run.
NOT_USUAL = object()



def usual_step(guard: ShapeGuard, args: tuple, kwargs: dict) -> StepCalls | None:
    """Begin a step at this call if it is the guard's usual one, as :meth:`ShapeGuard.on_call`
    would (counted, recorded); None, touching nothing, for any other call."""
    active = guard.active
    if active is None or guard.interim or guard.learning_calls or not torch.is_grad_enabled():
        return None
    busy = guard._busy.__dict__
    if busy and (busy.get("on") or busy.get("redispatched")):
        return None  # profiling the model, or a call the full check already routed
    quick = quick_sig(args, kwargs)
    if quick is None or guard._keys.get(quick) is not active:
        return None
    if guard.preferred and active in guard.preferred:
        return None  # steps beginning here may be planned as longer steps: the full check
    steps = guard._steps.__dict__
    step = steps.get("current")
    if step is not None and (not step.ended or step.off_plan):
        return None  # a later call of the running step, or one to settle first
    guard.calls += 1
    step = steps["current"] = StepCalls([active], [(args, kwargs)], active)
    return step


def run_usual(forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``forward`` (a guarded model's own, bound) if this is its usual call; else
    :data:`NOT_USUAL`, with nothing run or changed.

    Only the model's own guard: a copy's is bound at its first call by the full check.
    """
    model = getattr(forward, "__self__", None)
    guard = getattr(model, "__dict__", {}).get(_ATTR)
    if not isinstance(guard, ShapeGuard) or guard.owner is None or guard.owner() is not model:
        return NOT_USUAL
    step = usual_step(guard, args, kwargs)
    if step is None:
        return NOT_USUAL
    try:
        out = forward(*args, **kwargs)
    except BaseException:
        guard.abandon()
        raise
    if not arm(step, out):
        step.drop_last()  # nothing to backpropagate: not a call of a training step
    return out
