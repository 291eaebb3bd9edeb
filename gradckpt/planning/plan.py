"""The ``Plan``: what to keep and what to recompute, as versioned data.

A plan lists every plannable unit of the model once, in forward order, each
with a mode:

* ``keep``: run plainly, autograd keeps what it needs;
* ``recompute``: a checkpointed region (keeps its inputs only);
* ``selective``: a region that also keeps the outputs of the ops at positions
  ``save`` (their names in ``save_ops``, checked when applied).

A :class:`Segment` groups consecutive units into one region that keeps only
its first input; its ``items`` say how each unit runs while the segment is
recomputed in backward (a unit there may be a region again, or a sub-segment),
which is how budgets below checkpoint-every-block are reached.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Union

from gradckpt._versioned import check_header
from gradckpt.planning.errors import PlanFormatError, check_plan_fields

__all__ = [
    "PLAN_VERSION",
    "Item",
    "Plan",
    "PlanFormatError",
    "Segment",
    "UnitChoice",
    "iter_units",
]

PLAN_VERSION = 1
MODES = ("keep", "recompute", "selective")


@dataclass(frozen=True)
class UnitChoice:
    """How one unit runs."""

    path: str
    mode: str = "keep"
    save: tuple[int, ...] = ()
    save_ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unit mode must be one of {MODES}, got {self.mode!r}")
        if len(self.save) != len(self.save_ops):
            raise ValueError("save and save_ops must have the same length")
        if self.save and self.mode != "selective":
            raise ValueError(f"only selective units keep op outputs ({self.path})")


@dataclass(frozen=True)
class Segment:
    """Consecutive units checkpointed as one region; ``items`` run in its recompute."""

    items: tuple[Item, ...]

    def __post_init__(self) -> None:
        if len(list(iter_units(self.items))) < 2:
            raise ValueError("a segment spans at least two units")

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(u.path for u in iter_units(self.items))


Item = Union[UnitChoice, Segment]  # noqa: UP007 - a runtime alias used in isinstance-free code


def iter_units(items: tuple[Item, ...]) -> Iterator[UnitChoice]:
    """Every UnitChoice in ``items``, depth first, in forward order."""
    for item in items:
        if isinstance(item, Segment):
            yield from iter_units(item.items)
        else:
            yield item


def _item_to_json(item: Item) -> dict[str, Any]:
    if isinstance(item, Segment):
        return {"segment": [_item_to_json(i) for i in item.items]}
    data = {"path": item.path, "mode": item.mode}
    if item.save:
        data["save"] = list(item.save)
        data["save_ops"] = list(item.save_ops)
    return data


def _item_from_json(data: dict[str, Any]) -> Item:
    if "segment" in data:
        return Segment(tuple(_item_from_json(i) for i in data["segment"]))
    return UnitChoice(
        data["path"], data["mode"], tuple(data.get("save", ())), tuple(data.get("save_ops", ()))
    )


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan for one model and input shape, with its predictions.

    Example:
        >>> plan = gradckpt.plan(model, loss_fn, budget="800MB")
        >>> print(plan.summary())
        >>> plan.save("plan.json"); plan = gradckpt.Plan.load("plan.json")
    """

    items: tuple[Item, ...]
    fingerprint: str
    budget_bytes: int | None = None
    predicted_peak_bytes: int = 0
    baseline_peak_bytes: int = 0
    predicted_step_time: float = 0.0
    baseline_step_time: float = 0.0
    predicted_recompute_flops: int = 0
    solver: str = ""
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Units called more than once per step (shared weights), with their call
    # counts: never checkpointed, always kept whole; said in the summary.
    not_planned: tuple[tuple[str, int], ...] = ()
    #: Median extra step time over the plain step, measured by ``fit`` (None: not measured).
    measured_overhead: float | None = None
    #: Least and greatest of that ratio over the measured rounds.
    measured_overhead_range: tuple[float, float] | None = None
    #: Which peak the predictions (and the budget) are held at: "allocator" (what the
    #: allocator holds, kernel workspaces included) or "tensors" (op-created storages).
    peak_level: str = "tensors"
    version: int = field(default=PLAN_VERSION)

    @property
    def predicted_overhead(self) -> float:
        """Predicted extra step time as a fraction of the plain step (0.1 = 10% slower)."""
        if self.baseline_step_time <= 0:
            return 0.0
        return self.predicted_step_time / self.baseline_step_time - 1.0

    @property
    def units(self) -> tuple[UnitChoice, ...]:
        return tuple(iter_units(self.items))

    def with_predictions(self, **values: Any) -> Plan:
        return replace(self, **values)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["items"] = [_item_to_json(i) for i in self.items]
        data["input_shapes"] = [[p, list(s)] for p, s in self.input_shapes]
        data["not_planned"] = [[p, n] for p, n in self.not_planned]
        return {"kind": "gradckpt.Plan", **data}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str | None = None) -> Plan:
        """The plan in ``data``; :class:`PlanFormatError` (naming ``source``) if malformed."""
        if isinstance(data, dict):
            try:
                check_header(data, "gradckpt.Plan", PLAN_VERSION, "plan the model again")
            except ValueError as e:
                raise PlanFormatError(f"{source}: {e}" if source else str(e)) from None
        check_plan_fields(data, source)
        fields = {k: v for k, v in data.items() if k != "kind"}
        try:
            fields["items"] = tuple(_item_from_json(i) for i in data["items"])
        except ValueError as e:  # a unit mode, a one-unit segment, save without selective
            raise PlanFormatError(
                f"{source + ': ' if source else ''}malformed gradckpt plan: items: {e}"
            ) from None
        fields["input_shapes"] = tuple((p, tuple(s)) for p, s in data.get("input_shapes", ()))
        fields["not_planned"] = tuple((p, int(n)) for p, n in data.get("not_planned", ()))
        if fields.get("measured_overhead_range") is not None:
            fields["measured_overhead_range"] = tuple(fields["measured_overhead_range"])
        return cls(**fields)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`; :class:`PlanFormatError` names a malformed field."""
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFormatError(
                f"{path}: not a gradckpt plan: not JSON ({e.msg} at line {e.lineno}, column "
                f"{e.colno}). Write plans with plan.save(path), or plan the model again"
            ) from None
        return cls.from_json(data, source=str(path))

    # --------------------------------------------------------------- display

    def summary(self) -> str:
        """A table: per unit its decision; then budget, predicted peak and overhead."""
        from gradckpt.planning.report import plan_summary

        return plan_summary(self)
