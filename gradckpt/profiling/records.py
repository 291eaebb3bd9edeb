"""The ``Profile``: one measured training step, as plain data.

Time in a profile is a *position* on the event line of the plain step: every
counted op, storage free, save, unpack and release of a saved tensor gets the
next even number. Odd numbers fall between events (a storage freed "after op
k" in the forward-only pass is placed just before op k+1). The simulator
predicts a plan's memory by moving allocations and frees on this line.

Two levels of memory are recorded. Storages are what ATen ops return (the
dispatch level, what :class:`~gradckpt.measure.MemoryTracker` counts). An op's
``workspace`` is what the allocator held *beyond* that while the op ran
(convolution columns, library scratch space): the allocator's peak during the
op minus its level before the op minus the op's new storages, measured with
:class:`~gradckpt.measure.MemoryEvents`; on CPU plus what the kernel took from
malloc outside the allocator (:mod:`gradckpt.measure.outside`).
``measured_peak_bytes`` is the allocator's peak of the plain step (what an OOM
sees; on CPU with those outside bytes on top of the ops that took them);
``tracker_peak_bytes`` the dispatch-level one.

Fake profiles cannot run kernels, so their workspace is zero (no estimate):
their peak is the tensor-level one. Version 1 files (before workspace) load
with zero workspace and equal peaks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradckpt._versioned import check_header
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.profiling.sub_calls import SubCallRecord
from gradckpt.profiling.training_step import TrainingStep
from gradckpt.profiling.units import CALL_MARK, module_path

__all__ = [
    "NEVER", "OpRecord", "PackRecord", "Profile", "ProfileError", "StorageRecord", "UnitRecord",
    "retimed",
]  # fmt: skip

PROFILE_VERSION = 2


class ProfileError(RuntimeError):
    """The step could not be profiled (bad loss_fn, non-deterministic op sequence)."""


#: Position of "not within the step" (alive at the end, never unpacked, ...).
NEVER = 1 << 60


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One ATen op of the step.

    ``unit`` is the unit whose region the op runs in (forward) or whose
    autograd node runs it (backward); -1 outside every unit. ``local`` is the
    op's position inside its unit's region: what a policy sees as ``ctx.index``.
    """

    index: int
    name: str
    backward: bool
    unit: int
    local: int
    time: float
    flops: int
    outputs: tuple[int, ...]
    position: int
    #: Bytes the allocator held beyond the op's new storages while it ran (0 if none).
    workspace: int = 0


@dataclass(frozen=True, slots=True)
class StorageRecord:
    """One storage created during the step.

    ``natural_free`` is where the forward would free it if autograd kept
    nothing (NEVER when it outlives the forward, or was made in backward).
    ``mutated``: written in place after it was made (unsafe to keep for replay).
    """

    id: int
    nbytes: int
    producer: int
    alloc: int
    free: int
    natural_free: int
    mutated: bool
    #: Shape of the op output that made it (() in older profiles): its leading
    #: dimensions tell a per-token storage, which chunking slices.
    shape: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PackRecord:
    """One tensor autograd saved for backward during the forward."""

    id: int
    storage: int  # -1: not created in the step (a parameter, an input)
    unit: int
    ops_done: int  # forward ops completed when it was saved
    position: int
    unpack: int
    release: int
    shape: tuple[int, ...] = ()
    dtype: str = ""


@dataclass(frozen=True, slots=True)
class UnitRecord:
    """A module whose forward can be made a checkpointed region.

    ``chained``: its chain input is exactly the previous unit's output, with no
    op in between, so the two can share one multi-unit region.
    """

    index: int
    path: str
    cls: str
    is_block: bool
    calls: int
    first_op: int
    end_op: int
    inputs: tuple[int, ...]
    chain_input: int  # storage id of the chain input, -1 if none
    chain_arg: int  # flat position of the chain input among the call's arguments
    chain_output: int  # flat position of the tensor handed to the next unit
    output: int  # storage id of that tensor, -1 if not created here
    chained: bool
    fwd_time: float
    bwd_time: float
    #: Which call of its module this unit is (0-based; ``calls`` in all, per step).
    call: int = 0

    @property
    def module_path(self) -> str:
        """The module this unit calls (its path without the call number)."""
        return module_path(self.path)

    @property
    def plannable(self) -> bool:
        # A record of a module called several times that is not one call of it (an
        # older profile's, whose ops mix all calls) cannot be planned per call.
        per_call = self.calls == 1 or CALL_MARK in self.path
        return per_call and self.end_op > self.first_op


@dataclass(frozen=True)
class Profile:
    """A measured (or, with ``fake=True``, estimated) training step.

    Example:
        >>> prof = gradckpt.profile(model, loss_fn)
        >>> prof.plain_peak_bytes, len(prof.units)
    """

    ops: tuple[OpRecord, ...]
    storages: tuple[StorageRecord, ...]
    packs: tuple[PackRecord, ...]
    units: tuple[UnitRecord, ...]
    forward_ops: int
    end: int
    param_bytes: int
    step_time: float
    measured_peak_bytes: int
    fingerprint: str
    fake: bool = False
    device: str = "cpu"
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: Dispatch-level peak: parameters + the most live storage ops created.
    tracker_peak_bytes: int = 0
    #: What ``measured_peak_bytes`` and op workspaces come from: "allocator" (measured
    #: at the allocator) or "tensors" (fake profile, old file, or another profiler was
    #: running: workspace unknown, taken as zero).
    peak_level: str = "tensors"
    #: What gradckpt's engine adds per region, recomputed op, policy op and saved tensor.
    engine_costs: EngineCosts = field(default_factory=EngineCosts)
    #: Storages that are the parameters' gradients at the end of the step (made in
    #: backward, alive at its end); what stays resident under gradient accumulation.
    grad_storages: tuple[int, ...] = ()
    #: Bytes held through the whole forward and backward besides parameters and buffers:
    #: optimizer state, and gradients when they are resident (see :attr:`step`).
    resident_bytes: int = 0
    #: A peak outside the forward and backward that no plan changes: the optimizer
    #: step's (parameters, gradients, state and the step's temporaries); 0: not counted.
    floor_bytes: int = 0
    #: The training step folded into this profile
    #: (:func:`gradckpt.planning.solving.whole_step.with_training_step`); None: forward and
    #: backward of one micro-batch only.
    step: TrainingStep | None = None
    #: When block discovery found no repeated blocks: what it considered and how to name
    #: them (``blocks=``), for the message of a budget no plan meets; "" otherwise.
    blocks_note: str = ""
    #: Repeated modules that hold the blocks discovery chose (finer blocks inside them
    #: covered their code): named by the budget error when the peak lies outside every unit.
    block_parents: tuple[str, ...] = ()
    #: A fake profile for another device than this machine's CPU: the host's time per
    #: op it assumed, the least any op costs there (0: none assumed; see
    #: :func:`gradckpt.profiling.fake.with_estimated_times`).
    host_op_seconds: float = 0.0
    #: CPU with glibc: bytes the step held from malloc beside its tensors at the end of
    #: the forward (autograd's graph, Python objects: :mod:`gradckpt.measure.beside`), as
    #: the recorded plain pass read them; a budget counted at malloc's level holds them
    #: too, so ``fit`` plans the tensors for the budget less this. 0: not read.
    beside_bytes: int = 0
    #: Calls of modules inside blocks (attentions, MLPs) and their op spans: where the
    #: planner looks for token-wise layers to chunk (:mod:`gradckpt.profiling.sub_calls`);
    #: () in profiles from before they were recorded.
    sub_calls: tuple[SubCallRecord, ...] = ()
    version: int = field(default=PROFILE_VERSION)

    @property
    def blocks(self) -> tuple[UnitRecord, ...]:
        return tuple(u for u in self.units if u.is_block)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the parameters' gradients the step makes (each storage once)."""
        return sum(self.storages[i].nbytes for i in self.grad_storages)

    @property
    def forward_time(self) -> float:
        return sum(op.time for op in self.ops[: self.forward_ops])

    def unit_ops(self, unit: UnitRecord) -> tuple[OpRecord, ...]:
        """The forward ops of ``unit``'s region, in order."""
        return self.ops[unit.first_op : unit.end_op]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["step"] = self.step.to_json() if self.step is not None else None
        data["kind"] = "gradckpt.Profile"
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if data.get("kind") == "gradckpt.Profile" and data.get("version") == 1:
            # Version 1 had no workspace: zero for every op, one peak.
            data = {
                **data, "version": PROFILE_VERSION, "peak_level": "tensors",
                "tracker_peak_bytes": data.get("measured_peak_bytes", 0),
            }  # fmt: skip
        check_header(data, "gradckpt.Profile", PROFILE_VERSION, "profile the model again")
        return cls(
            ops=tuple(OpRecord(**{**o, "outputs": tuple(o["outputs"])}) for o in data["ops"]),
            storages=tuple(
                StorageRecord(**{**s, "shape": tuple(s.get("shape", ()))}) for s in data["storages"]
            ),
            packs=tuple(PackRecord(**{**p, "shape": tuple(p["shape"])}) for p in data["packs"]),
            units=tuple(UnitRecord(**{**u, "inputs": tuple(u["inputs"])}) for u in data["units"]),
            forward_ops=data["forward_ops"],
            end=data["end"],
            param_bytes=data["param_bytes"],
            step_time=data["step_time"],
            measured_peak_bytes=data["measured_peak_bytes"],
            fingerprint=data["fingerprint"],
            fake=data["fake"],
            device=data["device"],
            input_shapes=tuple((n, tuple(s)) for n, s in data["input_shapes"]),
            tracker_peak_bytes=data["tracker_peak_bytes"],
            peak_level=data["peak_level"],
            engine_costs=EngineCosts.from_json(data.get("engine_costs")),
            grad_storages=tuple(data.get("grad_storages", ())),
            resident_bytes=data.get("resident_bytes", 0),
            floor_bytes=data.get("floor_bytes", 0),
            step=TrainingStep.from_json(data["step"]) if data.get("step") else None,
            blocks_note=data.get("blocks_note", ""),
            block_parents=tuple(data.get("block_parents", ())),
            host_op_seconds=data.get("host_op_seconds", 0.0),
            beside_bytes=data.get("beside_bytes", 0),
            sub_calls=tuple(_sub_call(c) for c in data.get("sub_calls", ())),
            version=data["version"],
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))


def _sub_call(data: dict[str, Any]) -> SubCallRecord:
    shapes = {k: tuple(data.get(k, ())) for k in ("input_shape", "output_shape")}
    return SubCallRecord(**{**data, **shapes})


def retimed(profile: Profile, time_of: Callable[[OpRecord], float]) -> Profile:
    """``profile`` with each op's time replaced by ``time_of(op)``, unit and step times summed again.

    Example:
        >>> fused = retimed(prof, lambda op: 0.0 if op.flops == 0 else op.time)
    """
    ops = tuple(dataclasses.replace(op, time=time_of(op)) for op in profile.ops)
    fwd: dict[int, float] = {}
    bwd: dict[int, float] = {}
    for op in ops:
        times = bwd if op.backward else fwd
        times[op.unit] = times.get(op.unit, 0.0) + op.time
    units = tuple(
        dataclasses.replace(u, fwd_time=fwd.get(u.index, 0.0), bwd_time=bwd.get(u.index, 0.0))
        for u in profile.units
    )
    return dataclasses.replace(profile, ops=ops, units=units, step_time=sum(op.time for op in ops))
