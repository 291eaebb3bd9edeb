"""Per-op workspace: what the allocator holds while an op runs, beyond the op's outputs.

The profiler's first plain pass runs inside :class:`~gradckpt.measure.MemoryEvents`
with every op in its own allocator span. For op ``k`` the span gives the
allocator's level before the op and its peak during it; the op's new storages
(what the dispatch level sees) are subtracted, and what remains is the
transient the kernel allocated and freed inside itself::

    workspace[k] = max(0, peak_during(k) - before(k) + loose(k) - bytes(new storages of k))

``loose(k)``: blocks allocated between the previous op and this one that are
still held when it starts (the scalar tensors Python numbers become for its
call, which no ATen op returns).

On CUDA the caching allocator reports blocks rounded up to 512 bytes, so the
outputs are rounded the same way before subtracting. Fake profiles run no
kernels and get no workspace (zero; see ``gradckpt.profiling.records``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from gradckpt.measure.allocator import (
    MemoryEvents,
    allocator_block_bytes,
    foreign_profiler_running,
)
from gradckpt.profiling.recorder import StepRecorder

__all__ = ["allocator_events", "op_workspaces", "step_device"]


def step_device(model: nn.Module) -> torch.device | None:
    """The device whose allocator the step uses (None: one we cannot measure)."""
    for t in [*model.parameters(), *model.buffers()]:
        return t.device if t.device.type in ("cpu", "cuda") else None
    return torch.device("cpu")


@contextlib.contextmanager
def allocator_events(device: torch.device | None) -> Iterator[MemoryEvents | None]:
    """Memory events on ``device`` for the enclosed pass; None if they cannot be had."""
    if device is None:
        yield None
        return
    if foreign_profiler_running():
        warnings.warn(
            "gradckpt.profile ran inside another torch profiler, so kernel workspaces "
            "could not be measured; the profile's peak is the tensor-level one",
            stacklevel=4,
        )
        yield None
        return
    with MemoryEvents(device) as events:
        yield events


def op_workspaces(recorder: StepRecorder, events: MemoryEvents, device: torch.device) -> list[int]:
    """Workspace bytes of each recorded op (see the module docstring)."""
    spans = events.spans()
    block = allocator_block_bytes if device.type == "cuda" else (lambda n: n)
    out = []
    for op in recorder.ops:
        span = spans.get(op.index)
        if span is None:
            out.append(0)
            continue
        outputs = sum(block(recorder.storages[s].nbytes) for s in op.outputs)
        out.append(max(0, span.peak - span.before + span.loose - outputs))
    return out
