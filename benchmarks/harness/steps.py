"""Training steps and their untimed peaks, and the device chores around a timed step."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.harness.contenders import Installer
from gradckpt.measure import AllocatorTracker, MemoryTracker, state_bytes
from gradckpt.measure.timing import work_clock
from gradckpt.testing import Example


def clear_grads(model: nn.Module) -> None:
    """Drop every parameter's gradient (between untimed steps, after timing)."""
    for p in model.parameters():
        p.grad = None


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); nothing on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def release(device: str | torch.device) -> None:
    """Hand the caching allocator's free blocks back (CUDA), so the next model starts clean."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def step_clock(device: str, clock: str) -> Callable[[], float] | None:
    """The ``clock`` for ``time_interleaved``: this thread's CPU time for ``"cpu"`` (on a shared
    machine other processes' work does not count), else None (wall time)."""
    return work_clock(device) if clock == "cpu" else None


def wall_timed(step: Callable[[], Any], device: str, into: list[float]) -> Callable[[], None]:
    """``step`` that also appends its wall time (device synchronized around it) to ``into``;
    reported beside a CPU-clock time, which leaves out waiting."""

    def run() -> None:
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        into.append(time.perf_counter() - start)

    return run


def make_step(example: Example, seed: int = 0) -> Callable[[], torch.Tensor]:
    """One training step: drop old grads, seed the RNG, forward + backward; returns the loss."""
    params = list(example.model.parameters())  # listed once: the step is timed

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        torch.manual_seed(seed)
        loss = example.loss_fn()
        loss.backward()
        return loss.detach()

    return step


def measure_peaks(example: Example, install: Installer, seed: int = 0) -> tuple[int, int, float]:
    """Allocator peak, tensor (tracker) peak and loss of one untimed step with ``install``.

    Both peaks include the model's parameters and buffers. The allocator is
    read on the device the model lives on (CPU: torch's profiler memory events;
    CUDA: the caching allocator's statistics).
    """
    undo = install(example)
    try:
        step = make_step(example, seed)
        device = next(example.model.parameters()).device
        with AllocatorTracker(device) as allocator, MemoryTracker(example.model) as tracker:
            loss = step()
        clear_grads(example.model)
        peak = state_bytes(example.model) + allocator.peak_bytes
        return peak, tracker.peak_bytes, float(loss)
    finally:
        undo()


def measure_peak(example: Example, install: Installer, seed: int = 0) -> tuple[int, float]:
    """The allocator's peak bytes (params included) and loss of one untimed step."""
    peak, _, loss = measure_peaks(example, install, seed)
    return peak, loss
