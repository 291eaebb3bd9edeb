"""A stage's step time measured as the pipeline runs it: every stage computing at once.

A stage's profile times its plain step while its rank is alone in whatever the
other ranks happen to be doing at that moment (recording their own passes,
running the planner's DP, waiting). In the pipeline's steady state every rank
computes its stage at the same time, and on shared cores (a CPU machine, one
thread per rank) a step's CPU time depends on what runs beside it: the first
stage's profile of the benchmark's GPT read 28 ms per micro-batch where the run
measured 22 ms (+30%), while the last stage's, timed a moment earlier, read
within 8%. That was no part of the stage's work: the same profiles taken
alone in one process agree within a few percent with the stage's forward and
backward as ``PipelineStage`` runs them.

So every rank, in lock-step (lined up by a collective, then as many steps as fill
about a second, long enough to span the scheduler's swings), times its stage's plain
micro-batch again with gradients accumulating from the
second step on (as the schedule accumulates them over its micro-batches), and
the profile's op times are scaled to that time (:func:`retimed_to`): the
recompute a plan adds is priced at the same rate as the step it is added to.

Example:
    >>> seconds = time_together(stage_mod, loss_fn, steps=5)  # every rank calls it
    >>> prof = retimed_to(prof, seconds)
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradckpt.measure.timing import work_clock
from gradckpt.profiling.records import Profile, retimed
from gradckpt.profiling.state import StepState

__all__ = ["TOGETHER_SECONDS", "in_process_group", "retimed_to", "time_together"]

#: Wall seconds every rank times micro-batches for, at once (at least 3 micro-batches each,
#: after one untimed, which makes the gradients): 5 steps of 20 ms read up to 24% off the
#: run's median on a loaded 2-core machine, where the swings last a good part of a second.
TOGETHER_SECONDS = 1.0
_MIN_STEPS, _MAX_STEPS = 3, 200


def in_process_group(group: Any = None) -> bool:
    """Whether a process group of more than one rank is up (then stages are timed together).

    Example:
        >>> in_process_group()  # a plain script: no
        False
    """
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def time_together(
    module: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    *,
    seconds: float = TOGETHER_SECONDS,
    group: Any = None,
) -> float:
    """The median seconds of a plain micro-batch, every rank of ``group`` timing its own stage
    at once, as many micro-batches as fill ``seconds`` on the rank that wants the fewest
    (at least 3); a collective: every rank calls it. Gradients, buffers and RNG are as
    before on return.

    Example:
        >>> time_together(stage_mod, stage_loss_fn(stage_mod, (x_mb,)))
        0.0213
    """
    import torch.distributed as dist

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    clock = work_clock(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    state = StepState(module)
    state.reset()
    try:
        wall = time.perf_counter()
        loss = loss_fn()  # untimed: makes the gradients the timed steps accumulate into
        state.adopt_graph(loss)
        loss.backward()
        del loss
        sync()
        # One count for every rank (the least wanted): a stage whose step has collectives
        # of its own (FSDP inside it) must run as many steps as its peers.
        wanted = math.ceil(seconds / max(time.perf_counter() - wall, 1e-6))
        count = torch.tensor([min(max(wanted, _MIN_STEPS), _MAX_STEPS)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)  # also lines the ranks up
        times: list[float] = []
        for _ in range(int(count.item())):
            start = clock()
            loss_fn().backward()
            sync()
            times.append(clock() - start)
    finally:
        state.restore()
    return statistics.median(times)


def retimed_to(profile: Profile, seconds: float) -> Profile:
    """``profile`` with every op's time and the step's scaled so the plain step takes ``seconds``.

    Example:
        >>> retimed_to(prof, 2 * prof.step_time).step_time == 2 * prof.step_time
        True
    """
    if profile.step_time <= 0 or seconds <= 0:
        return profile
    factor = seconds / profile.step_time
    scaled = retimed(profile, lambda op: op.time * factor)
    return dataclasses.replace(scaled, step_time=seconds)
