"""Human-readable views of a plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradckpt.measure.memory import format_bytes

if TYPE_CHECKING:
    from gradckpt.planning.plan import Item, Plan

__all__ = ["plan_summary"]

_LEVELS = {
    "allocator": "the allocator (tensors and kernel workspaces, what an OOM sees)",
    "tensors": "tensor storages only (kernel workspaces not measured)",
}


def _lines(items: tuple[Item, ...], depth: int) -> list[str]:
    from gradckpt.planning.plan import Segment

    out = []
    pad = "  " * depth
    for item in items:
        if isinstance(item, Segment):
            out.append(f"{pad}segment {item.paths[0]} .. {item.paths[-1]} (keeps its input)")
            out.extend(_lines(item.items, depth + 1))
        elif item.mode == "selective":
            kept = ", ".join(n.replace("aten.", "") for n in item.save_ops)
            out.append(f"{pad}{item.path:<28} selective  keeps: {kept}")
        else:
            out.append(f"{pad}{item.path:<28} {item.mode}")
    return out


def plan_summary(plan: Plan) -> str:
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
    shared = [
        f"  {path:<28} keep (runs {calls}x per step: never checkpointed; see gradckpt explain)"
        for path, calls in plan.not_planned
    ]
    return "\n".join(head + _lines(plan.items, 1) + shared)
