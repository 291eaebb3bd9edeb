"""Profile a step without allocating it: the model's tensors become fake tensors.

Under ``FakeTensorMode`` every op computes shapes, dtypes and devices but no
data, so the storages the recorder sees have their real sizes and nothing is
allocated: a model too big for this machine can be profiled for memory. Op
times cannot be measured; they are estimated from FLOPs and bytes moved
(a roofline: the slower of compute and memory traffic).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gradckpt.profiling.records import Profile

__all__ = [
    "SPEEDS",
    "DeviceSpeed",
    "check_fake_device",
    "estimate_time",
    "fake_device_of",
    "fake_model",
    "with_estimated_times",
]


@dataclass(frozen=True)
class DeviceSpeed:
    """Sustained throughput used to turn FLOPs and bytes into seconds."""

    flops_per_s: float
    bytes_per_s: float


#: Rough sustained numbers; only ratios between plans matter for planning.
SPEEDS = {
    "cpu": DeviceSpeed(flops_per_s=5e10, bytes_per_s=1e10),
    "cuda": DeviceSpeed(flops_per_s=4e14, bytes_per_s=2.5e12),
    "meta": DeviceSpeed(flops_per_s=4e14, bytes_per_s=2.5e12),
}


def estimate_time(flops: int, nbytes: int, speed: DeviceSpeed) -> float:
    """Seconds for an op doing ``flops`` and writing ``nbytes`` (reads are of the same order)."""
    return max(flops / speed.flops_per_s, 2 * nbytes / speed.bytes_per_s)


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


@contextlib.contextmanager
def fake_model(
    model: nn.Module, device: str | torch.device | None = None
) -> Iterator[FakeTensorMode]:
    """Swap ``model``'s parameters and buffers for fake ones (on ``device``) while inside.

    Tied parameters stay tied. The real (or meta) tensors are put back on exit.

    Example:
        >>> with fake_model(model, "cpu") as mode, mode:
        ...     loss_fn().backward()  # nothing is allocated
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, object]] = []
    made: dict[int, torch.Tensor] = {}
    try:
        with mode:
            for module in model.modules():
                for table in (module._parameters, module._buffers):
                    for name, t in table.items():
                        if t is None:
                            continue
                        fake = made.get(id(t))
                        if fake is None:
                            where = torch.device(device) if device is not None else t.device
                            fake = _fake_like(t.detach(), where)
                            if isinstance(t, nn.Parameter):
                                fake = nn.Parameter(fake, requires_grad=t.requires_grad)
                            made[id(t)] = fake
                        swapped.append((table, name, t))
                        table[name] = fake
        yield mode
    finally:
        for table, name, original in reversed(swapped):
            table[name] = original


def check_fake_device(device: torch.device) -> None:
    """Refuse a fake device this torch build cannot make, with what to do instead."""
    # Fake tensors on a device type this torch build lacks abort the interpreter
    # deep in C++ instead of raising: refuse first.
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if device.type not in ("cpu", "meta") and callable(available) and not available():
        raise ValueError(
            f"fake profiling on {device.type!r} needs a torch build with {device.type} support; "
            "profile with device='cpu' on this machine (attention kernels may save slightly "
            "different tensors than on the GPU), or run the planner where the device exists"
        )


def fake_device_of(model: nn.Module) -> torch.device:
    """Where a fake profile claims to run: the parameters' device, 'cpu' for a meta model."""
    for t in [*model.parameters(), *model.buffers()]:
        return torch.device("cpu") if t.device.type == "meta" else t.device
    return torch.device("cpu")


def with_estimated_times(prof: Profile, device: torch.device) -> Profile:
    """Op times from FLOPs and bytes (a fake step cannot be timed)."""
    speed = SPEEDS.get(device.type, SPEEDS["cuda"])
    ops = tuple(
        replace(
            op,
            time=estimate_time(op.flops, sum(prof.storages[s].nbytes for s in op.outputs), speed),
        )
        for op in prof.ops
    )
    units = tuple(
        replace(
            u,
            fwd_time=sum(op.time for op in ops if op.unit == u.index and not op.backward),
            bwd_time=sum(op.time for op in ops if op.unit == u.index and op.backward),
        )
        for u in prof.units
    )
    return replace(
        prof,
        ops=ops,
        units=units,
        step_time=sum(op.time for op in ops),
        fake=True,
        device=device.type,
    )
