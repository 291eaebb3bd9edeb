"""A fake profile with what its ops' real runs measured: workspace where it occurs, real times.

:func:`gradckpt.profiling.replay.replay_ops` runs each distinct op of a fake
profile on real tensors; this puts the readings into the profile the planner
plans from: each run op's workspace on that op alone (the simulator holds it
while the op runs, as for a real profile), its measured time, and the plain
peak simulated again with them.

Example:
    >>> planned = with_replayed(fake, replay_ops(fake, specs.plain(), model, room))
"""

from __future__ import annotations

from dataclasses import replace

from gradckpt.planning.simulation.simulate import simulate
from gradckpt.planning.solving.solvers import none_plan
from gradckpt.profiling.records import Profile, retimed
from gradckpt.profiling.replay import Replayed

__all__ = ["with_replayed"]


def with_replayed(profile: Profile, replayed: Replayed) -> Profile:
    """``profile`` with each run op's workspace and time; ops not run keep their estimate,
    scaled by the ratio of the run ops' measured to estimated times (their sum).

    Example:
        >>> planned = with_replayed(fake, replay_ops(fake, specs.plain(), model, room))
    """
    readings = replayed.readings
    if not readings:
        return profile
    estimated = sum(profile.ops[i].time for i in readings)
    measured = sum(r.seconds for r in readings.values())
    scale = measured / estimated if estimated > 0 else 1.0
    ops = tuple(
        replace(op, workspace=readings[op.index].workspace) if op.index in readings else op
        for op in profile.ops
    )
    timed = retimed(
        replace(profile, ops=ops),
        lambda op: readings[op.index].seconds if op.index in readings else op.time * scale,
    )
    return replace(timed, measured_peak_bytes=simulate(timed, none_plan(timed)).peak_bytes)
