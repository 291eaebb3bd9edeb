"""One recorded pass of ``loss_fn().backward()``, and the unrecorded steps that time it.

A pass runs under a :class:`~gradckpt.profiling.recorder.StepRecorder` with each
unit's forward wrapped to note its calls, autograd's saved-tensor hooks, and
(once) the allocator's memory events; it checks what ``loss_fn`` returned.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode

from gradckpt.measure.allocator import AllocatorTracker
from gradckpt.measure.beside import BesideReading, graph_nodes, malloc_in_use
from gradckpt.measure.timing import low_estimate, work_clock
from gradckpt.profiling.accumulation import InPlaceCheck, node_boundaries
from gradckpt.profiling.recorder import RecordMode, StepRecorder
from gradckpt.profiling.records import ProfileError  # defined there: the recorder raises it too
from gradckpt.profiling.replay import spec_sink
from gradckpt.profiling.state import StepState
from gradckpt.profiling.sub_calls import enter_sub, exit_sub, inner_candidates
from gradckpt.profiling.units import Unit
from gradckpt.profiling.workspace import allocator_events, malloc_probe, op_workspaces, step_peak

__all__ = ["ProfileError", "run_pass", "time_plain_step"]


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

    def sub_marker(path: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def forward_noted(*args: Any, **kwargs: Any) -> Any:
            if not recorder.active or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            call = enter_sub(recorder, path, args, kwargs)
            out = forward(*args, **kwargs)
            exit_sub(recorder, call, out)
            return out

        return forward_noted

    try:
        for path, module in inner_candidates(units):
            had_own = "forward" in module.__dict__
            installed.append((module, module.__dict__.get("forward"), had_own))
            module.forward = sub_marker(path, module.forward)
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


def run_pass(
    units: list[Unit],
    loss_fn: Callable[[], torch.Tensor],
    state: StepState,
    *,
    plain: bool,
    device: str = "cpu",
    allocator: torch.device | None = None,
) -> StepRecorder:
    """Run ``loss_fn`` once (and backward when ``plain``) under a recorder; returns it.

    Example:
        >>> recorder = run_pass(units, loss_fn, StepState(model), plain=True)
    """
    recorder = StepRecorder(units, keep_saved=plain)
    InPlaceCheck.prepare()  # measured once per process, before the pass it serves
    hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)
    # With ``allocator``, the pass also runs under the allocator's memory events
    # (each op in its own span): the step's allocator peak and per-op workspace.
    with (
        allocator_events(allocator) as events,
        malloc_probe(allocator if events is not None else None) as probe,
        _unit_markers(units, recorder),
        hooks,
        RecordMode(recorder, device, mark_ops=events is not None, probe=probe,
                   specs=spec_sink() if plain else None),  # fmt: skip
    ):
        recorder.active = True
        before = None
        if plain and detect_fake_mode() is not None:  # what it holds beside is read here
            gc.collect()  # garbage freed during the pass would hide what the step takes
            before = malloc_in_use()
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
        if before is not None:  # fake: no tensor allocated, what malloc took is all beside
            recorder.beside_bytes = _beside(before)
            for node in graph_nodes(loss.grad_fn):  # and as backward runs (its own objects)
                node.register_prehook(lambda _, r=recorder, b=before: _most_beside(r, b))
        recorder.forward = False
        if plain:
            # Gradients accumulate as in the plain step (in place where it can).
            with node_boundaries(loss, recorder):
                loss.backward()
            # The model's parameters now (under fake tensors, the fake ones in their place).
            grads = (
                recorder.sid_of(p.grad) for p in state.model.parameters() if p.grad is not None
            )
            recorder.grad_storages = tuple(sorted({sid for sid in grads if sid >= 0}))
        del loss
        recorder.active = False
    recorder.watcher.close()
    if events is not None and allocator is not None:
        recorder.workspaces = op_workspaces(recorder, events, allocator)
        recorder.allocator_peak = step_peak(recorder, events)
    return recorder


def _beside(before: int | None) -> int:
    """What malloc holds now beyond ``before``: under fake tensors, autograd's graph and
    Python objects (:mod:`gradckpt.measure.beside`), the recorder's records too; 0 unread."""
    now = malloc_in_use() if before is not None else None
    if before is None or now is None:
        return 0
    return max(0, now - before)


def _most_beside(recorder: StepRecorder, before: int) -> None:
    recorder.beside_bytes = max(recorder.beside_bytes, _beside(before))


def time_plain_step(
    loss_fn: Callable[[], torch.Tensor],
    guard: StepState,
    repeats: int,
    device: str = "cpu",
    recorded: StepRecorder | None = None,
) -> float:
    """The least time of ``repeats`` unrecorded steps on the op times' clock, in seconds.

    With ``recorded`` (the allocator-measured plain pass, on the CPU) the last step
    also reads what malloc held beside the step's tensors at the forward's end,
    under the allocator's events (:class:`~gradckpt.measure.beside.BesideReading`: a
    recorded pass would count the recorder's own records): ``recorded.beside_bytes``
    is set, and that step is timed only when it is the one step.
    """
    clock = work_clock(device)  # the clock the op times are on: overheads are their ratio
    times = []
    for i in range(repeats):
        read = recorded is not None and i == repeats - 1 and device == "cpu"
        guard.reset()
        start = clock()
        if read:
            assert recorded is not None
            with AllocatorTracker(torch.device("cpu")) as tracker:
                beside = BesideReading(tracker)
                loss = loss_fn()
                beside.forward_done(loss)
                loss.backward()
                del loss
            recorded.beside_bytes = beside.bytes()
        else:
            loss_fn().backward()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if not read or repeats == 1:
            times.append(clock() - start)
    return low_estimate(times)
