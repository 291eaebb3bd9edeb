"""Plans per input shape: a set of plans keyed by the shape of the model call, and the
proof that lets a smaller shape run under a larger shape's plan.

A plan is made for one step at one shape; its predicted peak holds only there.
The key of a call (:class:`~gradckpt.planning.plans.call_key.ShapeKey`, made by
:func:`~gradckpt.planning.plans.call_key.shape_key`; importable from here too) is
what identifies "the same shape" cheaply on every call. A :class:`PlanSet` maps
keys to plans made under one budget and saves them as one versioned JSON file;
single-plan files still load into a one-plan set.

Example:
    >>> plans = gradckpt.plan(model, loss_fn, "3GiB", shapes=[128, 256, 512])
    >>> plans.save("plans.json"); plans = gradckpt.PlanSet.load("plans.json")
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

from gradckpt._versioned import check_header
from gradckpt.planning.plans.call_key import (
    CallsKey,
    Key,
    ShapeKey,
    TensorSig,
    as_written,
    key_from_json,
    shape_key,
)
from gradckpt.planning.plans.plan import Plan
from gradckpt.profiling.records import Profile

__all__ = [
    "PLANSET_VERSION",
    "CallsKey",
    "Key",
    "PlanSet",
    "ShapeKey",
    "TensorSig",
    "as_written",
    "load_plans",
    "proves_monotone",
    "same_event_line",
    "shape_key",
]

PLANSET_VERSION = 1


@dataclass(frozen=True)
class PlanSet:
    """Plans for one model under one budget, keyed by the shape of the model call.

    ``entries`` hold ``(key, plan)`` pairs; a key of None marks a plan loaded from a
    single-plan file, whose call shape was not recorded.

    Example:
        >>> plans = gradckpt.plan(model, loss_fn, "3GiB", shapes=[128, 512])
        >>> plans.get(gradckpt.planning.plans.planset.shape_key((), batch)).predicted_peak_bytes
    """

    entries: tuple[tuple[Key | None, Plan], ...]
    version: int = PLANSET_VERSION

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a plan set holds at least one plan")
        fingerprints = {plan.fingerprint for _, plan in self.entries}
        if len(fingerprints) != 1:
            raise ValueError(
                f"a plan set is for one model; got fingerprints {sorted(fingerprints)}"
            )
        keys = [k for k, _ in self.entries]
        if len(set(keys)) != len(keys):
            raise ValueError("a plan set holds one plan per shape; a shape is listed twice")

    @property
    def fingerprint(self) -> str:
        return self.entries[0][1].fingerprint

    @property
    def budget_bytes(self) -> int | None:
        return self.entries[0][1].budget_bytes

    @property
    def plans(self) -> dict[Key | None, Plan]:
        return dict(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[tuple[Key | None, Plan]]:
        return iter(self.entries)

    def get(self, key: Key) -> Plan | None:
        """The plan made for exactly ``key``, or None."""
        return self.plans.get(key)

    def bounding(self, key: Key) -> tuple[Key, Plan] | None:
        """The smallest planned shape that bounds ``key`` in every dimension, with its plan."""
        found = [(k, p) for k, p in self.entries if k is not None and key.bounded_by(k)]
        return min(found, key=lambda kp: kp[0].numel()) if found else None  # fewest elements

    def summary(self) -> str:
        """One line per shape: predicted peak against the budget."""
        from gradckpt.measure.memory import format_bytes

        lines = []
        for key, plan in self.entries:
            where = key.describe() if key is not None else "(shape not recorded)"
            budget = format_bytes(plan.budget_bytes) if plan.budget_bytes else "-"
            lines.append(
                f"{where}: predicted peak {format_bytes(plan.predicted_peak_bytes)} "
                f"(budget {budget}), overhead {plan.predicted_overhead:+.1%}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gradckpt.PlanSet",
            "version": self.version,
            "entries": [
                {"shape": k.to_json() if k is not None else None, "plan": p.to_json()}
                for k, p in self.entries
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanSet:
        """A set from its JSON; a single plan's JSON becomes a one-plan set (key None)."""
        if data.get("kind") == "gradckpt.Plan":
            return cls(((None, Plan.from_json(data)),))
        check_header(data, "gradckpt.PlanSet", PLANSET_VERSION, "plan the model again")
        return cls(
            tuple(
                (
                    key_from_json(e["shape"]) if e["shape"] is not None else None,
                    Plan.from_json(e["plan"]),
                )
                for e in data["entries"]
            )
        )

    def save(self, path: str | Path) -> None:
        """Write the set as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PlanSet:
        """Read a set written by :meth:`save`, or a single plan written by ``Plan.save``."""
        return cls.from_json(json.loads(Path(path).read_text()))


def load_plans(path: str | Path) -> Plan | PlanSet:
    """Whatever plan file ``path`` holds: a :class:`Plan` or a :class:`PlanSet`.

    Example:
        >>> gradckpt.apply(model, load_plans("plans.json"))
    """
    data = json.loads(Path(path).read_text())
    if data.get("kind") == "gradckpt.PlanSet":
        return PlanSet.from_json(data)
    return Plan.from_json(data)


def same_event_line(a: Profile, b: Profile) -> bool:
    """True when two profiles differ at most in sizes: bytes, FLOPs, times, shapes.

    Same ops in the same order (names, units, positions, outputs), same storages
    made and freed at the same positions, same tensors saved, unpacked and
    released at the same positions, same units.
    """
    if (a.forward_ops, a.end, a.param_bytes) != (b.forward_ops, b.end, b.param_bytes):
        return False
    shape = {  # the fields of each record kind that make up the event line
        "ops": attrgetter("name", "backward", "unit", "local", "outputs", "position"),
        "storages": attrgetter("producer", "alloc", "free", "natural_free", "mutated"),
        "packs": attrgetter("storage", "unit", "ops_done", "position", "unpack", "release"),
        "units": attrgetter(
            "path", "first_op", "end_op", "chain_input", "output", "chained", "calls"
        ),
    }
    for kind, fields in shape.items():
        xs, ys = getattr(a, kind), getattr(b, kind)
        if len(xs) != len(ys) or any(fields(x) != fields(y) for x, y in zip(xs, ys)):
            return False
    return True


def proves_monotone(small: Profile, large: Profile) -> bool:
    """True when any plan's peak on ``small`` is at most its peak on ``large``.

    The simulator predicts a plan's peak from the event line (which storages are
    made, saved, unpacked and freed, in what order) and each storage's bytes. If
    the two steps have the same event line and every storage of ``small`` is no
    larger than its counterpart in ``large``, then at every position of every
    plan's line the live bytes on ``small`` are at most those on ``large``, so
    the peak is too. Tests use this to show that a model family may run a
    shorter sequence under a longer one's plan.

    Example:
        >>> proves_monotone(gradckpt.profile(m, at_128, fake=True), gradckpt.profile(m, at_512, fake=True))
        True
    """
    return same_event_line(small, large) and all(
        s.nbytes <= t.nbytes for s, t in zip(small.storages, large.storages)
    )
