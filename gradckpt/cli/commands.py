"""``gradckpt plan``, ``gradckpt explain`` and ``gradckpt bench``."""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

from gradckpt.cli.common import (
    check_writable,
    cli_words,
    describe_plan,
    device_budget,
    jsonable_profile,
    least_peak,
    offload_from_args,
    pct,
    plan_for,
    plan_units_table,
    profile_target,
    target_header,
    training_step,
    write_frontier_png,
)
from gradckpt.cli.extras import CliError, require
from gradckpt.cli.output import Out
from gradckpt.cli.targets import resolve
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.explaining.explain import Explanation, format_shape
from gradckpt.planning.planner import Planner
from gradckpt.planning.solving.whole_step import with_training_step

__all__ = ["run_bench", "run_explain", "run_plan"]

APPLY_HINT = (
    "Apply it in your own training script (there is no 'gradckpt apply' command):\n"
    "    plan = gradckpt.Plan.load({path!r})\n"
    "    gradckpt.apply(model, plan)   # the same model class and input shapes"
)


APPLY_SET_HINT = (
    "Apply it in your own training script; each call switches to its shape's plan:\n"
    "    plans = gradckpt.PlanSet.load({path!r})\n"
    "    gradckpt.apply(model, plans)   # a shape not in the set raises gradckpt.ShapeError"
)


def _blocks(args: argparse.Namespace) -> list[str] | None:
    if not getattr(args, "blocks", None):
        return None
    return [b.strip() for b in args.blocks.split(",") if b.strip()]


def _target_and_profile(args: argparse.Namespace, out: Out):
    with out.status(f"building {args.target} ..."):
        target = resolve(args.target, fake=args.fake, device=args.device)
    prof = profile_target(
        target, out, fake=args.fake, device=args.device, blocks=_blocks(args), repeats=args.repeats
    )
    return target, prof


# --------------------------------------------------------------------------- plan


def run_plan(args: argparse.Namespace, out: Out) -> int:
    check_writable(args.out, "--out")  # fail before the (possibly long) profile
    if args.plot:
        check_writable(args.plot, "--plot")
        require("matplotlib", "--plot")
    offload = offload_from_args(args)  # bad flags fail before the profile
    target, raw = _target_and_profile(args, out)
    device = device_budget(target, args.device) if args.budget == "auto" else None
    # The whole training step (--optimizer, --accumulation, --zero-grads); with an auto
    # budget the breakdown shows even when nothing more is counted, as the library's does.
    step = training_step(target, args, always=device is not None)
    prof = with_training_step(raw, step)
    # the chain and DP, built once for every question below
    planner = Planner(prof, chunking=args.chunking)
    budget = device.budget_bytes if device is not None else args.budget
    plan = plan_for(planner, budget, args.solver, target.name, offload)
    least = least_peak(planner)
    explanation = planner.explain(plan=plan)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    plans = _plan_set(args, target, raw, plan)
    (plans if plans is not None else plan).save(path)
    plotted = None
    if args.plot:
        points = planner.frontier()
        write_frontier_png(
            Path(args.plot), points, title=f"{target.name}: memory-time frontier (predicted)",
            plain_peak=prof.measured_peak_bytes, budget=plan.budget_bytes,
            marks=[("this plan", plan.predicted_peak_bytes, plan.predicted_overhead, "r*")],
        )  # fmt: skip
        plotted = str(args.plot)
    if args.json:
        out.json({
            "target": target.name, "profile": jsonable_profile(prof),
            "budget_bytes": plan.budget_bytes, "least_peak_bytes": least,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_overhead": plan.predicted_overhead,
            "units": explanation.to_json()["units"], "peak": explanation.to_json()["peak"],
            "plan": plan.to_json(), "plan_path": str(path), "plot_path": plotted,
            "plan_set": plans.to_json() if plans is not None else None,
            "step": plan.step.to_json() if plan.step is not None else None,
            "training_step": step.to_json() if step is not None else None,
            "auto_budget": {"budget_bytes": device.budget_bytes, "headroom_bytes":
                            device.headroom_bytes, "rule": device.rule, "line": device.line()}
            if device is not None else None,
        })  # fmt: skip
        return 0
    target_header(out, target, prof, fake=args.fake)
    if device is not None:
        out.print(f"  {device.line()}")
    out.print()
    plan_units_table(out, explanation, title=f"plan ({plan.solver}): {describe_plan(plan)}")
    out.print(
        f"budget {format_bytes(plan.budget_bytes or 0)}: predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)} (plain {format_bytes(prof.measured_peak_bytes)}, "
        f"least feasible {format_bytes(least)}), predicted overhead {pct(plan.predicted_overhead)}"
    )
    if plan.step is not None:
        for line in plan.step.lines():
            out.print(cli_words(line))
    else:
        out.print(
            "  the optimizer is NOT counted: this peak is one micro-batch's forward and backward "
            "(pass --optimizer NAME to plan the whole training step)"
        )
    out.print(explanation.peak.describe())
    for hint in explanation.hints():
        out.print(f"note: {hint}")
    if plans is not None:
        out.print()
        out.print(f"plan set ({len(plans)} shapes, the rest planned from the model call alone):")
        for line in plans.summary().splitlines():
            out.print(f"  {line}")
    out.print()
    out.print(f"wrote {path}" + (f" and {plotted}" if plotted else ""))
    out.print((APPLY_SET_HINT if plans is not None else APPLY_HINT).format(path=str(path)))
    return 0


def _plan_set(args: argparse.Namespace, target, prof, plan):
    """With --shapes: the plan set over the target's shape and those lengths (else None)."""
    if not getattr(args, "shapes", None):
        return None
    import gradckpt
    from gradckpt.planning.solving.budget import BudgetError

    try:
        return gradckpt.plan(
            target.model, target.loss_fn, plan.budget_bytes,
            shapes=gradckpt.ShapeOptions(args.shapes),
            profiling=gradckpt.ProfileOptions(_blocks(args), profile=prof), solver=args.solver,
            offload=offload_from_args(args) or False,
            step=gradckpt.StepOptions(None if args.optimizer == "none" else args.optimizer,
                                      args.accumulation, not args.zero_grads),
            chunking=args.chunking,
        )  # fmt: skip
    except BudgetError as e:
        raise CliError(f"--shapes: {str(e).splitlines()[0]}") from e
    except (TypeError, ValueError) as e:
        raise CliError(f"--shapes: {e}") from e


# --------------------------------------------------------------------------- explain


def run_explain(args: argparse.Namespace, out: Out) -> int:
    from gradckpt.planning.plans.plan import Plan

    plan = None
    if args.plan:
        if args.budget is not None:
            raise CliError("give --plan or --budget, not both")
        try:
            plan = Plan.load(args.plan)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CliError(f"cannot read the plan {args.plan!r}: {e}") from e
    target, prof = _target_and_profile(args, out)
    planner = Planner(prof, chunking=args.chunking)
    if args.budget is not None:
        plan = plan_for(planner, args.budget, "dp", target.name, offload_from_args(args))
    try:
        explanation = planner.explain(plan=plan)
    except ValueError as e:  # a plan naming units this target does not have
        raise CliError(f"the plan does not fit {target.name}: {e}") from e
    if args.json:
        out.json({"target": target.name, "profile": jsonable_profile(prof),
                  **explanation.to_json()})  # fmt: skip
        return 0
    target_header(out, target, prof, fake=args.fake)
    if plan is not None:
        out.print(
            f"  under a plan ({describe_plan(plan)}): predicted peak "
            f"{format_bytes(plan.predicted_peak_bytes)}, overhead {pct(plan.predicted_overhead)}"
        )
    out.print()
    if args.units_only:
        plan_units_table(out, explanation, title="kept for backward, per unit")
    else:
        _explain_rows(out, explanation)
    _explain_totals(out, explanation)
    return 0


def _explain_rows(out: Out, explanation: Explanation) -> None:
    for i, (unit, rows) in enumerate(explanation.by_unit().items()):
        if i:
            out.print()
        kept = sum(r.nbytes for r in rows if r.kept)
        block = " (block)" if rows[0].is_block else ""
        table = [
            [r.op.removeprefix("aten."), format_shape(r.shape), r.dtype, format_bytes(r.nbytes),
             r.status, r.why]
            for r in rows
        ]  # fmt: skip
        out.table(
            ["op (producer)", "shape", "dtype", "bytes", "status", "why"], table,
            title=f"{unit}{block}: keeps {format_bytes(kept)}", right=(3,),
        )  # fmt: skip


def _explain_totals(out: Out, e: Explanation) -> None:
    out.print()
    out.print(
        f"bytes kept for backward: {format_bytes(e.kept_bytes)} ({e.kept_bytes} bytes, "
        f"{sum(r.kept for r in e.rows)} storages)"
    )
    out.print(
        f"bytes recomputed in backward: {format_bytes(e.recomputed_bytes)} "
        f"({sum(not r.kept for r in e.rows)} storages)"
    )
    out.print(f"parameters and inputs also saved (free: they exist anyway): {e.pre_existing_saved}")
    out.print(e.peak.describe())
    for hint in e.hints():
        out.print(f"note: {hint}")


# --------------------------------------------------------------------------- bench

SCRIPTS = ("engine", "frontier", "hf_models")


def _benchmarks_dir(given: str | None) -> Path:
    if given:
        path = Path(given)
        if not path.is_dir():
            raise CliError(f"--dir {given!r} is not a directory")
        return path
    here = Path.cwd() / "benchmarks"
    checkout = Path(__file__).resolve().parents[2] / "benchmarks"
    for path in (here, checkout):
        if path.is_dir() and any((path / f"{s}.py").is_file() for s in SCRIPTS):
            return path
    raise CliError(
        "no benchmarks/ folder found (the scripts ship with the gradckpt source, not the "
        "wheel): run from a gradckpt checkout or pass --dir"
    )


def _files(folder: Path) -> dict[Path, float]:
    if not folder.is_dir():
        return {}
    return {p: p.stat().st_mtime for p in folder.iterdir() if p.is_file()}


def run_bench(args: argparse.Namespace, out: Out) -> int:
    folder = _benchmarks_dir(args.dir)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(SCRIPTS)
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        raise CliError(f"unknown benchmark(s) {unknown}: choose from {', '.join(SCRIPTS)}")
    if args.out:
        check_writable(args.out, "--out", folder=True)
    results = Path(args.out) if args.out else folder / "results"
    before = _files(results)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    failed, ran = [], []
    kind = "quick" if args.quick else "full"
    out.heading(f"gradckpt bench ({kind}): {', '.join(names)} from {folder} -> {results}")
    with out.progress(len(names), "benchmarks") as bar:
        for name in names:
            script = folder / f"{name}.py"
            if not script.is_file():
                out.print(f"{script} is missing: skipped")
                bar.advance(f"{name}: missing")
                continue
            cmd = [sys.executable, str(script), "--out", str(results)]
            cmd += ["--quick"] if args.quick else []
            cmd += ["--threads", str(args.threads)] if args.threads else []
            started = time.perf_counter()
            tail: list[str] = []
            bar.note(f"{name}: starting", description=f"running {name}")
            proc = subprocess.Popen(
                cmd, cwd=folder.parent, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            assert proc.stdout is not None
            for line in proc.stdout:
                tail = [*tail[-39:], line.rstrip()]
                bar.note(f"{name}: {line.strip()[:70]}")
            code = proc.wait()
            took = time.perf_counter() - started
            ran.append(name)
            if code != 0:
                failed.append(name)
                out.bad(f"{name} failed (exit {code}) after {took:.0f} s; its last lines:")
                for line in tail[-20:]:
                    out.print(f"  | {line}")
            else:
                out.print(f"{name}: done in {took:.0f} s")
            bar.advance(f"{name}: {'failed' if code else 'done'}")
    written = sorted(p for p, t in _files(results).items() if before.get(p) != t)
    for path in written:
        out.print(f"wrote {path}")
    if not ran:
        out.print("no benchmark script ran")
    stamp = datetime.date.today().isoformat()
    out.print(f"{len(ran) - len(failed)}/{len(ran)} benchmarks succeeded ({stamp})")
    return 1 if failed else 0
