"""A model's plans by input shape, and where each call goes: the shape guard's decisions.

A plan's predicted peak holds for the shape it was made at. :class:`ShapeGuard`
compares each call's :class:`~gradckpt.planning.plans.call_key.ShapeKey` with the
active plan's (:meth:`ShapeGuard.on_call`, run by the model's root wrapper
before any op of the call, through :func:`gradckpt.apply.guard.check`):

* same key: nothing to do (one tuple comparison after building the key);
* a key with a cached plan: switch to it (re-install the wrappers, no planning);
* a new key, by the guard's policy:

  - ``"replan"``: plan for it now (the planner given by ``gradckpt.fit`` profiles
    the call under fake tensors) under the same budget, cache and switch; if no
    plan fits, raise :class:`~gradckpt.BudgetError` before anything runs, with
    the old plan still installed;
  - ``"warn"``: keep the old plan and warn once per key, naming the budget and
    the old plan's predicted peak at the new shape;
  - ``"error"``: raise before running.

With ``round_up`` a key bounded in every dimension by a planned key runs under
the smallest such plan (only for models whose peak is monotone in shape; see
:func:`gradckpt.planning.plans.planset.proves_monotone`). Calls without grad (eval) are not
guarded: nothing is kept for backward, so the plan does not matter. A plan
applied alone does not know its call's key: the guard learns it from its units
(:mod:`gradckpt.apply.guard_learning`). The guard keeps its counters for
:class:`ShapeStats`.

The guard only decides; planning and predicting are given to it as callables
(``gradckpt.fit`` builds them from the upper layers), and the switch is apply's.
Where it lives on the model is :mod:`gradckpt.apply.guard`.

Example:
    >>> guard = ShapeGuard("warn", {key: plan}, key, switch=lambda p: install_plan(model, p))
    >>> guard.on_call(args, kwargs)  # before the call runs: switch, plan, warn or raise
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from gradckpt.apply import guard_copies
from gradckpt.apply.guard_learning import Learning, start
from gradckpt.apply.guard_stats import ShapeStats
from gradckpt.apply.guard_steps import ShapeError, StepCalls, StepRouting, arm
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.call_key import Key, ShapeKey, shape_key
from gradckpt.planning.plans.plan import Plan
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.profiling.units import CALL_MARK

__all__ = [
    "POLICIES",
    "Planner",
    "Predictor",
    "ShapeError",
    "ShapeGuard",
    "ShapeStats",
    "register_installer",
]

POLICIES = ("replan", "warn", "error")

_PLAIN = (bool, int, float, str, type(None))
_KEYS_KEPT = 64  # quick signatures remembered (a training run meets a few shapes)


def quick_sig(args: tuple, kwargs: dict) -> tuple | None:
    """What a call's key reads, where reading it is cheap: plain tensors and plain values.

    Equal signatures mean equal keys (the key reads a tensor's shape, dtype and
    whether it takes a gradient, and a plain value itself); None for a call with
    anything else (containers, subclasses, objects), which gets its full key.
    A step calls its model with the same shapes again and again: building the key
    each time cost more than the rest of the guard's work per call.
    """
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # model(x): no loop
        x = args[0]
        return ((x.shape, x.dtype, x.requires_grad),)
    parts = []
    for value in (*args, *kwargs.values()):
        if type(value) is torch.Tensor:
            parts.append((value.shape, value.dtype, value.requires_grad))
        elif type(value) in _PLAIN:
            parts.append((type(value), value))
        else:
            return None
    return (tuple(kwargs), *parts) if kwargs else tuple(parts)


#: The (args, kwargs) of each model call of one step -> a plan for that step's shapes.
Planner = Callable[[list[tuple[tuple, dict]]], Plan]
#: A plan's predicted peak at the shapes of one step's calls.
Predictor = Callable[[Plan, list[tuple[tuple, dict]]], int]


# How a guard puts a plan on its model: gradckpt.apply.apply's install_plan, handed
# down when that module loads (it builds on the guard, so the guard cannot import it).
_INSTALLER: list[Callable[[nn.Module, Plan], Any]] = []


def register_installer(install: Callable[[nn.Module, Plan], Any]) -> None:
    """Make ``install(model, plan)`` how every guard switches its model's plan."""
    _INSTALLER[:] = [install]


@dataclass(eq=False)
class ShapeGuard(StepRouting):
    """Per-model guard state: plans by shape, the active shape, policy and counters."""

    policy: str
    plans: dict[Key | None, Plan]
    active: Key | None
    switch: Callable[[Plan], None] | None  # None: a copy's, bound to it at its first call
    planner: Planner | None = None
    predictor: Predictor | None = None
    round_up: bool = False
    rescaled: Callable[[], int] | None = None  # how many plans the planner made by rescaling
    recompiles: Callable[[], int] | None = None  # set by gradckpt.compile (integrations)
    calls: int = 0
    replans: list[float] = field(default_factory=list)
    switches: int = 0
    warned: set[Key] = field(default_factory=set)
    #: The step key that last began at a first call's key (the pattern steps repeat).
    preferred: dict[ShapeKey, Key] = field(default_factory=dict)
    unforeseen: int = 0  # steps that ran a combination of shapes no plan foresaw
    learning_calls: bool = False  # a plan applied alone: its later calls are learned too
    #: A plan without segments runs until the next step (fit from inside the model's call).
    interim: bool = False

    note: str = ""  # why this guard warns rather than plans (a copy, a plan applied by hand)
    unread: set[str] = field(default_factory=set)  # arguments already named as unreadable
    owner: weakref.ref | None = None  # the model guarded (None: a copy, bound at its first call)
    _busy: threading.local = field(default_factory=threading.local)
    _steps: threading.local = field(default_factory=threading.local)  # .current: StepCalls
    # Keys of recent calls by their quick signature: a call with the shapes of an earlier
    # one has its key, without building it (see quick_sig). Cleared when it grows.
    _keys: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"on_new_shape must be one of {POLICIES}, got {self.policy!r}")
        if self.policy == "replan" and self.planner is None:
            raise ValueError(
                'on_new_shape="replan" needs a planner: use gradckpt.fit(model, loss_fn, budget) '
                'to get one, or apply a plan set with on_new_shape="warn" or "error"'
            )

    @property
    def budget_bytes(self) -> int | None:
        return next(iter(self.plans.values())).budget_bytes

    def stats(self) -> ShapeStats:
        return ShapeStats(
            calls=self.calls,
            plans=len(self.plans),
            replans=len(self.replans),
            replan_seconds=tuple(self.replans),
            switches=self.switches,
            warnings=len(self.warned),
            policy=self.policy,
            active=self.active.describe() if self.active is not None else "(not recorded)",
            rescaled=self.rescaled() if self.rescaled is not None else 0,
            recompiles=self.recompiles() if self.recompiles is not None else 0,
        )

    def on_call(self, args: tuple, kwargs: dict) -> Learning | None:
        """Check one call before it runs; switch, plan, warn or raise as the policy says.

        The first call of a step picks the plan (a switch between steps); a later
        call is only compared with the plan the step began under: nothing is
        switched or planned in the middle of a step (an earlier call's saved
        state would see it). A step that went off its plan is planned once it
        ended, before the next step's first call (:meth:`_settle`).

        Returns the call's :class:`Learning` record when the plan's call shape is
        not known yet (its units then check their inputs; see :func:`finish`).
        """
        if getattr(self._busy, "redispatched", False):
            self._busy.redispatched = False  # this call was checked by the root it left
            return None
        if not torch.is_grad_enabled() or getattr(self._busy, "on", False):
            return None  # eval, or our own profiling call of the model
        self.calls += 1
        quick = quick_sig(args, kwargs)
        key = self._keys.get(quick) if quick is not None else None
        if key is None:
            key = shape_key(args, kwargs)
            self._name_unread(key)  # once per argument: a key read before was named then
            if key == self.active:
                key = self.active  # one object: the usual call is then found by identity
            if quick is not None:
                if len(self._keys) >= _KEYS_KEPT:
                    self._keys.clear()
                self._keys[quick] = key
        step = getattr(self._steps, "current", None)
        if step is None or step.ended:
            if step is not None:
                self._settle(step)
                self.learning_calls = False  # a plan applied alone learned its whole step
            step = self._steps.current = StepCalls()
        index = step.add(key, args, kwargs)
        try:
            if index > 0:
                self._later_call(step, index, key)
                return None
            entry = self._first_call(key, args, kwargs)
        except BaseException:
            self.abandon()  # the call does not run (refused, or no plan fits)
            raise
        step.plan_key = self.active
        return entry

    def abandon(self) -> None:
        """The running step stops here (a call refused or raised): the next call begins anew."""
        self._steps.current = None

    def on_return(self, out: Any) -> None:
        """A checked call returned ``out``: its step ends with the backward through it."""
        if not torch.is_grad_enabled() or getattr(self._busy, "on", False):
            return
        step = getattr(self._steps, "current", None)
        # The step's first call: the step ends with the backward through its outputs.
        if step is not None and len(step.keys) == 1 and not step.ended and not arm(step, out):
            step.drop_last()  # nothing to backpropagate: not a call of a training step

    def _first_call(self, key: ShapeKey, args: tuple, kwargs: dict) -> Learning | None:
        active = self.active
        if active is key and not self.interim and key not in self.preferred:
            return None  # the plan in use began at this key (the usual call)
        chosen = self._plan_for_first(key)
        if chosen is not None:
            if chosen != self.active or self.interim:
                self._switch(chosen, self.plans[chosen])
            return None
        if self.active is None:
            return self._learn(key)
        if self.policy == "error":
            raise ShapeError(
                f"gradckpt: the model was called with inputs {key.describe()}, but it has plans "
                f"only for {self._known()}; plan this shape too (gradckpt.fit(..., "
                "shapes=[...])), or fit with on_new_shape='replan' or 'warn'"
            )
        if self.policy == "warn":
            self._warn(key, [(args, kwargs)])
            return None
        self._replan(key, [(args, kwargs)])
        return None

    def _name_unread(self, key: ShapeKey) -> None:
        # Once per argument: the key holds such an argument's type, not what it holds.
        new = [u for u in key.unread() if u not in self.unread]
        if not new:
            return
        self.unread.update(new)
        warnings.warn(
            f"gradckpt: the shape guard cannot read the model's argument(s) {', '.join(new)}: "
            "a change inside them (a tensor's shape, a length) is not seen as a new shape, so "
            "its plan is neither switched nor re-planned. Pass tensors, plain values, or "
            "dicts/lists/tuples/dataclasses of them.",
            stacklevel=5,
        )

    def _learn(self, key: ShapeKey) -> Learning | None:
        """A call at ``key`` under a plan whose call shape is unknown: its units check it."""
        if key in self.warned:
            return None  # said once already: runs the plan, unchecked
        (plan,) = self.plans.values()
        if not plan.input_shapes:  # nothing to check against: the plan is taken as made for it
            self.learned(key)
            return None
        return start(self, key)

    def learned(self, key: ShapeKey) -> None:
        """Record ``key`` as the call shape of the plan applied without one."""
        if self.active is None and None in self.plans:
            self.plans[key] = self.plans.pop(None)
            self.active = key
            # A plan for several calls of the model per step learns its later calls too.
            self.learning_calls = any(CALL_MARK in u for u, _ in self.plans[key].input_shapes)

    def unit_mismatch(self, key: ShapeKey, path: str, planned: tuple, got: tuple) -> None:
        """A unit of a call at ``key`` got inputs of another shape than its plan's: warn or raise."""
        (plan,) = self.plans.values()
        where = (
            f"{path} was planned for inputs of shape {planned} but got {got} (model inputs "
            f"{key.describe()})"
        )
        if self.policy == "error":
            raise ShapeError(
                f"gradckpt: {where}; plan this shape (gradckpt.plan(..., shapes=[...])), or "
                "apply with on_new_shape='warn'"
            )
        self.warned.add(key)
        self._say(where, plan, None)

    def _known(self) -> str:
        return "; ".join(k.describe() for k in self.plans if k is not None) or "(none recorded)"

    def _switch(self, key: Key, plan: Plan) -> None:
        assert self.switch is not None, "a copy's guard is bound at its model's first call"
        self.switch(plan)
        self.interim = False
        self.active = key
        self.switches += 1

    def _busy_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Planning is not part of the caller's step: dispatch modes around the
        # call (a MemoryTracker, a FLOP counter) must not see the fake profile.
        before = getattr(self._busy, "on", False)
        self._busy.on = True
        try:
            with _disable_current_modes():
                return fn(*args)
        finally:
            self._busy.on = before

    def _warn(self, key: ShapeKey, inputs: list[tuple[tuple, dict]]) -> None:
        if key in self.warned:
            return
        self.warned.add(key)
        plan = self.plans[self.active]
        peak = (
            self._busy_call(self.predictor, plan, inputs) if self.predictor is not None else None
        )
        made_for = self.active.describe() if self.active else "?"
        self._say(
            f"the model was called with inputs {key.describe()}, but its plan was made for "
            f"{made_for}",
            plan,
            peak,
        )

    def _say(self, what: str, plan: Plan, peak: int | None) -> None:
        """The one warning of a new shape: what runs, its predicted peak, the budget."""
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none"
        if peak is not None:
            at = f"its predicted peak at this shape is {format_bytes(peak)}"
        elif plan.predicted_peak_bytes:
            at = (
                f"its predicted peak is {format_bytes(plan.predicted_peak_bytes)} at the shape it "
                "was made for and not known at this one (no planner)"
            )
        else:
            at = "its peak at this shape is not known (no planner, no recorded prediction)"
        warnings.warn(
            f"gradckpt: {what}; running that plan (on_new_shape='warn'): {at}, against the "
            f"budget of {budget}. To hold the budget at every shape, use gradckpt.fit(model, "
            f"loss_fn, budget) (on_new_shape='replan') or plan the shapes "
            f"(gradckpt.plan(..., shapes=[...])).{self.note}",
            stacklevel=5,
        )

    def _replan(
        self, key: Key, inputs: list[tuple[tuple, dict]], switch: bool = True
    ) -> None:
        """Plan ``key`` (the calls ``inputs`` of one step); with ``switch``, run it now."""
        assert self.planner is not None
        start = time.perf_counter()
        try:
            plan = self._busy_call(self.planner, inputs)
        except BudgetError as exc:
            raise BudgetError(
                f"gradckpt: no plan fits the budget at the new input shape {key.describe()} "
                f"(of your step nothing ran; a planning step measured at this shape may have "
                f"run over; the model keeps its plan for "
                f"{self.active.describe() if self.active else '?'}). {exc}",
                exc.least_peak_bytes,
            ) from exc
        finally:
            self.replans.append(time.perf_counter() - start)
        self.plans[key] = plan
        if switch:
            self._switch(key, plan)

    def bind(self, model: nn.Module) -> None:
        """Make ``model`` the guarded one; a copy's guard then switches the copy's plans."""
        self.owner = weakref.ref(model)
        if self.switch is None:
            assert _INSTALLER, "gradckpt.apply.apply registers install_plan when it loads"
            self.switch = functools.partial(_INSTALLER[0], model)

    def copied(self, keep_planner: bool) -> ShapeGuard:
        """This guard for a copy of its model (see :mod:`gradckpt.apply.guard_copies`)."""
        return guard_copies.copied(self, keep_planner)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShapeGuard:
        return guard_copies.deepcopied(self, memo)

    def __reduce__(self) -> tuple[Any, ...]:
        return guard_copies.reduced(self)
