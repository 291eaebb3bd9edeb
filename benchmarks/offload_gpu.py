"""Offload contenders for ``benchmarks/gpu_check.py``: side by side on one GPU.

NOT RUN YET: written on a CPU-only machine; ``gpu_check.py --cpu-dry-run`` runs
this code on CPU at tiny sizes (host-copy backend, no streams, numbers
meaningless for time).

On the zoo GPT, after measuring the link (pinned copies of 256 MiB each way):

* ``plain``: no checkpointing;
* ``full_ckpt``: ``torch.utils.checkpoint`` on every block;
* ``offload_all+full_ckpt``: the same, inside ``torch.autograd.graph.save_on_cpu``
  (pinned): every tensor saved outside the regions goes to the host, the stand-in
  for torchtune's ``OffloadActivations`` + AC (torchtune is not installed here);
* ``gradckpt``: the DP plan (no offload) at the budget ``full_ckpt`` measured;
* ``gradckpt_offload``: keep / recompute / offload chosen jointly at that budget,
  over the link as measured;
* ``gradckpt_offload_0.9``: ``offload=`` at 0.9 x the least peak without offload,
  with segments (streamed blocks where that is what fits; a note when refused);
* ``gradckpt_offload_floor``: without segments, at the least peak with offload
  (recomputed blocks' inputs moved to host too: below the least peak without), on
  the CUDA backend: within that budget at the allocator, gradients, host bytes.

Each: the allocator's peak of one step, the median step time of interleaved
rounds, and whether the gradients match the plain step's (bit-equal, or the
largest difference when not).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

import gradckpt
from benchmarks.harness import (
    make_step,
    per_block,
    plain,
    sync,
    torch_checkpoint,
    wall_timed,
    with_plan,
    wrap_blocks,
)
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.testing import Example, make

GPU_SIZES = dict(layers=12, d_model=1024, heads=16, seq=1024, vocab=8192, batch=8, dropout=0.1)
DRY_SIZES = dict(layers=3, d_model=32, heads=2, seq=32, vocab=128, batch=2, dropout=0.1)


def measure_link(device: str, nbytes: int = 256 << 20, rounds: int = 5) -> tuple[float, float]:
    """(device->host, host->device) bytes per second with pinned buffers (median of ``rounds``)."""
    if device != "cuda":
        return 25e9, 25e9  # a dry run: nothing to measure, the PCIe-class default
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for copy in (lambda: host.copy_(src, non_blocking=True),
                 lambda: src.copy_(host, non_blocking=True)):  # fmt: skip
        times: list[float] = []
        timed = wall_timed(copy, device, times)
        for _ in range(rounds):
            timed()
        out.append(nbytes / statistics.median(times))
    return out[0], out[1]


def _offload_all(install: Callable[[Example], Callable[[], None]], pin: bool):
    """``install``, with the model's whole forward run inside ``save_on_cpu``."""

    def on_cpu(forward: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return forward(*args, **kwargs)

        return run

    def installer(ex: Example) -> Callable[[], None]:
        undo = install(ex)
        undo_root = wrap_blocks(ex.model, [""], on_cpu)

        def restore() -> None:
            undo_root()
            undo()

        return restore

    return installer


def _run(ex: Example, install, device: str) -> tuple[int, dict[str, torch.Tensor]]:
    undo = install(ex)
    try:
        step = make_step(ex)
        step()  # warm-up
        sync(device)
        with AllocatorTracker(device) as tracker:
            step()
            sync(device)
        grads = {k: p.grad.clone() for k, p in ex.model.named_parameters() if p.grad is not None}
    finally:
        undo()
    return state_bytes(ex.model) + tracker.peak_bytes, grads


def _time(ex: Example, installs: dict[str, Any], device: str, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in installs}
    for _ in range(rounds):
        for name, install in installs.items():
            undo = install(ex)
            try:
                wall_timed(make_step(ex), device, times[name])()
            finally:
                undo()
    return {name: statistics.median(t) for name, t in times.items()}


def _grad_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)


def run_offload_contenders(dry: bool, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure the contenders (see the module docstring); a dict for the report and JSON."""
    ex = make("gpt", **(DRY_SIZES if dry else GPU_SIZES), device=device)
    d2h, h2d = measure_link(device)
    log(f"  link: {d2h / 1e9:.1f} GB/s out, {h2d / 1e9:.1f} GB/s back")
    installs: dict[str, Any] = {
        "plain": plain(),
        "full_ckpt": per_block(torch_checkpoint),
        "offload_all+full_ckpt": _offload_all(per_block(torch_checkpoint), pin=device == "cuda"),
    }
    rows: dict[str, dict[str, Any]] = {}
    for name, install in installs.items():
        peak, grads = _run(ex, install, device)
        rows[name] = {"peak_bytes": peak, "grads": grads}
    budget = rows["full_ckpt"]["peak_bytes"]
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=2)
    options = gradckpt.OffloadOptions(d2h_bandwidth=d2h, h2d_bandwidth=h2d)
    notes = []
    try:
        gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof))
    except gradckpt.BudgetError as e:
        # torch's checkpoint can reach below gradckpt's least peak (its frames keep
        # less): compare at gradckpt's least instead, and say so.
        notes.append(f"full_ckpt's peak {budget} B is below gradckpt's least feasible peak "
                     f"({e.least_peak_bytes} B): gradckpt planned at its least instead")  # fmt: skip
        budget = e.least_peak_bytes or budget
    for name, offload in (("gradckpt", False), ("gradckpt_offload", options)):
        try:
            plan = gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof), offload=offload)
        except gradckpt.BudgetError as e:
            notes.append(f"{name}: no plan at {budget} B: {str(e)[:200]}")
            continue
        installs[name] = with_plan(plan)
        peak, grads = _run(ex, installs[name], device)
        rows[name] = {"peak_bytes": peak, "grads": grads, "predicted_peak_bytes":
                      plan.predicted_peak_bytes, "predicted_overhead": plan.predicted_overhead,
                      "offloaded": [u.path for u in plan.units
                                    if u.mode in ("offload", "recompute_offload")]}  # fmt: skip
    floor_row = _below_the_floor(ex, prof, options, device, notes)
    if floor_row is not None:
        installs["gradckpt_offload_floor"], rows["gradckpt_offload_floor"] = floor_row
    tenth_row = _at_nine_tenths(ex, prof, options, device, notes)
    if tenth_row is not None:
        installs["gradckpt_offload_0.9"], rows["gradckpt_offload_0.9"] = tenth_row
    medians = _time(ex, installs, device, rounds=2 if dry else 5)
    base = rows["plain"]["grads"]
    for name, row in rows.items():
        row["median_step_s"] = medians.get(name)
        row["time_ratio"] = medians[name] / medians["plain"] if name in medians else None
        row["max_grad_diff"] = _grad_gap(base, row.pop("grads"))
    return {"budget_bytes": budget, "d2h_bandwidth": d2h, "h2d_bandwidth": h2d,
            "rows": rows, "notes": notes, "dry_run": dry}  # fmt: skip


def _below_the_floor(ex: Example, prof, options, device: str, notes: list[str]):
    """The plan at the least peak with offload, block inputs moved too, without segments
    (where moving them lowers the floor most); its install and row, or None.

    The row says the budget, the floor without offload, the host bytes the backend held
    (the CUDA backend's pinned pool: at most the host budget) and what was predicted.
    """
    from gradckpt.apply.apply import applied_units
    from gradckpt.engine.offload.runtime import OffloadRuntime
    from gradckpt.planning import simulate
    from gradckpt.planning.kinds.offload.floor import least_peak_offload
    from gradckpt.planning.solving.solvers import least_peak_plan

    _, without = least_peak_plan(prof, segments=False)
    _, floor = least_peak_offload(prof, options, segments=False)
    try:
        plan = gradckpt.plan(ex.model, ex.loss_fn, floor.peak_bytes, profiling=gradckpt.ProfileOptions(profile=prof),
                             segments=False, offload=options)  # fmt: skip
    except gradckpt.BudgetError as e:
        notes.append(f"gradckpt_offload_floor: no plan at {floor.peak_bytes} B: {str(e)[:200]}")
        return None
    install = with_plan(plan)
    peak, grads = _run(ex, install, device)
    undo = install(ex)  # one more step, for the host bytes of a fresh session
    try:
        make_step(ex)()
        runtimes = [s.runtime for s in applied_units(ex.model).values()
                    if isinstance(s.runtime, OffloadRuntime) and s.runtime.session is not None]  # fmt: skip
        host = runtimes[0].session.backend.peak_host_bytes if runtimes else 0
    finally:
        undo()
    row = {"peak_bytes": peak, "grads": grads, "budget_bytes": floor.peak_bytes,
           "floor_without_bytes": without.peak_bytes, "within_budget": peak <= floor.peak_bytes,
           "predicted_peak_bytes": plan.predicted_peak_bytes,
           "predicted_overhead": plan.predicted_overhead,
           "predicted_host_bytes": simulate(prof, plan).host_bytes, "host_bytes": host,
           "offloaded": [u.path for u in plan.units if u.mode in ("offload", "recompute_offload")]}  # fmt: skip
    return install, row


def _at_nine_tenths(ex: Example, prof, options, device: str, notes: list[str]):
    """``offload=`` at 0.9 x the least peak without offload, with segments: the plan
    (streamed blocks where that is what fits), its install and row, or None with a note.

    Streamed offload waits for every copy out and for copies back the backward does not
    hide: this is the row that shows what that costs on a real link.
    """
    from gradckpt.planning.solving.solvers import least_peak_plan

    _, without = least_peak_plan(prof)
    budget = int(0.9 * without.peak_bytes)
    try:
        plan = gradckpt.plan(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof), offload=options)
    except gradckpt.BudgetError as e:
        notes.append(f"gradckpt_offload_0.9: no plan at {budget} B: {str(e)[:300]}")
        return None
    install = with_plan(plan)
    peak, grads = _run(ex, install, device)
    row = {"peak_bytes": peak, "grads": grads, "budget_bytes": budget,
           "within_budget": peak <= budget, "predicted_peak_bytes": plan.predicted_peak_bytes,
           "predicted_overhead": plan.predicted_overhead,
           "streamed": bool(plan.offload is not None and plan.offload.stream),
           "offloaded": [u.path for u in plan.units if u.mode in ("offload", "recompute_offload")]}  # fmt: skip
    notes.append(f"gradckpt_offload_0.9: planned at {budget} B (0.9 x {without.peak_bytes} B), "
                 f"streamed: {row['streamed']}, measured peak within it: {row['within_budget']}")  # fmt: skip
    return install, row


def report_lines(result: dict[str, Any]) -> list[str]:
    """The Markdown section for gpu_check's report."""
    mib = lambda n: "-" if n is None else f"{n / 2**20:.1f}"  # noqa: E731
    lines = [
        "", "## Offload contenders (zoo GPT)", "",
        f"Link measured: {result['d2h_bandwidth'] / 1e9:.1f} GB/s out, "
        f"{result['h2d_bandwidth'] / 1e9:.1f} GB/s back"
        + (" (dry run: not measured, CPU, times meaningless)" if result["dry_run"] else "")
        + f"; gradckpt planned at {mib(result['budget_bytes'])} MiB (full_ckpt's measured peak, "
        "unless a note says otherwise).",
        "", "| contender | peak (MiB) | predicted (MiB) | time / plain | max grad diff | offloaded |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, r in result["rows"].items():
        ratio = "-" if r.get("time_ratio") is None else f"{r['time_ratio']:.3f}"
        lines.append(f"| {name} | {mib(r['peak_bytes'])} | {mib(r.get('predicted_peak_bytes'))} "
                     f"| {ratio} | {r['max_grad_diff']:.2e} | "
                     f"{len(r.get('offloaded', [])) or '-'} |")  # fmt: skip
    floor = result["rows"].get("gradckpt_offload_floor")
    if floor is not None:
        lines += ["", "gradckpt_offload_floor: planned without segments at the least peak with "
                  f"offload ({mib(floor['budget_bytes'])} MiB; without offload the least is "
                  f"{mib(floor['floor_without_bytes'])} MiB): measured peak within it: "
                  f"{'yes' if floor['within_budget'] else '**NO**'}; host bytes "
                  f"{mib(floor['host_bytes'])} MiB (predicted {mib(floor['predicted_host_bytes'])})."]  # fmt: skip
    lines += [f"- {n}" for n in result["notes"]]
    return lines
