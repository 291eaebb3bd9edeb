"""The engine where ops are short (a GPU's regime): gradckpt's per-op cost against torch's.

On a GPU the host issues each op in a few microseconds and a small transformer's
kernels take little longer, so whatever a checkpointing engine adds in Python
per op shows in the step (issue #42). On this CPU the zoo GPT with d_model 64
and sequence 32 has ops that short. Contenders, each on its own copy of the
model (same weights and batch):

* ``plain``: no checkpointing;
* ``torch_full``: ``torch.utils.checkpoint`` (non-reentrant) around every block;
* ``torch_sac``: torch selective checkpointing (``create_selective_checkpoint_contexts``)
  saving ``gradckpt.policies.MATMUL_OPS`` in every block;
* ``gradckpt_full``: ``gradckpt.checkpoint`` around every block;
* ``gradckpt_selective``: ``gradckpt.checkpoint(policy=save_matmuls)``: the same save set;
* ``fit_least`` / ``fit_midway`` / ``fit_plain``: ``gradckpt.fit`` at the least peak it
  reaches, halfway to the plain peak, and the plain peak (nothing to recompute), as
  fractions of the plain peak.

Times are this thread's CPU time on the CPU (other processes' slices do not count;
wall time with the device synchronized on CUDA), one step per interleaved round;
ratios are paired per round with a bootstrap 95% interval
(:func:`benchmarks.harness.paired_stats`). ``fit``'s plan is made once per
contender and applied again for the timed rounds (its peak step and its timed
steps run the same plan). Two copies of one model differ by a percent or two
(``plain_copy`` shows how far), so ``fit`` at the plain peak is also timed on one
model against itself, its installed forwards taken out and put back round by round
(:func:`toggled_fit`): that ratio is the target's. Run by ``python -m benchmarks.engine --short-ops``;
``benchmarks/gpu_check.py`` runs the same rows on CUDA.
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import gradckpt
from benchmarks.harness import (
    Installer,
    fmt_ratio,
    gradckpt_checkpoint,
    make_step,
    markdown_table,
    measure_contenders,
    mib,
    paired_stats,
    per_block,
    plain,
    step_clock,
    torch_checkpoint,
    torch_sac,
)
from gradckpt import policies
from gradckpt.measure import time_interleaved
from gradckpt.planning.planner import Planner
from gradckpt.testing import Example, make

#: The issue's short-op GPT, and one between it and the demo (ops ~4x longer).
CONFIGS: dict[str, dict[str, Any]] = {
    "short": dict(layers=8, d_model=64, heads=4, seq=32, batch=2, dropout=0.0),
    "mid": dict(layers=8, d_model=96, heads=4, seq=64, vocab=512, batch=4, dropout=0.0),
}
QUICK = {"short": dict(layers=2, d_model=32, heads=2, seq=16, vocab=128, batch=2, dropout=0.0)}

TARGET_FULL = 1.03  # gradckpt per block over torch per block
TARGET_SELECTIVE = 1.03  # gradckpt selective over torch SAC, same save set
TARGET_FIT_PLAIN = 1.01  # fit at the plain peak over plain
TARGET_PREDICTION = 0.10  # |predicted - measured| over measured overhead, for fit's plans

DESCRIPTIONS = {
    "plain": "no checkpointing",
    "plain_copy": "no checkpointing, another copy (how far two copies differ)",
    "torch_full": "torch.utils.checkpoint per block",
    "torch_sac": "torch SAC per block, MATMUL_OPS",
    "gradckpt_full": "gradckpt.checkpoint per block",
    "gradckpt_selective": "gradckpt.checkpoint per block, save_matmuls",
    "fit_least": "gradckpt.fit at its least peak",
    "fit_midway": "gradckpt.fit halfway to the plain peak",
    "fit_plain": "gradckpt.fit at the plain peak",
}


def fit_budgets(build: Callable[[], Example]) -> dict[str, float]:
    """The three budgets ``fit`` runs at, as fractions of the plain peak (so it profiles
    the step for real, as the demo does): its least peak (a hair above, so rounding
    cannot make it infeasible), halfway to the plain peak, the plain peak."""
    example = build()
    prof = gradckpt.profile(example.model, example.loss_fn)
    least = Planner(prof).least_peak()[1].peak_bytes / prof.measured_peak_bytes
    least = min(1.0, round(least + 0.002, 4))
    return {"fit_least": least, "fit_midway": round((least + 1.0) / 2, 4), "fit_plain": 1.0}


def fitted(budget: float, plans: dict[str, gradckpt.Plan], name: str) -> Installer:
    """``gradckpt.fit`` at ``budget``; its plan kept in ``plans[name]`` and applied again
    on the next install (so the peak step and the timed steps run one plan)."""

    def install(example: Example) -> Callable[[], None]:
        if name in plans:
            gradckpt.apply(example.model, plans[name])
        else:
            plans[name] = gradckpt.fit(example.model, example.loss_fn, budget=budget)
        return lambda: gradckpt.remove(example.model)

    return install


def contenders(budgets: dict[str, float], plans: dict[str, gradckpt.Plan]) -> dict[str, Installer]:
    matmuls = sorted(policies.MATMUL_OPS, key=str)
    return {
        "plain": plain(),
        "plain_copy": plain(),
        "torch_full": per_block(torch_checkpoint),
        "torch_sac": per_block(torch_sac(matmuls)),
        "gradckpt_full": per_block(gradckpt_checkpoint(None)),
        "gradckpt_selective": per_block(gradckpt_checkpoint(policies.save_matmuls)),
        **{name: fitted(b, plans, name) for name, b in budgets.items()},
    }


def toggled_fit(
    build: Callable[[], Example], seed: int, rounds: int, clock: Callable[[], float] | None,
    sync: Callable[[], None] | None,
) -> dict[str, list[float]]:  # fmt: skip
    """``fit`` at the plain peak against the same model plain, toggled round by round.

    Two copies of one model differ by a percent or two in step time (where their
    memory landed), as much as the target for a plan that keeps everything; on one
    model, the installed forwards taken out and put back between steps, only the
    plan differs.
    """
    example = build()
    gradckpt.fit(example.model, example.loss_fn, budget=1.0)
    installed = {
        m: m.__dict__["forward"] for m in example.model.modules() if "forward" in m.__dict__
    }
    step = make_step(example, seed)

    def as_plan(on: bool) -> Callable[[], None]:
        def run() -> None:  # both pay the same dozen dict writes before their step
            for module, forward in installed.items():
                if on:
                    module.__dict__["forward"] = forward
                else:
                    module.__dict__.pop("forward", None)
            step()

        return run

    try:
        timed = time_interleaved(
            {"plain": as_plan(False), "fit_plain": as_plan(True)},
            warmup=2, repeats=rounds, sync=sync, clock=clock,
        )  # fmt: skip
    finally:
        for module, forward in installed.items():
            module.__dict__["forward"] = forward
        gradckpt.remove(example.model)
    return {name: list(t.times) for name, t in timed.items()}


def run_config(
    sizes: dict[str, Any], *, device: str, warmup: int, repeats: int, seed: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """Measure every contender on the zoo GPT of ``sizes``; the JSON-ready rows and plans."""
    build = functools.partial(make, "gpt", device=device, seed=seed, **sizes)
    budgets = fit_budgets(build)
    plans: dict[str, gradckpt.Plan] = {}
    cuda = torch.device(device).type == "cuda"
    clock = None if cuda else step_clock(device, "cpu")
    sync = torch.cuda.synchronize if cuda else None
    results = measure_contenders(
        build, contenders(budgets, plans), baseline="plain", warmup=warmup, repeats=repeats,
        seed=seed, log=log, clock=clock, sync=sync,
    )  # fmt: skip
    return {
        "sizes": sizes,
        "budgets": budgets,
        "results": {name: m.to_json() for name, m in results.items()},
        "toggled_fit_plain": toggled_fit(build, seed, repeats, clock, sync),
        "plans": {
            name: {
                "predicted_overhead": p.predicted_overhead,
                "fit_measured_overhead": p.measured_overhead,
                "units": {u.path: u.mode for u in p.units},
                "segments": p.summary().count("segment "),
                "token_chunks": [list(t) for t in p.token_chunks],
            }
            for name, p in plans.items()
        },
    }


def _rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: {"times": row["times_s"]} for name, row in data["results"].items()}


def _ratio(rows: dict[str, Any], a: str, b: str) -> tuple[float, float, float]:
    return paired_stats(rows[a], rows[b])


def _cell(stats: tuple[float, float, float]) -> str:
    return f"{stats[0]:.3f} [{stats[1]:.3f}, {stats[2]:.3f}]"


def _verdict(stats: tuple[float, float, float], target: float) -> str:
    median, _, high = stats
    if high <= target:
        return "**met**"
    if median <= target:
        return "**met** (median; the interval reaches past the target)"
    return "**missed**"


def report(name: str, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """One config's Markdown section and its targets (JSON)."""
    rows = _rows(data)
    results = data["results"]
    base_peak = results["plain"]["peak_bytes"]
    table = [
        (
            f"`{c}`", DESCRIPTIONS[c], f"{statistics.median(r['times_s']) * 1e3:.3f}",
            _cell(_ratio(rows, c, "plain")), mib(r["peak_bytes"]),
            fmt_ratio(r["peak_bytes"] / base_peak),
        )
        for c, r in results.items()
    ]  # fmt: skip
    full = _ratio(rows, "gradckpt_full", "torch_full")
    selective = _ratio(rows, "gradckpt_selective", "torch_sac")
    toggled = data["toggled_fit_plain"]
    fit_plain = paired_stats({"times": toggled["fit_plain"]}, {"times": toggled["plain"]})
    copies = _ratio(rows, "plain_copy", "plain")
    targets = [
        ("gradckpt per block / torch per block", f"<= {TARGET_FULL}", _cell(full),
         _verdict(full, TARGET_FULL)),
        ("gradckpt selective / torch SAC (same save set)", f"<= {TARGET_SELECTIVE}",
         _cell(selective), _verdict(selective, TARGET_SELECTIVE)),
        ("fit at the plain peak / the same model plain (toggled per round)",
         f"<= {TARGET_FIT_PLAIN}", _cell(fit_plain), _verdict(fit_plain, TARGET_FIT_PLAIN)),
        ("(noise) a second plain copy / plain", "report", _cell(copies), "reported"),
    ]  # fmt: skip
    predictions = []
    for fit_name, plan in data["plans"].items():
        measured = _ratio(rows, fit_name, "plain")[0] - 1.0
        predicted = plan["predicted_overhead"]
        error = (predicted - measured) / measured if measured > 0.02 else None
        predictions.append(
            (
                f"`{fit_name}`", f"{plan['segments']} segment(s), "
                f"{sum(m != 'keep' for m in plan['units'].values())} unit(s) not kept",
                f"{predicted:+.1%}", f"{measured:+.1%}",
                "n/a (under 2%)" if error is None else f"{error:+.0%}",
                "" if error is None else ("**met**" if abs(error) <= TARGET_PREDICTION
                                          else "**missed**"),
            )
        )  # fmt: skip
    md = "\n\n".join(
        [
            f"## `{name}`: zoo GPT {data['sizes']}",
            markdown_table(
                [
                    "contender",
                    "what",
                    "median step (ms)",
                    "time / plain [95% CI]",
                    "peak (MiB)",
                    "peak / plain",
                ],
                table,
            ),
            markdown_table(["target", "wanted", "measured [95% CI]", "verdict"], targets),
            "Predicted against measured overhead of `fit`'s plans (measured: the paired "
            "median above; error relative to the measured overhead; target "
            f"{TARGET_PREDICTION:.0%}):",
            markdown_table(
                ["contender", "plan", "predicted", "measured", "error", "verdict"], predictions
            ),
        ]
    )
    return md, {
        "gradckpt_full_over_torch_full": full,
        "gradckpt_selective_over_torch_sac": selective,
        "fit_plain_over_plain": fit_plain,
    }


def main_sections(
    configs: dict[str, dict[str, Any]], *, device: str, warmup: int, repeats: int, seed: int,
    log: Callable[[str], None] = print,
) -> tuple[list[str], dict[str, Any]]:  # fmt: skip
    """Run every config; the Markdown sections and the JSON of all of them."""
    sections, data = [], {}
    for name, sizes in configs.items():
        log(f"short-op engine benchmark: {name} gpt {sizes} on {device}")
        measured = run_config(
            sizes, device=device, warmup=warmup, repeats=repeats, seed=seed, log=log
        )
        md, targets = report(name, measured)
        sections.append(md)
        data[name] = {**measured, "targets": targets}
    return sections, data
