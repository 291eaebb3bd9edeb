"""The allocator's high-water over the trainer's own steps under a plan.

The trainer callbacks report a measured peak only of real training steps that
ran under the plan; :class:`StepsMeasurement` holds one
:class:`~gradckpt.measure.AllocatorTracker` open across them.

Example:
    >>> m = StepsMeasurement(model, optimizer); m.start()
    >>> ...  # two optimizer steps of the trainer
    >>> m.finish()
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterable

import torch
from torch import nn

from gradckpt.api.budget import resident_bytes
from gradckpt.measure.allocator import AllocatorTracker, foreign_profiler_running

__all__ = ["StepsMeasurement"]

logger = logging.getLogger("gradckpt")


#: Measurements open now; one left open by a trainer that raised is closed by the next
#: one that starts, or at exit (on CPU a session holds the profiler and fd 2).
_OPEN: list[StepsMeasurement] = []


class StepsMeasurement:
    """The allocator's high-water over whole training steps, from :meth:`start` to :meth:`finish`.

    An :class:`~gradckpt.measure.AllocatorTracker` on the model's device, held
    open across the trainer's loop (forward, backward, ``optimizer.step()``,
    ``zero_grad``). The figure is its peak above entry plus the level at entry:
    on CUDA ``memory_allocated`` (so ``max_memory_allocated`` over the steps), on
    CPU :func:`gradckpt.api.budget.resident_bytes`. On CPU the tracker runs torch's profiler with memory events only,
    nesting with gradckpt's own sessions (a tracker around the whole training
    sees through it); while it is open another ``torch.profiler`` cannot start,
    and what is written to the process's stderr is held until it ends. A
    foreign profiler already running means no measurement (``start`` returns
    False).

    Example:
        >>> m = StepsMeasurement(model, optimizer)
        >>> m.start(); train_two_steps(); m.finish()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        others: Iterable[nn.Module] = (),
    ) -> None:
        self.model, self.optimizer, self.others = model, optimizer, list(others)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._tracker: AllocatorTracker | None = None
        self._entry = 0

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def start(self) -> bool:
        """Begin measuring; False (and a log line) when it cannot."""
        for stale in list(_OPEN):
            stale.abort()
        if self.device.type not in ("cpu", "cuda"):
            logger.info("gradckpt: steps on %s are not measured (cpu and cuda only)", self.device)
            return False
        if self.device.type == "cpu" and foreign_profiler_running():
            logger.info("gradckpt: another profiler is running: the steps under the plan are "
                        "not measured")  # fmt: skip
            return False
        if self.device.type == "cuda":  # the allocator's own level: everything on the device
            self._entry = torch.cuda.memory_allocated(self.device)
        else:  # the CPU allocator reports no level: what the step holds, counted
            self._entry = resident_bytes(self.model, self.optimizer, self.others)
        tracker = AllocatorTracker(self.device)
        tracker.__enter__()
        self._tracker = tracker
        _OPEN.append(self)
        return True

    def finish(self) -> int | None:
        """Stop; the whole-step high-water in bytes (None: not measuring)."""
        tracker = self._close(None)
        return None if tracker is None else self._entry + tracker.peak_bytes

    def abort(self) -> None:
        """Stop without a result (the trainer raised)."""
        self._close(RuntimeError("aborted"))

    def _close(self, exc: BaseException | None) -> AllocatorTracker | None:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return None
        if self in _OPEN:
            _OPEN.remove(self)
        if exc is None:
            tracker.__exit__(None, None, None)
        else:
            tracker.__exit__(type(exc), exc, None)
        return tracker


@atexit.register
def _close_open_measurements() -> None:  # pragma: no cover - runs at interpreter exit
    for measurement in list(_OPEN):
        measurement.abort()
