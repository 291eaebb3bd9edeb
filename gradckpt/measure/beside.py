"""What a CPU step takes from malloc beside the allocator's blocks: autograd's graph, Python.

torch's allocator reports tensor storage (and kernel workspace) to the profiler;
autograd's nodes, the engine's and the step's Python objects come from malloc
too, and a budget counted at malloc's level holds them. On a CPU step they are
small (a 106-op ResNet step: 84 KiB beside 32.1 MiB; a 620-op GPT: 218 KiB
beside 19.7 MiB) but not nothing next to a plan that fills its budget.

glibc's ``mallinfo2`` (2.33+) gives the bytes in use now, all arenas and
mmapped blocks together (within 0.1% of a preloaded malloc counter). Read at
the end of a measured step's forward, when autograd's graph is whole, beside
the allocator's level at the same moment
(:meth:`~gradckpt.measure.AllocatorTracker.note_level`), the difference above
the step's start is what the step held beside its tensors.

Example:
    >>> before = malloc_in_use()
    >>> loss = loss_fn()
    >>> malloc_in_use() - before  # tensors and everything beside them
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import TYPE_CHECKING

import torch

from gradckpt.measure.memory import format_bytes

if TYPE_CHECKING:
    from gradckpt.measure.allocator import AllocatorTracker

__all__ = [
    "BesideReading", "MallInfo2", "TensorsOnlyWarning", "graph_nodes", "mall_info",
    "malloc_in_use", "tracker_bytes", "warn_tensors_only",
]  # fmt: skip


class TensorsOnlyWarning(UserWarning):
    """A byte budget was planned for the step's tensors alone (:func:`warn_tensors_only`):
    on the CPU, what malloc holds beside them is not inside it.

    Example:
        >>> warnings.simplefilter("error", TensorsOnlyWarning)  # refuse such budgets instead
    """


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def mall_info(libc: ctypes.CDLL) -> MallInfo2 | None:
    """``mallinfo2()`` (None without it: glibc before 2.33, or another C library)."""
    try:
        fn = libc.mallinfo2  # the older mallinfo's int fields overflow
    except AttributeError:
        return None
    fn.restype = MallInfo2
    return fn()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not taken back, now (None where glibc cannot say).

    Example:
        >>> malloc_in_use() > 0
        True
    """
    libc = _libc()
    info = mall_info(libc) if libc is not None else None
    return None if info is None else info.uordblks + info.hblkhd


class BesideReading:
    """What a step measured under ``tracker`` held beside the allocator's blocks, at most.

    Make it inside the tracker's region before the step (``since``: malloc's bytes in
    use at an earlier moment to count from, :func:`malloc_in_use`; default: now), call
    :meth:`forward_done` with the loss once the forward has returned, read
    :meth:`bytes` after the region:
    0 off the CPU, without glibc, or when nothing was noted. Malloc's bytes and the
    allocator's level are noted together at the forward's end and as each backward
    node starts: a recompute in backward builds graph and Python objects of its own
    (a ResNet plan's step: 65 KiB at the forward's end, up to 212 KiB in backward).

    Example:
        >>> with AllocatorTracker() as at:
        ...     beside = BesideReading(at)
        ...     loss = loss_fn(); beside.forward_done(loss); loss.backward()
        >>> beside.bytes()
    """

    def __init__(
        self, tracker: AllocatorTracker, since: int | None = None, *, less_kept: bool = False
    ) -> None:
        self.tracker = tracker
        self.less_kept = less_kept
        self.start = malloc_in_use() if tracker.device.type == "cpu" else None
        self.before = self.start
        if self.before is not None and since is not None:
            # From an earlier moment (a planning call's start): what the caller holds
            # while the step runs (its profile, plans, specs) counts as beside it too.
            self.before = since
        self.readings: list[int] = []  # malloc's bytes in use at each noted moment

    def forward_done(self, loss: torch.Tensor | None = None) -> None:
        """Note the forward's end, and hook every node of ``loss``'s graph to note its start."""
        if self.before is None or self.readings:
            return
        self._note()
        if loss is not None and loss.grad_fn is not None:
            for node in graph_nodes(loss.grad_fn):
                node.register_prehook(self._node_starts)

    def _node_starts(self, grad_outputs: object) -> None:
        self._note()

    def _note(self) -> None:
        now = malloc_in_use()
        if now is not None:
            self.readings.append(now)
            self.tracker.note_level()

    def bytes(self) -> int:
        """The most bytes beside the allocator's at a noted moment, above the step's start
        (or ``since``); with ``less_kept``, less what the step left held beside its tensors
        (read when called: call it right after the tracker's region).

        What a step keeps after it ends can be a library's one-time buffer (MKL keeps
        ~10 MiB from the process's first large matrix product): ``tune``'s steps at
        micro-batch sizes no training runs would take it for theirs.
        """
        if self.before is None or self.start is None or not self.readings:
            return 0
        pairs = zip(self.readings, self.tracker.levels)
        most = max((now - self.before - level for now, level in pairs if level is not None),
                   default=0)  # fmt: skip
        end = malloc_in_use() if self.less_kept else None
        kept = end - self.start - self.tracker.end_bytes if end is not None else 0
        return max(0, most - max(0, kept))


def graph_nodes(root: object) -> list:
    """Every autograd node reachable from ``root`` (each once).

    Example:
        >>> len(graph_nodes(loss.grad_fn)) > 0
        True
    """
    seen: set[int] = set()
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return out


def tracker_bytes(events: int) -> int:
    """What an :class:`~gradckpt.measure.AllocatorTracker` itself takes from malloc while it
    records ``events`` allocations and frees: torch's profiler keeps each event (measured
    once per process: 24 KiB to start and ~150 bytes an event on torch 2.13), so a step
    measured under it holds that much more than the same step unmeasured. 0 without glibc.

    Example:
        >>> tracker_bytes(1000) > tracker_bytes(10)
        True
    """
    base, per_event = _tracker_cost()
    return base + int(per_event * events) if base or per_event else 0


@functools.cache
def _tracker_cost() -> tuple[int, float]:
    """(bytes at the first event, bytes per further event) of a tracker session, measured."""
    from gradckpt.measure.allocator import AllocatorTracker

    x = torch.zeros(64)
    grown = []
    for n in (4, 404):  # allocations (each an allocation event and a free event)
        with AllocatorTracker():
            before = malloc_in_use()
            for _ in range(n):
                y = x + 1
                del y
            after = malloc_in_use()
        if before is None or after is None:
            return 0, 0.0
        grown.append(after - before)
    per_event = max(0.0, (grown[1] - grown[0]) / (2 * 400))
    return max(0, grown[0]), per_event


def warn_tensors_only(budget_bytes: int, holds_both: int | None, stacklevel: int = 3) -> None:
    """Warn that a byte budget is held for the step's tensors only.

    A budget at the edge of what any checkpointing reaches (torch's every-block peak,
    measured at the allocator) leaves no room for what the step and planning take
    from malloc beside the tensors on the CPU; on a GPU that memory is the host's and
    the budget counts the tensors alone. Planning then holds the budget at the
    allocator, as a GPU counts it, and says so (``holds_both``: the least budget that
    holds the tensors and what is beside them, when known).

    Example:
        >>> warn_tensors_only(4 << 20, 5 << 20)  # UserWarning naming 5.00 MiB
    """
    both = f"; {format_bytes(holds_both, round_up=True)} holds both" if holds_both else ""
    warnings.warn(
        f"gradckpt: the budget of {format_bytes(budget_bytes)} holds the step's tensors at "
        "the allocator, not with them what the step and planning take from malloc beside "
        f"them on the CPU (autograd's graph, Python objects){both}. Planned for the tensors "
        "alone, as a GPU's memory counts them; raise the budget to hold the process's "
        "whole memory.",
        TensorsOnlyWarning,
        stacklevel=stacklevel,
    )
