"""MLPs chunked along the tokens (#41 item 3): least peak and overhead on long sequences (CPU).

For each model (transformers Llama from a config, random weights, sequence >= 8x the
hidden size, attention dropout off as Llama trains by default):

* the least peak without chunking, with the head and the loss chunked only, and with
  MLPs chunked too, each plan measured at the allocator (parameters included);
* the plan for a budget of 0.9x the least peak without MLP chunking, which only MLP
  chunking meets.

Times are this thread's CPU time over interleaved rounds, as ratios over the plain
step: median and a bootstrap 95% interval of the per-round ratios.

Usage:
    python -m benchmarks.mlp_chunk            # Llama hidden 64 and 128, 1,024 tokens
    python -m benchmarks.mlp_chunk --quick    # one small model, a smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradckpt
from benchmarks.harness import (
    MiB,
    base_parser,
    fmt_interval,
    info_block,
    load_average,
    machine_info,
    markdown_table,
    plain,
    rerender,
    settle,
    with_plan,
    write_results,
)
from benchmarks.harness.stats import median_interval
from benchmarks.harness.steps import clear_grads, make_step, measure_peaks
from gradckpt.cli.common import describe_plan
from gradckpt.measure.timing import time_interleaved, work_clock
from gradckpt.planning.kinds.chunk.token_plan import allow_token_chunking
from gradckpt.testing import Example

LLAMA = dict(layers=4, heads=4, seq=1024, batch=1, vocab=128, dropout=0.0)
FULL = {
    "hf-llama-h64-t1024": dict(LLAMA, hidden=64),
    "hf-llama-h128-t1024": dict(LLAMA, hidden=128),
}
QUICK = {"hf-llama-h32-t256": dict(LLAMA, layers=2, hidden=32, seq=256)}


def _example(sizes: dict[str, Any]) -> Example:
    from gradckpt.integrations.hf.zoo import hf_example

    ex = hf_example("llama", **sizes)
    ex.model.config.use_cache = False
    return ex


def run_model(name: str, sizes: dict[str, Any], args: Any) -> dict[str, Any]:
    print(f"== {name}: llama {sizes}")
    build = lambda: _example(sizes)  # noqa: E731 - same seed: same weights and batch
    ex0 = build()
    prof = gradckpt.profile(ex0.model, ex0.loss_fn)
    plans: dict[str, gradckpt.Plan] = {}
    plans["no chunking: least peak"] = gradckpt.Planner(prof, chunking=False).least_peak()[0]
    with allow_token_chunking(False):
        head_only = gradckpt.Planner(prof).least_peak()[0]
    plans["head chunking: least peak"] = head_only
    plans["head + MLP chunking: least peak"] = gradckpt.Planner(prof).least_peak()[0]
    budget = int(0.9 * head_only.predicted_peak_bytes)
    plans["head + MLP chunking @ 0.9x head-only least"] = gradckpt.Planner(prof).plan(budget)
    contenders = {"plain": (build(), plain(), {"plan": "keep all", "budget": None,
                                                "predicted": prof.measured_peak_bytes})}
    for label, plan in plans.items():
        row = {"plan": describe_plan(plan), "budget": plan.budget_bytes,
               "predicted": plan.predicted_peak_bytes, "token_chunks": plan.token_chunks}
        contenders[label] = (build(), with_plan(plan), row)  # fmt: skip
    measured: dict[str, dict[str, Any]] = {}
    for label, (ex, install, row) in contenders.items():
        peak, _, loss = measure_peaks(ex, install, args.seed)
        measured[label] = {**row, "peak": peak, "loss": loss}
        print(f"  {label:<44} peak {peak / MiB:9.2f} MiB  {row['plan']}")
    undos = [install(ex) for ex, install, _ in contenders.values()]
    try:
        steps = {k: make_step(ex, args.seed) for k, (ex, _, _) in contenders.items()}
        times = time_interleaved(
            steps, warmup=args.warmup, repeats=args.repeats, clock=work_clock("cpu")
        )
    finally:
        for undo in reversed(undos):
            undo()
        for ex, _, _ in contenders.values():
            clear_grads(ex.model)
    base = times["plain"].times
    for label, timing in times.items():
        measured[label]["ratio"] = median_interval([t / b for t, b in zip(timing.times, base)])
    return {"name": name, "sizes": sizes, "rows": measured}


def report(results: list[dict[str, Any]], info: dict[str, Any]) -> str:
    out = [
        "# MLPs chunked along the tokens (#41 item 3), CPU",
        "",
        "Peaks: the allocator's, parameters included, one untimed step each. Overheads:",
        "CPU thread time over the plain step, median and bootstrap 95% interval of the",
        "per-round ratios (interleaved rounds, a shared 2-core machine: wide intervals).",
        "",
    ]
    for r in results:
        rows_ = r["rows"]
        head = rows_["head chunking: least peak"]["peak"]
        mlp = rows_["head + MLP chunking: least peak"]["peak"]
        out += [
            f"## {r['name']}: llama {r['sizes']}",
            "",
            f"least peak, measured: head chunking only {head / MiB:.2f} MiB, with MLP chunking "
            f"{mlp / MiB:.2f} MiB: **{mlp / head:.3f}x**.",
            "",
        ]
        rows = [
            [label, "-" if row["budget"] is None else f"{row['budget'] / MiB:.2f} MiB",
             row["plan"] + (f"; MLPs in {row['token_chunks'][0][1]} slices"
                            if row.get("token_chunks") else ""),
             f"{row['predicted'] / MiB:.2f} MiB", f"{row['peak'] / MiB:.2f} MiB",
             fmt_interval(row.get("ratio"))]
            for label, row in rows_.items()
        ]  # fmt: skip
        out += [markdown_table(
            ["contender", "budget", "plan", "predicted peak", "measured peak", "overhead"], rows
        ), ""]  # fmt: skip
    out += ["## Machine", "", info_block(info)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    settle(args)
    if args.from_json is not None:  # re-render an earlier run's report, measuring nothing
        rerender(args.from_json, args.out, "mlp-chunk", report)
        return 0
    models = QUICK if args.quick else FULL
    before = load_average()
    info = machine_info(threads=args.threads, quick=args.quick, warmup=args.warmup,
                        repeats=args.repeats)  # fmt: skip
    results = [run_model(name, sizes, args) for name, sizes in models.items()]
    info["load_average_before"] = "/".join(f"{x:.2f}" for x in before)
    info["load_average_after"] = "/".join(f"{x:.2f}" for x in load_average())
    markdown = report(results, info)
    md, js = write_results(args.out, "mlp-chunk", markdown, {"info": info, "results": results})
    print(markdown)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
