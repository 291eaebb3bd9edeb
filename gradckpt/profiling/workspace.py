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
outputs are rounded the same way before subtracting.

On CPU, kernels also take memory from malloc behind the allocator's back
(oneDNN's GEMM buffers in a dilated convolution's backward). The same pass
reads each op's peak resident growth (:mod:`gradckpt.measure.outside`); what
it exceeds the allocator's growth by, beyond the probe's noise, is added::

    outside[k] = growth(k) - (peak_during(k) - before(k))
                 if it is > noise_bytes(), or its settled replay's is > settled_noise_bytes()
                 else 0

and the step's peak is at least ``peak_during(k) + outside[k]`` for every op. Fake profiles run no
kernels and get no workspace (zero; see ``gradckpt.profiling.records``).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from gradckpt.measure.allocator import (
    MarkedSpan,
    MemoryEvents,
    allocator_block_bytes,
    foreign_profiler_running,
)
from gradckpt.measure.outside import (
    RssProbe,
    noise_bytes,
    rss_probe,
    settled_noise_bytes,
    unavailable,
)
from gradckpt.profiling.recorder import REPLAY_MARKS, StepRecorder

__all__ = [
    "allocator_events", "malloc_probe", "op_workspaces", "outside_bytes", "step_device", "step_peak",
]  # fmt: skip

_log = logging.getLogger(__name__)
_said_unavailable = False


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


@contextlib.contextmanager
def malloc_probe(device: torch.device | None) -> Iterator[RssProbe | None]:
    """A resident-memory probe for a CPU pass measured at the allocator (else None)."""
    global _said_unavailable
    if device is None or device.type != "cpu":
        yield None
        return
    why = unavailable()
    if why:
        if not _said_unavailable:  # once per process: it will not change
            _said_unavailable = True
            _log.info("memory CPU kernels take outside torch's allocator is not measured: %s", why)
        yield None
        return
    with rss_probe() as probe:
        yield probe


def op_workspaces(recorder: StepRecorder, events: MemoryEvents, device: torch.device) -> list[int]:
    """Workspace bytes of each recorded op (see the module docstring)."""
    spans = events.spans()
    block = allocator_block_bytes if device.type == "cuda" else (lambda n: n)
    outside = outside_bytes(recorder, spans)
    out = []
    for op in recorder.ops:
        span = spans.get(op.index)
        if span is None:
            out.append(0)
            continue
        outputs = sum(block(recorder.storages[s].nbytes) for s in op.outputs)
        inside = max(0, span.peak - span.before + span.loose - outputs)
        out.append(inside + outside.get(op.index, 0))
    return out


def outside_bytes(recorder: StepRecorder, spans: dict[int, MarkedSpan]) -> dict[int, int]:
    """Per op, the peak bytes it held outside the allocator (ops with none left out)."""
    noise, settled_noise = noise_bytes(), settled_noise_bytes()
    out = {}
    for index, growth in recorder.resident_growth.items():
        span = spans.get(index)
        inside = span.peak - span.before if span is not None else growth
        settled = recorder.settled_growth.get(index, inside) - inside
        # Below the floor the kernel's resident count cannot tell, unless a settled
        # replay (no page malloc's bookkeeping faults in) showed it above its own.
        if growth - inside > noise or settled > settled_noise:
            out[index] = growth - inside
    return out


def step_peak(recorder: StepRecorder, events: MemoryEvents) -> int:
    """The step's allocator peak, with each op's outside bytes on top of its level."""
    spans = events.spans()
    during = (spans[k].peak + extra for k, extra in outside_bytes(recorder, spans).items())
    # Replays allocate on top of the first run's outputs: not the step's own level.
    step = (total for _, mark, _, total, _ in events.events if mark < REPLAY_MARKS)
    return max([0, *step, *during])
