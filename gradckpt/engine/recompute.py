"""The recompute half of a region: filling its holders by running it again.

A :class:`~gradckpt.engine.frame.Frame` keeps its inputs and leaves empty
holders in the forward; :class:`Recomputing` (a base of ``Frame``) is what fills
them: the first time backward unpacks one, :meth:`Recomputing.recompute` runs
the region's body again from its kept inputs under the saved-tensor hooks that
fill the holders in order, once per backward pass, and stops after the last
holder still alive (early stop). A region opened inside that recompute takes
its holders from it (:meth:`Recomputing.hand_to`, ``Frame._pack_nested``).
The recompute runs on the hooks alone unless it must see every op
(:meth:`Recomputing._needs_recompute_mode`): kept op outputs to replay, a
debug log, or writes to aim at copies.

Example:
    >>> frame.recompute(gid)  # from holders.unpack, the first time backward needs one
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gradckpt.engine import dynamo
from gradckpt.engine.holders import (
    DEBUG_TIP,
    CheckpointError,
    Deferred,
    Holder,
    PassId,
    current_exec_group,
    is_group_id,
    meta,
    region_stack,
    running_gid,
    unpack,
)
from gradckpt.engine.modes import OpLogMode, RecomputeMode

if TYPE_CHECKING:
    from gradckpt.engine.frame import Frame

__all__ = ["MAX_RECOMPUTE_DEPTH", "Recomputing"]


class _StopRecompute(Exception):
    def __init__(self, frame: Frame) -> None:
        self.frame = frame


#: Recomputes that may run inside one another on a thread (nested regions,
#: ``autograd.grad`` inside checkpointed code). Far above real nesting, far
#: below where Python's recursion limit would break the autograd engine.
MAX_RECOMPUTE_DEPTH = 32


class Recomputing:
    """The recompute half of :class:`~gradckpt.engine.frame.Frame` (its base): the state it
    reads (``slots``, ``counters``, ``stops``, ``recomputed``, ``_inputs``, ``_state``, ...)
    is the frame's, set in ``Frame.__init__``."""

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
