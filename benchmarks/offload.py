"""Offload benchmark (CPU): the frontier with and without offload, predicted; exactness measured.

TIMING IS SIMULATED. This machine has no GPU: there is no link to measure and
no copy stream to overlap. Every time with offload in it is the planner's
prediction from a *stated* bandwidth (25 GB/s, PCIe-class, and 400 GB/s,
superchip-class, each way) against the profiled op times. Two op-time
sources are shown:

* ``cpu``: the op times measured on this CPU (slow compute: the link is rarely
  the bottleneck, so offload looks nearly free);
* ``accelerator``: op times estimated from each op's FLOPs and bytes at an
  accelerator's speed (``gradckpt.profiling.fake.SPEEDS["cuda"]``: 400 TFLOP/s,
  2.5 TB/s), so that the copies compete with fast compute as they would on a GPU
  (the engine's Python costs, measured against CPU kernels, are left out there).

Models: the zoo GPT and HF GPT-2 (profiled for real), and a Llama-3.2-1B-shaped
model planned under fake tensors (accelerator op times only; nothing measured).
For each model, link and time source: the Pareto frontier (predicted peak,
predicted overhead over the plain step) of the DP without offload, and with
keep / recompute / offload chosen jointly (``gradckpt.frontier(..., offload=)``). A
recomputed block may also move the input it keeps to host (``recompute_offload``), and
offloaded blocks may stream (each saved tensor out when saved, back one ahead of its
use: ``OffloadOptions(stream=True)``), so the curve with offload goes on below the
least peak without it (floors, the plan at 0.9 x the floor without offload, and their
runs: ``benchmarks/offload_floor.py``).

What is measured (host-copy backend: saved bytes leave torch's allocator for a
host store outside it): for every frontier point that offloads (25 GB/s, CPU
times), and for the plans made with offload at up to six budgets of the curve
without it (mixed keep / recompute / offload), the plan is applied and one step
run under the allocator tracker: gradients are compared bit for bit with the plain step (dropout on, same
seed), the allocator's peak with the prediction, and the host bytes the
backend held with the predicted ones.

Usage:
    python -m benchmarks.offload            # GPT (zoo), HF GPT-2, Llama-1B (fake): ~10 min
    python -m benchmarks.offload --quick    # smoke test
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import gradckpt
from benchmarks.harness import (
    base_parser,
    info_block,
    load_average,
    machine_info,
    markdown_table,
    mib,
    settle,
    verdict,
    write_results,
)
from gradckpt.apply.apply import applied_units
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.measure.engine_costs import EngineCosts
from gradckpt.planning import simulate
from gradckpt.planning.kinds.offload.solve import offload_candidates
from gradckpt.profiling.fake import SPEEDS, estimate_time
from gradckpt.testing import make

LINKS = {"25 GB/s": 25e9, "400 GB/s": 400e9}
#: Decisions that move bytes to host: a block's saved tensors, or a recomputed block's input.
MOVING = ("offload", "recompute_offload")
FULL = {
    "gpt": dict(layers=6, d_model=128, seq=128, batch=4),
    "hf-gpt2": dict(layers=4, hidden=128, seq=128),
    "llama-1b": dict(fake=True),  # Llama-3.2-1B-shaped, planned under fake tensors
}
QUICK = {"gpt": dict(layers=3, d_model=32, seq=32, batch=2, vocab=512)}


def accelerator_timed(prof: gradckpt.Profile) -> gradckpt.Profile:
    """``prof`` with op times estimated at an accelerator's speed (FLOPs and bytes written)."""
    speed = SPEEDS["cuda"]
    out_bytes = lambda op: sum(prof.storages[s].nbytes for s in op.outputs)  # noqa: E731
    ops = tuple(replace(op, time=estimate_time(op.flops, out_bytes(op), speed)) for op in prof.ops)
    fwd = {u.index: 0.0 for u in prof.units}
    bwd = dict(fwd)
    for op in ops:
        if op.unit >= 0:
            (bwd if op.backward else fwd)[op.unit] += op.time
    units = tuple(replace(u, fwd_time=fwd[u.index], bwd_time=bwd[u.index]) for u in prof.units)
    # The engine's Python costs were measured against CPU kernels; on a GPU they run
    # ahead of the kernels, asynchronously: left out here (zero), for every plan alike.
    return replace(prof, ops=ops, units=units, step_time=sum(op.time for op in ops),
                   engine_costs=EngineCosts())  # fmt: skip


def _example(name: str, sizes: dict[str, Any]):
    if name == "hf-gpt2":
        from gradckpt.integrations.hf.zoo import hf_example

        ex = hf_example("gpt2", **sizes)
        ex.model.config.use_cache = False
        return ex
    return make(name, **sizes)


def _step(ex, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    ex.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with AllocatorTracker() as allocator:
        loss = ex.loss_fn()
        loss.backward()
    grads = {k: p.grad.clone() for k, p in ex.model.named_parameters() if p.grad is not None}
    ex.model.zero_grad(set_to_none=True)
    return loss.detach(), grads, state_bytes(ex.model) + allocator.peak_bytes


def mib2(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def _curve(points) -> list[dict[str, Any]]:
    return [
        {"peak_bytes": p.peak_bytes, "overhead": p.overhead,
         "offloaded": [u.path for u in p.plan.units if u.mode in MOVING]}
        for p in points
    ]  # fmt: skip


def _best_at(curve: list[dict[str, Any]], budget: int) -> float:
    return min((p["overhead"] for p in curve if p["peak_bytes"] <= budget), default=float("inf"))


def _overhead(x: float) -> str:
    return "no plan" if x == float("inf") else f"{x:+.1%}"


def _compare(without: list[dict], with_offload: list[dict]) -> dict[str, Any]:
    budgets = sorted({p["peak_bytes"] for p in without + with_offload})
    gaps = [(b, _best_at(without, b), _best_at(with_offload, b)) for b in budgets]
    finite = [(b, a, o) for b, a, o in gaps if o < float("inf")]
    return {
        "at_or_below_everywhere": all(o <= a for _, a, o in gaps),
        "strictly_below_somewhere": any(o < a for _, a, o in gaps),
        "least_peak_without": min(p["peak_bytes"] for p in without),
        "least_peak_with": min(p["peak_bytes"] for p in with_offload),
        "largest_gain": max((a - o for _, a, o in finite if a < float("inf")), default=0.0),
    }


def run_fake(name: str, points: int) -> dict[str, Any]:
    """A model too big for this machine (a built-in CLI target), planned under fake tensors:
    accelerator op times only, nothing measured."""
    from gradckpt.cli.targets import resolve

    target = resolve(name, fake=True, device="cpu")
    prof = accelerator_timed(gradckpt.profile(target.model, target.loss_fn, fake=True))
    without = _curve(gradckpt.frontier(target.model, target.loss_fn, profile=prof, points=points))
    curves: dict[str, Any] = {"accelerator": {"without": without}}
    for link, rate in LINKS.items():
        options = gradckpt.OffloadOptions(d2h_bandwidth=rate, h2d_bandwidth=rate)
        pts = gradckpt.frontier(target.model, target.loss_fn, profile=prof, points=points,
                                offload=options)  # fmt: skip
        curve = _curve(pts)
        curves["accelerator"][link] = {"curve": curve, **_compare(without, curve)}
    return {"sizes": "built-in target, fake tensors (nothing allocated, nothing measured)",
            "plain_peak_bytes": prof.measured_peak_bytes,
            "plain_step_s_accelerator": prof.step_time, "curves": curves, "measured": []}  # fmt: skip


def run_model(name: str, sizes: dict[str, Any], points: int) -> dict[str, Any]:
    if sizes.get("fake"):
        return run_fake(name, points)
    ex = _example(name, sizes)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    timings = {"cpu": prof, "accelerator": accelerator_timed(prof)}
    curves: dict[str, Any] = {}
    checked: list[gradckpt.Plan] = []
    for source, timed in timings.items():
        without = _curve(gradckpt.frontier(ex.model, ex.loss_fn, profile=timed, points=points))
        curves[source] = {"without": without}
        for link, rate in LINKS.items():
            options = gradckpt.OffloadOptions(d2h_bandwidth=rate, h2d_bandwidth=rate)
            pts = gradckpt.frontier(ex.model, ex.loss_fn, profile=timed, points=points,
                                    offload=options)  # fmt: skip
            curve = _curve(pts)
            curves[source][link] = {"curve": curve, **_compare(without, curve)}
            if source == "cpu" and link == "25 GB/s":
                checked = _to_measure(prof, options, pts, without)
    measured = [_measure(ex, prof, plan) for plan in checked]
    return {"sizes": sizes, "plain_peak_bytes": prof.measured_peak_bytes,
            "plain_step_s_cpu": prof.step_time,
            "plain_step_s_accelerator": timings["accelerator"].step_time,
            "curves": curves, "measured": measured}  # fmt: skip


def _to_measure(prof, options, points, without, most: int = 6) -> list[gradckpt.Plan]:
    """The frontier's plans that offload, and plans made with offload at up to ``most``
    of the budgets of the curve without it (mixed decisions), each once."""
    plans = [p.plan for p in points]
    plans += offload_candidates(prof, options, [p["peak_bytes"] for p in without], most=most)
    seen, out = set(), []
    for plan in plans:
        if any(u.mode in MOVING for u in plan.units) and plan.items not in seen:
            seen.add(plan.items)
            out.append(plan)
    return out


def _measure(ex, prof: gradckpt.Profile, plan: gradckpt.Plan) -> dict[str, Any]:
    loss0, grads0, _ = _step(ex, 0)
    pred = simulate(prof, plan)
    gradckpt.apply(ex.model, plan)
    try:
        loss, grads, peak = _step(ex, 0)
        session = next(s.runtime.session for s in applied_units(ex.model).values()
                       if isinstance(s.runtime, OffloadRuntime))  # fmt: skip
        host = session.backend.peak_host_bytes
    finally:
        gradckpt.remove(ex.model)
    equal = torch.equal(loss, loss0) and grads.keys() == grads0.keys() and all(
        torch.equal(grads[k], grads0[k]) for k in grads0
    )
    # A plan that chunks sums in another order (docs/chunking.md): held to 1e-5 relative.
    chunked = any(u.mode == "chunk" for u in plan.units) or bool(plan.token_chunks)
    close = grads.keys() == grads0.keys() and all(
        float((grads[k] - grads0[k]).norm()) <= 1e-5 * float(grads0[k].norm()) for k in grads0
    )
    return {
        "offloaded": [u.path for u in plan.units if u.mode == "offload"],
        "streamed": bool(plan.offload is not None and plan.offload.stream),
        "boundaries": [u.path for u in plan.units if u.mode == "recompute_offload"],
        "other": {u.path: u.mode for u in plan.units if u.mode not in ("keep", *MOVING)},
        "predicted_peak_bytes": pred.peak_bytes,
        "measured_peak_bytes": peak, "predicted_host_bytes": pred.host_bytes,
        "measured_host_bytes": host, "gradients_bit_equal": equal, "chunked": chunked,
        "gradients_within_1e-5": close,
    }  # fmt: skip


def _exact(m: dict[str, Any]) -> str:
    if m["gradients_bit_equal"]:
        return "yes"
    if m.get("chunked") and m.get("gradients_within_1e-5"):
        return "within 1e-5 (chunked: another order of sums)"
    return "**NO**"


def render(data: dict[str, Any]) -> str:
    lines = [
        "# Offload: the frontier with and without offload (CPU; timing SIMULATED)",
        "",
        "**Timing is simulated on CPU.** No GPU was used: every overhead below is the "
        "planner's prediction from a stated link bandwidth (not measured) against op "
        "times either measured on this CPU (`cpu`) or estimated from FLOPs and bytes at "
        "an accelerator's speed (`accelerator`: 400 TFLOP/s, 2.5 TB/s). What is measured: "
        "gradients (bit-equal to the plain step), the allocator's peak and the host bytes, "
        "with the host-copy backend (saved bytes moved to a host store outside torch's "
        "allocator).",
        "",
    ]
    for name, result in data["models"].items():
        lines += [f"## {name}", "", f"sizes: {result['sizes']}; plain peak "
                  f"{mib(result['plain_peak_bytes'])} MiB", ""]  # fmt: skip
        rows = []
        for source, curves in result["curves"].items():
            for link in LINKS:
                c = curves[link]
                rows.append([
                    source, link, verdict(c["at_or_below_everywhere"]),
                    verdict(c["strictly_below_somewhere"]), mib2(c["least_peak_without"]),
                    mib2(c["least_peak_with"]), f"{c['largest_gain']:.1%}",
                ])  # fmt: skip
        lines += [markdown_table(
            ["op times", "link (simulated)", "with offload at or below everywhere",
             "strictly below somewhere", "least peak without (MiB)", "least peak with (MiB)",
             "largest overhead cut at one budget"], rows), ""]  # fmt: skip
        for source, curves in result["curves"].items():
            table = []
            budgets = sorted({p["peak_bytes"] for p in curves["without"]})
            # Below the least peak without offload, the curves with it go on: their points.
            below = sorted({p["peak_bytes"] for link in LINKS for p in curves[link]["curve"]
                            if p["peak_bytes"] < budgets[0]})  # fmt: skip
            for b in below + budgets:
                row = [mib2(b), _overhead(_best_at(curves["without"], b))]
                row += [_overhead(_best_at(curves[link]["curve"], b)) for link in LINKS]
                table.append(row)
            lines += [f"Predicted overhead at each budget, {source} op times (rows above the "
                      "least peak without offload: only offload reaches them):", "",
                      markdown_table(["budget (MiB)", "without offload",
                                      *(f"with offload, {k}" for k in LINKS)], table), ""]  # fmt: skip
        if not result["measured"]:
            lines += ["Nothing measured: planned under fake tensors (too big for this machine).",
                      ""]  # fmt: skip
            continue
        rows = [[", ".join(m["offloaded"]) or "-", "yes" if m.get("streamed") else "no",
                 ", ".join(m.get("boundaries", ())) or "-",
                 ", ".join(f"{k}: {v}" for k, v in m["other"].items())
                 or "-", mib2(m["predicted_peak_bytes"]), mib2(m["measured_peak_bytes"]),
                 mib2(m["predicted_host_bytes"]), mib2(m["measured_host_bytes"]),
                 _exact(m)] for m in result["measured"]]  # fmt: skip
        lines += ["Measured (host-copy backend) for the offloading plans of the 25 GB/s, cpu "
                  "setting (frontier points, and plans at up to six budgets):", "", markdown_table(
            ["offloaded", "streamed", "input offloaded (recompute_offload)", "other decisions",
             "predicted peak (MiB)", "measured peak, allocator "
             "(MiB)", "predicted host (MiB)", "measured host (MiB)", "gradients bit-equal"],
            rows), ""]  # fmt: skip
    lines += ["## Machine", "", info_block(data["info"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    settle(args)
    models = QUICK if args.quick else FULL
    before = load_average()
    data = {"models": {}, "info": {}}
    for name, sizes in models.items():
        print(f"{name} ...", flush=True)
        data["models"][name] = run_model(name, sizes, points=8 if args.quick else 24)
    data["info"] = machine_info(quick=args.quick, links=list(LINKS),
                                load_average_before="/".join(f"{x:.2f}" for x in before),
                                load_average_after="/".join(f"{x:.2f}" for x in load_average()),
                                timing="simulated (no GPU)")  # fmt: skip
    md, js = write_results(args.out, "offload", render(data), data)
    print(render(data))
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
