"""Predicted peaks against the allocator's measured peaks, plan by plan, model by model.

For each model the step is profiled once (per-op kernel workspaces measured at
the allocator); then for a set of plans (no checkpointing, every block, sqrt(N)
segments, save-matmuls, and the DP at the least feasible peak and 25/50/75% of
the way from it to the plain peak) the plan is applied and one untimed step is
measured at two levels: the allocator's peak (:class:`gradckpt.measure.AllocatorTracker`,
kernel workspaces included) and the tensors' (:class:`gradckpt.measure.MemoryTracker`).
The prediction error is simulated / allocator - 1; DP plans must hold their
budget at the allocator. Memory only: nothing is timed, so the numbers do not
depend on machine load.

Models: the zoo at its default sizes, the U-Net of issue #8 (3 levels, 32 base
channels, 128x128, batch 4), ``resnet_conv`` (8 basic blocks at 128x128) and,
when transformers is installed, GPT-2, Llama, BERT, ViT and T5 from small configs.

Usage:
    python -m benchmarks.allocator_accuracy            # every model (a few minutes)
    python -m benchmarks.allocator_accuracy --quick    # two tiny models (smoke test)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradckpt
from benchmarks.harness import (
    base_parser,
    info_block,
    machine_info,
    markdown_table,
    measure_peaks,
    mib,
    plain,
    settle,
    unknown_models,
    verdict,
    with_plan,
    write_results,
)
from gradckpt.planning.solving.solvers import (
    every_kth_plan,
    finish,
    save_matmuls_plan,
    sqrt_plan,
)
from gradckpt.testing import Example, make, resnet_conv

MEDIAN_TARGET, MAX_TARGET = 0.02, 0.05
HF_SIZES = dict(layers=2, hidden=64, heads=4, seq=64, batch=4)


def _zoo(name: str, **sizes: Any) -> Callable[[], Example]:
    return lambda: make(name, **sizes)


def _hf(name: str) -> Callable[[], Example]:
    def build() -> Example:
        from gradckpt.integrations.hf import disable_cache
        from gradckpt.integrations.hf.zoo import hf_example

        ex = hf_example(name, **HF_SIZES)
        disable_cache(ex.model)  # as gradckpt.fit does: no KV cache while training
        return ex

    return build


def models(quick: bool) -> dict[str, Callable[[], Example]]:
    if quick:
        return {"mlp": _zoo("mlp"), "unet": _zoo("unet", depth=2, base=4, image=16)}
    out = {n: _zoo(n) for n in ("mlp", "dropout_mlp", "gpt", "resnet", "unet", "bn_convnet")}
    out["unet-issue8"] = _zoo("unet", depth=3, base=32, image=128, batch=4)
    out["resnet_conv"] = resnet_conv
    try:
        import transformers  # noqa: F401
    except ImportError:
        return out
    for name in ("gpt2", "llama", "bert", "vit", "t5"):
        out[f"hf-{name}"] = _hf(name)
    return out


def _plans(prof: gradckpt.Profile) -> list[tuple[str, gradckpt.Plan, int | None]]:
    plans: list[tuple[str, gradckpt.Plan, int | None]] = []
    for label, make_plan in (("every_block", lambda: every_kth_plan(prof, 1)),
                             ("sqrt", lambda: sqrt_plan(prof)),
                             ("save_matmuls", lambda: save_matmuls_plan(prof))):  # fmt: skip
        try:
            plans.append((label, finish(prof, make_plan(), None, label)[0], None))
        except ValueError:
            continue  # e.g. no blocks to checkpoint
    planner = gradckpt.Planner(prof)  # chain and DP built once for every budget below
    least, least_pred = planner.least_peak()
    top = prof.measured_peak_bytes
    plans.append(("dp@least", least, least_pred.peak_bytes))
    for share in (0.25, 0.5, 0.75):
        budget = least_pred.peak_bytes + round(share * (top - least_pred.peak_bytes))
        try:
            plan = planner.plan(budget)
        except gradckpt.BudgetError:
            continue
        plans.append((f"dp@{share:.0%}", plan, budget))
    return plans


def run_model(name: str, build: Callable[[], Example], log: Callable[[str], None]) -> dict:
    ex = build()
    t0 = time.perf_counter()
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    profile_s = time.perf_counter() - t0
    workspace = max((op.workspace for op in prof.ops), default=0)
    log(f"{name}: plain {mib(prof.measured_peak_bytes)} MiB at the allocator, "
        f"{mib(prof.tracker_peak_bytes)} MiB of tensors; largest op workspace "
        f"{mib(workspace)} MiB")  # fmt: skip
    rows = []
    for label, plan, budget in [("none", None, None), *_plans(prof)]:
        predicted = plan.predicted_peak_bytes if plan is not None else prof.measured_peak_bytes
        install = with_plan(plan) if plan is not None else plain()
        allocator, tracker, _ = measure_peaks(ex, install)
        error = predicted / allocator - 1.0
        rows.append({
            "plan": label, "budget": budget, "predicted": predicted, "allocator": allocator,
            "tracker": tracker, "error": error,
            "fits": budget is None or allocator <= budget,
        })  # fmt: skip
        log(f"  {label:<14} predicted {mib(predicted):>8} allocator {mib(allocator):>8} "
            f"tensors {mib(tracker):>8} MiB  error {error:+.3%}")  # fmt: skip
    return {
        "model": name,
        "plain_allocator": prof.measured_peak_bytes,
        "plain_tracker": prof.tracker_peak_bytes,
        "max_op_workspace": workspace,
        "profile_s": profile_s,
        "rows": rows,
    }


def render(results: list[dict], info: dict, out: Path) -> None:
    errors = [abs(r["error"]) for m in results for r in m["rows"]]
    over = [(m["model"], r["plan"]) for m in results for r in m["rows"] if not r["fits"]]
    med, top = statistics.median(errors), max(errors)
    table = markdown_table(
        ["model", "plain: allocator / tensors (MiB)", "largest op workspace (MiB)", "plans",
         "max |error|", "budgets held at the allocator"],
        [(m["model"], f"{mib(m['plain_allocator'])} / {mib(m['plain_tracker'])}",
          mib(m["max_op_workspace"]), len(m["rows"]),
          f"{max(abs(r['error']) for r in m['rows']):.3%}",
          f"{sum(r['fits'] for r in m['rows'] if r['budget'])}/"
          f"{sum(1 for r in m['rows'] if r['budget'])}")
         for m in results],
    )  # fmt: skip
    detail = markdown_table(
        ["model", "plan", "budget (MiB)", "predicted (MiB)", "allocator (MiB)", "tensors (MiB)",
         "error"],
        [(m["model"], r["plan"], mib(r["budget"]), mib(r["predicted"]), mib(r["allocator"]),
          mib(r["tracker"]), f"{r['error']:+.3%}") for m in results for r in m["rows"]],
    )  # fmt: skip
    targets = markdown_table(
        ["target", "wanted", "measured", "verdict"],
        [("prediction vs allocator peak", f"median <= {MEDIAN_TARGET:.0%}, max <= {MAX_TARGET:.0%}",
          f"median {med:.3%}, max {top:.3%} over {len(errors)} plans",
          verdict(med <= MEDIAN_TARGET and top <= MAX_TARGET)),
         ("DP plans within budget at the allocator", "0 over",
          f"{len(over)} over" + (f": {over}" if over else ""), verdict(not over))],
    )  # fmt: skip
    md = "\n\n".join([
        f"# Predicted vs allocator-measured peaks on CPU ({info['date']})",
        "Peaks include parameters and buffers. *allocator*: the most the CPU allocator held "
        "during the step above what it held before (torch's profiler memory events; kernel "
        "workspaces included, checked against a malloc-level counter in "
        "`tests/measure/test_allocator.py`). *tensors*: `MemoryTracker`, op-created storages "
        "only. Memory is deterministic; nothing here is timed.",
        "## Summary", table, "## Targets", targets, "## Every plan", detail,
        "## Setup", info_block(info),
    ])  # fmt: skip
    data = {"info": info, "models": results, "median_error": med, "max_error": top}
    md_path, json_path = write_results(out, "allocator-accuracy", md, data, info["date"])
    print(md)
    print(f"\nwrote {md_path} and {json_path}")


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated subset of the models")
    args = p.parse_args(argv)
    settle(args)
    chosen = models(args.quick)
    if args.models:
        wanted = [m.strip() for m in args.models.split(",") if m.strip()]
        if error := unknown_models(wanted, chosen):
            p.error(error)
        chosen = {m: chosen[m] for m in wanted}
    started = time.perf_counter()
    results = [run_model(name, build, print) for name, build in chosen.items()]
    info = machine_info(quick=args.quick, models=list(chosen),
                        wall_time_s=round(time.perf_counter() - started, 1))  # fmt: skip
    render(results, info, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
