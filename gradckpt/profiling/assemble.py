"""Turning the recorded passes into a :class:`~gradckpt.profiling.records.Profile`.

The first plain pass gives the event line; the forward-only pass gives when
each storage would die if nothing were kept; op times are the least over the
plain passes, pooled over identical ops and settled across this process's
earlier measurements; units are renumbered in the order they first ran.
"""

from __future__ import annotations

import statistics

from torch import nn

from gradckpt.measure.engine_costs import engine_costs
from gradckpt.measure.memory import state_bytes
from gradckpt.measure.timing import low_estimate
from gradckpt.profiling.calibration import settled_step_time, settled_times
from gradckpt.profiling.fingerprint import model_fingerprint
from gradckpt.profiling.passes import ProfileError
from gradckpt.profiling.recorder import RecordedOp, StepRecorder
from gradckpt.profiling.records import (
    NEVER,
    OpRecord,
    PackRecord,
    Profile,
    StorageRecord,
    UnitRecord,
)
from gradckpt.profiling.sub_calls import SubCallRecord
from gradckpt.profiling.units import Unit, call_path

__all__ = ["assemble", "device_of"]


def assemble(
    model: nn.Module,
    units: list[Unit],
    forward_only: StepRecorder,
    passes: list[StepRecorder],
    step_time: float,
) -> Profile:
    """The :class:`Profile` of the recorded passes (``passes[0]`` gives the event line).

    Example:
        >>> prof = assemble(model, units, forward_only, passes, step_time)
    """
    main = passes[0]
    natural = _natural_frees(forward_only, main)
    names = [op.name for op in main.ops]
    same = [p for p in passes if [op.name for op in p.ops] == names]
    times = _shared_times(
        main, [low_estimate(p.ops[i].elapsed for p in same) for i in range(len(names))]
    )
    device = device_of(model)
    if step_time > 0:  # measured, not estimated: reuse this process's first measurements
        times = settled_times([(device, *_signature(main, op)) for op in main.ops], times)
        step_time = settled_step_time(
            (device, model_fingerprint(model), tuple(names), main.watcher.peak_bytes), step_time
        )
    workspaces = main.workspaces or [0] * len(main.ops)
    provisional = [
        OpRecord(op.index, op.name, op.backward, op.unit, op.local, times[op.index], op.flops,
                 op.outputs, op.position, workspaces[op.index])
        for op in main.ops
    ]  # fmt: skip
    unit_records, renumber = _record_units(main, units, provisional)
    ops = tuple(
        OpRecord(o.index, o.name, o.backward, renumber.get(o.unit, -1), o.local, o.time,
                 o.flops, o.outputs, o.position, o.workspace)
        for o in provisional
    )  # fmt: skip
    storages = tuple(
        StorageRecord(i, s.nbytes, s.producer, s.alloc, s.free, natural[i], s.mutated, s.shape)
        for i, s in enumerate(main.storages)
    )
    packs = tuple(
        PackRecord(i, p.storage, renumber.get(p.unit, -1), p.ops_done, p.position, p.unpack,
                   p.release, p.shape, p.dtype)
        for i, p in enumerate(main.packs)
    )  # fmt: skip
    param_bytes = state_bytes(model)
    call_shapes = {renumber[call.serial]: call.input_shape for call in main.calls}
    shapes = tuple((u.path, call_shapes[u.index]) for u in unit_records)
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
        device=device_of(model),
        input_shapes=shapes,
        engine_costs=engine_costs(device_of(model)),  # measured once per process
        grad_storages=main.grad_storages,
        beside_bytes=main.beside_bytes,
        sub_calls=tuple(
            SubCallRecord(
                c.path, renumber[c.unit], c.first_op, c.end_op, c.input, c.output,
                c.input_shape, c.output_shape, c.tensor_args,
            )
            for c in main.sub_calls
            if c.unit in renumber
        ),
    )


def _shared_times(recorder: StepRecorder, times: list[float]) -> list[float]:
    """One median time for identical ops (same name, phase, FLOPs and output sizes).

    Repeated blocks run the same ops on the same shapes; pooling their timings
    removes most of the noise a busy machine adds to a single measurement.
    """
    groups: dict[tuple, list[int]] = {}
    for op in recorder.ops:
        groups.setdefault(_signature(recorder, op), []).append(op.index)
    pooled = list(times)
    for members in groups.values():
        if len(members) > 1:
            median = statistics.median(times[i] for i in members)
            for i in members:
                pooled[i] = median
    return pooled


def _signature(recorder: StepRecorder, op: RecordedOp) -> tuple:
    """What makes two ops the same work: name, phase, FLOPs and output sizes."""
    return (op.name, op.backward, op.flops, tuple(recorder.storages[s].nbytes for s in op.outputs))


def device_of(model: nn.Module) -> str:
    """The device type of the model's parameters ('cpu' when it has none)."""
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _natural_frees(forward_only: StepRecorder, plain: StepRecorder) -> list[int]:
    """Position on the plain pass's line where each storage would die if nothing were kept."""
    n_fwd = plain.forward_ops
    if [op.name for op in forward_only.ops[: forward_only.forward_ops]] != [
        op.name for op in plain.ops[:n_fwd]
    ]:
        raise ProfileError(
            "the forward ran different ops on two runs with the same RNG state and buffers; "
            "gradckpt needs a deterministic op sequence (data-dependent control flow on "
            "global state is not supported)"
        )
    died: dict[tuple[int, int], int] = {}
    for op in forward_only.ops:
        for ordinal, sid in enumerate(op.outputs):
            died[(op.index, ordinal)] = forward_only.storages[sid].free_ops_done
    natural = [NEVER] * len(plain.storages)
    for op in plain.ops[:n_fwd]:
        for ordinal, sid in enumerate(op.outputs):
            done = died.get((op.index, ordinal), -1)
            if 0 <= done < n_fwd:
                natural[sid] = plain.ops[done].position - 1
            elif done == n_fwd:
                natural[sid] = plain.ops[n_fwd - 1].position + 1
    return natural


def _record_units(recorder: StepRecorder, units: list[Unit], ops: list[OpRecord]) -> tuple:
    """One record per unit *call*, in the order the calls began.

    A module called several times per step (a shared layer, a model called twice)
    is a unit per call (``path#k``, :func:`~gradckpt.profiling.units.call_path`): the
    planner sees the calls in order and gives each its own decision. Returns the
    records and the map from call serials (what ops and packs carry) to their index.
    """
    calls = sorted(recorder.calls, key=lambda c: (c.first_op, c.serial))
    counts: dict[int, int] = {}
    for call in calls:
        counts[call.unit] = counts.get(call.unit, 0) + 1
    renumber = {call.serial: new for new, call in enumerate(calls)}
    fwd_time: dict[int, float] = {}
    bwd_time: dict[int, float] = {}
    for op in ops:
        if op.unit >= 0:
            table = bwd_time if op.backward else fwd_time
            table[op.unit] = table.get(op.unit, 0.0) + op.time
    records = []
    previous = None
    seen: dict[int, int] = {}
    for new, call in enumerate(calls):
        k = seen[call.unit] = seen.get(call.unit, -1) + 1
        unit = units[call.unit]
        chained = call.chained and previous is not None and previous.end_op == call.first_op
        records.append(
            UnitRecord(
                index=new, path=call_path(unit.path, k, counts[call.unit]),
                cls=type(unit.module).__name__, is_block=unit.is_block, calls=counts[call.unit],
                first_op=call.first_op, end_op=call.end_op, inputs=call.inputs,
                chain_input=call.chain_input, chain_arg=call.chain_arg,
                chain_output=call.chain_output, output=call.output, chained=chained,
                fwd_time=fwd_time.get(call.serial, 0.0), bwd_time=bwd_time.get(call.serial, 0.0),
                call=k,
            )
        )  # fmt: skip
        previous = call
    return tuple(records), renumber
