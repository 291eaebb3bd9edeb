"""Plans from fit's fake-first route against plans from a real profile, at the same budget (#40).

``fit(model, loss_fn, budget)`` profiles under fake tensors first when the plain
step may not fit a byte budget, then checks plans on real steps. Issue #40 found
those plans four to five times as slow as a real profile's on conv nets: the
fake profile saw no convolution workspace and priced all of it on every unit.
Now each distinct op runs once for real (workspace where it occurs, real op
times: ``gradckpt.profiling.replay``).

Per model, at the budget halfway between the measured peaks of plain and
every-block checkpointing (``torch.utils.checkpoint`` on each block):

* **fake-first**: ``gradckpt.fit(model, loss_fn, budget)`` (the default route);
* **real profile**: ``gradckpt.fit(model, loss_fn, budget, profile=gradckpt.profile(...))``;

then plain, every-block and both plans run interleaved (each on its own copy of
the model): the allocator's peak of an untimed step each, step time over plain
per round. Targets: the fake-first plan's overhead within 3 points of the real
profile's (median of the per-round difference, with a bootstrap 95% interval),
and its peak at least 0.85x the budget and within it. torch's default 2 threads
(the workspace the fake profile misses grows with them).

Usage:
    python -m benchmarks.fake_first                 # the #40 models (several minutes)
    python -m benchmarks.fake_first --quick         # one tiny model (smoke test)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradckpt
from benchmarks.harness import (
    RunClock,
    base_parser,
    gradckpt_checkpoint,
    info_block,
    load_note,
    machine_info,
    markdown_table,
    measure_contenders,
    measure_peaks,
    mib,
    per_block,
    plain,
    read_results,
    rerun_command,
    settle,
    unknown_models,
    verdict,
    with_plan,
    write_results,
)
from benchmarks.harness.stats import median_interval
from gradckpt.planning.plans.plan import Segment, iter_units
from gradckpt.testing import Example, make, resnet_imagenet
from gradckpt.testing.wild import wild

OVERHEAD_POINTS, LEAST_USE = 0.03, 0.85


def models(quick: bool) -> dict[str, Callable[[], Example]]:
    if quick:
        return {"unet-small": lambda: make("unet", depth=2, base=8, image=64, batch=2)}
    return {
        # The U-Net of issues #8 and #40: 3 levels, 32 base channels, 128x128, batch 4.
        "unet-issue40": lambda: make("unet", depth=3, base=32, image=128, batch=4),
        "unet-zoo-128": lambda: make("unet", image=128, batch=4),
        "resnet18-224": lambda: resnet_imagenet(batch=8),
        # An LM whose plans chunk its linear head (gradients made in the forward).
        "titan-llama": lambda: wild(
            "titan_llama", layers=4, dim=256, heads=4, seq=512, batch=2, vocab=8192
        ),
    }


def _fit(build: Callable[[], Example], budget: int, real: bool) -> tuple[gradckpt.Plan, float]:
    ex = build()
    start = time.perf_counter()
    prof = gradckpt.profile(ex.model, ex.loss_fn) if real else None
    plan = gradckpt.fit(ex.model, ex.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof))
    seconds = time.perf_counter() - start
    gradckpt.remove(ex.model)
    return plan, seconds


def run_model(
    name: str, build: Callable[[], Example], warmup: int, repeats: int, log: Callable[[str], None]
) -> dict[str, Any]:
    ex = build()
    plain_peak, _, _ = measure_peaks(ex, plain())
    every_peak, _, _ = measure_peaks(ex, per_block(gradckpt_checkpoint()))
    del ex
    budget = (plain_peak + every_peak) // 2
    log(f"{name}: plain {mib(plain_peak)} MiB, every block {mib(every_peak)} MiB, "
        f"budget {mib(budget)} MiB")  # fmt: skip
    fake_plan, fake_s = _fit(build, budget, real=False)
    real_plan, real_s = _fit(build, budget, real=True)
    log(f"  fit: fake-first {fake_s:.1f} s, real profile {real_s:.1f} s")
    contenders = {
        "plain": plain(),
        "every_block": per_block(gradckpt_checkpoint()),
        "fake_first": with_plan(fake_plan),
        "real_profile": with_plan(real_plan),
    }
    results = measure_contenders(build, contenders, baseline="plain", warmup=warmup,
                                 repeats=repeats, log=log)  # fmt: skip
    row: dict[str, Any] = {"budget": budget, "plain_peak": plain_peak, "every_peak": every_peak}
    for key, plan, seconds in (("fake_first", fake_plan, fake_s),
                               ("real_profile", real_plan, real_s)):  # fmt: skip
        row[key] = {
            "plan": plan.summary().splitlines()[0],
            "kinds": _kinds(plan),
            "predicted_peak": plan.predicted_peak_bytes,
            "predicted_overhead": plan.predicted_overhead,
            "fit_s": round(seconds, 1),
        }
    row["results"] = {k: m.to_json() for k, m in results.items()}
    return row


def _kinds(plan: gradckpt.Plan) -> str:
    """``2 segment, 3 recompute, 1 selective``: what the plan does besides keeping."""
    counts: dict[str, int] = {}
    for item in plan.items:
        if isinstance(item, Segment):
            counts["segment"] = counts.get("segment", 0) + 1
    for unit in iter_units(plan.items):
        kind = type(unit.decision).__name__.lower()
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()) if k != "keep") or "keep all"


def _overheads(row: dict[str, Any], key: str) -> list[float]:
    base = row["results"]["plain"]["times_s"]
    return [t / b - 1 for t, b in zip(row["results"][key]["times_s"], base)]


def verdicts(row: dict[str, Any]) -> dict[str, Any]:
    fake, real = _overheads(row, "fake_first"), _overheads(row, "real_profile")
    diff = median_interval([a - b for a, b in zip(fake, real)])
    peak = row["results"]["fake_first"]["peak_bytes"]
    return {
        "fake_overhead": median_interval(fake),
        "real_overhead": median_interval(real),
        "every_overhead": median_interval(_overheads(row, "every_block")),
        "difference": diff,
        "overhead_met": diff[0] <= OVERHEAD_POINTS,
        "use": peak / row["budget"],
        "peak_met": LEAST_USE * row["budget"] <= peak <= row["budget"],
    }


def _pct(v: tuple[float, float, float]) -> str:
    return f"{v[0]:+.1%} ({v[1]:+.1%} to {v[2]:+.1%})"


def report(data: dict[str, Any]) -> str:
    rows, targets = [], []
    for name, row in data["models"].items():
        v = verdicts(row)
        for key, label in (("fake_first", "fit (default: fake-first)"),
                           ("real_profile", "fit (real profile)")):  # fmt: skip
            r, p = row["results"][key], row[key]
            overhead = v["fake_overhead"] if key == "fake_first" else v["real_overhead"]
            rows.append([name, label, p["kinds"], mib(p["predicted_peak"]), mib(r["peak_bytes"]),
                         f"{p['predicted_overhead']:+.1%}", _pct(overhead), p["fit_s"]])  # fmt: skip
        rows.append([name, "every block", "", "", mib(row["results"]["every_block"]["peak_bytes"]),
                     "", _pct(v["every_overhead"]), ""])  # fmt: skip
        targets.append([name, mib(row["budget"]), _pct(v["difference"]), verdict(v["overhead_met"]),
                        f"{v['use']:.3f}", verdict(v["peak_met"])])  # fmt: skip
    return "\n\n".join([
        "# fit's fake-first route against a real profile, at the same budget (#40)",
        __doc__.split("\n\n")[1] if __doc__ else "",
        markdown_table(["model", "route", "plan", "predicted peak (MiB)", "measured peak (MiB)",
                        "predicted overhead", "measured overhead (95% interval)", "fit (s)"],
                       rows),
        markdown_table(["model", "budget (MiB)", "fake-first - real overhead (95% interval)",
                        "within 3 points", "peak / budget", "0.85 <= peak / budget <= 1"],
                       targets),
        "Overheads: per interleaved round, step time over the plain step's, less 1; median "
        "and a bootstrap 95% interval of the median. Peaks at the allocator, parameters included.",
        info_block(data["info"]),
        load_note(data["info"]),
    ])


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--models", nargs="*", default=None, help="which models (default: all)")
    args = p.parse_args(argv)
    if args.from_json:
        data = read_results(args.from_json)
        print(report(data))
        write_results(args.out, "fake-first", report(data), data)
        return 0
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 9)
    settle(args)
    chosen = models(args.quick)
    bad = unknown_models(args.models or [], chosen)
    if bad:
        p.error(bad)
    wanted = {k: v for k, v in chosen.items() if not args.models or k in args.models}
    clock = RunClock.start()
    rows = {n: run_model(n, b, warmup, repeats, print) for n, b in wanted.items()}
    info = machine_info(threads=args.threads, quick=args.quick, warmup=warmup, repeats=repeats,
                        rerun=rerun_command("benchmarks.fake_first", argv), **clock.info())  # fmt: skip
    data = {"info": info, "models": rows}
    text = report(data)
    print(text)
    write_results(args.out, "fake-first", text, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

