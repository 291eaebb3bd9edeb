"""Planner benchmark: gradckpt's plans against the hand-placed schemes, budget by budget.

For each model (the zoo GPT and U-Net, and ``resnet_conv``, a conv-heavy ResNet at
128x128 whose convolution kernels allocate large scratch buffers) the step is
profiled once; the budgets are
the least feasible peak, the every-block peak, 25/50/75% of the way from the
every-block peak to the plain peak, and the plain peak. Then, side by side in
one process, each contender's peak is measured (one untimed step each) and all
contenders are timed interleaved:

* ``gradckpt``: ``gradckpt.Planner(prof).plan(budget)`` per budget (one planner per model);
* the solvers' baselines, applied with ``gradckpt.apply``: ``none``, ``every_block``,
  ``every_kth`` (per budget the largest k whose *measured* peak fits), ``sqrt``,
  ``save_matmuls``;
* ``torch_full``: ``torch.utils.checkpoint`` per block; ``torch_sac``: torch selective
  checkpointing per block with ``gradckpt.policies.MATMUL_OPS``.

Peaks are measured at the allocator (kernel workspaces included: what an OOM
sees) and, for comparison, at the tensor level (``MemoryTracker``); budgets are
checked against the allocator's. A baseline counts at a budget only if its
measured peak fits. Planning time is
measured on a 48-block GPT with a small width. Results: Markdown + JSON + PNG.

Usage:
    python -m benchmarks.frontier            # full run (tens of minutes on 2 CPU cores)
    python -m benchmarks.frontier --quick    # smoke test
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
    Installer,
    Measured,
    MiB,
    RunClock,
    base_parser,
    fmt_ratio,
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
    results_path,
    settle,
    torch_checkpoint,
    torch_sac,
    unknown_models,
    verdict,
    with_plan,
    write_results,
)
from gradckpt.planning.plans.plan import Plan, Segment, iter_units
from gradckpt.planning.solving.solvers import (
    every_kth_plan,
    finish,
    none_plan,
    save_matmuls_plan,
    sqrt_plan,
)
from gradckpt.testing import make, resnet_conv

MODELS_FULL = {
    "gpt": dict(layers=12, d_model=512, heads=8, seq=512, vocab=2048, batch=4, dropout=0.0),
    # Activations dominate here (small width, long batch x sequence): unlike the
    # gpt above, whose floor is its parameters and gradients, segments can take
    # this one below checkpoint-every-block.
    "gpt_act": dict(layers=12, d_model=128, heads=4, seq=512, vocab=1024, batch=8, dropout=0.0),
    "unet": dict(depth=4, base=32, image=128, batch=2),
    "resnet_conv": dict(stages=(2, 2, 2, 2), channels=(16, 32, 64, 128), image=128, batch=4),
}
MODELS_QUICK = {
    "gpt": dict(layers=4, d_model=64, heads=4, seq=64, vocab=256, batch=2, dropout=0.0),
    "gpt_act": dict(layers=6, d_model=32, heads=2, seq=128, vocab=128, batch=8, dropout=0.0),
    "unet": dict(depth=2, base=8, image=32, batch=2),
    "resnet_conv": dict(stages=(1, 1, 1, 1), channels=(8, 8, 16, 16), image=32, batch=2),
}
#: Configurations above that are another size of a zoo model.
ZOO_NAME = {"gpt_act": "gpt"}
#: Models built outside the zoo's registry (too slow for its fast defaults).
BUILDERS = {"resnet_conv": resnet_conv}
PLANNING_FULL = dict(layers=48, d_model=64, heads=4, seq=64, vocab=256, batch=2, dropout=0.0)
PLANNING_QUICK = dict(layers=8, d_model=32, heads=2, seq=32, vocab=128, batch=2, dropout=0.0)

NOISE = 1.03  # "no worse than the best fitting baseline" allows 3% timing noise
PLAN_TIME_TARGET = 2.0  # seconds, planning a 48-block model from its profile
BASELINES = ("none", "every_block", "every_kth", "sqrt", "save_matmuls", "torch_full", "torch_sac")


def _describe(plan: Plan) -> str:
    units = list(iter_units(plan.items))
    modes = {m: sum(u.mode == m for u in units) for m in ("keep", "recompute", "selective")}
    segments = sum(isinstance(i, Segment) for i in plan.items)
    parts = [f"{n} {m}" for m, n in modes.items() if n]
    if segments:
        parts.append(f"{segments} segment(s)")
    return ", ".join(parts)


def _budgets(planner: gradckpt.Planner) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    prof = planner.profile
    _, least = planner.least_peak()
    _, every = finish(prof, every_kth_plan(prof, 1), None, "every_block")
    top, eb = prof.measured_peak_bytes, every.peak_bytes
    budgets = [
        ("least", least.peak_bytes),
        ("every_block", eb),
        *((f"{p}%", round(eb + p / 100 * (top - eb))) for p in (25, 50, 75)),
        ("plain", top),
    ]
    return budgets, {"least_feasible_predicted": least.peak_bytes, "every_block_predicted": eb}


def run_model(name: str, sizes: dict, args: Any, log: Callable[[str], None] = print) -> dict:
    """Profile, plan at each budget, measure every contender; returns everything as data."""

    def build():
        if name in BUILDERS:
            return BUILDERS[name](**sizes)
        return make(ZOO_NAME.get(name, name), **sizes)

    scratch = build()
    log(f"{name} {sizes}: profiling ({args.profile_repeats} repeats)")
    t0 = time.perf_counter()
    prof = gradckpt.profile(scratch.model, scratch.loss_fn, repeats=args.profile_repeats)
    profile_s = time.perf_counter() - t0
    blocks = [u.path for u in prof.blocks]
    planner = gradckpt.Planner(prof)  # chain and DP built once for every budget below
    budgets, predicted = _budgets(planner)
    log(f"  profiled in {profile_s:.1f} s; plain peak {mib(prof.measured_peak_bytes)} MiB "
        f"(tensors {mib(prof.tracker_peak_bytes)}), blocks {blocks}")  # fmt: skip

    # Plans (all simulated on the same profile).
    plans: dict[str, Plan] = {
        "none": none_plan(prof),
        "every_block": every_kth_plan(prof, 1),
        "sqrt": sqrt_plan(prof),
        "save_matmuls": save_matmuls_plan(prof),
    }
    kth = {k: every_kth_plan(prof, k) for k in range(2, len(blocks) + 1)}
    dp_plans: dict[str, Plan | None] = {}
    plan_errors: dict[str, str] = {}
    for label, budget in budgets:
        try:
            dp_plans[label] = planner.plan(budget)
        except gradckpt.BudgetError as e:
            dp_plans[label], plan_errors[label] = None, str(e)
    simulated = {
        key: finish(prof, plan, None, "x")[1]
        for key, plan in [*plans.items(), *((f"every_kth(k={k})", p) for k, p in kth.items())]
    }

    # Peaks of the every-k-th plans (k >= 2), untimed, on the scratch model.
    kth_peaks, kth_tracker = {}, {}
    for k, plan in kth.items():
        kth_peaks[k], kth_tracker[k], _ = measure_peaks(scratch, with_plan(plan), args.seed)
        log(f"  peak every_kth(k={k}) {mib(kth_peaks[k])} MiB")
    best_k: dict[str, int | None] = {}
    for label, budget in budgets:
        fitting = [k for k, peak in kth_peaks.items() if peak <= budget]
        best_k[label] = max(fitting) if fitting else None

    # The timed contenders; a dp plan equal to a baseline plan is measured once.
    contenders: dict[str, Installer] = {
        "none": plain(),
        "every_block": with_plan(plans["every_block"]),
        "sqrt": with_plan(plans["sqrt"]),
        "save_matmuls": with_plan(plans["save_matmuls"]),
        "torch_full": per_block(torch_checkpoint, blocks),
        "torch_sac": per_block(torch_sac(sorted(gradckpt.policies.MATMUL_OPS, key=str)), blocks),
    }
    by_items = {plans[n].items: n for n in ("none", "every_block", "sqrt", "save_matmuls")}
    for k in sorted({k for k in best_k.values() if k is not None}):
        contenders[f"every_kth(k={k})"] = with_plan(kth[k])
        by_items.setdefault(kth[k].items, f"every_kth(k={k})")
    dp_name: dict[str, str | None] = {}
    for label, plan in dp_plans.items():
        if plan is None:
            dp_name[label] = None
            continue
        same = by_items.get(plan.items)
        if same is None:
            same = f"gradckpt@{label}"
            contenders[same] = with_plan(plan)
            by_items[plan.items] = same
        dp_name[label] = same
    for label, plan in dp_plans.items():
        if plan is not None and dp_name[label] not in simulated:
            simulated[dp_name[label]] = finish(prof, plan, None, "dp")[1]
    log(f"  measuring {len(contenders)} contenders: {list(contenders)}")
    measured = measure_contenders(
        build, contenders, baseline="none", warmup=args.warmup, repeats=args.repeats,
        seed=args.seed, log=log,
    )  # fmt: skip
    for k, peak in kth_peaks.items():  # peak-only rows for the k never timed
        measured.setdefault(
            f"every_kth(k={k})", Measured(f"every_kth(k={k})", peak, float("nan"), kth_tracker[k])
        )

    # Per budget: what fits (by measured peak), and the targets.
    rows = []
    for label, budget in budgets:
        g = measured.get(dp_name[label]) if dp_name[label] else None
        fits: dict[str, Measured] = {}
        for base in BASELINES:
            key = base
            if base == "every_kth":
                key = f"every_kth(k={best_k[label]})" if best_k[label] else None
            m = measured.get(key) if key else None
            if m is not None and m.ratio is not None and m.peak_bytes <= budget:
                fits[base] = m
        best = min(fits.items(), key=lambda kv: kv[1].ratio) if fits else None
        plan = dp_plans[label]
        rows.append(
            {
                "label": label,
                "budget_bytes": budget,
                "gradckpt_contender": dp_name[label],
                "gradckpt_plan": _describe(plan) if plan else None,
                "gradckpt_predicted_peak": plan.predicted_peak_bytes if plan else None,
                "gradckpt_predicted_overhead": plan.predicted_overhead if plan else None,
                "gradckpt_peak": g.peak_bytes if g else None,
                "gradckpt_tracker_peak": g.tracker_peak_bytes if g else None,
                "gradckpt_ratio": g.ratio if g else None,
                "within_budget": bool(g and g.peak_bytes <= budget),
                "best_k": best_k[label],
                "fitting": {b: {"name": m.name, "ratio": m.ratio, "peak": m.peak_bytes}
                            for b, m in fits.items()},
                "best_baseline": best[1].name if best else None,
                "best_baseline_ratio": best[1].ratio if best else None,
                "no_worse": bool(g and (best is None or g.ratio <= best[1].ratio * NOISE)),
                "error": plan_errors.get(label),
            }
        )  # fmt: skip
    t0 = time.perf_counter()
    front = gradckpt.frontier(scratch.model, scratch.loss_fn, profile=prof)
    frontier_s = time.perf_counter() - t0
    return {
        "model": name,
        "sizes": sizes,
        "blocks": blocks,
        "profile_s": profile_s,
        "frontier_s": frontier_s,
        "plain_peak_profiled": prof.measured_peak_bytes,
        "plain_tracker_peak_profiled": prof.tracker_peak_bytes,
        "prediction_errors": prediction_errors(simulated, measured),
        "plain_step_profiled_s": prof.step_time,
        **predicted,
        "simulated": {
            k: {"peak": p.peak_bytes, "overhead": p.overhead} for k, p in simulated.items()
        },
        "measured": {k: m.to_json() for k, m in measured.items()},
        "budgets": rows,
        "frontier": [{"peak": p.peak_bytes, "overhead": p.overhead} for p in front],
    }


def prediction_errors(simulated: dict, measured: dict) -> dict[str, float]:
    """Simulated / allocator-measured peak - 1, per contender the simulator knows."""
    return {
        name: simulated[name].peak_bytes / m.peak_bytes - 1.0
        for name, m in measured.items()
        if name in simulated and m.peak_bytes > 0
    }


def targets_of(result: dict) -> list[tuple[str, str, str, str]]:
    rows = result["budgets"]
    meas = result["measured"]
    out = []
    failed = [r for r in rows if r["error"]]
    out.append(("gradckpt plans every budget (all >= the least feasible peak)", "no BudgetError",
                "; ".join(f"{r['label']}: {r['error'][:160]}" for r in failed) or "all planned",
                verdict(not failed)))  # fmt: skip
    over = [r for r in rows if r["gradckpt_peak"] is not None and not r["within_budget"]]
    out.append(("gradckpt never over budget (allocator peak)", "0 budgets over",
                f"{len(over)} over" + (": " + ", ".join(
                    f"{r['label']} {mib(r['gradckpt_peak'])} > {mib(r['budget_bytes'])} MiB"
                    for r in over) if over else ""),
                verdict(not over)))  # fmt: skip
    errors = [abs(e) for e in result.get("prediction_errors", {}).values()]
    if errors:
        med, top = statistics.median(errors), max(errors)
        out.append(("predicted vs allocator-measured peak", "median <= 2%, max <= 5%",
                    f"median {med:.2%}, max {top:.2%} over {len(errors)} plans",
                    verdict(med <= 0.02 and top <= 0.05)))  # fmt: skip
    worse = [r for r in rows if not r["no_worse"]]
    detail = "; ".join(
        f"{r['label']}: {fmt_ratio(r['gradckpt_ratio'])} vs {r['best_baseline']} "
        f"{fmt_ratio(r['best_baseline_ratio'])}"
        for r in rows
    )
    out.append((f"gradckpt time <= best fitting baseline x {NOISE}", "every budget", detail,
                verdict(not worse)))  # fmt: skip
    half = next(r for r in rows if r["label"] == "50%")
    eb = meas["every_block"]["ratio"] - 1.0
    g = half["gradckpt_ratio"] - 1.0 if half["gradckpt_ratio"] is not None else None
    out.append(("overhead at 50% budget <= half of every_block's", f"<= {eb / 2:+.3f}",
                "n/a" if g is None else f"{g:+.3f} (every_block {eb:+.3f})",
                verdict(g is not None and g <= eb / 2)))  # fmt: skip
    least = rows[0]
    eb_peak = meas["every_block"]["peak_bytes"]
    reached = (
        least["gradckpt_peak"] is not None
        and least["within_budget"]
        and (least["gradckpt_peak"] < eb_peak)
    )
    out.append(("budgets below every_block's peak reached", f"< {mib(eb_peak)} MiB",
                f"{mib(least['gradckpt_peak'])} MiB at budget {mib(least['budget_bytes'])} MiB",
                verdict(reached)))  # fmt: skip
    return out


def model_report(result: dict) -> str:
    rows = result["budgets"]
    meas = result["measured"]
    budget_table = markdown_table(
        ["budget", "budget (MiB)", "gradckpt plan", "predicted peak (MiB)",
         "allocator peak (MiB)", "tensor peak (MiB)", "in budget (allocator)", "time / plain",
         "predicted", "best fitting baseline", "its time / plain"],
        [
            (r["label"], mib(r["budget_bytes"]), r["gradckpt_plan"] or r["error"],
             mib(r["gradckpt_predicted_peak"]), mib(r["gradckpt_peak"]),
             mib(r.get("gradckpt_tracker_peak")),
             "yes" if r["within_budget"] else "**no**", fmt_ratio(r["gradckpt_ratio"]),
             "n/a" if r["gradckpt_predicted_overhead"] is None
             else f"{1 + r['gradckpt_predicted_overhead']:.3f}",
             r["best_baseline"] or "none fits", fmt_ratio(r["best_baseline_ratio"]))
            for r in rows
        ],
    )  # fmt: skip
    labels = [r["label"] for r in rows]
    matrix = []
    for base in BASELINES:
        cells = []
        for r in rows:
            if base == "every_kth":
                k = r["best_k"]
                m = meas.get(f"every_kth(k={k})") if k else None
                cells.append(f"{fmt_ratio(m['ratio'])} (k={k})" if m else "over")
                continue
            m = meas[base]
            cells.append(fmt_ratio(m["ratio"]) if m["peak_bytes"] <= r["budget_bytes"] else "over")
        matrix.append((base, *cells))
    matrix.append(("**gradckpt**", *(fmt_ratio(r["gradckpt_ratio"]) for r in rows)))
    matrix_table = markdown_table(["contender", *labels], matrix)
    sim = result["simulated"]
    contender_rows = []
    for name, m in meas.items():
        s = sim.get(name)
        contender_rows.append(
            (f"`{name}`", "n/a" if s is None else mib(s["peak"]), mib(m["peak_bytes"]),
             mib(m.get("tracker_peak_bytes")),
             "n/a" if s is None else f"{1 + s['overhead']:.3f}", fmt_ratio(m["ratio"]),
             fmt_ratio(m["min_ratio"]),
             "n/a" if m["median_s"] is None else f"{m['median_s']:.3f}")
        )  # fmt: skip
    contender_table = markdown_table(
        ["contender", "simulated peak (MiB)", "allocator peak (MiB)", "tensor peak (MiB)",
         "predicted time / plain",
         "measured time / plain", "fastest / plain's fastest", "median step (s)"],
        contender_rows,
    )  # fmt: skip
    targets = markdown_table(["target", "wanted", "measured", "verdict"], targets_of(result))
    return "\n\n".join(
        [
            f"## {result['model']} {result['sizes']}",
            f"Blocks: {', '.join(result['blocks'])}. Profiled once in {result['profile_s']:.1f} s "
            f"(plain peak {mib(result['plain_peak_profiled'])} MiB at the allocator, "
            f"{mib(result.get('plain_tracker_peak_profiled'))} MiB of tensors; step "
            f"{result['plain_step_profiled_s']:.3f} s). `gradckpt.frontier` from that profile: "
            f"{result['frontier_s']:.2f} s, {len(result['frontier'])} points. Simulated peaks: "
            f"`least_peak_plan` {mib(result['least_feasible_predicted'])} MiB, every block "
            f"{mib(result['every_block_predicted'])} MiB.",
            "### gradckpt at each budget",
            budget_table,
            "### Time / plain of every contender that fits each budget (by measured peak)",
            "`over`: its measured peak is above the budget. every_kth: the largest k >= 2 whose measured peak fits (k = 1 is every_block).",
            matrix_table,
            "### Contenders (each measured once; timed interleaved in one process)",
            contender_table,
            "### Targets",
            targets,
        ]
    )


def planning_time(sizes: dict, args: Any, log: Callable[[str], None] = print) -> dict:
    """Profile a deep GPT once, then time ``gradckpt.plan(..., profile=prof)`` per budget."""
    ex = make("gpt", **sizes)
    t0 = time.perf_counter()
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    profile_s = time.perf_counter() - t0
    budgets, _ = _budgets(gradckpt.Planner(prof))
    timings, errors = {}, {}
    for label, budget in budgets:
        times = []
        for _ in range(args.plan_repeats):
            t0 = time.perf_counter()
            try:
                gradckpt.plan(ex.model, ex.loss_fn, budget, solver="dp", profiling=gradckpt.ProfileOptions(profile=prof))
            except gradckpt.BudgetError as e:  # still a complete planning call: timed
                errors[label] = f"BudgetError: {e}"
            times.append(time.perf_counter() - t0)
        timings[label] = statistics.median(times)
        log(f"  plan at {label} ({mib(budget)} MiB): {timings[label]:.3f} s"
            + (f" ({errors[label][:80]}...)" if label in errors else ""))  # fmt: skip
    t0 = time.perf_counter()
    gradckpt.frontier(ex.model, ex.loss_fn, profile=prof)
    frontier_s = time.perf_counter() - t0
    worst = max(timings.values())
    return {"sizes": sizes, "blocks": len(prof.blocks), "ops": len(prof.ops),
            "profile_s": profile_s, "plan_s": timings, "errors": errors, "worst_s": worst,
            "frontier_s": frontier_s, "met": worst < PLAN_TIME_TARGET}  # fmt: skip


def plot(results: list[dict], path: Path) -> str:
    """The frontier (predicted) and each contender's measured point; returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: PNG skipped"
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5.5), squeeze=False)
    for ax, result in zip(axes[0], results):
        front = result["frontier"]
        ax.step([p["peak"] / MiB for p in front], [p["overhead"] for p in front], where="post",
                color="0.3", label="gradckpt.frontier (predicted)")  # fmt: skip
        for r in result["budgets"]:
            ax.axvline(r["budget_bytes"] / MiB, color="0.85", lw=0.8, zorder=0)
        g = [r for r in result["budgets"] if r["gradckpt_ratio"] is not None]
        ax.plot([r["gradckpt_peak"] / MiB for r in g], [r["gradckpt_ratio"] - 1 for r in g],
                "o-", color="tab:red", label="gradckpt (measured, per budget)", zorder=5)  # fmt: skip
        markers = iter("sD^v<>pPX*h")
        for name, m in result["measured"].items():
            if m["ratio"] is None or name.startswith("gradckpt@"):
                continue
            ax.plot(m["peak_mib"], m["ratio"] - 1, next(markers, "x"), ms=8, label=name)
        ax.set_xlabel("peak (MiB)")
        ax.set_ylabel("overhead (step time / plain - 1)")
        ax.set_title(f"{result['model']} (budgets: grey lines)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default="gpt,gpt_act,unet,resnet_conv",
        help="comma-separated zoo models to benchmark (default: %(default)s)",
    )
    p.add_argument(
        "--profile-repeats",
        type=int,
        default=None,
        help="profiled steps per model (default 3, quick 1)",
    )
    p.add_argument(
        "--plan-layers",
        type=int,
        default=None,
        help="blocks of the GPT used for planning time (default 48, quick 8)",
    )
    p.add_argument(
        "--plan-repeats",
        type=int,
        default=None,
        help="timed gradckpt.plan calls per budget for planning time (default 3, quick 1)",
    )
    p.add_argument("--skip-planning-time", action="store_true", help="do not measure planning time")
    args = p.parse_args(argv)  # fmt: skip
    settle(args)
    if args.from_json is not None:
        saved = read_results(args.from_json)
        render(saved["models"], saved["planning"], saved["info"], args.out)
        return 0
    if args.profile_repeats is None:
        args.profile_repeats = 1 if args.quick else 3
    if args.plan_repeats is None:
        args.plan_repeats = 1 if args.quick else 3
    sizes = MODELS_QUICK if args.quick else MODELS_FULL
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if error := unknown_models(names, sizes):
        p.error(error)
    clock = RunClock.start()
    results = [run_model(n, sizes[n], args) for n in names]
    planning = None
    if not args.skip_planning_time:
        psizes = dict(PLANNING_QUICK if args.quick else PLANNING_FULL)
        if args.plan_layers is not None:
            psizes["layers"] = args.plan_layers
        print(f"planning time: gpt {psizes}")
        planning = planning_time(psizes, args)
    info = machine_info(
        models={n: sizes[n] for n in names},
        warmup=args.warmup,
        repeats=args.repeats,
        profile_repeats=args.profile_repeats,
        plan_repeats=args.plan_repeats,
        seed=args.seed,
        quick=args.quick,
        **clock.info(),
    )
    if planning is not None:
        planning["plan_repeats"] = args.plan_repeats
    render(results, planning, info, args.out)
    return 0


def render(results: list[dict], planning: dict | None, info: dict, out: Path) -> None:
    """Write the Markdown, JSON and PNG for measured ``results``; print the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    png = results_path(out, "frontier", "png", info["date"])
    png_status = plot(results, png)
    parts = [
        f"# Planner benchmark: gradckpt vs hand-placed checkpointing on CPU ({info['date']})",
        "Budgets: the least feasible peak (DP), the every-block peak (simulated), 25/50/75% of "
        "the way from the every-block peak to the plain peak, and the plain peak (profiled). "
        "Each contender runs on its own copy of the model; peaks are measured in one untimed "
        "step each at the allocator (`AllocatorTracker`: every byte the allocator handed out, "
        "kernel workspaces included; budgets are checked against it) and at the tensor level "
        "(`MemoryTracker`), both with parameters and buffers; times are medians of interleaved "
        "rounds after warm-up, "
        "as ratios over the plain step (`none`) of the same rounds (`fastest / plain's fastest`: "
        "the same with each contender's fastest run, the least disturbed on a shared machine; "
        "verdicts use the medians). A baseline counts at a "
        "budget only when its measured peak fits.",
        *([note] if (note := load_note(info)) else []),
        *(model_report(r) for r in results),
    ]
    if planning is not None:
        calls = planning.get("plan_repeats")
        parts += [
            "## Planning time (profile excluded)",
            f"GPT {planning['sizes']}: {planning['blocks']} blocks, {planning['ops']} profiled "
            f"ops, profiled in {planning['profile_s']:.1f} s. `gradckpt.plan(..., profile=prof)` "
            "end to end, median of "
            + (f"{calls} call(s)" if calls else "the timed calls")
            + " per budget:",
            markdown_table(
                ["budget", "plan time (s)", "outcome"],
                [
                    (k, f"{v:.3f}", planning["errors"].get(k, "plan"))
                    for k, v in planning["plan_s"].items()
                ],
            ),
            f"Worst: {planning['worst_s']:.3f} s (target < {PLAN_TIME_TARGET} s: "
            f"{verdict(planning['met'])}). `gradckpt.frontier` from the same profile: "
            f"{planning['frontier_s']:.2f} s.",
        ]
    parts += [f"Plot: {png_status.replace(str(out) + '/', '')}", "## Setup", info_block(info)]
    md = "\n\n".join(parts)
    data = {"info": info, "models": results, "planning": planning, "png": png_status}
    md_path, json_path = write_results(out, "frontier", md, data, info["date"])
    print(md)
    print(f"\n{png_status}\nwrote {md_path} and {json_path}")


if __name__ == "__main__":
    sys.exit(main())
