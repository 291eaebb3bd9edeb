"""The ``Plan``: what to keep and what to recompute, as versioned data.

A plan lists every plannable unit of the model once, in forward order, each
with a decision (a typed value from :mod:`gradckpt.engine.decisions`):

* :class:`Keep` (``keep``): run plainly, autograd keeps what it needs;
* :class:`Recompute` (``recompute``): a checkpointed region (keeps its inputs only);
* :class:`Selective` (``selective``): a region that also keeps the outputs of
  the ops at positions ``save`` (their names in ``save_ops``, checked when applied);
* :class:`Offload` (``offload``): run plainly, but what autograd saves inside the
  unit goes to host memory after its forward and comes back ahead of its
  backward (:mod:`gradckpt.engine.offload`; the link and host budget in
  ``Plan.offload``). Only at the top level: inside a segment's recompute it runs
  as ``Keep``.

A plan file writes each unit's decision as ``mode`` (the decision's kind name)
plus the decision's own fields; what each kind does in the planner and at run
time lives in :mod:`gradckpt.planning.kinds`.

A :class:`Segment` groups consecutive units into one region that keeps only
its first input; its ``items`` say how each unit runs while the segment is
recomputed in backward (a unit there may be a region again, or a sub-segment),
which is how budgets below checkpoint-every-block are reached.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

from gradckpt._versioned import check_header
from gradckpt.engine.decisions import (
    KEEP,
    Decision,
    Offload,
    RecomputeOffload,
    Selective,
    decision_from_json,
)
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.handlers.registry import handler_for
from gradckpt.planning.plans.errors import PlanFormatError, check_plan_fields
from gradckpt.planning.plans.offload_options import OffloadOptions
from gradckpt.planning.plans.step_parts import StepParts
from gradckpt.planning.plans.token_chunks import token_chunk_lines, token_chunks_from_json

__all__ = [
    "PLAN_VERSION",
    "Item",
    "Plan",
    "PlanFormatError",
    "Segment",
    "UnitChoice",
    "iter_units",
    "plan_summary",
]

PLAN_VERSION = 1
#: Plan-file versions this gradckpt reads: 1, and 2 for plans holding a kind that
#: older readers cannot run (``Chunk``; see ``Decision.plan_version``), which they
#: then refuse by its version instead of by an unknown unit mode.
READ_VERSIONS = (1, 2)


@dataclass(frozen=True, init=False)
class UnitChoice:
    """How one unit runs: its path and its decision.

    Example:
        >>> UnitChoice("blocks.0", Recompute())
        >>> UnitChoice("blocks.1", Selective((3,), ("aten.mm.default",)))
        >>> UnitChoice("blocks.1", "selective", (3,), ("aten.mm.default",))  # by kind name
    """

    path: str
    decision: Decision

    def __init__(
        self,
        path: str,
        decision: Decision | str = KEEP,
        save: tuple[int, ...] = (),
        save_ops: tuple[str, ...] = (),
    ) -> None:
        if isinstance(decision, str):  # a kind name, as plan files write it
            if (save or save_ops) and decision != "selective":
                raise ValueError(f"only selective units keep op outputs ({path})")
            data = {"save": save, "save_ops": save_ops} if save or save_ops else {}
            decision = decision_from_json(decision, data)
        elif not isinstance(decision, Decision):
            raise TypeError(
                f"a unit's decision is a gradckpt decision (Keep(), Recompute(), "
                f"Selective(...)) or its kind name, got {decision!r} for {path}"
            )
        elif save or save_ops:
            raise ValueError(f"give op positions inside Selective(...), not beside it ({path})")
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "decision", decision)

    @property
    def mode(self) -> str:
        """The decision's kind name ("keep", "recompute", "selective", ...)."""
        return self.decision.kind

    @property
    def save(self) -> tuple[int, ...]:
        """Op positions whose outputs a selective unit keeps (empty for other kinds)."""
        return self.decision.save if isinstance(self.decision, Selective) else ()

    @property
    def save_ops(self) -> tuple[str, ...]:
        """Names of the ops at :attr:`save`."""
        return self.decision.save_ops if isinstance(self.decision, Selective) else ()


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
    return {"path": item.path, "mode": item.decision.kind, **item.decision.to_json()}


def _item_from_json(data: dict[str, Any]) -> Item:
    if "segment" in data:
        return Segment(tuple(_item_from_json(i) for i in data["segment"]))
    extra = {k: v for k, v in data.items() if k not in ("path", "mode")}
    if extra.get("save") and data["mode"] != "selective":
        raise ValueError(f"only selective units keep op outputs ({data['path']})")
    return UnitChoice(data["path"], decision_from_json(data["mode"], extra))


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
    # Modules called more than once per step in a profile from before units were
    # per call (path#k), with their call counts: kept whole; said in the summary.
    not_planned: tuple[tuple[str, int], ...] = ()
    #: Median extra step time over the plain step, measured by ``fit`` (None: not measured).
    measured_overhead: float | None = None
    #: Least and greatest of that ratio over the measured rounds.
    measured_overhead_range: tuple[float, float] | None = None
    #: Which peak the predictions (and the budget) are held at: "allocator" (what the
    #: allocator holds, kernel workspaces included) or "tensors" (op-created storages).
    peak_level: str = "tensors"
    #: The link and host budget the plan's ``offload`` units were planned for (None: no
    #: offload was considered).
    offload: OffloadOptions | None = None
    #: What one compiled training step of this plan peaked at, at the allocator
    #: (parameters and buffers included), measured by ``fit(..., compile=True)``;
    #: None: not measured (eager plans).
    measured_compiled_peak_bytes: int | None = None
    #: The predicted peak in parts (parameters, gradients, optimizer state and step,
    #: activations) and the phase that sets it, when the plan was made for a whole
    #: training step (``optimizer=``, ``accumulation_steps=``); None: one micro-batch's
    #: forward and backward, the optimizer not counted.
    step: StepParts | None = None
    #: Planned from a fake profile for another device: the host's time per op it took
    #: as the least an op costs there (None: op times measured, or a CPU profile).
    host_op_seconds: float | None = None
    #: Token-wise modules inside blocks (MLPs) run in slices of tokens: ``(module path,
    #: slices)`` pairs (:mod:`gradckpt.planning.kinds.chunk.token_plan`); () for none.
    token_chunks: tuple[tuple[str, int], ...] = ()
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

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        # A plan without newer kinds is written exactly as before (version 1).
        data["version"] = max([self.version] + [u.decision.plan_version for u in self.units])
        if self.token_chunks:  # older readers must refuse it by its version
            data["version"] = max(data["version"], 2)
            data["token_chunks"] = [[p, k] for p, k in self.token_chunks]
        else:  # a plan without it is written exactly as before
            del data["token_chunks"]
        data["items"] = [_item_to_json(i) for i in self.items]
        data["input_shapes"] = [[p, list(s)] for p, s in self.input_shapes]
        data["not_planned"] = [[p, n] for p, n in self.not_planned]
        return {"kind": "gradckpt.Plan", **data}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str | None = None) -> Plan:
        """The plan in ``data``; :class:`PlanFormatError` (naming ``source``) if malformed."""
        if isinstance(data, dict):
            version = data.get("version")
            readable = version if version in READ_VERSIONS else READ_VERSIONS[-1]
            try:
                check_header(data, "gradckpt.Plan", readable, "plan the model again")
            except ValueError as e:
                raise PlanFormatError(f"{source}: {e}" if source else str(e)) from None
        check_plan_fields(data, source)
        fields = {k: v for k, v in data.items() if k != "kind"}
        fields["version"] = PLAN_VERSION  # the file's version follows from its kinds
        try:
            fields["items"] = tuple(_item_from_json(i) for i in data["items"])
        except ValueError as e:  # a unit mode, a one-unit segment, save without selective
            raise PlanFormatError(
                f"{source + ': ' if source else ''}malformed gradckpt plan: items: {e}"
            ) from None
        fields["input_shapes"] = tuple((p, tuple(s)) for p, s in data.get("input_shapes", ()))
        fields["not_planned"] = tuple((p, int(n)) for p, n in data.get("not_planned", ()))
        fields["token_chunks"] = token_chunks_from_json(data.get("token_chunks", ()), source)
        if fields.get("offload") is not None:
            try:
                fields["offload"] = OffloadOptions.from_json(fields["offload"])
            except (TypeError, ValueError) as e:
                raise PlanFormatError(
                    f"{source + ': ' if source else ''}malformed gradckpt plan: offload: {e}"
                ) from None
        if fields.get("step") is not None:
            try:
                fields["step"] = StepParts.from_json(fields["step"])
            except TypeError as e:
                raise PlanFormatError(
                    f"{source + ': ' if source else ''}malformed gradckpt plan: step: {e}"
                ) from None
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
        return plan_summary(self)


# ----------------------------------------------------------------- the summary
# (here, not in a module of its own: the summary reads the plan and the plan prints it)

_LEVELS = {
    "allocator": "the allocator (tensors and kernel workspaces, what an OOM sees)",
    "tensors": "tensor storages only (kernel workspaces not measured)",
}


def _lines(
    items: tuple[Item, ...], depth: int, offloaded: tuple[list[str], bool, bool]
) -> list[str]:
    out = []
    pad = "  " * depth
    for item in items:
        if isinstance(item, Segment):
            out.append(f"{pad}segment {item.paths[0]} .. {item.paths[-1]} (keeps its input)")
            out.extend(_lines(item.items, depth + 1, offloaded))
        elif isinstance(item.decision, Offload) and depth == 1:
            out.append(f"{pad}{item.path:<28} offload    {_offload_when(item.path, *offloaded)}")
        else:
            out.append(f"{pad}{item.path:<28} {handler_for(item.decision).describe(item.decision)}")
    return out


def _offload_when(path: str, offloaded: list[str], prefetch: bool, stream: bool) -> str:
    """When an offloaded unit's saved tensors move (the engine's order, see engine.offload)."""
    if stream:
        ahead = "one tensor ahead of its use" if prefetch else "at its use"
        return f"streamed: each saved tensor out when saved, back {ahead}"
    i = offloaded.index(path)
    if i + 1 == len(offloaded):
        return "saved tensors copied out after its forward; still held when backward reaches it"
    after = offloaded[i + 1]
    back = f"when {after}'s backward begins" if prefetch else "at its own backward"
    return f"saved tensors out after its forward (freed when {after}'s ends), back {back}"


def _offload_head(plan: Plan) -> list[str]:
    # Top-level units that move bytes to host: their saved tensors, or (recompute_offload)
    # the input their region keeps.
    moving = (Offload, RecomputeOffload)
    units = [u for u in plan.items if isinstance(getattr(u, "decision", None), moving)]
    if not units:
        return []
    o = plan.offload or OffloadOptions()
    host = "no host budget" if o.host_budget is None else f"host budget {format_bytes(o.host_budget)}"
    return [
        f"  offload: {len(units)} unit(s) to host memory over {o.d2h_bandwidth / 1e9:g} GB/s out, "
        f"{o.h2d_bandwidth / 1e9:g} GB/s back (stated, not measured), {host}; "
        "gradckpt.explain gives the bytes and stalls"
    ]


def plan_summary(plan: Plan) -> str:
    """What :meth:`Plan.summary` prints (see there)."""
    budget = format_bytes(plan.budget_bytes) if plan.budget_bytes is not None else "none"
    head = [
        f"gradckpt plan ({plan.solver or 'custom'}), budget {budget}",
        f"  predicted peak {format_bytes(plan.predicted_peak_bytes)} "
        f"(plain {format_bytes(plan.baseline_peak_bytes)}), "
        f"predicted overhead {plan.predicted_overhead:+.1%}",
        f"  peak held at: {_LEVELS.get(plan.peak_level, plan.peak_level)}",
    ]
    if plan.measured_overhead is not None:
        low, high = plan.measured_overhead_range or (plan.measured_overhead,) * 2
        head.append(
            f"  measured overhead {plan.measured_overhead:+.1%} ({low:+.1%} to {high:+.1%})"
        )
    if plan.measured_compiled_peak_bytes is not None:
        head.append(
            f"  measured compiled peak {format_bytes(plan.measured_compiled_peak_bytes)} "
            "(one compiled step, at the allocator)"
        )
    if plan.host_op_seconds is not None:
        head.append(
            f"  op times estimated (fake profile): at least {plan.host_op_seconds * 1e6:.1f} us "
            "of host time per op assumed (gradckpt.profile(..., host_op_seconds=) states it)"
        )
    if plan.step is not None:
        head += plan.step.lines()
    else:
        head.append(
            "  the optimizer is NOT counted: this peak is one micro-batch's forward and "
            "backward (pass optimizer= to plan the whole training step)"
        )
    shared = [
        f"  {path:<28} keep (runs {calls}x per step: never checkpointed; see gradckpt explain)"
        for path, calls in plan.not_planned
    ]
    options = plan.offload
    offloaded = (
        [u.path for u in plan.items if isinstance(getattr(u, "decision", None), Offload)],
        options.prefetch if options is not None else True,
        options is not None and options.stream,
    )
    lines = _lines(plan.items, 1, offloaded)
    return "\n".join(head + _offload_head(plan) + lines + shared + token_chunk_lines(plan))
