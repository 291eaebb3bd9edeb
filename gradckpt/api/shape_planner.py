"""Planning at other shapes than the one ``loss_fn`` runs: what ``fit``/``plan`` do with
``shapes=`` and what the shape guard calls on a new shape.

``loss_fn`` is a zero-argument step at one fixed batch, so it cannot be rerun at
another shape. What can be: the model call itself. At a new shape gradckpt
profiles the step ``loss_from(model(*args, **kwargs), *args, **kwargs)`` under
fake tensors (nothing is allocated, so a shape too big to run plainly can still
be planned) with the call's own arguments, and solves it under the same budget.

The assumption, stated: the step's memory is the model call's plus the loss
``loss_from`` computes from its output. The default ``loss_from`` takes
``output.loss`` when the output carries a scalar loss (transformers models
called with ``labels``: exactly the training step) and otherwise sums the
output's floating tensors; pass ``loss_from`` when your loss outside the model
keeps more (e.g. ``lambda out, x: F.cross_entropy(out, torch.zeros(len(out),
dtype=torch.long))``: label values do not change memory, only shapes do).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradckpt.api.model_calls import Call, LossFrom, calls_for, length_of, step_at
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.call_key import Key
from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.profiling.fake import fake_op_names

__all__ = ["ROUTES", "ShapePlanner", "predicted_peak"]

logger = logging.getLogger("gradckpt")

#: How a shape got its plan, in the order they are tried (``shape_stats(model).routes``):
#: measured at ``fit``; a fake-tensor profile at the shape; a fake profile rescaled from
#: other lengths (op sequence checked at the shape); either of those checked by one real
#: step at the shape (models whose fitted profile held memory tensors do not show, e.g.
#: convolution workspace); one real step at the shape under the leanest plan, measured
#: at the allocator; the plan the model had (said in a warning).
ROUTES = ("fitted", "fake", "rescaled", "fake-verified", "real-frugal", "old-plan")

def predicted_peak(profile_at: Callable[[Call], Any], plan: Any, call: Call) -> int:
    """``plan``'s simulated peak at ``call``'s shape."""
    return simulate(profile_at(call), plan).peak_bytes


def _reason(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first[:200]}"


class ShapePlanner:
    """Plans a model call at its shape, by the first route of :data:`ROUTES` that works.

    1. **fake** / **rescaled**: a call that differs from the fitted one only in
       sequence length is planned from a :class:`~gradckpt.planning.solving.rescale.LengthScaling`
       built (once, at the first such call) from fake profiles at four lengths,
       accepted only when a fake trace of the forward at the new length
       dispatches the same ops as at the lengths it was fitted on (a branch on
       the length refuses it); any other call is profiled under fake tensors.
       User hooks are suspended while fake tensors run.
       **fake-verified**: with ``verify_real`` (given for models whose fitted profile
       showed memory a fake profile misses), the plan is not taken on the fake
       profile's word: ``verify_real(call, profile)`` runs the step for real under
       it (leaner plans while over the budget) and returns one that fits, or None
       (then the next route).
    2. **real-frugal**: the fake route failed (an op without a fake kernel, a fake
       kernel stricter than the real one, a value read, a data-dependent
       shape): ``measure_real(call)`` runs one real step at the shape under the
       leanest plan known and keeps it if its allocator peak fits the budget
       (:class:`BudgetError` if not: nothing fits).
    3. **old-plan**: that failed too: the plan the model has keeps running, with
       a warning giving its predicted peak.
    """

    def __init__(
        self,
        model: nn.Module,
        fitted: Call,
        loss_from: LossFrom | None,
        profile_fake: Callable[[Callable[[], torch.Tensor]], Any],
        solve_profile: Callable[[Any], Any],
        seq_dim: int = 1,
        rescale: bool = True,
        measure_real: Callable[[Call], Any] | None = None,
        verify_real: Callable[[Call, Any], Any] | None = None,
    ) -> None:
        self.model, self.fitted, self.loss_from = model, fitted, loss_from
        self.profile_fake, self.solve_profile, self.seq_dim = profile_fake, solve_profile, seq_dim
        self.rescale = rescale
        self.measure_real, self.verify_real = measure_real, verify_real
        #: The plan the model runs now (the guard sets it); the old-plan route keeps it.
        self.current: Callable[[], Any] = lambda: fitted.plan
        self.scaling: Any = None
        self.scaling_tried = False
        self.scaling_ops: tuple[str, ...] | None = None  # the op trace the scaling assumes
        self.rescaled = 0  # plans made from the scaling (no profile at their shape)
        self.routes: dict[Key, str] = {fitted.key: "fitted"}
        #: What the user's step keeps beyond the replayed model calls, at a profile's
        #: shape (set by the API, which knows the fitted step; 0 when not known).
        self.step_tail: Callable[[Any], int] = lambda prof: 0

    def profile_call(self, call: Call) -> Any:
        """A fake profile of the step at ``call`` (user hooks are suspended by ``fake_model``)."""
        # torch logs a failing fake kernel as an error before raising it; the failure is
        # handled here (the next route), so the log would only alarm.
        quiet = logging.getLogger("torch._subclasses.fake_tensor")
        level, quiet.level = quiet.level, logging.CRITICAL
        try:
            return self.profile_fake(step_at(self.model, call, self.loss_from))
        finally:
            quiet.setLevel(level)

    def __call__(self, call: Call) -> Any:
        try:
            prof, route = self._fake_route(call)
            plan = self.solve_profile(prof)  # BudgetError: fake tensors see less, none fits
            if self.verify_real is not None:
                plan, route = self.verify_real(call, prof), "fake-verified"
        except BudgetError:
            raise  # a true answer: no plan fits at this shape
        except Exception as exc:  # the step cannot run under fake tensors (or for real)
            # Only its text is kept: its traceback holds the failed pass's real tensors
            # (buffer snapshots), which must not sit beside the real step that follows.
            failure = f"fake tensors: {_reason(exc)}"
        else:
            if plan is not None:
                self.routes[call.key] = route
                return plan
            failure = "the plans made on fake tensors measured over the budget on a real step"
        plan, route = self._after_fake(call, failure)
        self.routes[call.key] = route
        return plan

    def _fake_route(self, call: Call) -> tuple[Any, str]:
        """The profile at ``call`` without a real step, and the route it came by."""
        lengths = length_of(self.fitted.key, call.key, self.seq_dim) if self.rescale else None
        if lengths is None:
            return self.profile_call(call), "fake"
        if self.scaling is not None and self._same_ops(call):
            prof = self.scaling.at(lengths[1])
            if prof is not None:
                self.rescaled += 1
                return prof, "rescaled"
        prof = self.profile_call(call)
        if not self.scaling_tried:
            self.scaling_tried = True
            self.scaling = self._fit_scaling(lengths, prof)
            if self.scaling is not None:
                self.scaling_ops = self._op_names(call)
        return prof, "fake"

    def _op_names(self, call: Call) -> tuple[str, ...]:
        return fake_op_names(self.model, lambda: self.model(*call.args, **call.kwargs))

    def _same_ops(self, call: Call) -> bool:
        """Whether the forward at ``call`` dispatches the ops the scaling was fitted on."""
        try:
            return self._op_names(call) == self.scaling_ops
        except Exception:
            return False  # profiled instead, which says why if it fails too

    def _after_fake(self, call: Call, failure: str) -> tuple[Any, str]:
        reasons = [failure]
        if self.measure_real is not None:
            try:
                plan = self.measure_real(call)
            except BudgetError:
                raise
            except Exception as real_exc:  # the next route says why
                reasons.append(f"a real step under the leanest plan: {_reason(real_exc)}")
            else:
                logger.info(
                    "gradckpt: planned %s from one real step under the leanest plan (%s at the "
                    "allocator; %s)", call.key.describe(),
                    format_bytes(plan.predicted_peak_bytes), reasons[0],
                )  # fmt: skip
                return plan, "real-frugal"
        old = self.current()
        if old is None:
            raise RuntimeError(
                f"gradckpt could not plan the input shape {call.key.describe()} ("
                + "; ".join(reasons)
                + "); pass shapes= only at lengths the model runs at"
            )
        peak = format_bytes(old.predicted_peak_bytes)
        budget = format_bytes(old.budget_bytes) if old.budget_bytes else "none"
        warnings.warn(
            f"gradckpt: could not plan the input shape {call.key.describe()} ("
            + "; ".join(reasons)
            + f"). Running the plan the model has: its predicted peak at the shape it was made "
            f"for is {peak} against the budget of {budget}; at this shape it may be higher.",
            stacklevel=5,
        )
        return old, "old-plan"

    def _fit_scaling(self, lengths: tuple[int, int], at_new: Any) -> Any:
        from gradckpt.planning.solving.rescale import fit_length_scaling

        fitted, new = lengths
        low, high = sorted((fitted, new))
        candidates = [fitted, (low + high) // 2, low // 2, (3 * low) // 4, low + (high - low) // 4]
        others: list[int] = []
        for n in candidates:
            if n >= 1 and n != new and n not in others:
                others.append(n)
        profiles = {new: at_new}
        try:
            for n in others[:3]:
                [call] = calls_for(self.fitted, [n], self.seq_dim)
                profiles[n] = self.profile_call(call)
        except Exception:
            # A model that cannot run at one of these lengths: plan every shape by profiling it.
            return None
        return fit_length_scaling(profiles)
