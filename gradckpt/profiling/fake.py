"""Profile a step without allocating it: the model's tensors become fake tensors.

Under ``FakeTensorMode`` every op computes shapes, dtypes and devices but no
data, so the storages the recorder sees have their real sizes and nothing is
allocated: a model too big for this machine can be profiled for memory. Op
times cannot be measured; they are estimated from FLOPs and bytes moved
(a roofline: the slower of compute and memory traffic).

On an accelerator an op also costs the host the time to issue it (Python,
dispatch, autograd, the launch): a few microseconds, more than the kernels of a
short-op model take, and what a recompute of such ops costs. A fake profile for
a device other than the CPU takes that time as the least an op costs
(``host_op_seconds``: this machine's own per-op time on tiny ops unless the caller
states it), records it in the profile and the plan (``plan.summary()`` says it),
and prices the engine's events at this host's measured costs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode

from gradckpt.measure.engine_costs import engine_costs
from gradckpt.profiling import adapters
from gradckpt.profiling.records import Profile

__all__ = [
    "SPEEDS",
    "AnsweredScalars",
    "DeviceSpeed",
    "check_fake_device",
    "estimate_time",
    "fake_device_of",
    "fake_model",
    "fake_op_names",
    "user_hooks_suspended",
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


def estimate_time(flops: int, nbytes: int, speed: DeviceSpeed, host: float = 0.0) -> float:
    """Seconds for an op doing ``flops`` and writing ``nbytes`` (reads are of the same order),
    and at least ``host``, the host's time to issue it (see :func:`with_estimated_times`)."""
    return max(host, flops / speed.flops_per_s, 2 * nbytes / speed.bytes_per_s)


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


@contextlib.contextmanager
def fake_model(
    model: nn.Module, device: str | torch.device | None = None
) -> Iterator[FakeTensorMode]:
    """Swap ``model``'s parameters and buffers for fake ones (on ``device``) while inside.

    Tied parameters stay tied. The real (or meta) tensors are put back on exit.
    The user's module hooks are suspended meanwhile (:func:`user_hooks_suspended`):
    they never see a fake tensor.

    Example:
        >>> with fake_model(model, "cpu") as mode, mode:
        ...     loss_fn().backward()  # nothing is allocated
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, object]] = []
    made: dict[int, torch.Tensor] = {}
    hooks = user_hooks_suspended(model)
    hooks.__enter__()
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
        hooks.__exit__(None, None, None)


class AnsweredScalars(TorchDispatchMode):
    """Answer what fake tensors cannot know: ``.item()`` and ``nonzero``, and count them.

    A fake tensor has no value, so a step that reads one (a metric logged with
    ``loss.item()``, TRL's DPO statistics, boolean-mask indexing) cannot run
    under fake tensors at all. Entered inside the fake mode this answers
    instead: a scalar read with a placeholder (1, 1.0, True), ``nonzero`` as if
    every element were nonzero (the largest output, so what follows is counted
    at its most). What the step *allocates* is otherwise the same unless its
    control flow depends on the values: the callers that use it check plans on
    real steps (:mod:`gradckpt.apply.frugal`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            try:
                return func(*args, **(kwargs or {}))
            except DataDependentOutputException:
                self.answered += 1
                dtype = args[0].dtype
                return 1.0 if dtype.is_floating_point else True if dtype == torch.bool else 1
        if func in _INDEXING and any(_is_mask(i) for i in args[1]):
            # A boolean mask index is a nonzero inside the fake kernel: as every-true here.
            self.answered += 1
            indices = [w for i in args[1] for w in (_as_positions(i) if _is_mask(i) else [i])]
            return func(args[0], indices, *args[2:], **(kwargs or {}))
        if func is torch.ops.aten.nonzero.default:
            try:
                return func(*args, **(kwargs or {}))
            except DynamicOutputShapeException:
                self.answered += 1
                x = args[0]
                return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **(kwargs or {}))


_INDEXING = (
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
)


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _as_positions(mask: torch.Tensor) -> list[torch.Tensor]:
    """The index tensors of ``mask`` were every element true (one per masked dimension)."""
    return [torch.zeros(mask.numel(), dtype=torch.long, device=mask.device)] * mask.dim()


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


def with_estimated_times(
    prof: Profile, device: torch.device, host_op_seconds: float | None = None
) -> Profile:
    """Op times from FLOPs and bytes (a fake step cannot be timed).

    For a device other than the CPU, no op takes less than ``host_op_seconds``, the
    host's time to issue one (None: this machine's, measured on tiny ops,
    :attr:`EngineCosts.host_op <gradckpt.measure.engine_costs.EngineCosts>`), and the
    engine's events are priced at this host's measured costs.

    Example:
        >>> prof = with_estimated_times(fake_prof, torch.device("cuda"), host_op_seconds=8e-6)
        >>> prof.host_op_seconds
        8e-06
    """
    speed = SPEEDS.get(device.type, SPEEDS["cuda"])
    host = 0.0
    costs = prof.engine_costs
    if device.type != "cpu":
        costs = replace(engine_costs("cpu"), device=device.type)  # the host's Python work
        host = costs.host_op if host_op_seconds is None else float(host_op_seconds)
        if host < 0:
            raise ValueError(f"host_op_seconds must be >= 0, got {host_op_seconds!r}")
    ops = tuple(
        replace(
            op,
            time=estimate_time(
                op.flops, sum(prof.storages[s].nbytes for s in op.outputs), speed, host
            ),
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
        engine_costs=costs,
        host_op_seconds=host,
    )


# The module hook tables a fake profile must not run the user's entries of: each
# module's, and the global ones (``register_module_forward_hook`` and friends).
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_TABLES = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def _is_users(hook: object) -> bool:
    """A hook the user (or a library outside torch and gradckpt) registered."""
    fn = getattr(hook, "func", hook)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # bound methods
    where = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return not (where == "torch" or where.startswith(("torch.", "gradckpt")))


@contextlib.contextmanager
def user_hooks_suspended(model: nn.Module) -> Iterator[int]:
    """Take the user's forward/backward hooks off ``model``'s modules and the global
    tables while inside (yields how many); they are put back, in order, on exit.

    A fake profile runs the model on tensors without values: a hook that logs
    ``.item()`` would fail, one that stores activations would keep fake tensors.
    torch's and gradckpt's own hooks stay (they are part of how the step runs).
    """
    import torch.nn.modules.module as module_mod

    tables = [getattr(m, name) for m in model.modules() for name in _HOOK_TABLES]
    tables += [getattr(module_mod, name) for name in _GLOBAL_TABLES]
    saved: list[tuple[dict, list[tuple[int, object]], set[int]]] = []
    for table in tables:
        taken = {k for k, hook in table.items() if _is_users(hook)}
        if taken:
            saved.append((table, list(table.items()), taken))
            for k in taken:
                del table[k]
    try:
        yield sum(len(t) for _, _, t in saved)
    finally:
        for table, before, taken in saved:
            added = [(k, h) for k, h in table.items() if all(k != b for b, _ in before)]
            kept = [(k, h) for k, h in before if k in taken or k in table]
            table.clear()
            table.update(kept + added)


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def fake_op_names(model: nn.Module, forward: Callable[[], object]) -> tuple[str, ...]:
    """The ATen ops ``forward()`` dispatches on ``model`` under fake tensors, in order.

    Cheap next to a profile (one forward without grad, no recorder): it tells
    whether two shapes of a call take the same code path, which is what
    rescaling a profile across lengths assumes.
    """
    # Without grad: an installed plan's wrappers run their units plainly, so the trace
    # does not depend on which plan the model has now.
    names = _OpNames()
    with (
        adapters.preparing(model, fake=True),
        fake_model(model) as mode,
        torch.no_grad(),
        mode,
        names,
    ):
        forward()
    return tuple(names.names)
