"""Record one training step at the dispatch level.

A :class:`StepRecorder` sees every ATen op (forward and backward, with its wall
time, FLOPs and the storages it creates), every tensor autograd saves (and when
backward unpacks and releases it), every storage free, and every call of a
unit's forward. Run with ``keep_saved=False`` it drops saved tensors on the
spot: that forward-only pass shows when each storage would die if nothing were
kept, which is what a checkpointed region does.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from gradckpt.engine.modes import counts_as_op, written_args
from gradckpt.measure.allocator import close_mark, open_mark
from gradckpt.measure.outside import RssProbe, needs_replay, replay_growth
from gradckpt.measure.storages import StorageWatcher, storage_key
from gradckpt.measure.timing import work_clock
from gradckpt.profiling.accumulation import InPlaceCheck
from gradckpt.profiling.opaque import check_output_seen
from gradckpt.profiling.records import NEVER
from gradckpt.profiling.replay import SpecSink, op_spec
from gradckpt.profiling.sub_calls import SubCall
from gradckpt.profiling.units import Unit

__all__ = ["RecordedOp", "StepRecorder", "UnitCall"]


class RecordedOp(NamedTuple):
    """One ATen op as the recorder saw it (a named tuple: made on every op, so it stays cheap).

    ``elapsed`` is this pass's time of the kernel alone; the profile's op time
    pools it over passes (see :class:`gradckpt.profiling.records.OpRecord`).
    """

    index: int
    name: str
    backward: bool
    unit: int  # -1: outside every unit
    local: int  # position inside its unit's region (-1 in backward or outside)
    elapsed: float
    flops: int
    outputs: tuple[int, ...]  # storage ids it created
    position: int


@dataclass
class UnitCall:
    unit: int  # the module's index among the units
    first_op: int
    # This call's number among all unit calls of the step, in the order they began:
    # what ops and saved tensors are attributed to (a module called twice is two
    # units of the profile, one per call).
    serial: int = -1
    end_op: int = -1
    inputs: tuple[int, ...] = ()
    chain_input: int = -1
    chain_arg: int = -1
    chain_output: int = -1
    output: int = -1
    chained: bool = False
    input_shape: tuple[int, ...] = ()
    # Autograd sequence numbers of the nodes its forward made: [seq_start, seq_end),
    # how backward ops are told to belong to the unit.
    seq_start: int = 0
    seq_end: int = 0


@dataclass
class _Storage:
    nbytes: int
    producer: int
    alloc: int
    free: int = NEVER
    free_ops_done: int = -1  # forward ops completed when freed (-1: not freed in forward)
    mutated: bool = False
    shape: tuple[int, ...] = ()  # of the op output that made it (rows: what chunking slices)


@dataclass
class _Pack:
    storage: int
    unit: int
    ops_done: int
    position: int
    shape: tuple[int, ...]
    dtype: str
    unpack: int = NEVER
    release: int = NEVER


class _Saved:
    """What autograd holds for a saved tensor while recording; notes its release."""

    __slots__ = ("pack", "recorder", "tensor")

    def __init__(self, recorder: StepRecorder, pack: int, tensor: torch.Tensor | None) -> None:
        self.recorder = recorder
        self.pack = pack
        self.tensor = tensor

    def __del__(self) -> None:
        self.recorder._released(self.pack)


def _flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    formula = flop_registry.get(getattr(func, "_overloadpacket", None))
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not accept this overload's arguments
        return 0


@dataclass
class StepRecorder:
    """Collects ops, storages, saved tensors and unit calls of one step."""

    units: list[Unit]
    keep_saved: bool = True
    time_ops: bool = True
    ops: list[RecordedOp] = field(default_factory=list)
    storages: list[_Storage] = field(default_factory=list)
    packs: list[_Pack] = field(default_factory=list)
    calls: list[UnitCall] = field(default_factory=list)
    #: Calls of modules inside blocks, with their op spans (gradckpt.profiling.sub_calls).
    sub_calls: list[SubCall] = field(default_factory=list)
    forward: bool = True
    forward_ops: int = 0
    position: int = 0
    active: bool = False
    #: Per-op workspace bytes and the step's allocator peak, when the pass measured them.
    workspaces: list[int] | None = None
    allocator_peak: int | None = None
    #: Per-op peak resident growth (op index -> bytes), when a malloc probe ran
    #: (``gradckpt.measure.outside``): what the kernel took outside the allocator too.
    resident_growth: dict[int, int] = field(default_factory=dict)
    #: Per replayed op, its settled run's growth (``gradckpt.measure.outside.replay_growth``).
    settled_growth: dict[int, int] = field(default_factory=dict)
    #: Storages that are the parameters' ``.grad`` after backward (ids, ascending).
    grad_storages: tuple[int, ...] = ()
    #: Bytes malloc held beside the step's tensors at the forward's end (0: not read).
    beside_bytes: int = 0
    #: True between a backward node's post-hook and the next one's pre-hook, where
    #: the engine accumulates gradients (``gradckpt.profiling.accumulation``).
    between: bool = False

    def __post_init__(self) -> None:
        self.watcher = StorageWatcher(on_alloc=self._alloc, on_free=self._free)
        self._live: dict[int, int] = {}
        self._new: list[int] = []
        self._stack: list[UnitCall] = []
        self._last_output: weakref.ref | None = None
        self._last_end = -1
        self._seq_starts: list[int] = []
        self._seq_calls: list[UnitCall] = []
        self._serials = 0

    # --------------------------------------------------------------- positions

    def _next(self) -> int:
        self.position += 2
        return self.position

    def sid_of(self, t: torch.Tensor) -> int:
        try:
            return self._live.get(storage_key(t), -1)
        except (RuntimeError, NotImplementedError, TypeError):
            return -1

    def _alloc(self, key: int, nbytes: int) -> None:
        sid = len(self.storages)
        self._live[key] = sid
        self.storages.append(_Storage(nbytes, len(self.ops), self.position))
        self._new.append(sid)

    def _free(self, key: int) -> None:
        sid = self._live.pop(key, None)
        if sid is None:
            return
        record = self.storages[sid]
        record.free = self._next() if self.active else NEVER
        if self.forward and self.active:
            record.free_ops_done = self.forward_ops

    # --------------------------------------------------------------------- ops

    def record_op(self, func: Any, args: Any, kwargs: Any, out: Any, elapsed: float) -> None:
        index = len(self.ops)
        position = self._next()
        if self.forward:
            call = self._stack[-1] if self._stack else None
            unit = call.serial if call is not None else -1
            local = index - call.first_op if call is not None else -1
            self.forward_ops += 1
        else:
            unit, local = self._backward_unit(), -1
        self._new = []
        self.watcher.observe(func, out)
        if self._new:
            self._note_shapes(out)
        if self.forward:
            self._note_writes(func, args, kwargs, index)
        self.ops.append(
            RecordedOp(index, str(func), not self.forward, unit, local, elapsed,
                       _flops(func, args, kwargs, out), tuple(self._new), position)
        )  # fmt: skip

    def _note_shapes(self, out: Any) -> None:
        outs = (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        for t in outs:
            if isinstance(t, torch.Tensor):
                sid = self.sid_of(t)
                if sid >= 0 and not self.storages[sid].shape:
                    self.storages[sid].shape = tuple(t.shape)

    def _note_writes(self, func: Any, args: Any, kwargs: Any, index: int) -> None:
        positions, names = written_args(func)
        targets = [args[i] for i in positions if i < len(args)]
        targets += [kwargs[n] for n in names if n in kwargs]
        for t in targets:
            if isinstance(t, torch.Tensor):
                sid = self.sid_of(t)
                if sid >= 0 and self.storages[sid].producer != index:
                    self.storages[sid].mutated = True

    def _backward_unit(self) -> int:
        node = torch._C._current_autograd_node()
        if node is None or not self._seq_starts:
            return -1
        seq = node._sequence_nr()
        i = bisect.bisect_right(self._seq_starts, seq) - 1
        if i >= 0:
            call = self._seq_calls[i]
            if call.seq_start <= seq < call.seq_end:
                return call.serial
        return -1

    # ------------------------------------------------------------ saved tensors

    def pack(self, x: torch.Tensor) -> _Saved:
        call = self._stack[-1] if self._stack and self.forward else None
        pid = len(self.packs)
        self.packs.append(
            _Pack(
                self.sid_of(x), call.serial if call else -1, self.forward_ops, self._next(),
                tuple(x.shape), str(x.dtype).removeprefix("torch."),
            )
        )  # fmt: skip
        return _Saved(self, pid, x.detach() if self.keep_saved else None)

    def unpack(self, saved: _Saved) -> torch.Tensor:
        record = self.packs[saved.pack]
        if record.unpack == NEVER:
            record.unpack = self._next()
        if saved.tensor is None:
            raise RuntimeError("internal: the forward-only profiling pass cannot run backward")
        return saved.tensor

    def _released(self, pid: int) -> None:
        if self.active and pid < len(self.packs) and self.packs[pid].release == NEVER:
            self.packs[pid].release = self._next()

    # ------------------------------------------------------------------- units

    def enter_unit(self, unit: int, args: tuple, kwargs: dict) -> UnitCall:
        flat, _ = tree_flatten((args, kwargs))
        call = UnitCall(unit=unit, first_op=len(self.ops), serial=self._serials)
        self._serials += 1
        tensors = [(i, x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        call.inputs = tuple(s for _, x in tensors if (s := self.sid_of(x)) >= 0)
        previous = self._last_output() if self._last_output is not None else None
        for i, x in tensors:
            if previous is not None and x is previous:
                call.chain_arg, call.chain_input = i, self.sid_of(x)
                call.chained = self._last_end == call.first_op
                break
        else:
            if tensors:
                call.chain_arg, call.chain_input = tensors[0][0], self.sid_of(tensors[0][1])
        if tensors:  # what apply's shape check compares: the first tensor argument
            call.input_shape = tuple(tensors[0][1].shape)
        call.seq_start = torch._C._autograd._get_sequence_nr()
        self._stack.append(call)
        return call

    def exit_unit(self, call: UnitCall, out: Any) -> None:
        self._stack.pop()
        call.end_op = len(self.ops)
        call.seq_end = torch._C._autograd._get_sequence_nr()
        unit = self.units[call.unit]
        flat = check_output_seen(out, unit.path, type(unit.module).__name__)
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                call.chain_output, call.output = i, self.sid_of(x)
                self._last_output = weakref.ref(x)
                break
        else:
            self._last_output = None
        self._last_end = call.end_op
        self.calls.append(call)
        if call.seq_end > call.seq_start:
            i = bisect.bisect_right(self._seq_starts, call.seq_start)
            self._seq_starts.insert(i, call.seq_start)
            self._seq_calls.insert(i, call)


#: Allocator spans of an op's replays (``gradckpt.measure.outside``) are numbered from here.
REPLAY_MARKS = 1 << 40


class RecordMode(TorchDispatchMode):
    """Feeds every counted op to a :class:`StepRecorder`, timing the kernel alone.

    With ``mark_ops`` each op runs inside an allocator span numbered by its op
    index (:func:`gradckpt.measure.allocator.open_mark`), so that a surrounding
    :class:`~gradckpt.measure.MemoryEvents` tells its workspace; the span opens
    outside the timed call. With ``probe`` each op's peak resident growth is read
    too (malloc-level memory the allocator's events miss), also outside the timing.
    With ``specs`` each op's arguments are kept as specs (a fake pass's, to run
    the ops for real afterwards: :mod:`gradckpt.profiling.replay`).
    """

    def __init__(
        self,
        recorder: StepRecorder,
        device: str = "cpu",
        *,
        mark_ops: bool = False,
        probe: RssProbe | None = None,
        specs: SpecSink | None = None,
    ) -> None:
        super().__init__()
        self.recorder = recorder
        self.clock = work_clock(device)  # CPU: thread CPU time, robust to a shared machine
        self.mark_ops = mark_ops
        self.probe = probe
        # A fake pass's ops as specs, by op index, to run for real afterwards.
        self.sink = specs
        self.specs = specs.new_pass() if specs is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not counts_as_op(func):
            return func(*args, **kwargs)
        if self.recorder.between and InPlaceCheck.applies(func, args, kwargs):
            # The engine's buffer accumulation, which the plain step does in place
            # (under a mode the engine cannot): see gradckpt.profiling.accumulation.
            func = torch.ops.aten.add_.Tensor
        index = len(self.recorder.ops)
        handle = open_mark(index) if self.mark_ops else None
        resident = self.probe.start() if self.probe is not None else 0
        try:
            start = self.clock()
            out = func(*args, **kwargs)
            elapsed = self.clock() - start
        finally:
            grown = self.probe.stop(resident) if self.probe is not None else 0
            if handle is not None:
                close_mark(handle)
        if self.probe is not None:
            self.recorder.resident_growth[index] = self._worst_growth(
                index, func, args, kwargs, out, grown
            )
        self.recorder.record_op(func, args, kwargs, out, elapsed)
        if self.specs is not None:
            assert self.sink is not None
            self.specs.append(op_spec(func, args, kwargs, self.sink.names))
        return out

    def _worst_growth(
        self, index: int, func: Any, args: Any, kwargs: Any, out: Any, grown: int
    ) -> int:
        """The op's resident growth: of its run, or when that took memory beyond its
        outputs, the worst of its replays. A first run can fault in pages no later run
        does (resnet's convolution backward: up to 1.2 MiB over malloc's count, where
        its replays agree with malloc), and the replays see how the kernel's threads
        overlap their buffers. Replays run in their own allocator span
        (:data:`REPLAY_MARKS` + index): the first run's outputs are still held, and
        what the replays allocate on top of them is no part of the step's peak."""
        assert self.probe is not None
        if not needs_replay(func, grown, out):
            return grown
        handle = open_mark(REPLAY_MARKS + index) if self.mark_ops else None
        try:
            worst, self.recorder.settled_growth[index] = replay_growth(
                self.probe, func, args, kwargs
            )
            return worst
        finally:
            if handle is not None:
                close_mark(handle)
