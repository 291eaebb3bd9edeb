"""Real kernels for a fake profile: each distinct op run once more, alone, on real tensors.

A fake profile (:mod:`gradckpt.profiling.fake`) runs no kernel: it knows every
storage's size but no op's workspace (a convolution's columns, oneDNN's
reorders: 25% of a U-Net's plain peak on a 2-thread CPU) and no op's time. The
fake route of ``fit`` used to learn the workspace from one real step and add
it to every prediction, so each unit was priced as if it held all of it.

Here the fake pass keeps each op's arguments as specs (shapes, strides, dtypes;
the model's parameters by name), and afterwards every distinct op (the same
function on the same specs: a repeated block's ops are run once) runs on real
tensors, alone, under the allocator's memory events:

* its **workspace** is what the allocator held beyond the op's outputs while it
  ran (as a real profile measures it, :mod:`gradckpt.profiling.workspace`),
  priced on that op only;
* its **time** is the least of :data:`RUNS` runs on the profile's clock, in place
  of the FLOPs-and-bytes estimate (ops not run keep the estimate, scaled by
  how the run ones compared with theirs).

What one run holds is its inputs, outputs and workspace: every plan holds at
least that while the op runs (the op's inputs and outputs are live in any
plan), so a run that would not fit the budget says no plan does, and which op
sets that floor. Inputs are random (integers zero, so indices stay in range);
the model's parameters and buffers are used as they are unless the op writes
them. Ops whose outputs depend on values (``nonzero``), that take a generator
or an opaque object, or whose shapes are symbolic, are not run.

Example:
    >>> with capturing_specs(model) as specs:
    ...     fake = gradckpt.profile(model, loss_fn, fake=True)
    >>> replayed = replay_ops(fake, specs.plain(), model, budget - fake.param_bytes)
    >>> planned = with_replayed(fake, replayed)  # gradckpt.planning.solving.rescale
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradckpt.measure.allocator import MemoryEvents, close_mark, open_mark
from gradckpt.measure.timing import low_estimate, work_clock
from gradckpt.profiling.records import Profile

__all__ = [
    "RUNS", "OpReading", "OpSpec", "ParamRef", "Replayed", "SpecSink", "TensorSpec",
    "capturing_specs", "op_spec", "replay_ops", "spec_sink",
]  # fmt: skip

#: Runs of each distinct op; its time is the least (the first builds oneDNN's primitives).
RUNS = 3


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as the fake pass saw it: what a real one needs to be made."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        if not self.shape or 0 in self.shape:
            return self.dtype.itemsize * (0 if 0 in self.shape else 1)
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return extent * self.dtype.itemsize

    def make(self) -> torch.Tensor:
        """A real tensor of this spec: random values (floats), zeros (integers, booleans)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if self.dtype.is_floating_point or self.dtype.is_complex:
            t.uniform_(-1, 1) if not self.dtype.is_complex else t.copy_(torch.randn_like(t))
        else:
            t.zero_()
        return t


@dataclass(frozen=True)
class ParamRef:
    """A parameter or buffer of the model, by its name (the real one is used when run)."""

    name: str
    spec: TensorSpec


@dataclass(frozen=True)
class OpSpec:
    """One op's function and arguments, tensors as specs; ``key`` tells identical ops."""

    func: Any
    tree: Any
    leaves: tuple[Any, ...]
    writes: frozenset[int] = frozenset()  # flat positions of arguments the op writes

    @property
    def key(self) -> tuple:
        return (self.func, self.tree, self.leaves)

    @property
    def input_bytes(self) -> int:
        """Bytes of the tensors a run makes (parameters it reads are not made)."""
        return sum(
            leaf.nbytes if isinstance(leaf, TensorSpec) else leaf.spec.nbytes
            for i, leaf in enumerate(self.leaves)
            if isinstance(leaf, TensorSpec) or (isinstance(leaf, ParamRef) and i in self.writes)
        )


@dataclass
class SpecSink:
    """Where the fake passes' specs go: one list per plain pass (the profile's op order)."""

    names: dict[int, str] = field(default_factory=dict)
    passes: list[list[OpSpec | None]] = field(default_factory=list)
    model: nn.Module | None = None

    def new_pass(self) -> list[OpSpec | None]:
        if self.model is not None and not self.names:  # the model holds its fake tensors now
            tables = [*self.model.named_parameters(remove_duplicate=False),
                      *self.model.named_buffers(remove_duplicate=False)]  # fmt: skip
            self.names = {id(t): name for name, t in tables}
        self.passes.append([])
        return self.passes[-1]

    def plain(self) -> list[OpSpec | None]:
        """The specs of the last plain pass (what the profile's ops are), by op index."""
        return self.passes[-1] if self.passes else []


_SINK: contextvars.ContextVar[SpecSink | None] = contextvars.ContextVar("spec_sink", default=None)


@contextlib.contextmanager
def capturing_specs(model: nn.Module) -> Iterator[SpecSink]:
    """Fake profiles of ``model`` made inside keep their ops' specs in the sink yielded.

    Example:
        >>> with capturing_specs(model) as specs:
        ...     fake = gradckpt.profile(model, loss_fn, fake=True)
        >>> len(specs.plain()) == len(fake.ops)
        True
    """
    sink = SpecSink(model=model)
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def spec_sink() -> SpecSink | None:
    """The sink a plain fake pass records its specs into (None: not capturing)."""
    return _SINK.get()


def op_spec(func: Any, args: Any, kwargs: Any, names: dict[int, str]) -> OpSpec | None:
    """``func``'s call as an :class:`OpSpec` (None: it cannot be run again from specs).

    Example:
        >>> op_spec(torch.ops.aten.relu.default, (fake_x,), {}, {}).leaves[0].shape
    """
    if torch.Tag.data_dependent_output in getattr(func, "tags", ()):
        return None
    flat, tree = tree_flatten((args, kwargs))
    leaves: list[Any] = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            spec = _tensor_spec(value)
            if spec is None:
                return None
            name = names.get(id(value))
            leaves.append(ParamRef(name, spec) if name is not None else spec)
        elif value is None or isinstance(value, (bool, int, float, str, torch.dtype,
                                                 torch.device, torch.layout,
                                                 torch.memory_format)):  # fmt: skip
            leaves.append(value)
        else:  # a generator, an opaque object, a symbolic size
            return None
    return OpSpec(func, tree, tuple(leaves), _written(func, flat, tree))


def _tensor_spec(t: torch.Tensor) -> TensorSpec | None:
    if t.layout != torch.strided:
        return None
    try:
        shape = tuple(int(n) for n in t.shape)
        stride = tuple(int(s) for s in t.stride())
    except (TypeError, RuntimeError):  # symbolic
        return None
    return TensorSpec(shape, stride, t.dtype, t.device.type, t.requires_grad)


def _written(func: Any, flat: list[Any], tree: Any) -> frozenset[int]:
    """Flat positions of the tensors ``func`` writes (by its schema's alias annotations)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return frozenset()
    marks = [object() for _ in flat]
    args, kwargs = tree_unflatten(marks, tree)
    where = {id(m): i for i, m in enumerate(marks)}
    out = set()
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for leaf in tree_flatten(value)[0]:
            if id(leaf) in where:
                out.add(where[id(leaf)])
    return frozenset(out)


@dataclass(frozen=True)
class OpReading:
    """One distinct op run for real: its workspace, least time, and what the run held."""

    workspace: int
    seconds: float
    held: int  # inputs made + outputs + workspace: what any plan holds while the op runs


@dataclass(frozen=True)
class Replayed:
    """Per op index of the profile, its reading (ops not run are absent), and the ops that
    did not fit ``room`` (index, bytes the run needed) — the floor no plan goes under."""

    readings: dict[int, OpReading]
    too_big: tuple[tuple[int, int], ...] = ()
    skipped: int = 0


def replay_ops(
    profile: Profile, specs: Sequence[OpSpec | None], model: nn.Module, room_bytes: int
) -> Replayed:
    """Run each distinct op of ``profile`` on real tensors (see the module docstring).

    ``room_bytes``: what a run may hold beside the resident parameters (the budget
    less them). A run whose inputs and outputs alone exceed it is not made; one whose
    workspace took it over is reported in ``too_big``.
    """
    if len(specs) != len(profile.ops):
        return Replayed({}, skipped=len(profile.ops))
    groups: dict[tuple, list[int]] = {}
    skipped = 0
    for i, spec in enumerate(specs):
        if spec is None or not _runnable(spec):
            skipped += 1
            continue
        groups.setdefault(spec.key, []).append(i)
    readings: dict[int, OpReading] = {}
    too_big: list[tuple[int, int]] = []
    clock = work_clock(profile.device)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for members in sorted(groups.values(), key=lambda m: _known(profile, specs, m[0])):
            first = members[0]
            known = _known(profile, specs, first)
            if known > room_bytes:
                too_big.append((first, known))
                continue
            reading = _run(specs[first], model, clock, known - specs[first].input_bytes)  # type: ignore[union-attr]
            if reading is None:
                skipped += len(members)
                continue
            if reading.held > room_bytes:
                too_big.append((first, reading.held))
            for i in members:
                readings[i] = reading
    return Replayed(readings, tuple(too_big), skipped)


def _runnable(spec: OpSpec) -> bool:
    devices = {leaf.device for leaf in spec.leaves if isinstance(leaf, TensorSpec)}
    return all(d == "cpu" or (d == "cuda" and torch.cuda.is_available()) for d in devices)


def _known(profile: Profile, specs: Sequence[OpSpec | None], i: int) -> int:
    spec = specs[i]
    assert spec is not None
    return spec.input_bytes + sum(profile.storages[s].nbytes for s in profile.ops[i].outputs)


def _run(spec: OpSpec, model: nn.Module, clock: Any, output_bytes: int) -> OpReading | None:
    try:
        leaves = [_real(leaf, i in spec.writes, model) for i, leaf in enumerate(spec.leaves)]
    except (AttributeError, RuntimeError, TypeError):  # a name no longer on the model
        return None
    made = spec.input_bytes
    times = []
    workspace = 0
    try:
        for run in range(RUNS):
            args, kwargs = tree_unflatten(leaves if run == 0 else _fresh(leaves, spec), spec.tree)
            if run == 0:
                with MemoryEvents(torch.device(_device(spec))) as events:
                    handle = open_mark(0)
                    start = clock()
                    out = spec.func(*args, **kwargs)
                    times.append(clock() - start)
                    close_mark(handle)
                    del out
                span = events.spans().get(0)
                if span is not None:
                    workspace = max(0, span.peak - span.before + span.loose - output_bytes)
                continue
            start = clock()
            out = spec.func(*args, **kwargs)
            times.append(clock() - start)
            del out
    except Exception:  # values the op refuses (a shape check on data), an unsupported kernel
        return None
    return OpReading(workspace, low_estimate(times), made + output_bytes + workspace)


def _device(spec: OpSpec) -> str:
    for leaf in spec.leaves:
        if isinstance(leaf, TensorSpec):
            return leaf.device
        if isinstance(leaf, ParamRef):
            return leaf.spec.device
    return "cpu"


def _real(leaf: Any, written: bool, model: nn.Module) -> Any:
    if isinstance(leaf, TensorSpec):
        return leaf.make()
    if isinstance(leaf, ParamRef):
        real = _named(model, leaf.name).detach()
        return real.clone() if written else real
    return leaf


def _fresh(leaves: list[Any], spec: OpSpec) -> list[Any]:
    """The leaves again, with fresh copies of those the op writes (in-place ops change them)."""
    return [
        leaf.clone() if i in spec.writes and isinstance(leaf, torch.Tensor) else leaf
        for i, leaf in enumerate(leaves)
    ]


def _named(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    t = module._parameters.get(attr)
    if t is None:
        t = module._buffers[attr]
    return t
