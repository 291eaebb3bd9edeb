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

Profiles run one at a time in a process (models fitted from several threads take
turns here): torch's profiler and the RNG resets are process-wide.

Before each pass the RNG, buffers and gradients are reset to what they were on
entry, and they are restored exactly at the end (:mod:`gradckpt.profiling.state`):
also the gradients of leaves outside the model the step reaches, and the
buffers of modules outside the model it calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from gradckpt.measure.exclusive import MEASURING
from gradckpt.profiling import adapters
from gradckpt.profiling.assemble import assemble, device_of
from gradckpt.profiling.block_cover import nested, settle_nested
from gradckpt.profiling.fake import (
    AnsweredScalars,
    check_fake_device,
    fake_device_of,
    fake_model,
    with_estimated_times,
)
from gradckpt.profiling.passes import ProfileError, run_pass, time_plain_step
from gradckpt.profiling.records import Profile
from gradckpt.profiling.state import StepState
from gradckpt.profiling.unit_costs import capturing_call, with_unit_times
from gradckpt.profiling.units import (
    BlockSpec,
    Unit,
    block_candidates,
    blocks_not_found,
    called_blocks,
    find_blocks,
    find_units,
)
from gradckpt.profiling.workspace import step_device

# How a pass runs is gradckpt.profiling.passes, how passes become a Profile is
# gradckpt.profiling.assemble; ProfileError is re-exported from here as always.
__all__ = ["ProfileError", "profile"]


def profile(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    *,
    blocks: BlockSpec = None,
    repeats: int = 3,
    fake: bool = False,
    device: str | torch.device | None = None,
    answer_scalars: bool = False,
    host_op_seconds: float | None = None,
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
        repeats: plain passes to take per-op times from (the least over them). On
            CPU the first pass also runs the malloc probe, which trims the heap and
            fills new blocks, so its op times run high: with ``repeats=1`` they
            are all there is, and plans follow that noise; keep at least 2.
        fake: run under ``FakeTensorMode``: nothing is allocated (plan a model too
            big for this machine, e.g. built on the meta device); op times are
            estimated from FLOPs and bytes.
        device: with ``fake``, the device the fake tensors claim to be on (default:
            where the parameters are; "cpu" for a meta model).
        answer_scalars: with ``fake``, answer the step's reads of tensor values
            (``.item()``) with placeholders instead of failing
            (:class:`~gradckpt.profiling.fake.AnsweredScalars`): for callers that
            check the plan on real steps.
        host_op_seconds: with ``fake`` on a device other than the CPU (a GPU), the
            host's time to issue one op, the least an op costs there (default: this
            machine's per-op time on tiny ops, measured; the profile and its plans
            state it). Short-op models are bound by it on a GPU.

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
    # One profile at a time per process: torch's profiler and the RNG resets
    # between passes are process-wide (gradckpt.measure.exclusive).
    with MEASURING, adapters.preparing(model, fake=fake):
        return _profile_prepared(
            model, loss_fn, blocks, repeats, fake, device, answer_scalars, host_op_seconds
        )


def _profile_prepared(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    blocks: BlockSpec,
    repeats: int,
    fake: bool,
    device: str | torch.device | None,
    answer_scalars: bool = False,
    host_op_seconds: float | None = None,
) -> Profile:
    found = find_blocks(model, blocks)
    guard = StepState(model)

    def discovered() -> tuple[list[Unit], str, tuple[str, ...]]:
        # Repeated classes at several depths: the step's forward says which level
        # covers its compute. No repeated class: a module the step calls several times
        # (a shared layer) is the block. Still none: the step is planned by top-level
        # parts only; say why, for the budget error.
        paths, parents = found, []
        candidates = block_candidates(model) if blocks is None else []
        if nested(candidates):
            guard.reset()
            paths, parents = settle_nested(model, candidates, loss_fn)
        if blocks is None and not paths:
            guard.reset()
            paths = called_blocks(model, loss_fn)
        note = blocks_not_found(model) if blocks is None and not paths else ""
        return find_units(model, paths), note, tuple(parents)

    try:
        if fake:
            where = torch.device(device) if device is not None else fake_device_of(model)
            check_fake_device(where)
            answers = AnsweredScalars() if answer_scalars else contextlib.nullcontext()
            with fake_model(model, where) as mode, mode, answers:
                units, note, parents = discovered()
                guard.reset()
                forward_only = run_pass(units, loss_fn, guard, plain=False)
                guard.reset()
                passes = [run_pass(units, loss_fn, guard, plain=True)]
            fake_profile = assemble(model, units, forward_only, passes, 0.0)
            timed = with_estimated_times(fake_profile, where, host_op_seconds)
            return replace(timed, blocks_note=note, block_parents=parents)
        where = device_of(model)
        with guard.watching_modules():  # buffers of modules outside the model, too
            units, note, parents = discovered()
            guard.reset()
            forward_only = run_pass(units, loss_fn, guard, plain=False, device=where)
            passes = []
            for i in range(max(1, repeats)):
                guard.reset()
                measured = step_device(model) if i == 0 else None  # the allocator, once
                passes.append(
                    run_pass(units, loss_fn, guard, plain=True, device=where, allocator=measured)
                )
        # Timed without the watch: a global hook on every module call counts in the step
        # (an empty one: 4% of a short-op GPT's), and the passes above met every module.
        with capturing_call(units) as call:  # one block's arguments, to time it alone
            step_time = time_plain_step(
                loss_fn, guard, max(1, repeats), where,
                passes[0] if passes[0].allocator_peak is not None else None,
            )  # fmt: skip
    finally:
        guard.restore()
    real = with_unit_times(assemble(model, units, forward_only, passes, step_time), call)
    return replace(real, blocks_note=note, block_parents=parents)
