"""Tune benchmark: gradckpt.tune's micro-batch and plan against the usual ways to fit a budget.

For the GPT-2, Llama and ViT configs of ``benchmarks/hf_models.py`` (transformers,
random weights, smaller sizes here so that the whole run stays short), AdamW and
a fixed global batch ``G`` (16 samples per optimizer step), at two whole-step
budgets, four contenders train whole optimizer steps (``zero_grad``, ``K = G / b``
micro-batches of forward + backward, each on its own rows of the global batch,
``AdamW.step()``):

* **(a) plain**: no checkpointing, at the largest micro-batch that fits, found
  the way accelerate's ``find_executable_batch_size`` finds it: start at ``G``,
  halve on "out of memory" (here: the measured whole-step peak over the budget);
* **(b) per-layer**: transformers' own checkpointing (every layer one checkpoint,
  ``activation_checkpointing_enable(use_reentrant=False)``, the 5.x name of
  ``gradient_checkpointing_enable``) at the largest micro-batch it fits, found
  the same way;
* **(c) fit**: ``gradckpt.fit(model, loss_fn, budget, optimizer=opt,
  accumulation_steps=K)`` at (a)'s micro-batch;
* **(d) tune**: ``gradckpt.tune(model, make_loss, budget, optimizer=opt,
  global_batch=G)``, then ``result.apply(model)`` at its micro-batch.

The budgets come from the plain whole-step peaks measured at micro-batches 1, 2
and 4: ``loose`` halfway between the peaks at 2 and 4 (plain training fits a
micro-batch of 2), ``tight`` halfway between those at 1 and 2 (plain fits 1).

Whole-step peak: the allocator's high-water (``AllocatorTracker``) over two whole
steps of a fresh model and a fresh AdamW (the first allocates AdamW's state, the
second runs forward and backward with it resident) plus what existed at entry
(``state_bytes``: parameters and buffers). A search trial is those two steps;
its seconds are what it took (under the tracker), so "OOM seconds" are what
finding out cost, the trial's own model build included. Peaks at a micro-batch
do not depend on the budget, so each is measured once per model and both
budgets' searches read them.

Each contender trains its own model built from the same seed (same weights and
batch) with its own AdamW. Times: one whole step per contender in turn (a, b, c,
d, a, b, ...), ``--repeats`` timed rounds after ``--warmup`` rounds; medians with
the least and greatest round. Tune's verdict: per round, the best of (a)-(c)'s
step time (the one with the highest median samples/s) over tune's, the median of
those ratios with a bootstrap 95% interval (``benchmarks.compiled_report.paired_stats``);
the interval holding 1 or lying above it means "not slower".

Usage:
    python -m benchmarks.tune                    # 3 models x 2 budgets (~4 min on 2 CPU cores)
    python -m benchmarks.tune --quick            # tiny sizes, a smoke test
    python -m benchmarks.tune --models gpt2 --device cuda   # the GPU check's stage
    python -m benchmarks.tune --from-json benchmarks/results/tune-cpu-<date>.json
        # re-renders the report and plot; a "notes" list added to the JSON (a reading of
        # the numbers written after the run) becomes its "Notes" section
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

import gradckpt
from benchmarks.common import (
    RunClock,
    base_parser,
    hardware_slug,
    info_block,
    load_note,
    machine_info,
    markdown_table,
    mib,
    results_path,
    settle,
    write_results,
)
from benchmarks.compiled_report import paired_stats
from gradckpt.api_budget import resident_bytes
from gradckpt.measure import AllocatorTracker, time_interleaved
from gradckpt.measure.timing import work_clock

MODELS = ("gpt2", "llama", "vit")
# hf_models.py's configs, smaller: a whole step of 16 samples takes about a second on one
# CPU thread, so 3 models x 2 budgets x 4 contenders (and tune itself) fit in minutes.
FULL: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=4, hidden=256, heads=4, seq=128, vocab=4096),
    "llama": dict(layers=4, hidden=256, heads=4, seq=128, vocab=4096),
    "vit": dict(layers=4, hidden=256, heads=4, image=128, patch=16),
}
QUICK: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=2, hidden=32, heads=2, seq=32, vocab=128),
    "llama": dict(layers=2, hidden=32, heads=2, seq=32, vocab=128),
    "vit": dict(layers=2, hidden=32, heads=2, image=32, patch=8),
}
# On a GPU: GPT-2 small's shape (vocab cut to 16k), 1024 tokens a sample.
GPU: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=16384),
    "llama": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=16384),
    "vit": dict(layers=12, hidden=768, heads=12, image=224, patch=16),
}
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

Rows = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- models and steps


@dataclass
class Setup:
    """What every contender of one model shares."""

    name: str
    sizes: dict[str, Any]
    global_batch: int
    device: str
    seed: int
    lr: float = 1e-4

    def build(self) -> tuple[nn.Module, Rows]:
        """A fresh model (same seed, same weights) and the global batch, on the device."""
        from gradckpt.integrations import hf
        from gradckpt.integrations.hf_zoo import hf_example

        ex = hf_example(self.name, batch=self.global_batch, dropout=0.0, seed=self.seed,
                        **self.sizes)  # fmt: skip
        hf.disable_cache(ex.model)  # as in training
        model = ex.model.to(self.device)
        inputs = {k: v.to(self.device) for k, v in ex.inputs.items()}
        return model, inputs

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr)


def micro_batches(inputs: Rows, b: int) -> list[Rows]:
    """The global batch cut into micro-batches of ``b`` rows (each its own rows)."""
    n = next(iter(inputs.values())).shape[0]
    return [{k: v[i : i + b] for k, v in inputs.items()} for i in range(0, n, b)]


def whole_step(
    model: nn.Module, opt: torch.optim.Optimizer, micro: list[Rows], seed: int
) -> Callable[[], None]:
    """One optimizer step: zero_grad, K micro-batches of forward + backward (loss / K), step."""
    k = len(micro)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        for rows in micro:
            (model(**rows).loss / k).backward()
        opt.step()

    return step


def per_layer(model: nn.Module) -> None:
    """transformers' per-layer checkpointing, as ``benchmarks/hf_models.py`` switches it on."""
    from benchmarks.hf_models import _hf_enable

    _hf_enable(model)


def whole_step_peak(
    model: nn.Module, opt: torch.optim.Optimizer, step: Callable[[], None], device: str
) -> int:
    """Allocator high-water over ``PEAK_STEPS`` whole steps plus what existed at entry; on
    CUDA the caching allocator's reserved high-water when higher (what an OOM sees)."""
    at_entry = resident_bytes(model, opt)
    with AllocatorTracker(device) as allocator:
        for _ in range(PEAK_STEPS):
            step()
    return max(at_entry + allocator.peak_bytes, allocator.reserved_high_water_bytes or 0)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def trial(setup: Setup, strategy: str, b: int) -> dict[str, Any]:
    """One search trial: a fresh model under ``strategy`` at micro-batch ``b``, its peak."""
    started = time.perf_counter()
    model, inputs = setup.build()
    if strategy == "per-layer":
        per_layer(model)
    opt = setup.optimizer(model)
    micro = micro_batches(inputs, b)
    peak = whole_step_peak(model, opt, whole_step(model, opt, micro, setup.seed), setup.device)
    _sync(setup.device)
    seconds = time.perf_counter() - started
    del model, opt
    _release(setup.device)
    return {"micro_batch": b, "accumulation": len(micro), "peak_bytes": peak, "seconds": seconds}


def _release(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class Peaks:
    """Whole-step peaks per (strategy, micro-batch), each measured once per model."""

    def __init__(self, setup: Setup, log: Callable[[str], None]) -> None:
        self.setup, self.log = setup, log
        self.done: dict[tuple[str, int], dict[str, Any]] = {}

    def __call__(self, strategy: str, b: int) -> dict[str, Any]:
        if (strategy, b) not in self.done:
            t = trial(self.setup, strategy, b)
            self.done[strategy, b] = t
            self.log(f"  {strategy:<9} micro-batch {b:>3}: whole-step peak "
                     f"{mib(t['peak_bytes'])} MiB ({t['seconds']:.1f} s)")  # fmt: skip
        return self.done[strategy, b]


def find_executable(peaks: Peaks, strategy: str, budget: int, start: int) -> dict[str, Any]:
    """accelerate's ``find_executable_batch_size``: from ``start``, halve while over the budget."""
    trials, b = [], start
    while b >= 1:
        t = {**peaks(strategy, b)}
        t["fits"] = t["peak_bytes"] <= budget
        trials.append(t)
        if t["fits"]:
            break
        b //= 2
    found = trials[-1]["micro_batch"] if trials[-1]["fits"] else None
    ooms = [t for t in trials if not t["fits"]]
    return {
        "micro_batch": found,
        "trials": trials,
        "oom_trials": len(ooms),
        "oom_seconds": sum(t["seconds"] for t in ooms),
    }


# --------------------------------------------------------------------------- contenders


@dataclass
class Contender:
    key: str
    model: nn.Module
    opt: torch.optim.Optimizer
    micro_batch: int
    step: Callable[[], None]
    info: dict[str, Any]


def _plan_text(plan: gradckpt.Plan | None) -> str:
    if plan is None:
        return "no plan"
    from collections import Counter

    modes = Counter(u.mode for u in plan.units)
    segments = sum(isinstance(i, gradckpt.Segment) for i in plan.items)
    text = ", ".join(f"{n} {m}" for m, n in sorted(modes.items()))
    return (text or "nothing") + (f", {segments} segment(s)" if segments else "")


def make_contender(setup: Setup, key: str, b: int | None, budget: int) -> Contender:
    """Build, install and (for c, d) plan one contender; ``b`` is its micro-batch (d: tune's)."""
    from gradckpt.tuning import sliced_loss

    model, inputs = setup.build()
    opt = setup.optimizer(model)
    info: dict[str, Any] = {}
    if key == "b":
        per_layer(model)
    elif key == "c":
        assert b is not None
        micro = micro_batches(inputs, b)
        first = micro[0]
        started = time.perf_counter()
        plan = gradckpt.fit(model, lambda: model(**first).loss, budget, optimizer=opt,
                            accumulation_steps=len(micro))  # fmt: skip
        info.update(fit_seconds=time.perf_counter() - started, plan=_plan_text(plan),
                    predicted_peak_bytes=plan.predicted_peak_bytes)  # fmt: skip
    elif key == "d":
        started = time.perf_counter()
        result = gradckpt.tune(model, sliced_loss(model, inputs), budget, optimizer=opt,
                               global_batch=setup.global_batch)  # fmt: skip
        total = time.perf_counter() - started
        result.apply(model)
        b = result.micro_batch
        chosen = next(c for c in result.candidates if c.verdict == "chosen")
        tune_json = result.to_json()
        tune_json.pop("plan", None)
        info.update(
            tune=tune_json, tune_seconds=total, plan=_plan_text(result.plan),
            strategy=result.strategy, predicted_peak_bytes=result.plan.predicted_peak_bytes,
            predicted_samples_per_s=chosen.predicted_samples_per_s,
            tune_measured_samples_per_s=chosen.measured_samples_per_s,
            planning_seconds=result.planning_seconds, measuring_seconds=result.measuring_seconds,
            table=result.table(),
        )  # fmt: skip
    assert b is not None
    micro = micro_batches(inputs, b)
    return Contender(key, model, opt, b, whole_step(model, opt, micro, setup.seed), info)


def run_row(
    setup: Setup, label: str, budget: int, peaks: Peaks, args: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    """One (model, budget): the searches, the four contenders, their peaks and interleaved times."""
    g = setup.global_batch
    searches = {
        "a": find_executable(peaks, "plain", budget, g),
        "b": find_executable(peaks, "per-layer", budget, g),
    }
    sizes = {"a": searches["a"]["micro_batch"], "b": searches["b"]["micro_batch"]}
    sizes["c"] = sizes["a"]
    row: dict[str, Any] = {
        "model": setup.name, "budget": label, "budget_bytes": budget, "searches": searches,
        "contenders": {},
    }  # fmt: skip
    contenders: dict[str, Contender] = {}
    for key in CONTENDERS:
        if key != "d" and sizes[key] is None:
            row["contenders"][key] = {"error": "no micro-batch fits (even 1 is over the budget)"}
            log(f"  {NAMES[key]}: nothing fits")
            continue
        try:
            c = make_contender(setup, key, sizes.get(key), budget)
        except gradckpt.BudgetError as e:
            row["contenders"][key] = {"error": f"BudgetError: {str(e)[:300]}"}
            log(f"  {NAMES[key]}: {e}")
            continue
        if key in ("a", "b"):  # the search measured this very configuration already
            peak = peaks("plain" if key == "a" else "per-layer", c.micro_batch)["peak_bytes"]
        else:
            peak = whole_step_peak(c.model, c.opt, c.step, setup.device)
        contenders[key] = c
        row["contenders"][key] = {
            "micro_batch": c.micro_batch, "accumulation": g // c.micro_batch,
            "peak_bytes": peak, "within_budget": peak <= budget, **c.info,
        }  # fmt: skip
        extra = ""
        if key == "d":
            extra = (f"; tune {c.info['tune_seconds']:.1f} s (planning "
                     f"{c.info['planning_seconds']:.1f}, measuring "
                     f"{c.info['measuring_seconds']:.1f}), {c.info['strategy']}")  # fmt: skip
        log(f"  {NAMES[key]:<14} micro-batch {c.micro_batch:>3} x {g // c.micro_batch:<3} "
            f"peak {mib(peak)} MiB (budget {mib(budget)}){extra}")  # fmt: skip
    if contenders:
        times, walls = time_contenders(contenders, setup.device, args)
        for key in contenders:
            row["contenders"][key]["times"] = times[key]
            row["contenders"][key]["wall_times"] = walls[key]
    for c in contenders.values():
        for p in c.model.parameters():
            p.grad = None
    del contenders
    _release(setup.device)
    return row


def _clock(device: str, name: str) -> Callable[[], float] | None:
    return work_clock(device) if name == "cpu" else None


def time_contenders(
    contenders: dict[str, Contender], device: str, args: Any
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleaved whole steps: times on ``--clock`` (via ``time_interleaved``) and wall times."""
    walls: dict[str, list[float]] = {k: [] for k in contenders}

    def walled(key: str, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            walls[key].append(time.perf_counter() - start)

        return run

    steps = {k: walled(k, c.step) for k, c in contenders.items()}
    timings = time_interleaved(steps, warmup=args.warmup, repeats=args.repeats,
                               sync=device, clock=_clock(device, args.clock))  # fmt: skip
    times = {k: list(t.times) for k, t in timings.items()}
    return times, {k: w[args.warmup :] for k, w in walls.items()}


def per_sample_times(setup: Setup, sizes: list[int], args: Any) -> dict[str, Any]:
    """Plain forward + backward at each micro-batch, interleaved: does a bigger one pay?"""
    model, inputs = setup.build()
    params = list(model.parameters())
    walls: dict[int, list[float]] = {b: [] for b in sizes}

    def fwd_bwd(b: int) -> Callable[[], None]:
        rows = {k: v[:b] for k, v in inputs.items()}

        def run() -> None:
            for p in params:
                p.grad = None
            _sync(setup.device)
            start = time.perf_counter()
            model(**rows).loss.backward()
            _sync(setup.device)
            walls[b].append(time.perf_counter() - start)

        return run

    timings = time_interleaved({str(b): fwd_bwd(b) for b in sizes}, warmup=args.warmup,
                               repeats=args.repeats, sync=setup.device,
                               clock=_clock(setup.device, args.clock))  # fmt: skip
    _release(setup.device)
    return {
        str(b): {"times": list(timings[str(b)].times), "wall_times": walls[b][args.warmup :]}
        for b in sizes
    }


def run_model(setup: Setup, args: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """Budgets from the plain peaks at 1, 2 and 4, then both rows and the per-sample table."""
    started = time.perf_counter()
    peaks = Peaks(setup, log)
    plain = {b: peaks("plain", b)["peak_bytes"] for b in (1, 2, 4)}
    budgets = {
        "loose": (plain[2] + plain[4]) // 2,
        "tight": (plain[1] + plain[2]) // 2,
    }
    rows = []
    for label, budget in budgets.items():
        log(f" {setup.name}, budget {label}: {mib(budget)} MiB")
        rows.append(run_row(setup, label, budget, peaks, args, log))
    g = setup.global_batch
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= g and g % b == 0]
    log(f" {setup.name}: plain forward + backward per micro-batch {sizes}")
    table = per_sample_times(setup, sizes, args)
    return {
        "model": setup.name, "sizes": setup.sizes, "rows": rows, "per_sample": table,
        "peaks": {f"{s}@{b}": t for (s, b), t in peaks.done.items()},
        "seconds": time.perf_counter() - started,
    }  # fmt: skip


# --------------------------------------------------------------------------- report


def _rates(times: list[float], g: int) -> list[float]:
    return [g / t for t in times]


def _median_spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "n/a"
    med = statistics.median(values)
    return f"{fmt.format(med)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


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
        _median_spread(_rates(c.get("times") or [], g)),
        _median_spread(_rates(c.get("wall_times") or [], g)),
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
            out.append([model["model"], b, _median_spread(per, "{:.1f}"),
                        _median_spread(wall, "{:.1f}"),
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


def write(data: dict[str, Any], out: Path, tag: str) -> tuple[Path, Path]:
    info = data["info"]
    where = hardware_slug(info.get("gpu"))
    png = results_path(out, tag, "png", info["date"], where)
    try:
        out.mkdir(parents=True, exist_ok=True)
        plot(data, png)
        info["plot"] = png.name
    except ImportError:
        info["plot"] = None
    return write_results(out, tag, render(data), data, date=info["date"], where=where)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default 16; quick 8)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="what times a step: this thread's CPU time (default on CPU: the machine "
                        "is shared; tune measures its own steps so) or wall time (default on CUDA)")  # fmt: skip
    p.add_argument("--tag", default="tune", help="results file name prefix (default %(default)s)")
    # One thread: on 2 shared cores two OpenMP threads wait on each other whenever another
    # process runs (benchmarks/hf_models.py), and the CPU clock counts one thread's work only.
    p.set_defaults(threads=1)
    args = p.parse_args(argv)
    settle(args)
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        md, js = write(data, args.out, args.tag)
        print(render(data))
        print(f"wrote {md} and {js}")
        return 0
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("tune: no CUDA device here")
        return 1
    args.clock = args.clock or ("wall" if cuda else "cpu")
    g = args.global_batch or (8 if args.quick else 16)
    import transformers

    transformers.logging.set_verbosity_error()  # config chatter, not results
    warnings.filterwarnings("ignore", message="gradckpt.fit on")  # the use_cache message
    table = QUICK if args.quick else (GPU if cuda else FULL)
    clock = RunClock.start()
    _warm_up(args.device)
    models = []
    for name in args.models:
        setup = Setup(name, table[name], g, args.device, args.seed)
        print(f"{name}: {setup.sizes}, global batch {g}", flush=True)
        models.append(run_model(setup, args, lambda s: print(s, flush=True)))
    argv = sys.argv[1:] if argv is None else list(argv)
    info = machine_info(
        transformers=transformers.__version__, models=", ".join(args.models),
        sizes={m: table[m] for m in args.models}, global_batch=g, lr=Setup.lr,
        device=args.device, gpu=torch.cuda.get_device_name() if cuda else None,
        clock=args.clock, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
        quick=args.quick, optimizer="torch.optim.AdamW (torch defaults otherwise)",
        command=shlex.join(["python", "-m", "benchmarks.tune", *argv]), **clock.info(),
    )  # fmt: skip
    data = {"info": info, "models": models}
    md, js = write(data, args.out, args.tag)
    print(render(data))
    print(f"wrote {md} and {js}")
    return 0


def _warm_up(device: str) -> None:
    """One tiny whole step under the tracker: the process's first sets up kernels, the profiler
    and (CUDA) cuBLAS workspaces, which are no contender's memory."""
    setup = Setup("gpt2", QUICK["gpt2"], 2, device, 0)
    trial(setup, "plain", 1)


if __name__ == "__main__":
    raise SystemExit(main())
