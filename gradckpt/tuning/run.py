"""Check by running: the most promising candidates, real steps, interleaved; the fastest kept.

Each candidate runs ``rounds`` times in turn (A, B, C, A, B, C, ...), each
time two micro-batches of forward and backward at its size under its plan,
gradients accumulating as they do under accumulation; its first run is
measured at the allocator. Its samples per second are
``global_batch / (K * median micro-batch seconds + optimizer seconds)``: the
micro-batches after the second cost what the second does, and the optimizer's
step, the same for every candidate, is timed once (:func:`optimizer_seconds`).
Candidates run from the leanest predicted peak up, and what the allocator held
beyond a prediction is added to the next ones' before they may run, so no
candidate predicted over the budget runs. The model, its gradients, buffers and
RNG are left as found.

Example:
    >>> measured = run_candidates(model, make_loss, rows, budget, rounds=3)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from gradckpt.apply.apply import apply, remove
from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.measure.beside import BesideReading, malloc_in_use
from gradckpt.measure.memory import state_bytes
from gradckpt.measure.optimizer import fresh_optimizer
from gradckpt.measure.timing import work_clock
from gradckpt.profiling import adapters
from gradckpt.profiling.state import StepState
from gradckpt.tuning.batches import MakeLoss
from gradckpt.tuning.result import TuneCandidate

__all__ = ["optimizer_seconds", "run_candidates"]


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_seconds(
    model: nn.Module, loss_fn: Callable[[], torch.Tensor], optimizer: object
) -> float:
    """Seconds of one ``optimizer.step()`` (its second: the first makes the state).

    A fresh optimizer of the same class and groups with a learning rate of 0
    steps over gradients from one real backward, so the parameters are left as
    they are; gradients and RNG are restored.

    Example:
        >>> optimizer_seconds(model, make_loss(1), torch.optim.AdamW(model.parameters()))
    """
    if optimizer is None:
        return 0.0
    guard = StepState(model)
    clock = work_clock(_device(model).type)
    try:
        with adapters.preparing(model), guard.watching_modules():
            guard.reset()
            loss_fn().backward()
            opt = fresh_optimizer(model, optimizer, lr=0.0, weight_decay=0.0)
            opt.step()
            start = clock()
            opt.step()
            _sync(_device(model))
            seconds = clock() - start
            del opt
    finally:
        guard.restore()
    return seconds


class _Runs:
    def __init__(
        self, model: nn.Module, make_loss: MakeLoss, state_bytes_: int, since: int | None
    ) -> None:
        self.model, self.make_loss = model, make_loss
        self.since = since  # malloc's bytes in use when tuning began
        self.guard = StepState(model)
        self.device = _device(model)
        self.clock = work_clock(self.device.type)
        self.state = state_bytes_  # optimizer state: resident in a real step, not made here

    def run(self, c: TuneCandidate, measure: bool) -> tuple[float, int | None, int]:
        """(seconds of a micro-batch, whole-step fwd/bwd peak at the allocator or None,
        the most held beside the allocator's blocks since tuning began: 0 unmeasured)."""
        loss_fn = self.make_loss(c.micro_batch)
        assert c.plan is not None
        apply(self.model, c.plan)
        try:
            self.guard.reset()
            tracker = AllocatorTracker(self.device) if measure else None
            times = []
            if tracker is not None:
                tracker.__enter__()
                # A step at a size no training runs can make a library keep a one-time
                # buffer (MKL's, ~10 MiB): what it keeps is not taken for its own.
                beside = BesideReading(tracker, since=self.since, less_kept=True)
            try:
                for _ in range(2 if c.accumulation_steps > 1 else 1):
                    start = self.clock()
                    loss = loss_fn()
                    self.guard.adopt_graph(loss)
                    if tracker is not None:
                        beside.forward_done(loss)  # the first micro-batch's graph
                    loss.backward()
                    del loss
                    _sync(self.device)
                    times.append(self.clock() - start)
            finally:
                if tracker is not None:
                    tracker.__exit__(None, None, None)
        finally:
            remove(self.model)
        if tracker is None:
            return times[-1], None, 0
        peak = state_bytes(self.model) + self.state + tracker.peak_bytes
        # On CUDA an out-of-memory error sees what the caching allocator reserved.
        peak = max(peak, (tracker.reserved_high_water_bytes or 0) + self.state)
        return times[-1], peak, beside.bytes()


def run_candidates(
    model: nn.Module,
    make_loss: MakeLoss,
    chosen: list[TuneCandidate],
    budget: int,
    optimizer_state_bytes: int,
    optimizer_step_seconds: float,
    global_batch: Callable[[int], int],
    rounds: int = 3,
    since: int | None = None,
    count_beside: bool = True,
) -> list[TuneCandidate]:
    """``chosen`` with measured samples/s and peaks (or why not run), in the same order.

    Each candidate's measured step counts what it holds beside the allocator's blocks
    (autograd's graph, the tracker's records: :class:`~gradckpt.measure.beside.BesideReading`);
    with ``since`` (malloc's bytes in use at an earlier moment) what the caller holds
    from then on counts too. ``count_beside=False``: the tensors alone, at the allocator.
    """
    runs = _Runs(model, make_loss, optimizer_state_bytes, since)
    order = sorted(range(len(chosen)), key=lambda i: chosen[i].predicted_peak_bytes or 0)
    missed = 0  # bytes the allocator held beyond a prediction, so far
    now = malloc_in_use() if since is not None else None
    beside = max(0, now - since) if now is not None and since is not None and count_beside else 0
    seconds: dict[int, list[float]] = {i: [] for i in order}
    peaks: dict[int, int] = {}
    verdicts: dict[int, str] = {}
    try:
        with adapters.preparing(model), runs.guard.watching_modules():
            for r in range(rounds):
                for i in order:
                    c = chosen[i]
                    if i in verdicts:
                        continue
                    if (c.predicted_peak_bytes or 0) + missed + beside > budget:
                        verdicts[i] = "not run (predicted over the budget after measuring others)"
                        continue
                    t, peak, held = runs.run(c, measure=r == 0)
                    held = held if count_beside else 0
                    if peak is not None:
                        peaks[i] = peak
                        missed = max(missed, peak - (c.predicted_peak_bytes or 0))
                        beside = max(beside, held)
                        if peak + held > budget:
                            verdicts[i] = f"over budget (measured {peak + held} B with malloc's)"
                            continue
                    seconds[i].append(t)
    finally:
        runs.guard.restore()
    out = []
    for i, c in enumerate(chosen):
        if i in verdicts or not seconds[i]:
            out.append(replace(c, measured_peak_bytes=peaks.get(i), verdict=verdicts.get(i, "")))
            continue
        per_step = [c.accumulation_steps * t + optimizer_step_seconds for t in seconds[i]]
        rates = [global_batch(c.micro_batch) / s for s in per_step]
        out.append(replace(
            c, measured_samples_per_s=statistics.median(rates), measured_rounds=tuple(rates),
            measured_peak_bytes=peaks.get(i),
        ))  # fmt: skip
    return out
