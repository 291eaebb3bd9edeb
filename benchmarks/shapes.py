"""Shapes benchmark: the budget holds while sequence lengths change, at what cost.

For HF GPT-2 and Llama (built from configs, random weights, ``use_cache`` off),
a run of training steps whose sequence lengths are drawn from a realistic,
right-skewed spread (log-uniform between the shortest and the longest length,
rounded up to a multiple of ``--multiple`` as a collator's ``pad_to_multiple_of``
would). The budget is set for the longest length: halfway between the least
peak any plan reaches there and the plain peak there.

Contenders, each on its own copy of the model (same weights and batches):

* ``plain``: no checkpointing (the time reference; its peak breaks the budget at
  long lengths);
* ``gradckpt``: ``gradckpt.fit`` at the first batch's length with the default
  ``on_new_shape="replan"``: each new length is planned (fake tensors) before it
  runs, later ones switch plans from the cache;
* ``one-plan``: one plan made for the longest length, applied unchanged to every
  length (what tools that plan once do);
* ``padded``: that plan, with every batch padded to the longest length (how
  users avoid shape changes today; the padding's compute is the cost).

Phase 1 runs ``gradckpt``'s steps under an ``AllocatorTracker`` (the allocator's
peak, kernel workspaces included; the tensor tracker's peak is kept beside it) and
records every step's peak against the budget, each re-plan's time, the plan
switches, and the gradients against the plain model's at every step (dropout on,
same seed). Phase 2 times all contenders step by step, interleaved.

Usage:
    python -m benchmarks.shapes            # 100 steps per model (~15 min on a loaded 2-core CPU)
    python -m benchmarks.shapes --quick    # smoke test
"""

from __future__ import annotations

import copy
import math
import sys
import time
import warnings
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
    load_note,
    machine_info,
    markdown_table,
    mib,
    read_results,
    results_path,
    settle,
    verdict,
    write_results,
)
from gradckpt.measure import AllocatorTracker, MemoryTracker, state_bytes

MODELS = ("gpt2", "llama")
FULL: dict[str, Any] = dict(
    layers=4, hidden=256, heads=4, batch=2, vocab=2048, shortest=64, longest=512, steps=100
)
QUICK: dict[str, Any] = dict(
    layers=2, hidden=64, heads=4, batch=2, vocab=128, shortest=16, longest=64, steps=8
)
CONTENDERS = ("plain", "gradckpt", "one-plan", "padded")


def draw_lengths(steps: int, shortest: int, longest: int, multiple: int, seed: int) -> list[int]:
    """Log-uniform lengths in [shortest, longest], rounded up to ``multiple`` (many short, few long)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log(shortest), math.log(longest)
    raw = (lo + (hi - lo) * torch.rand(steps, generator=g)).exp()
    return [min(longest, multiple * math.ceil(float(x) / multiple)) for x in raw]


def _batch(ids: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    part = ids[:, :length]
    return {"input_ids": part, "labels": part}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _budget(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(budget, least peak, plain peak) at the longest length, from a fake profile."""
    prof = gradckpt.profile(model, lambda: model(**batch).loss, fake=True)
    try:
        gradckpt.plan(model, lambda: model(**batch).loss, 1, profiling=gradckpt.ProfileOptions(profile=prof))
        raise AssertionError("a one-byte budget fitted")
    except gradckpt.BudgetError as exc:
        least = exc.least_peak_bytes
    return (least + prof.measured_peak_bytes) // 2, least, prof.measured_peak_bytes


def bench_model(name: str, sizes: dict[str, Any], args: Any, log=print) -> dict[str, Any]:
    from gradckpt.integrations import hf
    from gradckpt.integrations.hf.zoo import hf_example

    longest = sizes["longest"]
    ex = hf_example(
        name, layers=sizes["layers"], hidden=sizes["hidden"], heads=sizes["heads"],
        seq=longest, batch=sizes["batch"], vocab=sizes["vocab"], dropout=0.1, seed=args.seed,
    )  # fmt: skip
    hf.disable_cache(ex.model)
    ids = ex.inputs["input_ids"]
    lengths = draw_lengths(sizes["steps"], sizes["shortest"], longest, args.multiple, args.seed)
    models = {c: copy.deepcopy(ex.model) for c in CONTENDERS}
    budget, least, plain_longest = _budget(models["plain"], _batch(ids, longest))
    log(
        f"{name}: budget {mib(budget)} MiB (least {mib(least)}, plain {mib(plain_longest)} at {longest})"
    )

    # gradckpt: fit at the first batch's length; the guard does the rest.
    g = models["gradckpt"]
    first = _batch(ids, lengths[0])
    start = time.perf_counter()
    gradckpt.fit(g, lambda: g(**first).loss, budget, profiling=gradckpt.ProfileOptions(repeats=1))
    fit_s = time.perf_counter() - start
    # one plan for the longest length (apply: no shape guard), also used padded.
    longest_plan = gradckpt.plan(models["one-plan"], lambda: models["one-plan"](**_batch(ids, longest)).loss, budget, profiling=gradckpt.ProfileOptions(repeats=1))  # fmt: skip
    gradckpt.apply(models["one-plan"], longest_plan)
    gradckpt.apply(models["padded"], longest_plan)

    # Phase 1: every step of gradckpt measured, gradients against plain.
    steps = []
    for i, length in enumerate(lengths):
        batch = _batch(ids, length)
        before = gradckpt.shape_stats(g)
        torch.manual_seed(args.seed + i)
        with AllocatorTracker() as allocator, MemoryTracker(g) as tracker:
            g(**batch).loss.backward()
        torch.manual_seed(args.seed + i)
        models["plain"](**batch).loss.backward()
        mine, theirs = _grads(g), _grads(models["plain"])
        equal = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        for m in (g, models["plain"]):
            m.zero_grad(set_to_none=True)
        after = gradckpt.shape_stats(g)
        replan_s = after.replan_seconds[-1] if after.replans > before.replans else None
        active = gradckpt.applied_plan(g)
        steps.append({
            "step": i, "length": length,
            "peak_bytes": state_bytes(g) + allocator.peak_bytes,
            "tensor_peak_bytes": tracker.peak_bytes,
            "predicted_peak_bytes": active.predicted_peak_bytes, "grads_equal": equal,
            "replan_s": replan_s, "switched": after.switches > before.switches,
        })  # fmt: skip
    stats = gradckpt.shape_stats(g)

    # Peaks of the other contenders at each distinct length (deterministic per length).
    other_peaks: dict[str, dict[int, int]] = {"one-plan": {}, "plain": {}}
    for length in sorted(set(lengths)):
        for c in other_peaks:
            m = models[c]
            with AllocatorTracker() as allocator:
                m(**_batch(ids, length)).loss.backward()
            m.zero_grad(set_to_none=True)
            other_peaks[c][length] = state_bytes(m) + allocator.peak_bytes
    with AllocatorTracker() as allocator:
        models["padded"](**_batch(ids, longest)).loss.backward()
    models["padded"].zero_grad(set_to_none=True)
    padded_peak = state_bytes(models["padded"]) + allocator.peak_bytes

    # Phase 2: step times, contenders interleaved at every step.
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    plain_time_at: dict[int, list[float]] = {}
    for i, length in enumerate(lengths):
        for c in CONTENDERS:
            m = models[c]
            batch = _batch(ids, longest if c == "padded" else length)
            torch.manual_seed(args.seed + i)
            start = time.perf_counter()
            m(**batch).loss.backward()
            elapsed = time.perf_counter() - start
            m.zero_grad(set_to_none=True)
            times[c].append(elapsed)
            if c == "plain":
                plain_time_at.setdefault(length, []).append(elapsed)
    totals = {c: sum(ts) for c, ts in times.items()}
    replans = [s for s in steps if s["replan_s"] is not None]
    return {
        "model": name, "sizes": sizes, "lengths": lengths, "budget_bytes": budget,
        "least_peak_longest": least, "plain_peak_longest": plain_longest, "fit_s": fit_s,
        "steps": steps, "violations": sum(s["peak_bytes"] > budget for s in steps),
        "grads_equal_steps": sum(s["grads_equal"] for s in steps),
        "predicted_equals_measured": sum(abs(s["peak_bytes"] - s["predicted_peak_bytes"]) <= 1e-3 * s["peak_bytes"] for s in steps),
        "max_prediction_error": max(abs(s["peak_bytes"] - s["predicted_peak_bytes"]) / s["peak_bytes"] for s in steps),
        "plans": stats.plans, "replans": stats.replans, "switches": stats.switches,
        "replan_s_total": stats.replan_seconds_total,
        "replan_vs_step": [
            {"length": s["length"], "replan_s": s["replan_s"],
             "plain_step_s": sorted(plain_time_at[s["length"]])[len(plain_time_at[s["length"]]) // 2]}
            for s in replans
        ],
        "other_peaks": {c: {str(k): v for k, v in d.items()} for c, d in other_peaks.items()},
        "padded_peak_bytes": padded_peak, "totals_s": totals,
        "summary": stats.summary(),
    }  # fmt: skip


def render(data: dict[str, Any]) -> str:
    info = data["info"]
    lines = [
        "# Shapes: the budget across changing sequence lengths",
        "",
        "Per-step peaks are at the allocator (`gradckpt.measure.AllocatorTracker`, kernel "
        "workspaces included) plus parameters and buffers; the tensor tracker's peak is in the "
        "JSON beside it. Budget: halfway between the "
        "least feasible peak and the plain peak at the longest length. Lengths: log-uniform "
        f"between the shortest and longest, rounded up to a multiple of {info['multiple']}.",
        "",
    ]
    note = load_note(info)
    if note:
        lines += [note, ""]
    rows, targets = [], []
    for r in data["results"]:
        n = len(r["steps"])
        base = r["totals_s"]["plain"]
        max_peak = max(s["peak_bytes"] for s in r["steps"])
        one_max = max(r["other_peaks"]["one-plan"].values())
        plain_over = sum(
            r["other_peaks"]["plain"][str(s["length"])] > r["budget_bytes"] for s in r["steps"]
        )
        over = {c: r["totals_s"][c] / base - 1 for c in ("gradckpt", "one-plan", "padded")}
        with_replan = (r["totals_s"]["gradckpt"] + r["replan_s_total"]) / base - 1
        rows.append([
            r["model"], n, f"{len(set(r['lengths']))}", mib(r["budget_bytes"]),
            f"{mib(max_peak)} ({r['violations']} over)", f"{mib(one_max)}",
            f"{mib(r['padded_peak_bytes'])}", f"{plain_over} of {n}",
            f"{over['gradckpt']:+.1%} ({with_replan:+.1%} with re-plans)",
            f"{over['one-plan']:+.1%}", f"{over['padded']:+.1%}",
            f"{r['replans']} in {r['replan_s_total']:.2f} s", r["switches"],
        ])  # fmt: skip
        ratios = [x["replan_s"] / x["plain_step_s"] for x in r["replan_vs_step"]]
        # The first re-plan of a new length also builds the length scaling (four fake
        # profiles); later lengths are rescaled and solved.
        first = ratios[0] if ratios else 0.0
        later = sorted(ratios[1:])
        worst = later[-1] if later else 0.0
        median = later[len(later) // 2] if later else 0.0
        targets += [
            [r["model"], "every step within the budget", f"{r['violations']} violations", verdict(r["violations"] == 0)],
            [r["model"], "gradients equal to plain at every step", f"{r['grads_equal_steps']} of {n} bitwise equal", verdict(r["grads_equal_steps"] == n)],
            [r["model"], "predicted peak within 0.1% of measured", f"{r['predicted_equals_measured']} of {n} steps", verdict(r["predicted_equals_measured"] == n)],
            [r["model"], "first re-plan under a training step", f"{first:.2f} plain steps at that length (builds the length scaling: four fake profiles)", verdict(first < 0.5)],
            [r["model"], "later re-plans well under a training step", f"re-plan / plain step at that length: median {median:.2f}, worst {worst:.2f}", verdict(worst < 0.5)],
            [r["model"], "cheaper than padding to the longest", f"{with_replan:+.1%} with re-plans ({over['gradckpt']:+.1%} without) vs {over['padded']:+.1%} (time over plain)", verdict(with_replan < over["padded"])],
        ]  # fmt: skip
    lines += [
        markdown_table(
            [
                "model",
                "steps",
                "lengths",
                "budget MiB",
                "gradckpt max peak MiB",
                "one-plan max peak MiB",
                "padded peak MiB",
                "plain over budget",
                "gradckpt time over plain",
                "one-plan",
                "padded",
                "re-plans",
                "switches",
            ],
            rows,
        ),
        "",
        markdown_table(["model", "target", "measured", "verdict"], targets),
        "",
        "Re-plan time against the plain step at the same length (median of that length's steps):",
        "",
    ]
    for r in data["results"]:
        cells = [
            f"{x['length']}: {x['replan_s']:.2f} s / {x['plain_step_s']:.2f} s"
            for x in r["replan_vs_step"]
        ]
        lines.append(f"- {r['model']}: " + ("; ".join(cells) or "no re-plans"))
        lines.append(f"  - `{r['summary']}`")
    lines += ["", "## Machine and settings", "", info_block(info)]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3.2 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        xs = [s["step"] for s in r["steps"]]
        mb = 1 << 20
        ax.plot(xs, [r["other_peaks"]["plain"][str(s["length"])] / mb for s in r["steps"]],
                ".", color="0.6", label="plain (no checkpointing)")  # fmt: skip
        ax.plot(xs, [s["peak_bytes"] / mb for s in r["steps"]], "o-", ms=3, lw=0.8,
                color="tab:red", label="gradckpt (re-planned per length), measured")  # fmt: skip
        ax.axhline(r["budget_bytes"] / mb, color="k", ls="--", lw=1, label="budget")
        replanned = [s["step"] for s in r["steps"] if s["replan_s"] is not None]
        ax.plot(replanned, [r["steps"][i]["peak_bytes"] / mb for i in replanned], "k^",
                ms=6, label="step with a re-plan")  # fmt: skip
        ax.set_title(
            f"{r['model']}: peak per step, lengths {min(r['lengths'])}..{max(r['lengths'])}"
        )
        ax.set_xlabel("training step")
        ax.set_ylabel("peak (MiB)")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:

    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument(
        "--multiple",
        type=int,
        default=None,
        help="round lengths up to this (default: shortest/4... 32, quick 8)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per model (default 100, quick 8)"
    )
    args = p.parse_args(argv)  # fmt: skip
    if args.from_json:
        data = read_results(args.from_json)
    else:
        settle(args)
        sizes = dict(QUICK if args.quick else FULL)
        if args.steps:
            sizes["steps"] = args.steps
        if args.multiple is None:
            args.multiple = 8 if args.quick else 32
        load_before = load_average()
        results = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for name in args.models:
                results.append(bench_model(name, sizes, args))
        info = machine_info(
            quick=args.quick, multiple=args.multiple, seed=args.seed, sizes=sizes,
            load_average_before="/".join(f"{x:.2f}" for x in load_before),
            load_average_after="/".join(f"{x:.2f}" for x in load_average()),
        )  # fmt: skip
        data = {"info": info, "results": results}
    md = render(data)
    md_path, _ = write_results(args.out, "shapes", md, data, date=data["info"]["date"])
    png = results_path(args.out, "shapes", "png", data["info"]["date"])
    plot(data, png)
    print(md)
    print(f"\nwrote {md_path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
