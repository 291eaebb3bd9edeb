"""``profile(model, loss_fn)``: measure one training step and leave the model as found.

Two kinds of pass run ``loss_fn().backward()`` under a :class:`StepRecorder`:

* one *forward-only* pass that drops every saved tensor on the spot: it tells
  when each storage would die if autograd kept nothing (inside a checkpointed
  region nothing is kept);
* ``repeats`` *plain* passes (forward and backward) that give the event line,
  what autograd saves and releases, per-op times and the measured peak; the
  first also runs under the allocator's memory events, which give the
  allocator's peak and each op's kernel workspace (``gradckpt.profiling.workspace``);

and then ``repeats`` unrecorded steps that time the plain step. So ``loss_fn`` runs
``1 + 2 * repeats`` times (7 with the default ``repeats=3``; 2 under ``fake``):
take the batch outside it, not from an iterator inside it.

Times are taken on :func:`gradckpt.measure.timing.work_clock` (thread CPU time
on the CPU) and summarized by their least value over the passes
(:func:`~gradckpt.measure.timing.low_estimate`): load on a shared machine and a
cold first pass only add time, and plans must not change with them.

Before each pass the RNG, buffers and gradients are reset to what they were on
entry, and they are restored exactly at the end (:mod:`gradckpt.profiling.state`):
also the gradients of leaves outside the model the step reaches, and the
buffers of modules outside the model it calls.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradckpt.measure.engine_costs import engine_costs
from gradckpt.measure.memory import state_bytes
from gradckpt.measure.timing import low_estimate, work_clock
from gradckpt.profiling import adapters
from gradckpt.profiling.calibration import settled_step_time, settled_times
from gradckpt.profiling.fake import SPEEDS, estimate_time, fake_model
from gradckpt.profiling.fingerprint import model_fingerprint
from gradckpt.profiling.recorder import RecordMode, StepRecorder
from gradckpt.profiling.records import (
    NEVER,
    OpRecord,
    PackRecord,
    Profile,
    StorageRecord,
    UnitRecord,
)
from gradckpt.profiling.state import StepState
from gradckpt.profiling.units import BlockSpec, Unit, find_blocks, find_units
from gradckpt.profiling.workspace import allocator_events, op_workspaces, step_device

__all__ = ["ProfileError", "profile"]


class ProfileError(RuntimeError):
    """The step could not be profiled (bad loss_fn, non-deterministic op sequence)."""


@contextlib.contextmanager
def _unit_markers(units: list[Unit], recorder: StepRecorder) -> Iterator[None]:
    """Wrap each unit's forward (where gradckpt.apply puts regions) to note its calls."""
    installed: list[tuple[nn.Module, Any, bool]] = []

    def marker(index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def forward_marked(*args: Any, **kwargs: Any) -> Any:
            if not recorder.active or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            call = recorder.enter_unit(index, args, kwargs)
            out = forward(*args, **kwargs)
            recorder.exit_unit(call, out)
            return out

        return forward_marked

    try:
        for index, unit in enumerate(units):
            module = unit.module
            had_own = "forward" in module.__dict__
            previous = module.__dict__.get("forward")
            plain = getattr(module.forward, "__gradckpt_original__", module.forward)
            module.forward = marker(index, plain)
            installed.append((module, previous, had_own))
        yield
    finally:
        # Last installed first: a module that is two units (shared by two parents)
        # got two markers, the second wrapping the first.
        for module, previous, had_own in reversed(installed):
            if had_own:
                module.forward = previous
            else:
                del module.forward


_BACKWARD_INSIDE = (
    "loss_fn ran backward() itself; gradckpt runs loss_fn().backward() while profiling, so "
    "loss_fn must only run the forward and return the loss: move .backward() (and any "
    "optimizer step) out of it"
)


def _run_pass(
    units: list[Unit],
    loss_fn: Callable[[], torch.Tensor],
    state: StepState,
    *,
    plain: bool,
    device: str = "cpu",
    allocator: torch.device | None = None,
) -> StepRecorder:
    recorder = StepRecorder(units, keep_saved=plain)
    hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)
    # With ``allocator``, the pass also runs under the allocator's memory events
    # (each op in its own span): the step's allocator peak and per-op workspace.
    with (
        allocator_events(allocator) as events,
        _unit_markers(units, recorder),
        hooks,
        RecordMode(recorder, device, mark_ops=events is not None),
    ):
        recorder.active = True
        try:
            loss = loss_fn()
        except RuntimeError as e:
            if "forward-only profiling pass cannot run backward" in str(e):
                raise ProfileError(_BACKWARD_INSIDE) from e
            raise
        if any(p.grad is not None for p in state.params):  # they were cleared before the pass
            raise ProfileError(_BACKWARD_INSIDE)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ProfileError(
                "loss_fn must run one forward and return a scalar loss tensor that requires "
                f"grad; it returned {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        state.adopt_graph(loss)  # leaves outside the model: their gradients are put back too
        recorder.forward = False
        if plain:
            loss.backward()
        del loss
        recorder.active = False
    recorder.watcher.close()
    if events is not None and allocator is not None:
        recorder.workspaces = op_workspaces(recorder, events, allocator)
        recorder.allocator_peak = events.peak_bytes
    return recorder


def _time_plain_step(
    loss_fn: Callable[[], torch.Tensor], guard: StepState, repeats: int, device: str = "cpu"
) -> float:
    clock = work_clock(device)  # the clock the op times are on: overheads are their ratio
    times = []
    for _ in range(repeats):
        guard.reset()
        start = clock()
        loss_fn().backward()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(clock() - start)
    return low_estimate(times)


def _natural_frees(forward_only: StepRecorder, plain: StepRecorder) -> list[int]:
    """Position on the plain pass's line where each storage would die if nothing were kept."""
    n_fwd = plain.forward_ops
    if [op[1] for op in forward_only.ops[: forward_only.forward_ops]] != [
        op[1] for op in plain.ops[:n_fwd]
    ]:
        raise ProfileError(
            "the forward ran different ops on two runs with the same RNG state and buffers; "
            "gradckpt needs a deterministic op sequence (data-dependent control flow on "
            "global state is not supported)"
        )
    died: dict[tuple[int, int], int] = {}
    for op in forward_only.ops:
        for ordinal, sid in enumerate(op[7]):
            died[(op[0], ordinal)] = forward_only.storages[sid].free_ops_done
    natural = [NEVER] * len(plain.storages)
    for op in plain.ops[:n_fwd]:
        for ordinal, sid in enumerate(op[7]):
            done = died.get((op[0], ordinal), -1)
            if 0 <= done < n_fwd:
                natural[sid] = plain.ops[done][8] - 1
            elif done == n_fwd:
                natural[sid] = plain.ops[n_fwd - 1][8] + 1
    return natural


def _units(recorder: StepRecorder, units: list[Unit], ops: list[OpRecord]) -> tuple:
    first_calls: dict[int, Any] = {}
    counts: dict[int, int] = {}
    for call in recorder.calls:
        counts[call.unit] = counts.get(call.unit, 0) + 1
        first_calls.setdefault(call.unit, call)
    order = sorted(first_calls, key=lambda u: first_calls[u].first_op)
    renumber = {old: new for new, old in enumerate(order)}
    fwd_time: dict[int, float] = {}
    bwd_time: dict[int, float] = {}
    for op in ops:
        if op.unit >= 0:
            table = bwd_time if op.backward else fwd_time
            table[op.unit] = table.get(op.unit, 0.0) + op.time
    records = []
    previous = None
    for new, old in enumerate(order):
        call = first_calls[old]
        chained = call.chained and previous is not None and previous.end_op == call.first_op
        records.append(
            UnitRecord(
                index=new, path=units[old].path, cls=type(units[old].module).__name__,
                is_block=units[old].is_block, calls=counts[old], first_op=call.first_op,
                end_op=call.end_op, inputs=call.inputs, chain_input=call.chain_input,
                chain_arg=call.chain_arg, chain_output=call.chain_output, output=call.output,
                chained=chained, fwd_time=fwd_time.get(old, 0.0), bwd_time=bwd_time.get(old, 0.0),
            )
        )  # fmt: skip
        previous = call
    return tuple(records), renumber


def profile(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    *,
    blocks: BlockSpec = None,
    repeats: int = 3,
    fake: bool = False,
    device: str | torch.device | None = None,
) -> Profile:
    """Measure one training step of ``model``: ops, sizes, times, what backward keeps.

    ``loss_fn`` is called ``1 + 2 * repeats`` times (one forward-only pass,
    ``repeats`` recorded steps, ``repeats`` timed steps; twice with ``fake``).
    Everything the step touches is left as found: the model's weights, gradients
    and buffers, the gradients of any other leaf tensor the loss reaches (a loss
    head, a learnable prompt, an input that requires grad), the buffers of any
    other module it calls, and torch's RNG.

    Args:
        model: the model (left exactly as found: weights, grads, buffers, RNG).
        loss_fn: zero-argument callable running one forward, returning the scalar loss;
            take its batch outside it (it runs several times).
        blocks: module paths or a predicate ``(path, module) -> bool`` naming the
            repeated blocks; discovered automatically when None.
        repeats: plain passes to take per-op median times from.
        fake: run under ``FakeTensorMode``: nothing is allocated (plan a model too
            big for this machine, e.g. built on the meta device); op times are
            estimated from FLOPs and bytes.
        device: with ``fake``, the device the fake tensors claim to be on (default:
            where the parameters are; "cpu" for a meta model).

    The model is profiled inside every registered adapter's preparation
    (:mod:`gradckpt.profiling.adapters`): the API, ``explain`` and the CLI all
    come through here.

    Example:
        >>> prof = gradckpt.profile(model, lambda: model(x).pow(2).mean())
        >>> prof.measured_peak_bytes
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"profile needs an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be a zero-argument callable returning the loss")
    # The one profiling path: every registered adapter prepares the model first
    # (transformers: no KV cache; under fake tensors, its real-data branches).
    with adapters.preparing(model, fake=fake):
        return _profile_prepared(model, loss_fn, blocks, repeats, fake, device)


def _profile_prepared(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    blocks: BlockSpec,
    repeats: int,
    fake: bool,
    device: str | torch.device | None,
) -> Profile:
    units = find_units(model, find_blocks(model, blocks))
    guard = StepState(model)
    try:
        if fake:
            where = torch.device(device) if device is not None else _fake_device(model)
            _check_fake_device(where)
            with fake_model(model, where) as mode, mode:
                guard.reset()
                forward_only = _run_pass(units, loss_fn, guard, plain=False)
                guard.reset()
                passes = [_run_pass(units, loss_fn, guard, plain=True)]
            return _estimated(_assemble(model, units, forward_only, passes, 0.0), where)
        where = _device_of(model)
        with guard.watching_modules():  # buffers of modules outside the model, too
            guard.reset()
            forward_only = _run_pass(units, loss_fn, guard, plain=False, device=where)
            passes = []
            for i in range(max(1, repeats)):
                guard.reset()
                measured = step_device(model) if i == 0 else None  # the allocator, once
                passes.append(
                    _run_pass(units, loss_fn, guard, plain=True, device=where, allocator=measured)
                )
            step_time = _time_plain_step(loss_fn, guard, max(1, repeats), where)
    finally:
        guard.restore()
    return _assemble(model, units, forward_only, passes, step_time)


def _check_fake_device(device: torch.device) -> None:
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


def _fake_device(model: nn.Module) -> torch.device:
    for t in [*model.parameters(), *model.buffers()]:
        return torch.device("cpu") if t.device.type == "meta" else t.device
    return torch.device("cpu")


def _estimated(prof: Profile, device: torch.device) -> Profile:
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


def _assemble(
    model: nn.Module,
    units: list[Unit],
    forward_only: StepRecorder,
    passes: list[StepRecorder],
    step_time: float,
) -> Profile:
    main = passes[0]
    natural = _natural_frees(forward_only, main)
    names = [op[1] for op in main.ops]
    same = [p for p in passes if [op[1] for op in p.ops] == names]
    times = _shared_times(
        main, [low_estimate(p.ops[i][5] for p in same) for i in range(len(names))]
    )
    device = _device_of(model)
    if step_time > 0:  # measured, not estimated: reuse this process's first measurements
        times = settled_times([(device, *_signature(main, op)) for op in main.ops], times)
        step_time = settled_step_time(
            (device, model_fingerprint(model), tuple(names), main.watcher.peak_bytes), step_time
        )
    workspaces = main.workspaces or [0] * len(main.ops)
    provisional = [
        OpRecord(op[0], op[1], op[2], op[3], op[4], times[op[0]], op[6], op[7], op[8],
                 workspaces[op[0]])
        for op in main.ops
    ]  # fmt: skip
    unit_records, renumber = _units(main, units, provisional)
    ops = tuple(
        OpRecord(o.index, o.name, o.backward, renumber.get(o.unit, -1), o.local, o.time,
                 o.flops, o.outputs, o.position, o.workspace)
        for o in provisional
    )  # fmt: skip
    storages = tuple(
        StorageRecord(i, s.nbytes, s.producer, s.alloc, s.free, natural[i], s.mutated)
        for i, s in enumerate(main.storages)
    )
    packs = tuple(
        PackRecord(i, p.storage, renumber.get(p.unit, -1), p.ops_done, p.position, p.unpack,
                   p.release, p.shape, p.dtype)
        for i, p in enumerate(main.packs)
    )  # fmt: skip
    param_bytes = state_bytes(model)
    first_calls = {}
    for call in main.calls:
        first_calls.setdefault(units[call.unit].path, call.input_shape)
    shapes = tuple((u.path, first_calls[u.path]) for u in unit_records)
    return Profile(
        ops=ops,
        storages=storages,
        packs=packs,
        units=unit_records,
        forward_ops=main.forward_ops,
        end=main.position + 2,
        param_bytes=param_bytes,
        step_time=step_time,
        # The allocator's peak when it was measured (what an OOM sees), else tensors'.
        measured_peak_bytes=param_bytes
        + (main.watcher.peak_bytes if main.allocator_peak is None else main.allocator_peak),
        tracker_peak_bytes=param_bytes + main.watcher.peak_bytes,
        peak_level="tensors" if main.allocator_peak is None else "allocator",
        fingerprint=model_fingerprint(model),
        device=_device_of(model),
        input_shapes=shapes,
        engine_costs=engine_costs(_device_of(model)),  # measured once per process
    )


def _shared_times(recorder: StepRecorder, times: list[float]) -> list[float]:
    """One median time for identical ops (same name, phase, FLOPs and output sizes).

    Repeated blocks run the same ops on the same shapes; pooling their timings
    removes most of the noise a busy machine adds to a single measurement.
    """
    groups: dict[tuple, list[int]] = {}
    for op in recorder.ops:
        groups.setdefault(_signature(recorder, op), []).append(op[0])
    pooled = list(times)
    for members in groups.values():
        if len(members) > 1:
            median = statistics.median(times[i] for i in members)
            for i in members:
                pooled[i] = median
    return pooled


def _signature(recorder: StepRecorder, op: tuple) -> tuple:
    """What makes two ops the same work: name, phase, FLOPs and output sizes."""
    return (op[1], op[2], op[6], tuple(recorder.storages[s].nbytes for s in op[7]))


def _device_of(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"
