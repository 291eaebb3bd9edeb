"""Human-readable views of a plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradckpt.engine.decisions import Offload
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.handlers import handler_for

if TYPE_CHECKING:
    from gradckpt.planning.plan import Item, Plan

__all__ = ["plan_summary"]

_LEVELS = {
    "allocator": "the allocator (tensors and kernel workspaces, what an OOM sees)",
    "tensors": "tensor storages only (kernel workspaces not measured)",
}


def _lines(items: tuple[Item, ...], depth: int, offloaded: tuple[list[str], bool]) -> list[str]:
    from gradckpt.planning.plan import Segment

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


def _offload_when(path: str, offloaded: list[str], prefetch: bool) -> str:
    """When an offloaded unit's saved tensors move (the engine's order, see engine.offload)."""
    i = offloaded.index(path)
    if i + 1 == len(offloaded):
        return "saved tensors copied out after its forward; still held when backward reaches it"
    after = offloaded[i + 1]
    back = f"when {after}'s backward begins" if prefetch else "at its own backward"
    return f"saved tensors out after its forward (freed when {after}'s ends), back {back}"


def _offload_head(plan: Plan) -> list[str]:
    from gradckpt.planning.offload_cost import OffloadOptions

    units = [u for u in plan.items if isinstance(getattr(u, "decision", None), Offload)]
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
    prefetch = plan.offload.prefetch if plan.offload is not None else True
    offloaded = (
        [u.path for u in plan.items if isinstance(getattr(u, "decision", None), Offload)],
        prefetch,
    )
    lines = _lines(plan.items, 1, offloaded)
    return "\n".join(head + _offload_head(plan) + lines + shared)
