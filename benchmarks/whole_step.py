"""Whole training step (CPU): optimizer state and step temporaries, predicted vs measured.

For one model and each optimizer (SGD with momentum, Adam, AdamW for-loop /
foreach / fused, Adagrad, RMSprop, Adafactor, and AdamW over a PEFT-LoRA model
with two param groups; accumulation 1, and AdamW also with 4 micro-batches):

* **predicted**: :func:`gradckpt.measure.optimizer_memory` (state bytes, step
  temporaries, on fake tensors); the plain whole-step peak
  (``gradckpt.profile(..., optimizer=opt, accumulation_steps=K).measured_peak_bytes``);
  and, at a budget of 0.6 of it, the plan's whole-step peak
  (``Planner(prof).plan(budget)``, and the plan ``gradckpt.fit`` applies);
* **measured** (each on a fresh model built from the same seed): the real
  optimizer's state (unique storages of ``opt.state`` after the run), the plain
  run's allocator high-water over 3 whole steps (``zero_grad``, K micro-batches
  of forward + backward, ``optimizer.step()``; the first step, which allocates
  the state, included), and the same after ``gradckpt.fit(model, loss_fn,
  budget, optimizer=opt, accumulation_steps=K)`` (the 3 steps, and ``fit``
  itself + the 3 steps);
* **the formulas people use**, from parameter counts: weights + gradients +
  optimizer states (accelerate ``estimate-memory`` style; Adam/AdamW 2 states,
  SGD momentum 1, Adagrad 1, RMSprop 1, Adafactor factored: rows + cols per
  matrix, the full vector for 1-D params), and, for the Adam rows, the "16
  bytes per parameter for mixed-precision Adam" rule (2 bf16 weights + 2 bf16
  grads + 12 fp32 master and moments; a frozen parameter 2 bytes). They know no
  activations and no step temporaries; their errors are against the measured
  plain whole-step peak.

A last section runs ``gradckpt.fit`` at the AdamW row's budget *without*
``optimizer=``, then trains with AdamW: what the plan then ignores.

Peaks are at the allocator (``gradckpt.measure.AllocatorTracker``: torch's CPU
allocator events, above its level at entry) plus what the step holds from before
that entry: the model's parameters and buffers (``gradckpt.measure.state_bytes``)
and any optimizer state the constructor made (Adagrad's; the others make theirs
in the first ``step()``, inside the measured region).

Usage:
    python -m benchmarks.whole_step            # HF GPT-2 6 x 256, T=256, batch 4: ~3 min
    python -m benchmarks.whole_step --quick    # tiny sizes, a smoke test (seconds)
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

import gradckpt
from benchmarks.harness import (
    RunClock,
    base_parser,
    info_block,
    load_note,
    machine_info,
    markdown_table,
    mib,
    read_results,
    rerun_command,
    settle,
    write_results,
)
from gradckpt.api.budget import resident_bytes
from gradckpt.measure import AllocatorTracker, optimizer_memory
from gradckpt.measure.optimizer import optimizer_state_sizes
from gradckpt.planning.solving.budget import BudgetError
from gradckpt.testing import Example

FRACTION = 0.6  # the budget, as a fraction of the predicted plain whole-step peak
STEPS = 3  # whole steps measured per run
# The config in which users met the problem (plain ``fit(0.6)`` left out AdamW's 52.7 MiB).
FULL = dict(layers=6, hidden=256, heads=4, seq=256, batch=4, vocab=8192)
QUICK = dict(layers=2, hidden=32, heads=2, seq=128, batch=4, vocab=128)


# --------------------------------------------------------------------------- setups


def build_model(sizes: dict[str, Any], lora: bool = False) -> Example:
    """HF GPT-2 from a config (random weights, seed 0), optionally PEFT-LoRA on ``c_attn``."""
    if lora:
        from gradckpt.integrations.peft_zoo import lora_example

        ex = lora_example("gpt2", rank=8, **sizes)
        ex.model.base_model.model.config.use_cache = False
        return ex
    from gradckpt.integrations.hf.zoo import hf_example

    ex = hf_example("gpt2", **sizes)
    ex.model.config.use_cache = False
    return ex


def lora_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups over the adapters: ``lora_A`` (lr 1e-3, decay 0.01), ``lora_B``
    (lr 5e-4, no decay); the base is frozen by PEFT."""
    a = [p for n, p in model.named_parameters() if p.requires_grad and "lora_A" in n]
    b = [p for n, p in model.named_parameters() if p.requires_grad and "lora_A" not in n]
    return [{"params": a, "lr": 1e-3, "weight_decay": 0.01},
            {"params": b, "lr": 5e-4, "weight_decay": 0.0}]  # fmt: skip


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@dataclass(frozen=True)
class Setup:
    """One table row: an optimizer over a model, K micro-batches per step."""

    label: str
    make: Callable[[nn.Module], torch.optim.Optimizer]
    states: str  # the formula's optimizer states: "2", "1" or "factored"
    adam: bool = False  # the 16 bytes/parameter rule applies
    accumulation: int = 1
    lora: bool = False


SETUPS = (
    Setup("SGD (momentum 0.9)",
          lambda m: torch.optim.SGD(_trainable(m), lr=1e-2, momentum=0.9), "1"),
    Setup("Adam", lambda m: torch.optim.Adam(_trainable(m), lr=1e-3), "2", adam=True),
    Setup("AdamW (for-loop, CPU default)",
          lambda m: torch.optim.AdamW(_trainable(m), lr=1e-3), "2", adam=True),
    Setup("AdamW (foreach=True)",
          lambda m: torch.optim.AdamW(_trainable(m), lr=1e-3, foreach=True), "2", adam=True),
    Setup("AdamW (fused=True)",
          lambda m: torch.optim.AdamW(_trainable(m), lr=1e-3, fused=True), "2", adam=True),
    Setup("Adagrad", lambda m: torch.optim.Adagrad(_trainable(m), lr=1e-2), "1"),
    Setup("RMSprop", lambda m: torch.optim.RMSprop(_trainable(m), lr=1e-3), "1"),
    Setup("Adafactor", lambda m: torch.optim.Adafactor(_trainable(m), lr=1e-2), "factored"),
    Setup("AdamW, PEFT LoRA r=8 (frozen base, 2 param groups)",
          lambda m: torch.optim.AdamW(lora_groups(m)), "2", adam=True, lora=True),
    Setup("AdamW (for-loop), accumulation 4",
          lambda m: torch.optim.AdamW(_trainable(m), lr=1e-3), "2", adam=True, accumulation=4),
)  # fmt: skip


# --------------------------------------------------------------------------- measuring


def train(ex: Example, opt: torch.optim.Optimizer, k: int, steps: int = STEPS) -> list[float]:
    """``steps`` whole steps: zero_grad(set_to_none), k x forward + backward, opt.step()."""
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(k):
            loss = ex.loss_fn()
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses


def real_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``opt.state`` (nested too), each storage once."""
    return sum(optimizer_state_sizes(opt).values())


def formulas(model: nn.Module, setup: Setup) -> dict[str, Any]:
    """The parameter-count estimates (bytes) and what each counts."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    if setup.states == "factored":
        elements = sum(
            p.numel() // p.shape[-1] + p.numel() // p.shape[-2] if p.dim() >= 2 else p.numel()
            for p in trainable
        )
        states = elements * 4
        counts = "weights + grads + factored second moment (rows + cols; 1-D params: full)"
    else:
        states = int(setup.states) * grads
        counts = f"weights + grads + {setup.states} x trainable (optimizer states)"
    n_train = sum(p.numel() for p in trainable)
    n_frozen = sum(p.numel() for p in params) - n_train
    rule = 16 * n_train + 2 * n_frozen if setup.adam else None
    return {
        "params": sum(p.numel() for p in params),
        "trainable": n_train,
        "weights_bytes": weights,
        "grads_bytes": grads,
        "states_bytes": states,
        "formula_bytes": weights + grads + states,
        "formula": counts,
        "rule16_bytes": rule,
        "rule16": "16 B x trainable + 2 B x frozen" if setup.adam else None,
    }


def run_setup(setup: Setup, sizes: dict[str, Any], seed: int, log: Callable[[str], None]
              ) -> dict[str, Any]:  # fmt: skip
    k = setup.accumulation
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(what: str) -> None:
        seconds[what] = round(time.perf_counter() - started - sum(seconds.values()), 1)

    # Predicted: optimizer memory and the plain whole step, from a fresh model.
    ex = build_model(sizes, setup.lora)
    opt = setup.make(ex.model)
    om = optimizer_memory(ex.model, opt)
    prof = gradckpt.profile(ex.model, ex.loss_fn, optimizer=opt, accumulation_steps=k, repeats=1)
    plain_predicted = prof.measured_peak_bytes
    budget = int(FRACTION * plain_predicted)
    row: dict[str, Any] = {
        "optimizer": setup.label, "accumulation_steps": k, "lora": setup.lora,
        "optimizer_name": om.name, "predicted": om.to_json(),
        "state_predicted_bytes": om.state_bytes, "step_bytes_predicted": om.step_bytes,
        "first_step_bytes_predicted": om.first_step_bytes,
        "step_peak_bytes_predicted": om.step_peak_bytes,
        "plain_predicted_bytes": plain_predicted, "budget_bytes": budget,
        **formulas(ex.model, setup),
    }  # fmt: skip
    try:
        planned = gradckpt.Planner(prof).plan(budget)
        row["planner_predicted_bytes"] = planned.predicted_peak_bytes
        row["planner_step"] = planned.step.to_json() if planned.step else None
    except BudgetError as e:
        row["planner_predicted_bytes"] = None
        row["planner_error"] = str(e)
    del ex, opt, prof
    lap("predict")

    # Measured: the plain run, 3 whole steps.
    ex = build_model(sizes, setup.lora)
    opt = setup.make(ex.model)
    torch.manual_seed(seed)
    resident = resident_bytes(ex.model, opt)
    with AllocatorTracker() as plain:
        plain_losses = train(ex, opt, k)
    row["plain_measured_bytes"] = resident + plain.peak_bytes
    row["resident_at_entry_bytes"] = resident
    row["state_measured_bytes"] = real_state_bytes(opt)
    del ex, opt
    lap("plain run")

    # Measured: fit at the budget, then 3 whole steps.
    ex = build_model(sizes, setup.lora)
    opt = setup.make(ex.model)
    try:
        before_fit = resident_bytes(ex.model, opt)
        with AllocatorTracker() as everything:
            plan = gradckpt.fit(ex.model, ex.loss_fn, budget, step=gradckpt.StepOptions(optimizer=opt, accumulation_steps=k))  # fmt: skip
            lap("fit")
            torch.manual_seed(seed)
            before_steps = resident_bytes(ex.model, opt)
            with AllocatorTracker() as steps:
                losses = train(ex, opt, k)
            lap("planned run")
        row.update({
            "fit_predicted_bytes": plan.predicted_peak_bytes,
            "fit_step": plan.step.to_json() if plan.step else None,
            "fit_plan": {u.path: u.mode for u in plan.units},
            "planned_measured_bytes": before_steps + steps.peak_bytes,
            "fit_and_steps_measured_bytes": before_fit + everything.peak_bytes,
            "losses_equal": losses == plain_losses,
        })  # fmt: skip
    except BudgetError as e:
        row.update({"fit_predicted_bytes": None, "planned_measured_bytes": None,
                    "fit_and_steps_measured_bytes": None, "fit_error": str(e)})  # fmt: skip
    finally:
        gradckpt.remove(ex.model)
    row["seconds"] = seconds
    log(f"  {setup.label:<52} state {mib(om.state_bytes)}/{mib(row['state_measured_bytes'])}  "
        f"plain {mib(plain_predicted)}/{mib(row['plain_measured_bytes'])}  budget {mib(budget)}  "
        f"planned {mib(row['fit_predicted_bytes'])}/{mib(row['planned_measured_bytes'])} MiB  "
        f"({seconds} s)")  # fmt: skip
    return row


def run_ignored(sizes: dict[str, Any], budget: int, seed: int) -> dict[str, Any]:
    """``fit`` at ``budget`` without ``optimizer=``, then 3 AdamW steps: what it misses."""
    ex = build_model(sizes)
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    try:
        before_fit = resident_bytes(ex.model, opt)
        with AllocatorTracker() as everything:
            plan = gradckpt.fit(ex.model, ex.loss_fn, budget)
            torch.manual_seed(seed)
            before_steps = resident_bytes(ex.model, opt)
            with AllocatorTracker() as steps:
                train(ex, opt, 1)
        return {"budget_bytes": budget, "fit_predicted_bytes": plan.predicted_peak_bytes,
                "planned_measured_bytes": before_steps + steps.peak_bytes,
                "fit_and_steps_measured_bytes": before_fit + everything.peak_bytes,
                "state_measured_bytes": real_state_bytes(opt)}  # fmt: skip
    except BudgetError as e:
        return {"budget_bytes": budget, "fit_error": str(e)}
    finally:
        gradckpt.remove(ex.model)


def warm_up() -> None:
    """One tiny whole step under the tracker: the process's first sets up kernels and the
    profiler, which is no optimizer's memory."""
    ex = build_model(dict(layers=1, hidden=16, heads=2, seq=16, batch=1, vocab=64))
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    with AllocatorTracker():
        train(ex, opt, 1, steps=1)


# --------------------------------------------------------------------------- report


def _err(pred: float | None, measured: float | None) -> str:
    if pred is None or not measured:
        return "n/a"
    return f"{(pred - measured) / measured:+.1%}"


def _yes(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "**NO**")


def _states(row: dict[str, Any]) -> str:
    """The formula a row uses, short: W + G + the optimizer's states."""
    count = re.search(r"\+ (\d+) x", row["formula"])
    return f"W+G+{count.group(1)}S" if count else "W+G+factored S"


def _within(value: int | None, budget: int) -> bool | None:
    return None if value is None else value <= budget


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "optimizer", "state pred / meas (MiB)", "state exact", "step temporaries pred (MiB)",
        "plain whole-step peak pred / meas (MiB)", "error",
        "formula: W+G+states (MiB)", "error", "16 B/param rule (MiB)", "error",
        "budget 0.6x (MiB)", "planned peak pred: Planner / fit (MiB)",
        "planned peak meas (MiB)", "within budget", "fit + steps meas (MiB)", "losses equal",
    ]  # fmt: skip
    out = []
    for r in rows:
        plain = r["plain_measured_bytes"]
        out.append([
            r["optimizer"],
            f"{mib(r['state_predicted_bytes'])} / {mib(r['state_measured_bytes'])}",
            _yes(r["state_predicted_bytes"] == r["state_measured_bytes"]),
            f"{mib(r['step_bytes_predicted'])} (step 1: {mib(r['first_step_bytes_predicted'])})",
            f"{mib(r['plain_predicted_bytes'])} / {mib(plain)}",
            _err(r["plain_predicted_bytes"], plain),
            f"{mib(r['formula_bytes'])} ({_states(r)})", _err(r["formula_bytes"], plain),
            mib(r["rule16_bytes"]), _err(r["rule16_bytes"], plain),
            mib(r["budget_bytes"]),
            f"{mib(r['planner_predicted_bytes'])} / {mib(r['fit_predicted_bytes'])}",
            mib(r["planned_measured_bytes"]),
            _yes(_within(r["planned_measured_bytes"], r["budget_bytes"])),
            f"{mib(r['fit_and_steps_measured_bytes'])} "
            f"({_yes(_within(r['fit_and_steps_measured_bytes'], r['budget_bytes']))})",
            _yes(r.get("losses_equal")),
        ])  # fmt: skip
    return markdown_table(headers, out)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    exact = [r for r in rows if r["state_predicted_bytes"] == r["state_measured_bytes"]]
    within = [r for r in rows if _within(r["planned_measured_bytes"], r["budget_bytes"])]
    plain = [r["plain_predicted_bytes"] - r["plain_measured_bytes"] for r in rows]
    applied = [r["fit_predicted_bytes"] - r["planned_measured_bytes"] for r in rows
               if r.get("planned_measured_bytes") is not None]  # fmt: skip
    formula = [(r["formula_bytes"] - r["plain_measured_bytes"]) / r["plain_measured_bytes"]
               for r in rows]  # fmt: skip
    lines = [
        f"- optimizer state predicted exactly (to the byte) on {len(exact)} of {len(rows)} rows"
        + ("" if len(exact) == len(rows) else
           ": missed on " + ", ".join(f"{r['optimizer']} ({r['state_predicted_bytes']} vs "
                                      f"{r['state_measured_bytes']} B)"
                                      for r in rows if r not in exact)),
        f"- plain whole-step peak predicted to the byte on {plain.count(0)} of {len(rows)} rows "
        f"(largest difference {max(map(abs, plain))} B)",
        f"- the planned run's measured whole-step peak within the budget on {len(within)} of "
        f"{len(rows)} rows" + ("" if len(within) == len(rows) else ": over on " + ", ".join(
            f"{r['optimizer']} ({mib(r['planned_measured_bytes'])} MiB vs budget "
            f"{mib(r['budget_bytes'])} MiB)" for r in rows if r not in within)),
    ]  # fmt: skip
    if applied:
        lines.append(f"- the applied plan's predicted peak equals its measured one to the byte on "
                     f"{applied.count(0)} of {len(applied)} rows (largest difference "
                     f"{max(map(abs, applied))} B; `fit` calibrates its fake-tensor prediction "
                     "on one real step of the leanest plan)")  # fmt: skip
    fits = [r for r in rows if r.get("fit_and_steps_measured_bytes") is not None]
    over = [r for r in fits if r["fit_and_steps_measured_bytes"] > r["budget_bytes"]]
    lines.append(
        f"- from the call to `fit` to the end of the 3rd step, within the budget on "
        f"{len(fits) - len(over)} of {len(fits)} rows"
        + "".join(
            f"; {r['optimizer']} over by {r['fit_and_steps_measured_bytes'] - r['budget_bytes']} B"
            for r in over
        )
    )
    lines.append(f"- the parameter-count formula is off by {min(formula):+.1%} to "
                 f"{max(formula):+.1%} of the measured plain whole-step peak")  # fmt: skip
    return lines


def render(data: dict[str, Any]) -> str:
    info, rows = data["info"], data["rows"]
    lines = [
        "# The whole training step in the budget: optimizer state and step, predicted vs "
        "measured (CPU)",
        "",
        f"Model: {info['model']}. Every peak is the allocator's high-water "
        "(`AllocatorTracker`, torch's CPU allocator events) plus what existed at its entry "
        "(parameters and buffers; optimizer state made by the constructor, Adagrad's), over "
        f"{STEPS} whole steps (`zero_grad(set_to_none=True)`, K micro-batches of forward + "
        "backward, `optimizer.step()`; the first step, which allocates the optimizer state, "
        "included), each run on a fresh model built from the same seed. Budget: "
        f"{FRACTION} x the predicted plain whole-step peak.",
        "",
        "- **state pred / meas**: `optimizer_memory(model, opt).state_bytes` (fake tensors) / "
        "the real optimizer's `opt.state` after the plain run (unique storages).",
        "- **step temporaries pred**: what a later `step()` adds above params + grads + state "
        "(`step_bytes`); in brackets what the first step adds above params + grads, state "
        "included (`first_step_bytes`).",
        "- **plain whole-step peak pred**: `gradckpt.profile(model, loss_fn, optimizer=opt, "
        "accumulation_steps=K).measured_peak_bytes` (forward and backward profiled for real at "
        "the allocator, one step; the optimizer's state and step from fake tensors, folded "
        "in); **meas**: the plain run.",
        "- **formula: W+G+states**: parameter-count estimate (accelerate `estimate-memory` "
        "style): weights + gradients (trainable) + optimizer states (Adam/AdamW: 2 x "
        "trainable; SGD momentum, Adagrad, RMSprop: 1 x; Adafactor: rows + cols per matrix, "
        "full for 1-D params, fp32). **16 B/param rule** (Adam rows only): 16 B x trainable "
        "(2 bf16 weights + 2 bf16 grads + 12 fp32 master + moments) + 2 B x frozen. Both "
        "know no activations and no step temporaries; errors are against the measured plain "
        "whole-step peak. (The model is fp32: there AdamW's weights + grads + 2 moments are "
        "16 B/param too, so the two estimates nearly agree for the full-model Adam rows.)",
        "- **planned peak pred**: `Planner(prof).plan(budget).predicted_peak_bytes` from "
        "the profile above / the plan `gradckpt.fit(model, loss_fn, budget, optimizer=opt, "
        "accumulation_steps=K)` applied (planned on fake tensors, as the budget is below the "
        "plain step, and calibrated by `fit` on one real step of the leanest plan); **meas**: "
        "the 3 whole steps after that `fit`; **fit + steps**: the "
        "high-water from the call to `fit` to the end of the 3rd step (within budget?).",
        "- **losses equal**: the planned run's losses are the plain run's, bit for bit "
        "(dropout on, same seed).",
        "",
        table(rows),
        "",
        "## Summary",
        "",
        *summary(rows),
        "",
    ]
    ignored = data.get("ignored")
    if ignored:
        lines += ["## The same budget with the optimizer not counted", "",
                  f"`gradckpt.fit(model, loss_fn, {mib(ignored['budget_bytes'])} MiB)` "
                  "(no `optimizer=`: the plan counts parameters, gradients and activations "
                  "only), then AdamW (for-loop) trained for 3 steps:", ""]  # fmt: skip
        if "fit_error" in ignored:
            lines += [f"- fit raised: {ignored['fit_error']}", ""]
        else:
            b = ignored["budget_bytes"]
            lines += [
                f"- plan's predicted peak {mib(ignored['fit_predicted_bytes'])} MiB; measured "
                f"{mib(ignored['planned_measured_bytes'])} MiB over the 3 steps "
                f"({_err(ignored['planned_measured_bytes'], b)} against the budget "
                f"{mib(b)} MiB: within budget {_yes(ignored['planned_measured_bytes'] <= b)}); "
                f"the AdamW state it ignored: {mib(ignored['state_measured_bytes'])} MiB",
                "",
            ]  # fmt: skip
    if note := load_note(info):
        lines += [note, ""]
    lines += ["## Setup and machine", "", f"Rerun: `{info['command']}`", "", info_block(info)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--only", default=None,
                   help="comma-separated row numbers (0-based) of the setups to run")  # fmt: skip
    # One thread: only peaks are measured here, and on a shared 2-core machine two
    # OpenMP threads spin against other processes (a row took 5x longer).
    p.set_defaults(threads=1)
    args = p.parse_args(argv)
    settle(args)
    if args.from_json is not None:
        data = read_results(args.from_json)
        date = data["info"]["date"]
        md, js = write_results(args.out, "whole-step", render(data), data, date=date)
        print(render(data))
        print(f"wrote {md} and {js}")
        return 0
    clock = RunClock.start()
    sizes = QUICK if args.quick else FULL
    setups = SETUPS
    if args.only:
        setups = tuple(SETUPS[int(i)] for i in args.only.split(","))
    warm_up()
    print(f"HF GPT-2 {sizes}", flush=True)
    rows = [run_setup(s, sizes, args.seed, lambda s: print(s, flush=True)) for s in setups]
    adamw = next((r for r in rows if r["optimizer"].startswith("AdamW (for-loop")
                  and r["accumulation_steps"] == 1), None)  # fmt: skip
    ignored = run_ignored(sizes, adamw["budget_bytes"], args.seed) if adamw else None
    model = f"HF GPT-2 (transformers, random weights, dropout 0.1) {sizes}"
    info = machine_info(
        model=model, sizes=sizes, fraction=FRACTION, steps=STEPS, quick=args.quick,
        seed=args.seed, command=rerun_command("benchmarks.whole_step", argv),
        **clock.info(),
    )  # fmt: skip
    data = {"rows": rows, "ignored": ignored, "info": info}
    text = render(data)
    md, js = write_results(args.out, "whole-step", text, data)
    print(text)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
