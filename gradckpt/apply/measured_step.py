"""One training step under a plan, from the state the model was found in, timed and measured.

Three checks run a real step of the user's ``loss_fn`` under a plan to see what
it holds: the frugal check of fake-planned plans (:mod:`gradckpt.apply.frugal`),
the step at a new shape fake tensors cannot profile
(:mod:`gradckpt.apply.real_shape`) and the compiled budget hold
(:mod:`gradckpt.compiled.hold`). They all run it through :class:`PlanSteps`:
the plan is put on the model for the step and the plan the model had put back
after; each step starts from the gradients, buffers and RNG snapshotted on entry
(so every step, and the user's own after them, runs as a plain model's would),
adopts the leaves outside the model its graph reaches, and runs forward and
backward under :class:`~gradckpt.measure.AllocatorTracker` (or timed only, for
warm-ups and later rounds).

Example:
    >>> with PlanSteps(model, loss_fn) as steps:
    ...     seconds, reading = steps.run(plan)
    >>> reading.peak_bytes  # allocator bytes above the level at entry
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradckpt.apply.apply import applied_plan, install_plan, remove
from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.measure.beside import BesideReading
from gradckpt.measure.timing import work_clock
from gradckpt.planning.plans.plan import Plan
from gradckpt.profiling import adapters
from gradckpt.profiling.state import StepState

__all__ = ["PlanSteps", "StepReading", "measured_step", "model_device", "timed_step"]


@dataclass(frozen=True)
class StepReading:
    """What one measured step took and held.

    ``seconds``: by the caller's clock (:func:`~gradckpt.measure.timing.work_clock`),
    the allocator's measurement included. ``peak_bytes``: the most the allocator held
    above its level at entry. ``reserved_high_water_bytes``: CUDA only (None on the
    CPU), all the caching allocator had reserved: what an out-of-memory error sees.
    """

    seconds: float
    peak_bytes: int
    reserved_high_water_bytes: int | None
    #: CPU with glibc: the most the step held from malloc beside the allocator's blocks, at
    #: its forward's end or a backward node's start (autograd's graph, Python objects, the
    #: allocator's records: :class:`gradckpt.measure.beside.BesideReading`);
    #: 0 where it cannot be read. A budget counted at malloc's level holds it too.
    beside_bytes: int = 0


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s step allocates: its first parameter's device (the CPU without any).

    Example:
        >>> model_device(torch.nn.Linear(2, 2))
        device(type='cpu')
    """
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def measured_step(
    state: StepState,
    loss_fn: Callable[[], torch.Tensor],
    device: torch.device,
    clock: Callable[[], float] | None = None,
    *,
    beside_since: int | None = None,
) -> StepReading:
    """Run ``loss_fn().backward()`` once from ``state``'s snapshot, timed and measured.

    Args:
        state: the snapshot the step starts from (reset first). The caller restores
            it when its steps are done, and enters ``state.watching_modules()`` around
            them to cover the buffers of modules outside the model (not under Dynamo,
            which would trace that global hook into the compiled step).
        loss_fn: the step's forward, returning the loss.
        device: where the step allocates (:func:`model_device`).
        clock: the clock to time with (default: :func:`~gradckpt.measure.timing.work_clock`
            of ``device``).
        beside_since: malloc's bytes in use when the caller's work began
            (:func:`~gradckpt.measure.beside.malloc_in_use`): what it holds while the step
            runs is counted in ``beside_bytes`` (default: from the step's start).

    Example:
        >>> measured_step(state, loss_fn, torch.device("cpu")).peak_bytes
    """
    clock = clock if clock is not None else work_clock(device)
    state.reset()
    start = clock()
    with AllocatorTracker(device) as tracker:
        beside = BesideReading(tracker, since=beside_since)
        _step(state, loss_fn, device, beside.forward_done)
    seconds = clock() - start
    return StepReading(
        seconds, tracker.peak_bytes, tracker.reserved_high_water_bytes, beside.bytes()
    )


def timed_step(
    state: StepState,
    loss_fn: Callable[[], torch.Tensor],
    device: torch.device,
    clock: Callable[[], float] | None = None,
) -> float:
    """:func:`measured_step` without the allocator: seconds only (a warm-up, a later round).

    Example:
        >>> seconds = timed_step(state, loss_fn, torch.device("cpu"))
    """
    clock = clock if clock is not None else work_clock(device)
    state.reset()
    start = clock()
    _step(state, loss_fn, device)
    return clock() - start


def _step(
    state: StepState,
    loss_fn: Callable[[], torch.Tensor],
    device: torch.device,
    forward_done: Callable[[torch.Tensor], None] | None = None,
) -> None:
    loss = loss_fn()
    state.adopt_graph(loss)  # leaves outside the model the step reaches
    if forward_done is not None:
        forward_done(loss)  # autograd's graph is whole here; its nodes are hooked
    loss.backward()
    del loss  # freed inside a measured region, as in a plain step
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the clock reads the work done


class PlanSteps:
    """Real steps of ``loss_fn``, each under a plan put on ``model`` for it and from the
    state the model was in on entry; at exit that state and the model's plan are back.

    Args:
        install: how a plan goes on the model (default :func:`~gradckpt.apply.apply.install_plan`,
            which leaves a shape guard alone; :func:`~gradckpt.apply.apply.apply` for a
            plain model). A model without a plan is plain again after each step; the
            plan a model had is installed again at exit.
        clock: what to time steps with (default: :func:`~gradckpt.measure.timing.work_clock`).
        beside_since: see :func:`measured_step`.
        prepared: run the steps as profiled (registered adapters' preparation:
            transformers without KV cache), so they compare with the profile;
            ``watch_modules``: snapshot buffers of modules outside the model too.
            Both off for a compiled step: Dynamo would trace the hooks into it.

    Example:
        >>> with PlanSteps(model, step, install=apply) as steps:
        ...     seconds, _ = steps.run(plan, measure=False)
        ...     seconds, reading = steps.run(plan)
    """

    def __init__(
        self, model: nn.Module, loss_fn: Callable[[], torch.Tensor], *,
        install: Callable[[nn.Module, Plan], Any] = install_plan,
        clock: Callable[[], float] | None = None, beside_since: int | None = None,
        prepared: bool = True, watch_modules: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.loss_fn, self.install = model, loss_fn, install
        self.device = model_device(model)
        self.clock = clock if clock is not None else work_clock(self.device)
        self.beside_since = beside_since  # malloc's bytes in use when planning began
        self.prepared, self.watch_modules = prepared, watch_modules
        self.state = StepState(model)
        self._before = applied_plan(model)
        self._entered = ExitStack()

    def __enter__(self) -> PlanSteps:
        with ExitStack() as entering:
            entering.callback(self.state.restore)
            if self.prepared:
                entering.enter_context(adapters.preparing(self.model))
            if self.watch_modules:
                entering.enter_context(self.state.watching_modules())
            self._entered = entering.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered.close()
        if self._before is not None:  # once the state is back, as the model had it
            install_plan(self.model, self._before)

    def run(self, plan: Plan | None, measure: bool = True) -> tuple[float, StepReading | None]:
        """One step under ``plan`` (None: the model as it is): its seconds, and what it held
        (None when not ``measure``: timed only)."""
        if plan is not None:
            self.install(self.model, plan)
        try:
            if not measure:
                return timed_step(self.state, self.loss_fn, self.device, self.clock), None
            reading = measured_step(self.state, self.loss_fn, self.device, self.clock,
                                    beside_since=self.beside_since)  # fmt: skip
            return reading.seconds, reading
        finally:
            if self._before is None and applied_plan(self.model) is not None:
                remove(self.model)
