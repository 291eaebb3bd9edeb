"""Offload below recompute's floor (CPU; timing SIMULATED): the least peak with and without.

Recomputing a block keeps its input; ``RecomputeOffload`` moves that input to
host memory too. For each model this prints the least peak the planner reaches
without offload and with it (offloaded blocks and offloaded boundaries chosen
jointly), with segments (nested recompute) and without (as under FSDP), then:

* the plan at 0.9 x the floor without offload: planned with ``offload=``, does
  it fit (or what the error says);
* the predicted overhead near the floor (2% above it) with and without offload;
* the leanest plan with offload, run: allocator peak against the prediction,
  gradients bit for bit against the plain step (dropout on), host bytes.

TIMING IS SIMULATED: overheads are the planner's prediction from the stated
25 GB/s link against op times measured on this CPU. Memory and gradients are
measured (host-copy backend: moved bytes leave torch's allocator).

Usage:
    python -m benchmarks.offload_floor           # zoo GPT, HF GPT-2 and Llama configs
    python -m benchmarks.offload_floor --quick   # two small models
"""

from __future__ import annotations

import sys
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
    settle,
    write_results,
)
from gradckpt.apply.apply import applied_units
from gradckpt.engine.offload.runtime import OffloadRuntime
from gradckpt.measure import AllocatorTracker, state_bytes
from gradckpt.planning import simulate
from gradckpt.planning.kinds.offload.floor import least_peak_offload
from gradckpt.planning.solve import solve
from gradckpt.planning.solving.solvers import _where, least_peak_plan
from gradckpt.testing import make

OPTIONS = gradckpt.OffloadOptions(d2h_bandwidth=25e9, h2d_bandwidth=25e9, min_bytes=1024)
NARROW = dict(layers=8, seq=128, batch=8, vocab=64)
FULL = {
    "gpt": ("zoo", dict(layers=6, d_model=128, seq=128, batch=4)),
    "gpt-narrow": ("zoo", dict(NARROW, d_model=32)),
    "hf-gpt2": ("gpt2", dict(layers=4, hidden=128, seq=128)),
    "hf-gpt2-6": ("gpt2", dict(layers=6, hidden=128, seq=128)),
    "hf-gpt2-narrow": ("gpt2", dict(NARROW, hidden=32, heads=2)),
    "hf-llama-narrow": ("llama", dict(NARROW, hidden=32, heads=2)),
}
QUICK = {
    "gpt-narrow": ("zoo", dict(NARROW, layers=4, d_model=32)),
    "hf-gpt2-narrow": ("gpt2", dict(NARROW, layers=4, hidden=32, heads=2)),
}


def _example(family: str, sizes: dict[str, Any]):
    if family == "zoo":
        return make("gpt", **sizes)
    from gradckpt.integrations.hf.zoo import hf_example

    ex = hf_example(family, **sizes)
    ex.model.config.use_cache = False
    return ex


def _step(ex) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    ex.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with AllocatorTracker() as allocator:
        loss = ex.loss_fn()
        loss.backward()
    grads = {k: p.grad.clone() for k, p in ex.model.named_parameters() if p.grad is not None}
    ex.model.zero_grad(set_to_none=True)
    return loss.detach(), grads, state_bytes(ex.model) + allocator.peak_bytes


def _measure(ex, prof, plan, plain) -> dict[str, Any]:
    pred = simulate(prof, plan)
    gradckpt.apply(ex.model, plan)
    try:
        loss, grads, peak = _step(ex)
        sessions = [s.runtime.session for s in applied_units(ex.model).values()
                    if isinstance(s.runtime, OffloadRuntime) and s.runtime.session is not None]  # fmt: skip
        host = sessions[0].backend.peak_host_bytes if sessions else 0
    finally:
        gradckpt.remove(ex.model)
    loss0, grads0, _ = plain
    equal = (
        torch.equal(loss, loss0)
        and grads.keys() == grads0.keys()
        and all(torch.equal(grads[k], grads0[k]) for k in grads0)
    )
    return {"predicted_peak_bytes": pred.peak_bytes, "measured_peak_bytes": peak,
            "predicted_host_bytes": pred.host_bytes, "measured_host_bytes": host,
            "gradients_bit_equal": equal,
            "modes": sorted({u.mode for u in plan.units}),
            "streamed": bool(plan.offload is not None and plan.offload.stream)}  # fmt: skip


def _at(prof, budget: int, segments: bool, offload) -> dict[str, Any]:
    try:
        plan = solve(prof, budget, segments=segments, offload=offload)
    except gradckpt.BudgetError as e:
        return {"fits": False, "error": str(e)}
    return {"fits": True, "overhead": plan.predicted_overhead, "plan": plan}


def run_model(family: str, sizes: dict[str, Any]) -> dict[str, Any]:
    ex = _example(family, sizes)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    plain = _step(ex)
    out: dict[str, Any] = {"sizes": sizes, "family": family,
                           "plain_peak_bytes": prof.measured_peak_bytes,
                           "param_bytes": prof.param_bytes, "grad_bytes": prof.grad_bytes}  # fmt: skip
    for segments in (True, False):
        _, without = least_peak_plan(prof, segments=segments)
        floor, with_offload = least_peak_offload(prof, OPTIONS, segments=segments)
        tenth = _at(prof, int(0.9 * without.peak_bytes), segments, OPTIONS)
        near = int(1.02 * without.peak_bytes)
        near_without = _at(prof, near, segments, None)
        near_with = _at(prof, near, segments, OPTIONS)
        row = {
            "floor_without": without.peak_bytes,
            "overhead_at_floor_without": without.overhead,
            "floor_with": with_offload.peak_bytes,
            "overhead_at_floor_with": with_offload.overhead,
            "host_at_floor_with": with_offload.host_bytes,
            # Where each floor's peak is: a boundary held at the start of backward can
            # move; parameters, gradients and one block's recompute at its end cannot.
            "floor_without_at": _where(prof, without.peak_position),
            "floor_with_at": _where(prof, with_offload.peak_position),
            "at_0.9": {k: v for k, v in tenth.items() if k != "plan"},
            "near_overhead_without": near_without.get("overhead"),
            "near_overhead_with": near_with.get("overhead"),
            "floor_plan_run": _measure(ex, prof, floor, plain),
        }
        if tenth.get("fits"):
            row["at_0.9"]["budget"] = int(0.9 * without.peak_bytes)
            row["at_0.9"]["run"] = _measure(ex, prof, tenth["plan"], plain)
        out["segments" if segments else "no_segments"] = row
    return out


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def render(data: dict[str, Any]) -> str:
    lines = [
        "# Offload below recompute's floor (CPU; timing SIMULATED)",
        "",
        "**Overheads are simulated**: the planner's prediction from a stated 25 GB/s link "
        "against op times measured on this CPU (no GPU). Peaks are measured at the "
        "allocator; gradients compared bit for bit with the plain step (dropout on); host "
        "bytes counted by the host-copy backend.",
        "",
    ]
    rows, runs, fits_runs = [], [], []
    for name, r in data["models"].items():
        for key, label in (("segments", "yes"), ("no_segments", "no")):
            c = r[key]
            tenth = c["at_0.9"]
            verdict = ("fits" if tenth.get("fits") else "refused") + (
                f" ({_pct(tenth['overhead'])})" if tenth.get("fits") else "")  # fmt: skip
            rows.append([name, label, _mib(c["floor_without"]), _pct(c["overhead_at_floor_without"]),
                         _mib(c["floor_with"]), _pct(c["overhead_at_floor_with"]),
                         f"{c['floor_with'] / c['floor_without']:.3f}", _mib(c["host_at_floor_with"]),
                         verdict, _pct(c["near_overhead_without"]), _pct(c["near_overhead_with"]),
                         c["floor_without_at"], c["floor_with_at"]])  # fmt: skip
            m = c["floor_plan_run"]
            if "run" in tenth:
                t = tenth["run"]
                fits_runs.append([name, label, _mib(tenth["budget"]), ", ".join(t["modes"]),
                                  "yes" if t["streamed"] else "no",
                                  _mib(t["predicted_peak_bytes"]), _mib(t["measured_peak_bytes"]),
                                  "yes" if t["measured_peak_bytes"] <= tenth["budget"] else "**NO**",
                                  _mib(t["measured_host_bytes"]),
                                  "yes" if t["gradients_bit_equal"] else "**NO**"])  # fmt: skip
            runs.append([name, label, ", ".join(m["modes"]), "yes" if m.get("streamed") else "no",
                         _mib(m["predicted_peak_bytes"]),
                         _mib(m["measured_peak_bytes"]), _mib(m["predicted_host_bytes"]),
                         _mib(m["measured_host_bytes"]),
                         "yes" if m["gradients_bit_equal"] else "**NO**"])  # fmt: skip
    lines += [markdown_table(
        ["model", "segments", "least peak without (MiB)", "its overhead",
         "least peak with offload (MiB)", "its overhead", "with / without",
         "host at it (MiB)", "offload= at 0.9 x floor without", "overhead at 1.02 x, without",
         "with offload", "floor without: peak during", "floor with: peak during"], rows),
        ""]  # fmt: skip
    lines += ["The leanest plan with offload, run (host-copy backend):", "", markdown_table(
        ["model", "segments", "decisions", "streamed", "predicted peak (MiB)",
         "allocator peak (MiB)", "predicted host (MiB)", "measured host (MiB)",
         "gradients bit-equal"], runs), ""]  # fmt: skip
    if fits_runs:
        lines += ["The plan made with `offload=` at 0.9 x the floor without, run:", "",
                  markdown_table(
            ["model", "segments", "budget (MiB)", "decisions", "streamed",
             "predicted peak (MiB)", "allocator peak (MiB)", "within budget",
             "measured host (MiB)", "gradients bit-equal"], fits_runs), ""]  # fmt: skip
    lines += ["Sizes, plain peaks, parameters and gradients:", "", markdown_table(
        ["model", "sizes", "plain (MiB)", "parameters (MiB)", "gradients (MiB)"],
        [[n, f"{r['family']} {r['sizes']}", _mib(r["plain_peak_bytes"]), _mib(r["param_bytes"]),
          _mib(r["grad_bytes"])] for n, r in data["models"].items()]), ""]  # fmt: skip
    lines += ["## Machine", "", info_block(data["info"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    settle(args)
    models = QUICK if args.quick else FULL
    before = load_average()
    data: dict[str, Any] = {"models": {}, "info": {}}
    for name, (family, sizes) in models.items():
        print(f"{name} ...", flush=True)
        data["models"][name] = run_model(family, sizes)
    data["info"] = machine_info(quick=args.quick, link="25 GB/s (stated)",
                                load_average_before="/".join(f"{x:.2f}" for x in before),
                                load_average_after="/".join(f"{x:.2f}" for x in load_average()),
                                timing="simulated (no GPU)")  # fmt: skip
    md, js = write_results(args.out, "offload-floor", render(data), data)
    print(render(data))
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
