"""The recompute mechanism: regions, their saved-tensor holders, and recomputation.

A *region* (a :class:`Frame`) is a stretch of forward computation whose saved
tensors are not kept. While it runs, ``saved_tensors_hooks`` replace every
tensor autograd wants to save by an empty holder (:mod:`gradckpt.engine.holders`). The first time
backward unpacks one of them, the region runs again from its kept inputs
(once per backward pass) and fills all its holders; each value is dropped as
soon as backward has unpacked it.

Nesting follows one rule: **while a region runs its original forward, regions
opened inside it are not regions** (the outer one will rerun them anyway, so
they keep nothing). When the outer region is *recomputed*, the regions met
during that recompute become real: they keep their inputs (and the outputs
their policy saves), and the holders they cover are filled later, by their own
recompute, when backward first needs one of them. This is the schedule of the
rotor dynamic program: a segment is recomputed once, and inside that recompute
each block is either kept or checkpointed again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradckpt.engine import dynamo
from gradckpt.engine.decisions import SAVE, TAG, PolicyContext, as_decision
from gradckpt.engine.handoffs import Handoffs
from gradckpt.engine.holders import (
    DEBUG_TIP,
    CheckpointError,
    Deferred,
    Holder,
    PassId,
    active_frame,
    current_exec_group,
    in_region_forward,
    is_group_id,
    meta,
    region_stack,
    running_gid,
    unpack,
)
from gradckpt.engine.inputs import KeptInputs
from gradckpt.engine.modes import CacheEntry, OpLogMode, PolicyMode, RecomputeMode
from gradckpt.engine.state import ReplayState, capture_state
from gradckpt.engine.writes import StateFn, StateWatch

__all__ = ["CheckpointError", "Frame", "active_frame", "in_region_forward", "tag"]


class _StopRecompute(Exception):
    def __init__(self, frame: Frame) -> None:
        self.frame = frame


#: Recomputes that may run inside one another on a thread (nested regions,
#: ``autograd.grad`` inside checkpointed code). Far above real nesting, far
#: below where Python's recursion limit would break the autograd engine.
MAX_RECOMPUTE_DEPTH = 32


class Frame:
    """One checkpointed region: its kept inputs, holders, policy cache and recompute.

    ``body(inputs)`` reruns the region from the list of its flattened inputs.
    A frame is opened with :meth:`begin` and closed with :meth:`end`, which may
    happen in different Python calls (a region spanning several blocks).

    ``state()`` lists the modules whose buffers its body may write to, which
    its recompute must leave as the forward left them: a frame that knows them
    and keeps no op outputs recomputes with the saved-tensor hooks alone (the
    lean path, :mod:`gradckpt.engine.writes`); one that does not recomputes
    under :class:`~gradckpt.engine.modes.RecomputeMode`, which sees every op.
    ``compiled=True`` marks a body that calls ``torch.compile``d code, to be
    rerun compiled in the recompute (see :mod:`gradckpt.engine.dynamo`); such a
    frame takes no policy.
    """

    def __init__(
        self,
        body: Callable[[list[Any]], Any] | None,
        *,
        policy: Callable[..., Any] | None = None,
        preserve_rng_state: bool = True,
        check_metadata: bool = True,
        early_stop: bool | None = None,
        debug: bool | None = None,
        name: str = "",
        context_fn: Callable[[], tuple[Any, Any]] | None = None,
        compiled: bool = False,
        state: StateFn | None = None,
    ) -> None:
        if compiled and policy is not None:
            raise ValueError("a compiled region cannot take a policy (its ops are not dispatched)")
        self.body = body
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.check_metadata = check_metadata
        self.early_stop = _torch_toggle("_enable_checkpoint_early_stop", early_stop, True)
        debug = _torch_toggle("_checkpoint_debug_enabled", debug, False)
        self.name = name
        self.context_fn = context_fn
        self.compiled = compiled
        self.ran_compiled = False  # the forward ran compiled code: so must the recompute
        self.watch = StateWatch(state) if state is not None else None
        # The forward's writes were aimed at copies by an enclosing recompute's
        # RecomputeMode, so the watch saw none of them: recompute per op as well.
        self.forward_redirected = False
        self.redirecting = False  # this frame's recompute runs under RecomputeMode now
        top = active_frame()
        # Opened during an enclosing region's recompute: holders come from it.
        self.parent: tuple[Frame, PassId] | None = (
            (top[0], top[1]) if top is not None and top[1] is not None else None
        )
        self.slots: list[weakref.ref[Holder] | None] = []
        #: Chunks run in this region's forward: the slot count at a chunk's start ->
        #: the count after each of its slices (:mod:`gradckpt.engine.chunking.slices`).
        self.chunk_spans: dict[int, tuple[int, ...]] = {}
        self.cache: dict[tuple[Any, int], CacheEntry] = {}  # by modes.replay_key
        # id(output) -> (weak reference, replay key, op) of the forward's recomputed
        # ops, for tag(); a plain dict (a WeakIdKeyDictionary costs ~3 us per op).
        self.producers: dict[int, tuple[weakref.ref, tuple[Any, int], Any]] = {}
        self.op_count = 0
        self.forward_completed = False
        self.lenient_count = False
        self.recomputed: set[PassId] = set()
        self.counters: dict[PassId, int] = {}
        self.stops: dict[PassId, int] = {}
        self.forward_log: list[str] | None = [] if debug else None
        self.recompute_log: list[str] | None = None
        self._inputs: KeptInputs | None = None
        self._state: ReplayState | None = None
        self._exit: contextlib.ExitStack | None = None
        self._recompute_context: Any = None
        # A region over several units (a segment) follows what they hand each other.
        self.handoffs: Handoffs | None = None

    # ------------------------------------------------------------------ forward

    def save_inputs(self, flat_inputs: list[Any]) -> None:
        """Keep the region's inputs (tensors by reference; other values as they are)."""
        tensors = [x for x in flat_inputs if isinstance(x, torch.Tensor)]
        self._inputs = KeptInputs(flat_inputs, nested=self.parent is not None)
        self._state = capture_state(tensors, self.preserve_rng_state)

    def begin(self) -> None:
        """Enter the region's forward: saved tensors become holders from here on."""
        stack = contextlib.ExitStack()
        try:
            if not self.compiled:
                # Whatever is compiled inside runs eagerly, as in the recompute.
                stack.enter_context(dynamo.eager())
            forward_context = None
            if self.context_fn is not None:
                forward_context, self._recompute_context = self.context_fn()
            pack = self._pack_forward if self.parent is None else self._pack_nested
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            if self.policy is not None:
                stack.enter_context(PolicyMode(self))
            if self.forward_log is not None:
                stack.enter_context(OpLogMode(self.forward_log))
            if forward_context is not None:
                # Entered last, as torch does: a TorchDispatchMode it holds (SAC's
                # caching mode) is the innermost mode, for code that inspects the stack.
                stack.enter_context(forward_context)
            if self.compiled:
                self.ran_compiled = dynamo.eager_reason() is None
            if self.watch is not None:
                self.forward_redirected = _redirecting_recompute_running()
                self.watch.begin()
            region_stack().append((self, None))
            stack.callback(region_stack().pop)
        except BaseException:
            stack.close()
            raise
        self._exit = stack

    def end(self, exc: BaseException | None = None) -> None:
        """Leave the region's forward (pass the exception if it failed)."""
        exit_stack, self._exit = self._exit, None
        if exit_stack is None:
            return
        exit_stack.close()
        self.producers = {}  # tag() names tensors of a running forward only
        if self.watch is not None:
            # What the forward wrote to (running statistics): its recompute must not.
            self.watch.end()
        if exc is None:
            self.forward_completed = True
            if self._state is not None:
                self._state.forget_unused_host_rngs()
                if self.parent is None:
                    self._state.check_device_not_initialized_inside()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """``begin``/``end`` as a context manager."""
        self.begin()
        try:
            yield
        except BaseException as exc:
            self.end(exc)
            raise
        self.end()

    def _pack_forward(self, x: torch.Tensor) -> Holder:
        holder = Holder(self, meta(x) if self.check_metadata else None)
        self.slots.append(weakref.ref(holder))
        return holder

    def _pack_nested(self, x: torch.Tensor) -> Any:
        parent, gid = self.parent
        holder = parent._fill(gid, Deferred(self), x)
        self.slots.append(weakref.ref(holder) if holder is not None else None)
        parent._maybe_stop(gid)
        return holder if holder is not None else x.detach()

    def note_producer(self, output: torch.Tensor, key: tuple[Any, int], func: Any) -> None:
        """The forward's op ``func`` (replay key ``key``) made ``output``, not kept (for tag)."""
        self.producers[id(output)] = (weakref.ref(output), key, func)

    def _producer(self, tensor: torch.Tensor) -> tuple[tuple[Any, int], Any] | None:
        found = self.producers.get(id(tensor))
        # The id of a dead output may be reused: only the very tensor counts.
        if found is None or found[0]() is not tensor:
            return None
        return found[1], found[2]

    def tag(self, tensor: torch.Tensor, name: str) -> None:
        """A tensor of this region's forward got a name: ask the policy about it."""
        ctx = PolicyContext(index=-1, region=self.name)
        decision = as_decision(self.policy(ctx, TAG, tensor, name), TAG, self.policy)
        found = self._producer(tensor)
        if found is None and tensor._base is not None:
            # A view (a Linear on 3-D input ends in one): keep the op that made its base.
            tensor = tensor._base
            found = self._producer(tensor)
        if decision is SAVE and found is not None:
            key, func = found
            self.cache[key] = CacheEntry(func, tensor)

    # ---------------------------------------------------------------- recompute

    def run_body(self, inputs: list[Any]) -> Any:
        """Rerun the region from its inputs (subclasses replay differently)."""
        return self.body(inputs)

    def hand_to(self, gid: PassId, nested: Frame, count: int) -> None:
        """The next ``count`` holders of recompute ``gid`` get their values from ``nested``
        (a region opened here whose forward is not run: its own recompute fills them)."""
        for _ in range(count):
            holder = self._fill(gid, Deferred(nested), None)
            nested.slots.append(weakref.ref(holder) if holder is not None else None)
            self._maybe_stop(gid)

    def _fill(self, gid: PassId, value: Any, x: torch.Tensor | None) -> Holder | None:
        index = self.counters[gid]
        self.counters[gid] = index + 1
        if index >= len(self.slots):
            if not self.forward_completed:
                # Backward inside the region's own forward: the recompute runs past
                # the point where that backward happened. Nothing to fill.
                self.lenient_count = True
                return None
            raise CheckpointError(
                "gradckpt: trying to save more tensors during recomputation than "
                f"during the original forward pass: region {self.name!r} saved "
                f"{len(self.slots)} in its forward. {DEBUG_TIP}{self._log_tail()}"
            )
        ref = self.slots[index]
        holder = ref() if ref is not None else None
        if holder is None:
            return None  # already consumed by an earlier (partial) backward
        if x is not None and holder.meta is not None and holder.meta != meta(x):
            raise CheckpointError(
                "Recomputed values for the following tensors have "
                f"different metadata than during the forward pass: region {self.name!r} "
                f"recomputed saved tensor #{index} with shape/dtype/device {meta(x)}, but its "
                f"forward saved {holder.meta}. {DEBUG_TIP}{self._log_tail()}"
            )
        holder.values[gid] = value
        return holder

    def _maybe_stop(self, gid: PassId) -> None:
        if self.early_stop and self.counters[gid] > self.stops[gid]:
            raise _StopRecompute(self)

    def _pack_recompute(self, gid: PassId) -> Callable[[torch.Tensor], Any]:
        def pack(x: torch.Tensor) -> Any:
            # Detach only what carries a graph: a tensor without one is handed
            # back as itself (identity and Python attributes kept, as in torch).
            value = x.detach() if x.requires_grad else x
            self._fill(gid, value, x)
            self._maybe_stop(gid)
            return value

        return pack

    def recompute(self, gid: PassId) -> None:
        """Run the region again (once per backward pass) and fill its holders."""
        if gid in self.recomputed:
            return
        # Only a bug could trip these (see holders.unpack): say so rather than
        # recurse until the autograd engine fails with a bare SystemError.
        if running_gid(self) is not None:
            raise CheckpointError(
                f"region {self.name!r} was asked to recompute while its recompute for another "
                "backward pass is running; please report this with the model code."
            )
        depth = sum(1 for _, running in region_stack() if running is not None)
        if depth >= MAX_RECOMPUTE_DEPTH:
            raise CheckpointError(
                f"recomputing region {self.name!r} would make {depth + 1} recomputes run inside "
                f"one another (at most {MAX_RECOMPUTE_DEPTH}); checkpointed regions are recomputing each "
                "other without end. Please report this with the model code."
            )
        self.recomputed.add(gid)
        alive = [i for i, ref in enumerate(self.slots) if ref is not None and ref() is not None]
        if not alive:
            return
        if torch._C._current_graph_task_id() == gid:
            # A backward that reaches only some outputs (retain_graph) leaves the
            # values it did not unpack in the holders: drop them when it ends. (Weakly:
            # a frame whose holders are all gone must be freed, with its inputs, now.)
            ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: (frame := ref()) is not None and frame._release(gid)
            )
        elif is_group_id(gid):
            # Several backward calls share this pass (a GraphExecGroup): forget it
            # when the group object is gone.
            group = current_exec_group()
            if group is not None:
                ref = weakref.ref(self)
                weakref.finalize(
                    group, lambda: (frame := ref()) is not None and frame._release(gid)
                )
        if self.handoffs is not None:
            self.handoffs.check(self.name)
        self.counters[gid] = 0
        self.stops[gid] = alive[-1]
        inputs = self._inputs.get()
        stopped = False
        stack = region_stack()
        stack.append((self, gid))
        if self.forward_log is not None:
            self.recompute_log = []
        per_op = self._needs_recompute_mode()
        try:
            with contextlib.ExitStack() as ctx:
                if self.ran_compiled:
                    self._check_compiled_recompute()
                if not per_op and self.watch is not None:
                    # What the forward wrote to goes back once the recompute ends.
                    ctx.enter_context(self.watch.restoring())
                ctx.enter_context(self._state.replay())
                ctx.enter_context(torch.enable_grad())
                ctx.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(self._pack_recompute(gid), unpack)
                )
                if per_op:
                    # Dynamo runs compiled code eagerly under this mode: the
                    # recompute of an eager region stays eager.
                    ctx.enter_context(RecomputeMode(self))
                    self.redirecting = True
                    if self.recompute_log is not None:
                        ctx.enter_context(OpLogMode(self.recompute_log))
                elif not self.ran_compiled:
                    ctx.enter_context(dynamo.eager())  # eager as its forward, without the mode
                if self._recompute_context is not None:
                    # Innermost, as in torch: SAC's cached mode answers kept ops
                    # first; what it runs goes through RecomputeMode below it.
                    ctx.enter_context(self._recompute_context)
                self.run_body(inputs)
        except _StopRecompute as stop:
            if stop.frame is not self:
                raise
            stopped = True
        finally:
            self.redirecting = False
            stack.pop()
        count = self.counters.pop(gid)
        self.stops.pop(gid)
        if not stopped and count != len(self.slots) and not self.lenient_count:
            raise CheckpointError(
                "A different number of tensors was saved during the "
                f"original forward and recomputation: region {self.name!r} saved {count} "
                f"tensors during its recompute but {len(self.slots)} during its forward. "
                f"{DEBUG_TIP}{self._log_tail()}"
            )

    def _check_compiled_recompute(self) -> None:
        reason = dynamo.eager_reason()
        if reason is not None:
            raise CheckpointError(
                f"region {self.name!r} ran torch.compile'd code in its forward, but its "
                f"recompute would run it eagerly ({reason}), which saves other tensors. "
                "Keep the same compiler stance and TorchDispatchModes around the forward "
                "and the backward."
            )

    def _needs_recompute_mode(self) -> bool:
        """Whether the recompute must see every op (else it runs on the hooks alone).

        Per op: to replay kept outputs (a policy saved some, or ``tag``), to log
        ops for ``debug``, or to aim writes at copies when the region's state is
        not known (or its forward's writes were aimed so already). Compiled code
        writes inside its graph, where no mode could aim them: its region always
        restores its state instead.
        """
        if self.ran_compiled:
            return False
        return bool(
            self.cache
            or self.recompute_log is not None
            or self.watch is None
            or self.forward_redirected
        )

    def _release(self, gid: PassId) -> None:
        """Forget backward pass ``gid`` (called when it ends)."""
        self.recomputed.discard(gid)
        for ref in self.slots:
            holder = ref() if ref is not None else None
            if holder is not None:
                holder.values.pop(gid, None)

    def _log_tail(self) -> str:
        if self.forward_log is None:
            return ""
        fwd = "\n  ".join(self.forward_log) or "(none)"
        rec = "\n  ".join(self.recompute_log or []) or "(none)"
        return (
            "\nDetected non-determinism while running activation checkpointing (debug=True): "
            "compare the two op sequences.\n"
            f"Ops in the forward:\n  {fwd}\nOps in the recompute:\n  {rec}"
        )


def _redirecting_recompute_running() -> bool:
    """Whether a recompute under RecomputeMode runs on this thread (it aims writes at copies)."""
    return any(gid is not None and frame.redirecting for frame, gid in region_stack())


def _torch_toggle(name: str, explicit: bool | None, default: bool) -> bool:
    """A per-call keyword if given, else torch's global toggle if set, else the default.

    ``torch.utils.checkpoint.set_checkpoint_early_stop`` and
    ``set_checkpoint_debug_enabled`` set module globals; they are read when the
    region opens, as torch reads them.
    """
    if explicit is not None:
        return bool(explicit)
    from torch.utils import checkpoint as torch_checkpoint

    toggled = getattr(torch_checkpoint, name, None)
    return bool(toggled) if toggled is not None else default


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Name a tensor so name-based policies can keep it; returns the tensor itself.

    Inside a region whose policy saves ``name`` (e.g. ``policies.save_names``),
    the op that produced ``tensor`` is kept instead of recomputed. Elsewhere it
    does nothing.

    Example:
        >>> h = gradckpt.tag(attn(x), "attn_out")
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"gradckpt.tag needs a non-empty string name, got {name!r}")
    top = active_frame()
    if top is not None and top[1] is None and top[0].policy is not None:
        top[0].tag(tensor, name)
    return tensor
