"""One training step from the state the model was found in, timed and measured at the allocator.

Three checks run a real step of the user's ``loss_fn`` under a plan to see what
it holds: the frugal check of fake-planned plans (:mod:`gradckpt.apply.frugal`),
the step at a new shape fake tensors cannot profile
(:mod:`gradckpt.apply.real_shape`) and the compiled budget hold
(:mod:`gradckpt.compiled.hold`). Each step starts from the gradients, buffers
and RNG the caller's :class:`~gradckpt.profiling.state.StepState` snapshotted
(so every step, and the user's own after them, runs as a plain model's would),
adopts the leaves outside the model its graph reaches, and runs forward and
backward under :class:`~gradckpt.measure.AllocatorTracker` (:func:`timed_step`:
timed only, for warm-ups and later rounds). Putting the plan on the model (and
taking it off) stays with the caller: each does it its own way (a plain model,
a shape guard's plan to put back, a compiled model).

Example:
    >>> state = StepState(model)
    >>> try:
    ...     reading = measured_step(state, loss_fn, model_device(model))
    ... finally:
    ...     state.restore()
    >>> reading.peak_bytes  # allocator bytes above the level at entry
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.measure.beside import BesideReading
from gradckpt.measure.timing import work_clock
from gradckpt.profiling.state import StepState

__all__ = ["StepReading", "measured_step", "model_device", "timed_step"]


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
