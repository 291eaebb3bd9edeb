"""Chunking the head and the loss (#41): least peak and overhead, measured at the allocator (CPU).

For each model (transformers causal LMs from configs, random weights, dropout on):

* the least peak each strategy reaches: keep/recompute/selective (``chunking=False``),
  the same with offload (a stated 25 GB/s link), and with chunking;
* three budgets: halfway from the recompute-only floor to the plain peak, that floor,
  and 0.85x it. Each strategy's plan there (or "no plan fits"), its predicted and
  measured peak and its overhead;
* a hand-written chunked cross-entropy (the Mini-Sequence Transformer / torchtune
  pattern: the base model's hidden states, then ``lm_head`` and the loss in 8 slices,
  each under ``torch.utils.checkpoint``), alone and with every block checkpointed by
  torch, and gradckpt planned at each one's measured peak.

Peaks are the allocator's (parameters included) in one untimed step per contender.
Times are this thread's CPU time over interleaved rounds (robust to other load on a
shared machine), as ratios over the plain step: median and a bootstrap 95% interval
of the per-round ratios. Offload's overhead is SIMULATED from the stated link (on CPU
its copies are memcpys to host memory), so it is the planner's, not a measurement.

Usage:
    python -m benchmarks.chunk            # HF GPT-2 (vocabulary 8,000) and Llama (32,000)
    python -m benchmarks.chunk --quick    # tiny sizes, a smoke run
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gradckpt
from benchmarks.harness import (
    MiB,
    base_parser,
    fmt_interval,
    info_block,
    load_average,
    machine_info,
    markdown_table,
    per_block,
    plain,
    rerender,
    settle,
    torch_checkpoint,
    with_plan,
    write_results,
)
from benchmarks.harness.stats import median_interval
from benchmarks.harness.steps import clear_grads, make_step, measure_peaks
from gradckpt.cli.common import describe_plan
from gradckpt.measure.timing import time_interleaved, work_clock
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.testing import Example

LINK = gradckpt.OffloadOptions(d2h_bandwidth=25e9, h2d_bandwidth=25e9, min_bytes=1024)
HAND_CHUNKS = 8
FULL = {
    "hf-gpt2-8k": ("gpt2", dict(layers=6, hidden=256, heads=4, seq=256, batch=4, vocab=8000)),
    "hf-llama-32k": ("llama", dict(layers=4, hidden=64, heads=4, seq=256, batch=4, vocab=32000)),
}
QUICK = {
    "hf-gpt2-8k": ("gpt2", dict(layers=2, hidden=64, heads=4, seq=64, batch=2, vocab=8000)),
}


def _example(family: str, sizes: dict[str, Any]) -> Example:
    from gradckpt.integrations.hf.zoo import hf_example

    ex = hf_example(family, **sizes)
    ex.model.config.use_cache = False
    return ex


def _hand_chunked(ex: Example, chunks: int = HAND_CHUNKS) -> Example:
    """The same model and batch, its loss written by hand: hidden states from the base
    model, then the head and the cross-entropy in ``chunks`` slices, each checkpointed."""
    model, head = ex.model, ex.model.lm_head
    ids, labels = ex.inputs["input_ids"], ex.inputs["labels"]

    def part(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(rows).float(), targets, reduction="sum")

    def loss_fn() -> torch.Tensor:
        hidden = model.base_model(input_ids=ids).last_hidden_state
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]  # as ForCausalLMLoss shifts
        rows, targets = hidden.reshape(-1, hidden.shape[-1]), shifted.reshape(-1)
        size = -(-rows.shape[0] // chunks)
        total = sum(
            checkpoint(part, r, t, use_reentrant=False)
            for r, t in zip(rows.split(size), targets.split(size))
        )
        return total / (targets != -100).sum()

    return replace(ex, name=f"{ex.name}+hand-chunked", loss_fn=loss_fn)


def _plan(planner: gradckpt.Planner, budget: int) -> gradckpt.Plan | None:
    try:
        return planner.plan(budget)
    except BudgetError:
        return None


def _describe(plan: gradckpt.Plan | None) -> str:
    if plan is None:
        return "no plan fits"
    chunked = [f"{u.path} in {u.decision.chunks} slices" for u in plan.units if u.mode == "chunk"]
    return "; ".join([describe_plan(plan), *chunked])


def _mib(nbytes: int | None) -> str:
    return f"{nbytes / MiB:.2f} MiB" if nbytes else "-"


def run_model(name: str, family: str, sizes: dict[str, Any], args: Any) -> dict[str, Any]:
    print(f"== {name}: {family} {sizes}")
    build = lambda: _example(family, sizes)  # noqa: E731 - same seed: same weights and batch
    ex0 = build()  # profiled on a model of its own
    prof = gradckpt.profile(ex0.model, ex0.loss_fn)
    planners = {
        "recompute": gradckpt.Planner(prof, chunking=False),
        "offload": gradckpt.Planner(prof, chunking=False, offload=LINK),
        "chunk": gradckpt.Planner(prof),
    }
    least = {k: p.least_peak()[1].peak_bytes for k, p in planners.items()}
    floor, top = least["recompute"], prof.measured_peak_bytes
    budgets = {"halfway": (floor + top) // 2, "floor": floor, "0.85x floor": int(0.85 * floor)}
    contenders: dict[str, tuple[Example, Any, dict[str, Any]]] = {
        "plain": (build(), plain(), {"budget": None, "plan": "keep all", "predicted": top}),
    }
    for where, budget in budgets.items():
        for kind, planner in planners.items():
            plan = _plan(planner, budget)
            row = {"budget": budget, "where": where, "kind": kind, "plan": _describe(plan),
                   "predicted": plan.predicted_peak_bytes if plan else None,
                   "predicted_overhead": plan.predicted_overhead if plan else None}  # fmt: skip
            if plan is not None:
                contenders[f"{kind} @ {where}"] = (build(), with_plan(plan), row)
            else:
                contenders[f"{kind} @ {where}"] = (None, None, row)  # type: ignore[assignment]
    hand = _hand_chunked(build())
    contenders["hand chunked CE"] = (hand, plain(), {"plan": f"{HAND_CHUNKS} slices, by hand"})
    hand_ckpt = _hand_chunked(build())
    blocks = per_block(torch_checkpoint, hand_ckpt.block_paths)
    contenders["hand chunked CE + torch ckpt per block"] = (
        hand_ckpt, blocks, {"plan": f"{HAND_CHUNKS} slices + every block, by hand"},
    )  # fmt: skip
    measured: dict[str, dict[str, Any]] = {}
    for label, (ex, install, row) in list(contenders.items()):
        if ex is None:
            measured[label] = {**row, "peak": None}
            continue
        peak, _, loss = measure_peaks(ex, install, args.seed)
        measured[label] = {**row, "peak": peak, "loss": loss}
        print(f"  {label:<44} peak {_mib(peak):>12}  {row['plan']}")
        if label.startswith("hand"):  # gradckpt at the hand-written baseline's peak
            plan = _plan(planners["chunk"], peak)
            at = f"gradckpt at {label}'s peak"
            row2 = {"budget": peak, "plan": _describe(plan),
                    "predicted": plan.predicted_peak_bytes if plan else None,
                    "predicted_overhead": plan.predicted_overhead if plan else None}  # fmt: skip
            if plan is None:
                measured[at] = {**row2, "peak": None}
                continue
            ex2 = build()
            peak2, _, loss2 = measure_peaks(ex2, with_plan(plan), args.seed)
            measured[at] = {**row2, "peak": peak2, "loss": loss2}
            contenders[at] = (ex2, with_plan(plan), row2)
            print(f"  {at:<44} peak {_mib(peak2):>12}  {row2['plan']}")
    timed = {k: v for k, v in contenders.items() if v[0] is not None}
    undos = [install(ex) for ex, install, _ in timed.values()]
    try:
        steps = {k: make_step(ex, args.seed) for k, (ex, _, _) in timed.items()}
        print(f"  timing {len(steps)} contenders interleaved ({args.warmup} + {args.repeats})")
        times = time_interleaved(
            steps, warmup=args.warmup, repeats=args.repeats, clock=work_clock("cpu")
        )
    finally:
        for undo in reversed(undos):
            undo()
        for ex, _, _ in timed.values():
            clear_grads(ex.model)
    base = times["plain"].times
    for label, timing in times.items():
        ratios = [t / b for t, b in zip(timing.times, base)]
        measured[label]["ratio"] = median_interval(ratios)
    return {"name": name, "family": family, "sizes": sizes, "least": least,
            "budgets": budgets, "plain_peak": top, "rows": measured}  # fmt: skip


def report(results: list[dict[str, Any]], info: dict[str, Any]) -> str:
    out = [
        "# Chunking the head and the loss (#41), CPU",
        "",
        "Peaks: the allocator's, parameters included, one untimed step each. Overheads:",
        "CPU thread time over the plain step, median and bootstrap 95% interval of the",
        "per-round ratios (interleaved rounds). Offload's overhead is the planner's,",
        "SIMULATED from a stated 25 GB/s link; its peak is measured.",
        "",
    ]
    for r in results:
        least = r["least"]
        out += [
            f"## {r['name']}: {r['family']} {r['sizes']}",
            "",
            f"plain peak {_mib(r['plain_peak'])}; least peak: keep/recompute "
            f"{_mib(least['recompute'])}, with offload {_mib(least['offload'])}, with chunking "
            f"{_mib(least['chunk'])} ({least['chunk'] / least['recompute']:.2f}x).",
            "",
        ]
        rows = []
        for label, row in r["rows"].items():
            budget = row.get("budget")
            fits = "-" if budget is None or row["peak"] is None else (
                "yes" if row["peak"] <= budget else "**no**")  # fmt: skip
            overhead = fmt_interval(row.get("ratio"))
            if row.get("kind") == "offload" and row.get("predicted_overhead") is not None:
                overhead = f"{row['predicted_overhead']:+.1%} (simulated)"
            rows.append([
                label, _mib(budget), row["plan"], _mib(row.get("predicted")),
                _mib(row.get("peak")), fits, overhead,
            ])  # fmt: skip
        out += [markdown_table(
            ["contender", "budget", "plan", "predicted peak", "measured peak", "fits",
             "overhead"], rows,
        ), ""]  # fmt: skip
    out += ["## Machine", "", info_block(info)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    settle(args)
    if args.from_json is not None:  # re-render an earlier run's report, measuring nothing
        rerender(args.from_json, args.out, "chunk", report)
        return 0
    models = QUICK if args.quick else FULL
    before = load_average()
    info = machine_info(threads=args.threads, quick=args.quick, warmup=args.warmup,
                        repeats=args.repeats)  # fmt: skip
    results = [run_model(name, family, sizes, args) for name, (family, sizes) in models.items()]
    info["load_average_before"] = "/".join(f"{x:.2f}" for x in before)
    info["load_average_after"] = "/".join(f"{x:.2f}" for x in load_average())
    markdown = report(results, info)
    md, js = write_results(args.out, "chunk", markdown, {"info": info, "results": results})
    print(markdown)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
