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

This module is the forward half (opening a region, packing holders, naming
tensors for a policy); the recompute half, a base of :class:`Frame`, is
:mod:`gradckpt.engine.recompute`.
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
    CheckpointError,
    Deferred,
    Holder,
    PassId,
    active_frame,
    in_region_forward,
    meta,
    region_stack,
    unpack,
)
from gradckpt.engine.inputs import KeptInputs
from gradckpt.engine.modes import CacheEntry, OpLogMode, PolicyMode
from gradckpt.engine.recompute import Recomputing
from gradckpt.engine.state import ReplayState, capture_state
from gradckpt.engine.writes import StateFn, StateWatch

__all__ = ["CheckpointError", "Frame", "active_frame", "in_region_forward", "tag"]


class Frame(Recomputing):
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
