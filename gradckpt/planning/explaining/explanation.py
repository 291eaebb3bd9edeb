"""What ``explain`` returns: one row per storage kept for backward, per-unit costs, the peak.

The frozen result types of :func:`gradckpt.planning.explaining.explain.explain`, with how
they read as text (:meth:`Explanation.table`, :meth:`PeakInfo.describe`, the
hints) and as versioned JSON (:meth:`Explanation.to_json`). How a profile and a
plan become these rows is :mod:`gradckpt.planning.explaining.explain`.

Example:
    >>> ex = gradckpt.explain(model, loss_fn, budget=0.5)
    >>> print(ex.table()); ex.to_json()["totals"]["kept_bytes"]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gradckpt.measure.memory import format_bytes
from gradckpt.planning.plans.plan import Plan
from gradckpt.profiling.units import CALL_MARK

OUTSIDE = "(outside units)"
STATUSES = ("kept", "region input", "selective", "recomputed", "offloaded")


@dataclass(frozen=True)
class SavedStorage:
    """One storage the plain step keeps for backward, and what the plan does with it (a row)."""

    unit: str  # the unit that saves it (or holds it, for a region input); OUTSIDE if none
    is_block: bool
    op: str  # the op that produced it, e.g. "aten.addmm.default"
    shape: tuple[int, ...] | None  # as saved (a view's shape); None if no op saves it
    dtype: str
    nbytes: int
    status: str  # one of STATUSES
    why: str
    storage: int  # storage id in the profile
    saved_by: int  # saved-tensor records (ops) that save this storage

    @property
    def kept(self) -> bool:
        return self.status != "recomputed"


@dataclass(frozen=True)
class UnitCost:
    """Per unit: the plan's decision, bytes it keeps and recomputes, recompute time."""

    path: str
    is_block: bool
    decision: str
    kept_bytes: int
    recomputed_bytes: int
    recompute_time: float  # seconds of its forward ops run again in backward
    calls: int = 1  # times its module runs per step (each call is a unit: path#k)


@dataclass(frozen=True)
class PeakInfo:
    """Where the (predicted) peak occurs and what it is made of."""

    peak_bytes: int
    param_bytes: int
    kept_bytes: int  # tensors kept for backward (rows with kept status) alive at the peak
    other_bytes: int  # gradients, temporaries and recomputed activations
    phase: str  # "forward" or "backward"
    unit: str
    op: str
    #: Bytes the op's kernel allocates beyond its outputs, when they are part of the peak.
    workspace_bytes: int = 0
    #: Held through forward and backward besides parameters: optimizer state and resident
    #: gradients, when the profile counts the training step (0 otherwise).
    resident_bytes: int = 0
    #: The optimizer step's peak when it is above forward/backward's (0 otherwise); then
    #: ``peak_bytes`` is forward/backward's and this is the whole step's.
    optimizer_step_bytes: int = 0

    def describe(self) -> str:
        workspace = (
            f", kernel workspace of {self.op.removeprefix('aten.')} "
            f"{format_bytes(self.workspace_bytes)}"
            if self.workspace_bytes
            else ""
        )
        resident = (
            f", optimizer state and resident gradients {format_bytes(self.resident_bytes)}"
            if self.resident_bytes
            else ""
        )
        text = (
            f"peak {format_bytes(self.peak_bytes)} during the {self.phase} of {self.unit} "
            f"({self.op.removeprefix('aten.')}): parameters and buffers "
            f"{format_bytes(self.param_bytes)}{resident}, tensors kept for backward "
            f"{format_bytes(self.kept_bytes)}, gradients, temporaries and recomputed "
            f"activations {format_bytes(self.other_bytes)}{workspace}"
        )
        if self.optimizer_step_bytes:
            return (
                f"the optimizer step sets the whole step's peak, "
                f"{format_bytes(self.optimizer_step_bytes)} (no plan lowers it); forward/backward's "
                + text
            )
        return text


@dataclass(frozen=True)
class Explanation:
    """What a step keeps for backward under a plan (or plainly), with totals and the peak."""

    rows: tuple[SavedStorage, ...]
    units: tuple[UnitCost, ...]
    kept_bytes: int
    recomputed_bytes: int
    pre_existing_saved: int  # saved tensors that are parameters or inputs (not rows)
    peak: PeakInfo
    plain_peak_bytes: int
    plan: Plan | None

    def by_unit(self) -> dict[str, list[SavedStorage]]:
        """Rows grouped by unit, in forward order."""
        groups: dict[str, list[SavedStorage]] = {}
        for row in self.rows:
            groups.setdefault(row.unit, []).append(row)
        return groups

    def hints(self) -> list[str]:
        """Plain-language conclusions about the peak."""
        peak = self.peak
        created = max(1, peak.peak_bytes - peak.param_bytes - peak.resident_bytes)
        out = []
        if peak.kept_bytes < 0.25 * created:
            out.append(
                f"the peak is during the {peak.phase} of {peak.unit}, and only "
                f"{format_bytes(peak.kept_bytes)} of it is tensors kept for backward: the rest "
                "is gradients and temporaries, which checkpointing does not remove; a smaller "
                "batch or sequence (or fewer trainable parameters) lowers it"
            )
        elif self.plan is None:
            out.append(
                f"checkpointing can free at most {format_bytes(peak.kept_bytes)} at the peak "
                "(the kept tensors alive there)"
            )
        if peak.workspace_bytes >= 0.1 * created:
            out.append(
                f"{format_bytes(peak.workspace_bytes)} of the peak is scratch memory that "
                f"{peak.op.removeprefix('aten.')} allocates inside its kernel (measured at the "
                "allocator); checkpointing does not shrink it, smaller inputs to that op do"
            )
        for u in self.units:
            if u.calls > 1 and CALL_MARK not in u.path:  # an older profile's unit of all calls
                out.append(
                    f"{u.path} runs {u.calls} times per step (shared weights): gradckpt never "
                    f"checkpoints it and keeps all it saves ({format_bytes(u.kept_bytes)}); "
                    "to checkpoint it, wrap its calls in gradckpt.checkpoint yourself"
                )
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "gradckpt.Explanation",
            "plan": self.plan.to_json() if self.plan is not None else None,
            "rows": [
                {**asdict(r), "shape": None if r.shape is None else list(r.shape)}
                for r in self.rows
            ],
            "units": [asdict(u) for u in self.units],
            "totals": {
                "kept_bytes": self.kept_bytes,
                "recomputed_bytes": self.recomputed_bytes,
                "saved_storages": len(self.rows),
                "pre_existing_saved": self.pre_existing_saved,
            },
            "peak": asdict(self.peak),
            "plain_peak_bytes": self.plain_peak_bytes,
            "hints": self.hints(),
        }

    def table(self) -> str:
        """Rows grouped by unit, then totals and the peak, as plain text."""
        lines = []
        head = f"  {'op':<30} {'shape':<20} {'dtype':<9} {'bytes':>12}  {'status':<12} why"
        for unit, rows in self.by_unit().items():
            kept = sum(r.nbytes for r in rows if r.kept)
            block = " (block)" if rows[0].is_block else ""
            lines.append(f"{unit}{block}: keeps {format_bytes(kept)}")
            lines.append(head)
            for r in rows:
                shape = format_shape(r.shape)
                lines.append(
                    f"  {r.op.removeprefix('aten.'):<30} {shape:<20} {r.dtype:<9} "
                    f"{format_bytes(r.nbytes):>12}  {r.status:<12} {r.why}"
                )
        lines += [
            "",
            f"bytes kept for backward: {format_bytes(self.kept_bytes)} "
            f"({sum(r.kept for r in self.rows)} storages)",
            f"bytes recomputed in backward: {format_bytes(self.recomputed_bytes)} "
            f"({sum(not r.kept for r in self.rows)} storages)",
            *self._offloaded_line(),
            f"saved parameters and inputs (not counted, they exist anyway): "
            f"{self.pre_existing_saved}",
            self.peak.describe(),
            *(f"note: {h}" for h in self.hints()),
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _offloaded_line(self) -> list[str]:
        moved = [r for r in self.rows if r.status == "offloaded"]
        if not moved:
            return []
        total = format_bytes(sum(r.nbytes for r in moved))
        return [f"of which offloaded to host between forward and backward: {total} "
                f"({len(moved)} storages)"]  # fmt: skip


def format_shape(shape: tuple[int, ...] | None) -> str:
    """'4x64x64', 'scalar' for (), '?' when unknown."""
    if shape is None:
        return "?"
    return "x".join(map(str, shape)) or "scalar"
