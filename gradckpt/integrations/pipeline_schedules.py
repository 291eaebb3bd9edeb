"""Which pipeline schedules gradckpt plans, and how many micro-batches each keeps in flight.

A stage's activation memory is not one micro-batch's: it holds the saved
tensors of every micro-batch whose forward has run and whose backward has not.
``torch.distributed.pipelining`` schedules, per stage ``s`` of ``P`` with ``M``
micro-batches:

* ``ScheduleGPipe``: every forward, then every backward: ``M`` in flight on every stage.
* ``Schedule1F1B``: stage ``s`` runs ``min(M, P - s)`` forwards before its first
  backward (torch's ``warmup_chunks``), then one forward per backward: ``min(M, P - s)``.

Schedules with several stages per rank (``ScheduleInterleaved1F1B``,
``ScheduleLoopedBFS``, the zero-bubble and DualPipe schedules) are refused: their
stages share one rank's memory and the zero-bubble ones split backward into input
and weight gradients, which gradckpt's profile does not model.

Example:
    >>> in_flight("1f1b", stage_index=0, num_stages=4, n_microbatches=8)
    4
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEDULES", "in_flight", "schedule_name", "schedule_shape"]

#: Schedules planned, by the name gradckpt uses (torch class name -> name).
SCHEDULES = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}

_REFUSED = {
    "ScheduleInterleaved1F1B": "virtual stages (several stages on one rank)",
    "ScheduleLoopedBFS": "virtual stages (several stages on one rank)",
    "ScheduleInterleavedZeroBubble": "zero-bubble backward split in input and weight gradients",
    "ScheduleZBVZeroBubble": "zero-bubble backward split in input and weight gradients",
    "ScheduleDualPipeV": "DualPipe's two-direction virtual stages",
}


def _refuse(name: str) -> ValueError:
    why = _REFUSED.get(name, "a schedule gradckpt does not know")
    return ValueError(
        f"gradckpt plans pipeline stages under ScheduleGPipe and Schedule1F1B; {name} is not "
        f"supported ({why}). Use one of those, or plan each stage yourself with "
        "gradckpt.plan at a budget that leaves room for the micro-batches it keeps in flight."
    )


def schedule_name(schedule: Any) -> str:
    """``"gpipe"`` or ``"1f1b"`` for a schedule given by name, class or instance.

    Raises:
        ValueError: any other schedule (the message says why and what to do).

    Example:
        >>> schedule_name(torch.distributed.pipelining.Schedule1F1B)
        '1f1b'
    """
    if isinstance(schedule, str):
        key = schedule.lower().replace("schedule", "").replace("_", "")
        for cls_name, name in SCHEDULES.items():
            if key == name or schedule == cls_name:
                return name
        for cls_name in _REFUSED:
            if key == cls_name.lower().replace("schedule", ""):
                raise _refuse(cls_name)
        raise ValueError(
            f"unknown pipeline schedule {schedule!r}: name one of {sorted(SCHEDULES.values())} "
            "or pass a torch.distributed.pipelining schedule (class or instance)"
        )
    cls = schedule if isinstance(schedule, type) else type(schedule)
    for klass in cls.__mro__:
        if klass.__name__ in SCHEDULES:
            return SCHEDULES[klass.__name__]
        if klass.__name__ in _REFUSED:
            raise _refuse(klass.__name__)
    raise _refuse(cls.__name__)


def schedule_shape(schedule: Any) -> tuple[str, int, int, int]:
    """``(name, stage_index, num_stages, n_microbatches)`` of a schedule instance.

    Example:
        >>> schedule_shape(Schedule1F1B(stage, 4))
        ('1f1b', 0, 2, 4)
    """
    name = schedule_name(schedule)
    stage = getattr(schedule, "_stage", None)
    if stage is None or not hasattr(schedule, "_n_microbatches"):
        raise ValueError(
            "pass stage_index, num_stages and n_microbatches with a schedule given by name or class"
        )
    return name, int(stage.stage_index), int(stage.num_stages), int(schedule._n_microbatches)


def in_flight(schedule: Any, stage_index: int, num_stages: int, n_microbatches: int) -> int:
    """Micro-batches stage ``stage_index`` holds activations for at its peak.

    Example:
        >>> [in_flight("1f1b", s, 4, 8) for s in range(4)]
        [4, 3, 2, 1]
        >>> in_flight("gpipe", 3, 4, 8)
        8
    """
    name = schedule_name(schedule)
    if num_stages < 1 or not 0 <= stage_index < num_stages:
        raise ValueError(
            f"stage_index must be in [0, num_stages); got {stage_index} of {num_stages}"
        )
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}")
    if name == "gpipe":
        return n_microbatches
    return min(n_microbatches, num_stages - stage_index)
