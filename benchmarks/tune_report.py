"""The tune benchmark's verdicts, tables, report and plot, from its measured rows.

Rows are ``benchmarks.tune``'s per (model, budget) dicts: ``searches`` (how (a)
and (b) found their micro-batch) and ``contenders`` (a-d: micro-batch, whole-step
peak, ``times`` on the run's clock, one per interleaved round, ``wall_times``
beside them, and what fit or tune said). ``render`` re-renders a saved run's JSON
(``--from-json``) byte for byte.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    info_block,
    load_note,
    markdown_table,
    median_spread,
    mib,
    paired_stats,
)

# The contenders and the targets they are judged by (the issue's).
CONTENDERS = ("a", "b", "c", "d")
NAMES = {"a": "(a) plain", "b": "(b) per-layer", "c": "(c) fit", "d": "(d) tune"}
DESCRIPTIONS = {
    "a": "no checkpointing, the largest micro-batch that fits (halving from the global batch)",
    "b": "transformers' per-layer checkpointing (activation_checkpointing_enable, "
    "use_reentrant=False), the largest micro-batch it fits (halving)",
    "c": "gradckpt.fit(..., optimizer=opt, accumulation_steps=K) at (a)'s micro-batch",
    "d": "gradckpt.tune(..., optimizer=opt, global_batch=G), its micro-batch and plan",
}
PREDICTION_TOLERANCE = 0.15  # the issue: tune's predicted samples/s within 15% of measured
COST_TARGET_S = 60.0  # the issue: tuning under a minute
PEAK_STEPS = 2  # whole steps a peak is measured over (the second has AdamW's state resident)


def _rates(times: list[float], g: int) -> list[float]:
    return [g / t for t in times]


def best_baseline(row: dict[str, Any]) -> str | None:
    """Of (a)-(c) timed, the one with the highest median samples/s (least median step time)."""
    timed = [k for k in ("a", "b", "c") if row["contenders"].get(k, {}).get("times")]
    return min(timed, key=lambda k: statistics.median(row["contenders"][k]["times"]), default=None)


def verdict_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """Tune's paired speed over the best of (a)-(c): per round best's time / tune's."""
    d = row["contenders"].get("d", {})
    best = best_baseline(row)
    if best is None or not d.get("times"):
        return None
    median, low, high = paired_stats(row["contenders"][best], d)
    if low > 1.0:
        call = "faster"
    elif high >= 1.0:
        call = "not slower (interval holds 1)"
    else:
        call = "slower"
    return {"best": best, "ratio": median, "low": low, "high": high, "call": call,
            "not_slower": high >= 1.0}  # fmt: skip


def op_times(timing: str) -> str:
    """Tune's ``TuneResult.timing``, short: where its op times came from."""
    if timing.startswith("estimated"):
        return "FLOP/byte estimates (no size fit plainly with margin)"
    if "micro-batches" in timing:
        return "real at " + timing.split("micro-batches ")[1].split(",")[0]
    if "micro-batch" in timing:
        return "real at " + timing.split("micro-batch ")[1].split(",")[0] + " only"
    return timing or "n/a"


def prediction_of(row: dict[str, Any], g: int) -> dict[str, Any] | None:
    d = row["contenders"].get("d", {})
    if not d.get("times") or not d.get("predicted_samples_per_s"):
        return None
    measured = statistics.median(_rates(d["times"], g))
    predicted = d["predicted_samples_per_s"]
    error = predicted / measured - 1.0
    return {"predicted": predicted, "measured": measured, "error": error,
            "within": abs(error) <= PREDICTION_TOLERANCE,
            "op_times": op_times(d.get("tune", {}).get("timing", ""))}  # fmt: skip


def _cell(c: dict[str, Any], g: int, budget: int) -> list[str]:
    if "error" in c:
        return ["-", "n/a", "n/a", c["error"][:90]]
    peak = c["peak_bytes"]
    over = "" if peak <= budget else " **OVER**"
    return [
        f"{c['micro_batch']} x {c['accumulation']}",
        median_spread(_rates(c.get("times") or [], g)),
        median_spread(_rates(c.get("wall_times") or [], g)),
        f"{mib(peak)} ({peak / budget:.3f}){over}",
    ]


def contender_table(model: dict[str, Any], g: int) -> str:
    out = []
    for row in model["rows"]:
        budget = row["budget_bytes"]
        for key in CONTENDERS:
            c = row["contenders"].get(key, {"error": "not run"})
            plan = c.get("plan", "")
            if key == "a":
                plan = "no checkpointing"
            elif key == "b":
                plan = "every layer one checkpoint (transformers)"
            elif key == "d" and "strategy" in c:
                plan = f"{c['strategy']}: {plan}"
            out.append([f"{row['budget']} ({mib(budget)})", NAMES[key], *_cell(c, g, budget),
                        plan])  # fmt: skip
    headers = ["budget (MiB)", "contender", "micro-batch x accumulation",
               "samples/s median [min-max]", "wall samples/s median [min-max]",
               "whole-step peak MiB (/ budget)", "plan"]  # fmt: skip
    return markdown_table(headers, out)


def search_table(model: dict[str, Any]) -> str:
    out = []
    for row in model["rows"]:
        for key in ("a", "b"):
            s = row["searches"][key]
            tried = ", ".join(
                f"{t['micro_batch']}: {mib(t['peak_bytes'])}{'' if t['fits'] else ' OOM'}"
                for t in s["trials"]
            )
            out.append([row["budget"], NAMES[key], tried, s["micro_batch"] or "none",
                        s["oom_trials"], f"{s['oom_seconds']:.1f}"])  # fmt: skip
    headers = ["budget", "search", "trials (micro-batch: whole-step peak MiB)", "found",
               "OOM trials", "OOM seconds"]  # fmt: skip
    return markdown_table(headers, out)


def verdict_rows(data: dict[str, Any]) -> list[list[str]]:
    g = data["info"]["global_batch"]
    out = []
    for model in data["models"]:
        for row in model["rows"]:
            d = row["contenders"].get("d", {})
            v, p = verdict_of(row), prediction_of(row, g)
            budget = row["budget_bytes"]
            choice = (f"{d['micro_batch']} x {d['accumulation']} {d.get('strategy', '')}"
                      if "micro_batch" in d else d.get("error", "n/a")[:80])  # fmt: skip
            best = "n/a"
            if v is not None:
                b = row["contenders"][v["best"]]
                best = f"{NAMES[v['best']]} {b['micro_batch']} x {b['accumulation']}"
            peak = "n/a" if "peak_bytes" not in d else (
                f"{mib(d['peak_bytes'])} / {mib(budget)} "
                + ("yes" if d["peak_bytes"] <= budget else "**NO**"))  # fmt: skip
            cost = d.get("planning_seconds"), d.get("measuring_seconds")
            out.append([
                model["model"], f"{row['budget']} ({mib(budget)})", choice, best,
                "n/a" if v is None else f"x{v['ratio']:.3f} ({v['low']:.3f}-{v['high']:.3f})",
                "n/a" if v is None else v["call"], peak,
                "n/a" if p is None else f"{p['predicted']:.2f} / {p['measured']:.2f} "
                f"({p['error']:+.1%}) {'yes' if p['within'] else '**no**'}; op times: "
                f"{p['op_times']}",
                "n/a" if None in cost else f"{cost[0]:.1f} + {cost[1]:.1f} = "
                f"{cost[0] + cost[1]:.1f} {'yes' if cost[0] + cost[1] <= COST_TARGET_S else '**no**'}",
            ])  # fmt: skip
    return out


VERDICT_HEADERS = [
    "model", "budget (MiB)", "tune's choice", "best of (a)-(c)",
    "tune's speed / best's (paired, 95% interval)", "verdict", "tune's peak / budget (MiB)",
    "samples/s predicted / measured (error) within 15%",
    "tuning cost s: planning + measuring (< 60 s)",
]  # fmt: skip


def per_sample_table(data: dict[str, Any]) -> str:
    out = []
    for model in data["models"]:
        table = model["per_sample"]
        first = statistics.median(next(iter(table.values()))["times"]) / int(next(iter(table)))
        for b, r in table.items():
            per = [t / int(b) * 1e3 for t in r["times"]]
            wall = [t / int(b) * 1e3 for t in r["wall_times"]]
            out.append([model["model"], b, median_spread(per, "{:.1f}"),
                        median_spread(wall, "{:.1f}"),
                        f"{first / statistics.median(r['times']) * int(b):.2f}"])  # fmt: skip
    headers = ["model", "micro-batch", "ms per sample, median [min-max]",
               "wall ms per sample", "samples/s vs micro-batch 1"]  # fmt: skip
    return markdown_table(headers, out)


def _med_rate(row: dict[str, Any], key: str, g: int) -> float:
    return statistics.median(_rates(row["contenders"][key]["times"], g))


def _needless_fit(row: dict[str, Any]) -> bool:
    """(c) recomputes something though (a), at the same micro-batch, fits the budget."""
    a, c = row["contenders"].get("a", {}), row["contenders"].get("c", {})
    if not a.get("times") or not c.get("times") or a.get("micro_batch") != c.get("micro_batch"):
        return False
    return a["peak_bytes"] <= row["budget_bytes"] and not c["plan"].endswith("keep")


def summary(data: dict[str, Any]) -> list[str]:
    g = data["info"]["global_batch"]
    rows = [(m["model"], r) for m in data["models"] for r in m["rows"]]
    n = len(rows)
    lines = []
    within = [(m, r) for m, r in rows
              if r["contenders"].get("d", {}).get("peak_bytes", 1 << 62) <= r["budget_bytes"]]  # fmt: skip
    lines.append(f"- tune's whole-step peak within the budget on {len(within)} of {n} rows"
                 + "".join(f"; {m} {r['budget']}: "
                           f"{r['contenders'].get('d', {}).get('error') or 'over'}"
                           for m, r in rows if (m, r) not in within))  # fmt: skip
    others = [(m, r, k) for m, r in rows for k in ("a", "b", "c")
              if "peak_bytes" in r["contenders"].get(k, {})
              and r["contenders"][k]["peak_bytes"] > r["budget_bytes"]]  # fmt: skip
    if others:
        lines.append("- other contenders over the budget: " + "; ".join(
            f"{m} {r['budget']} {NAMES[k]} {mib(r['contenders'][k]['peak_bytes'])} MiB"
            for m, r, k in others))  # fmt: skip
    verdicts = [(m, r, verdict_of(r)) for m, r in rows]
    ok = [x for x in verdicts if x[2] is not None and x[2]["not_slower"]]
    lines.append(
        f"- tune not slower than the best of (a)-(c) on {len(ok)} of {n} rows"
        + "".join(
            f"; slower on {m} {r['budget']}: x{v['ratio']:.3f} ({v['low']:.3f}-{v['high']:.3f}) "
            f"of {NAMES[v['best']]}"
            for m, r, v in verdicts if v is not None and not v["not_slower"]
        )
    )  # fmt: skip
    faster = [x for x in verdicts if x[2] is not None and x[2]["low"] > 1.0]
    lines.append(f"- of those, faster with the interval above 1 on {len(faster)}")
    preds = [(m, r, prediction_of(r, g)) for m, r in rows]
    good = [x for x in preds if x[2] is not None and x[2]["within"]]
    lines.append(
        f"- tune's predicted samples/s within {PREDICTION_TOLERANCE:.0%} of the measured on "
        f"{len(good)} of {n} rows"
        + "".join(f"; {m} {r['budget']}: {p['predicted']:.2f} predicted, {p['measured']:.2f} "
                  f"measured ({p['error']:+.1%}; op times: {p['op_times']})"
                  for m, r, p in preds if p is not None and not p["within"])
    )  # fmt: skip
    costs = [(m, r, r["contenders"].get("d", {})) for m, r in rows]
    cheap = [x for x in costs if "planning_seconds" in x[2]
             and x[2]["planning_seconds"] + x[2]["measuring_seconds"] <= COST_TARGET_S]  # fmt: skip
    spent = [d["planning_seconds"] + d["measuring_seconds"] for _, _, d in costs
             if "planning_seconds" in d]  # fmt: skip
    lines.append(f"- tuning cost (planning + measuring) under {COST_TARGET_S:.0f} s on "
                 f"{len(cheap)} of {n} rows"
                 + (f" ({min(spent):.1f} to {max(spent):.1f} s)" if spent else ""))  # fmt: skip
    needless = [(m, r) for m, r in rows if _needless_fit(r)]
    if needless:
        lines.append(
            "- (c) `fit` checkpointed at a micro-batch whose plain step fits the budget "
            "(measured) on " + "; ".join(
                f"{m} {r['budget']}: plan {r['contenders']['c']['plan']}, predicted "
                f"{mib(r['contenders']['c']['predicted_peak_bytes'])} MiB, measured "
                f"{mib(r['contenders']['c']['peak_bytes'])} MiB, where plain measured "
                f"{mib(r['contenders']['a']['peak_bytes'])} MiB within "
                f"{mib(r['budget_bytes'])}; samples/s {_med_rate(r, 'c', g):.2f} vs plain's "
                f"{_med_rate(r, 'a', g):.2f}" for m, r in needless)
        )  # fmt: skip
    ooms = [r["searches"]["a"] for _, r in rows]
    lines.append(
        "- (a)'s halving search: " + ", ".join(
            f"{m} {r['budget']} {r['searches']['a']['oom_trials']} OOM trials "
            f"({r['searches']['a']['oom_seconds']:.1f} s)" for m, r in rows)
        + f"; {sum(s['oom_trials'] for s in ooms)} in all"
    )  # fmt: skip
    return lines


def render(data: dict[str, Any]) -> str:
    info = data["info"]
    g = info["global_batch"]
    clock = ("this thread's CPU time (`work_clock`, as tune measures its own steps)"
             if info["clock"] == "cpu" else "wall time")  # fmt: skip
    lines = [
        f"# gradckpt.tune against the usual ways to fit a budget, {info.get('gpu') or 'CPU'} "
        f"({info['date']})",
        "",
        f"Models: transformers {', '.join(m['model'] for m in data['models'])} from configs "
        f"(random weights, dropout 0, `use_cache=False`); AdamW (lr {info['lr']}); global batch "
        f"{g} samples per optimizer step; micro-batch b runs K = {g}/b accumulation steps, each "
        "on its own rows. A whole step: `zero_grad(set_to_none=True)`, K x forward + backward "
        "(loss / K), `AdamW.step()`.",
        "",
        "Contenders: " + "; ".join(f"**{NAMES[k]}**: {d}" for k, d in DESCRIPTIONS.items()) + ".",
        "",
        "Budgets (whole step, bytes): **loose** = halfway between the plain whole-step peaks "
        "at micro-batches 2 and 4 (plain fits 2), **tight** = halfway between those at 1 and 2 "
        "(plain fits 1). Whole-step peak: the allocator's high-water (`AllocatorTracker`) "
        f"over {PEAK_STEPS} whole steps of a fresh model and AdamW (the second with AdamW's "
        "state resident) plus the parameters and buffers. Out of memory in the searches = that "
        "peak over the budget; a trial's seconds are those two steps and the model's build, "
        "run under the tracker (each micro-batch measured once per model, both budgets' "
        "searches read it).",
        "",
        # `compiled_report.paired_stats` (now benchmarks.harness.stats's, still importable
        # there) stays as written: --from-json must re-render committed reports byte for byte.
        f"Times: {clock}; one whole step per contender in turn (a, b, c, d, a, ...), "
        f"{info['repeats']} timed rounds after {info['warmup']} warm-up round(s); samples/s = "
        f"{g} / step time, median [least-greatest round]; wall-clock samples/s beside them. "
        "Tune's verdict: per round, the best of (a)-(c)'s step time (the one with the highest "
        "median samples/s) over tune's, median over the rounds with a bootstrap 95% interval "
        "(`compiled_report.paired_stats`); above 1 tune is faster; the interval holding 1 or "
        "lying above it = not slower. Predicted: the samples/s `gradckpt.tune` predicted for "
        "the candidate it chose (`TuneCandidate.predicted_samples_per_s`), against this "
        "benchmark's measured median.",
        "",
    ]
    lines += [
        f"Machine load (1/5/15-minute averages): {info.get('load_average_before')} before, "
        f"{info.get('load_average_after')} after the run ({info.get('cores')} cores; the run "
        f"itself uses {info.get('threads')} thread(s)).",
        "",
    ]
    if note := load_note(info):
        lines += [note, ""]
    lines += ["## Verdicts", "", markdown_table(VERDICT_HEADERS, verdict_rows(data)), "",
              "## Summary", "", *summary(data), ""]  # fmt: skip
    if data.get("notes"):  # reading of the numbers, added to the JSON after the run
        lines += ["## Notes (written after the run)", "", *(f"- {n}" for n in data["notes"]), ""]
    for model in data["models"]:
        lines += [
            f"## {model['model']} {model['sizes']}",
            "",
            contender_table(model, g),
            "",
            "How (a) and (b) found their micro-batch (halving from the global batch):",
            "",
            search_table(model),
            "",
        ]
        for row in model["rows"]:
            d = row["contenders"].get("d", {})
            if "table" in d:
                lines += [f"`gradckpt.tune` at the {row['budget']} budget "
                          f"({d['tune_seconds']:.1f} s in all):", "", "```", d["table"], "```",
                          ""]  # fmt: skip
    lines += [
        "## Per-sample time against micro-batch size (plain forward + backward)",
        "",
        "Without the optimizer step: does a bigger micro-batch pay on this machine? "
        f"Interleaved, {info['repeats']} rounds; samples/s relative to micro-batch 1 "
        "(medians).",
        "",
        per_sample_table(data),
        "",
    ]
    if info.get("plot"):
        lines += [f"![samples/s vs micro-batch]({info['plot']})", ""]
    lines += ["## Setup and machine", "", f"Rerun: `{info['command']}`", "", info_block(info)]
    return "\n".join(lines)


_STYLE = {"none": "C0", "per-layer": "C1", "gradckpt": "C2"}
_MARK = {"a": "s", "b": "^", "c": "D", "d": "*"}
_CONTENDER_COLOR = {"a": "C0", "b": "C1", "c": "C3", "d": "C2"}


def plot(data: dict[str, Any], path: Path) -> None:
    """Per (model, budget): tune's predicted samples/s per strategy against the micro-batch
    (lines), tune's own measured points (hollow) and the contenders' measured medians (filled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = data["info"]["global_batch"]
    models = data["models"]
    ncols = max(len(m["rows"]) for m in models)
    fig, axes = plt.subplots(len(models), ncols, figsize=(5.2 * ncols, 3.6 * len(models)),
                             squeeze=False)  # fmt: skip
    for i, model in enumerate(models):
        for j, row in enumerate(model["rows"]):
            ax = axes[i][j]
            cands = row["contenders"].get("d", {}).get("tune", {}).get("candidates", [])
            for strategy, color in _STYLE.items():
                pts = sorted((c["micro_batch"], c["predicted_samples_per_s"]) for c in cands
                             if c["strategy"] == strategy and c["predicted_samples_per_s"])  # fmt: skip
                if pts:
                    ax.plot(*zip(*pts), "--", color=color, lw=1,
                            label=f"tune predicted: {strategy}")  # fmt: skip
                meas = sorted((c["micro_batch"], c["measured_samples_per_s"]) for c in cands
                              if c["strategy"] == strategy and c["measured_samples_per_s"])  # fmt: skip
                if meas:
                    ax.plot(*zip(*meas), "o", color=color, fillstyle="none", ms=7,
                            label=f"tune's own run: {strategy}")  # fmt: skip
            for key in CONTENDERS:
                c = row["contenders"].get(key, {})
                if not c.get("times"):
                    continue
                rates = _rates(c["times"], g)
                med = statistics.median(rates)
                ax.errorbar([c["micro_batch"]], [med],
                            yerr=[[med - min(rates)], [max(rates) - med]],
                            fmt=_MARK[key], color=_CONTENDER_COLOR[key], ms=10 if key == "d" else 7,
                            label=NAMES[key])  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model['model']}, {row['budget']} ({mib(row['budget_bytes'])} MiB)",
                         fontsize=9)  # fmt: skip
            ax.set_xlabel("micro-batch")
            ax.set_ylabel("samples/s")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=5, fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
