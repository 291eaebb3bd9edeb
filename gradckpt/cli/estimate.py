"""``gradckpt estimate``: the whole training step's memory, the question asked before renting a GPU.

The step is always profiled under fake tensors (nothing is allocated; built-ins
are built on the meta device) and the training step is folded in
(:func:`gradckpt.planning.solving.whole_step.with_training_step`). Printed: the peak in
parts (parameters and buffers, gradients, optimizer state, the optimizer step's
temporaries, activations) and the phase that sets it, for the plain step and for
the leanest checkpointing plan; the parameter-count formulas people use, next to
it (they leave out activations and the optimizer step's temporaries); with
``--budget``, whether each fits and the plan for the budget.

Example:
    $ gradckpt estimate llama-1b --optimizer adamw --budget 24GB
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from gradckpt.cli.common import (
    chunk_lines,
    describe_plan,
    device_budget,
    ms,
    pct,
    plan_for,
    profile_target,
    training_step,
)
from gradckpt.cli.extras import CliError
from gradckpt.cli.output import Out
from gradckpt.cli.targets import resolve
from gradckpt.measure.memory import format_bytes
from gradckpt.planning.solving.step_phases import PHASE_OPTIMIZER

__all__ = ["Formula", "formulas", "run_estimate"]

#: Optimizer state tensors per parameter under torch's defaults (for the formulas).
#: SGD's default momentum is 0 (no state); Adafactor's state is factored (rows and
#: columns of each matrix), so it has no per-parameter count.
STATES: dict[str, int | None] = {
    "none": 0, "sgd": 0, "adam": 2, "adamw": 2, "adagrad": 1, "rmsprop": 1, "adafactor": None,
}  # fmt: skip
NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad",
         "rmsprop": "RMSprop", "adafactor": "Adafactor"}  # fmt: skip
LEFT_OUT = ("activations", "optimizer step temporaries")
PARTS = (
    ("parameters and buffers", "params"),
    ("gradients", "gradients"),
    ("optimizer state", "optimizer_state"),
    ("optimizer step temporaries", "optimizer_step"),
    ("activations, recompute, workspace", "activations"),
)


@dataclass(frozen=True)
class Formula:
    """A parameter-count estimate: ``bytes_per_param`` times the parameters, nothing else."""

    name: str
    terms: str  # "4 + 4 + 2x4"
    bytes_per_param: float
    bytes: int


@dataclass(frozen=True)
class Params:
    """The model's parameter count and dtype, as built."""

    count: int
    trainable: int
    dtype: str
    element_size: int
    bytes: int  # all parameters, as built
    trainable_bytes: int


def _params(model: Any) -> Params:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    by_dtype: Counter = Counter()
    for p in params:
        by_dtype[p.dtype] += p.numel()
    dtype = by_dtype.most_common(1)[0][0] if by_dtype else None
    return Params(
        count=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "none",
        element_size=dtype.itemsize if dtype is not None else 0,
        bytes=sum(p.numel() * p.element_size() for p in params),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
    )


def formulas(params: Params, optimizer: str) -> list[Formula]:
    """The formulas people use (accelerate's estimate-memory, DeepSpeed's ZeRO count).

    As built: weights + gradients + one copy per optimizer state, all in the
    model's dtype (torch keeps the state in the parameters' dtype). Mixed
    precision: bf16 weights and gradients, fp32 state (2 + 2 + 4 per state), and
    the same with an fp32 master copy of the weights (+4, DeepSpeed's 16 B/param for Adam).

    Example:
        >>> [f.bytes_per_param for f in formulas(Params(10, 10, "float32", 4, 40, 40), "adamw")]
        [16.0, 12.0, 16.0]
    """
    states = STATES[optimizer]
    n, t, e = params.count, params.trainable, params.element_size
    as_built = params.bytes + params.trainable_bytes * (1 + states)
    if optimizer == "none":
        name = "weights + gradients (optimizer not counted)"
    elif states is None:
        name = f"{NAMES[optimizer]}, factored state (not per parameter)"
    else:
        name = f"{NAMES[optimizer]}, {states} state{'s' * (states != 1)} per parameter"
    states = states or 0
    state_terms = f" + {states}x{{}}" if states else ""
    per = (lambda total: total / n) if n else (lambda total: 0.0)
    state = ", fp32 optimizer state" if states else ""
    mixed = 2 * n + (2 + 4 * states) * t
    return [
        Formula(f"{name}, all {params.dtype} (as built)",
                f"{e} + {e}{state_terms.format(e)}", per(as_built), as_built),
        Formula(f"bf16 weights and gradients{state}, no fp32 master copy",
                f"2 + 2{state_terms.format(4)}", per(mixed), mixed),
        Formula(f"bf16 weights and gradients{state}, an fp32 master copy (DeepSpeed)",
                f"2 + 2{state_terms.format(4)} + 4", per(mixed + 4 * t), mixed + 4 * t),
    ]  # fmt: skip


def _state_note(optimizer: str, e: int) -> str | None:
    if optimizer == "sgd":
        return f"SGD: torch's default momentum=0 keeps no state; with momentum, +1 state (+{e} B/param)"
    if optimizer == "adafactor":
        return (
            "Adafactor: its state is factored (row and column statistics per matrix), "
            "so the formulas count none of it"
        )
    return None


# --------------------------------------------------------------------------- the estimate


def run_estimate(args: argparse.Namespace, out: Out) -> int:
    from gradckpt.planning.planner import Planner
    from gradckpt.planning.solving.baselines import finish, none_plan
    from gradckpt.planning.solving.whole_step import with_training_step

    blocks = [b.strip() for b in args.blocks.split(",") if b.strip()] if args.blocks else None
    with out.status(f"building {args.target} ..."):
        target = resolve(args.target, fake=True, device=args.device)
    raw = profile_target(target, out, fake=True, device=args.device, blocks=blocks, repeats=1)
    step = training_step(target, args, always=True)
    whole = with_training_step(raw, step)
    planner = Planner(whole, chunking=args.chunking)
    plain = finish(whole, none_plan(whole), None, "none")[0]
    leanest = planner.least_peak()[0]
    params = _params(target.model)
    device = device_budget(target, args.device) if args.budget == "auto" else None
    budget = _budget_check(args, planner, plain, leanest, device, target.name)
    temporaries = whole.floor_bytes - whole.param_bytes - whole.grad_bytes - step.state_bytes
    data = {
        "kind": "gradckpt.Estimate",
        "target": target.name,
        "device": raw.device,
        "fake": True,
        "parameters": asdict(params),
        "training_step": step.to_json(),
        "optimizer_step_peak_bytes": whole.floor_bytes if step.optimizer is not None else None,
        "optimizer_step_temporaries_bytes": max(temporaries, 0) if step.optimizer else None,
        "gradient_bytes": whole.grad_bytes,
        "plain": _jsonable(plain),
        "leanest": _jsonable(leanest),
        "formulas": [asdict(f) for f in formulas(params, args.optimizer)],
        "formulas_leave_out": list(LEFT_OUT),
        "budget": budget,
    }
    if args.json:
        out.json(data)
        return 0
    _print(out, args, target, raw, data, plain, leanest, params)
    return 0


def _jsonable(plan: Any) -> dict[str, Any]:
    assert plan.step is not None
    return {
        **plan.step.to_json(), "total_bytes": plan.step.total,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_overhead": plan.predicted_overhead, "plan": describe_plan(plan),
        "chunked": [
            {"path": u.path, "chunks": u.decision.chunks} for u in plan.units
            if u.mode == "chunk"
        ],
    }  # fmt: skip


def _budget_check(args, planner, plain, leanest, device, name: str) -> dict[str, Any] | None:
    """With --budget: what fits, and the plan for the budget (None where no plan fits).

    Below what no plan lowers (parameters and optimizer state, or the optimizer
    step) is an input error, as for ``plan``; between that and the least peak,
    the estimate says that no plan fits.
    """
    if args.budget is None:
        return None
    if args.budget == "least":
        nbytes = leanest.predicted_peak_bytes
    elif device is not None:
        nbytes = device.budget_bytes
    else:
        nbytes = planner.budget_bytes(args.budget)
    plan = None
    if leanest.predicted_peak_bytes <= nbytes:
        plan = plan_for(planner, nbytes, "dp", name)
    else:
        from gradckpt.planning.solving.budget import BudgetError
        from gradckpt.planning.solving.whole_step import check_floor

        try:
            check_floor(planner.profile, nbytes)
        except BudgetError as e:
            raise CliError(f"{name}: {e}") from e
    return {
        "budget_bytes": nbytes,
        "auto": {**asdict(device), "budget_bytes": device.budget_bytes, "line": device.line()}
        if device is not None else None,
        "plain_fits": plain.predicted_peak_bytes <= nbytes,
        "leanest_fits": leanest.predicted_peak_bytes <= nbytes,
        "plan": _jsonable(plan) if plan is not None else None,
    }  # fmt: skip


# --------------------------------------------------------------------------- text


def _print(out: Out, args, target, raw, data, plain, leanest, params: Params) -> None:
    step = plain.step
    out.heading(f"{target.name}: {target.description}")
    trainable = "all" if params.trainable == params.count else _count(params.trainable)
    out.print(
        f"  {_count(params.count)} parameters ({trainable} trainable, {params.dtype}), "
        f"{len(raw.blocks)} blocks, {len(raw.units)} units; device {raw.device}; estimated "
        "under fake tensors (nothing allocated)"
    )
    out.print(f"  {_step_words(args, step)}")
    out.print()
    rows = [[label, format_bytes(getattr(plain.step, key)), format_bytes(getattr(leanest.step, key))]
            for label, key in PARTS]  # fmt: skip
    rows.append(["peak set by", plain.step.phase, leanest.step.phase])
    lean_time = f"{ms(leanest.predicted_step_time)} ({pct(leanest.predicted_overhead)})"
    rows.append(["step time (estimate)", ms(plain.predicted_step_time), lean_time])
    out.table(
        ["whole training step", "plain (no checkpointing)", f"leanest plan: {describe_plan(leanest)}"],
        rows, title="predicted peak, in parts", right=(1, 2),
        footer=["whole-step peak", format_bytes(plain.step.total), format_bytes(leanest.step.total)],
    )  # fmt: skip
    out.print(
        f"checkpointing moves the peak between {format_bytes(leanest.step.total)} (leanest, "
        f"{pct(leanest.predicted_overhead)} step time) and {format_bytes(plain.step.total)} "
        "(none)"
    )
    for line in chunk_lines(leanest):
        out.print(f"leanest plan chunks: {line}")
    if data["optimizer_step_peak_bytes"] is not None:
        out.print(
            f"the optimizer step itself peaks at {format_bytes(data['optimizer_step_peak_bytes'])} "
            f"(parameters + gradients + state + {format_bytes(data['optimizer_step_temporaries_bytes'])}"
            " of temporaries): no checkpointing plan lowers that"
        )
    else:
        out.print("the optimizer is NOT counted: pass --optimizer NAME to count its state and step")
    out.print()
    _print_formulas(out, args, data, params, plain, leanest)
    if data["budget"] is not None:
        out.print()
        _print_budget(out, args, target, data["budget"], plain, leanest)


def _count(n: int) -> str:
    """236,928 / 124.4M / 1.24B."""
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 10**6 else f"{n:,}"


def _step_words(args, step) -> str:
    grads = "zeroed in place (resident)" if args.zero_grads else "set to None"
    k = args.accumulation
    counted = f"optimizer {step.optimizer}" if step.optimizer else "optimizer not counted"
    return (
        f"training step: {counted}; {k} micro-batch{'es' * (k > 1)} per optimizer step; "
        f"gradients {grads}"
    )


def _print_formulas(out: Out, args, data, params: Params, plain, leanest) -> None:
    rows = [[f.name, f"{f.terms} = {f.bytes_per_param:.3g} B", format_bytes(f.bytes)]
            for f in formulas(params, args.optimizer)]  # fmt: skip
    counted = plain.step.params + data["gradient_bytes"] + plain.step.optimizer_state
    rows.append(["gradckpt's count of the same parts (as built)", "", format_bytes(counted)])
    out.table(
        ["formula", "bytes per parameter", "total"], rows, right=(2,),
        title=f"parameter-count formulas ({params.count:,} parameters, {params.dtype})",
    )  # fmt: skip
    note = _state_note(args.optimizer, params.element_size)
    if note:
        out.print(note)
    temporaries = data["optimizer_step_temporaries_bytes"]
    step_part = (
        f" and the optimizer step's temporaries ({format_bytes(temporaries)})"
        if temporaries is not None else " and the optimizer step's temporaries"
    )  # fmt: skip
    lean = leanest.step
    also = (
        f", {format_bytes(lean.activations)} at the leanest plan's"
        if lean.phase != PHASE_OPTIMIZER else ""
    )  # fmt: skip
    out.print(
        f"the formulas leave out activations ({format_bytes(plain.step.activations)} at the "
        f"plain step's peak{also}){step_part}. The bf16 rows are for training in bf16; "
        f"gradckpt's numbers are for the model as built ({params.dtype})"
    )


def _print_budget(out: Out, args, target, budget: dict[str, Any], plain, leanest) -> None:
    nbytes = budget["budget_bytes"]
    if budget["auto"] is not None:
        out.print(budget["auto"]["line"])
    out.heading(f"budget {format_bytes(nbytes)}:")
    for name, plan in (("plain step", plain), ("leanest plan", leanest)):
        peak = plan.predicted_peak_bytes
        verdict = "fits" if peak <= nbytes else f"does NOT fit ({format_bytes(peak - nbytes)} over)"
        out.print(f"  {name}: {format_bytes(peak)}, {verdict}")
    chosen = budget["plan"]
    if chosen is None:
        out.bad(
            f"  no checkpointing plan fits {format_bytes(nbytes)}: the least reachable peak is "
            f"{format_bytes(leanest.predicted_peak_bytes)}; shrink the batch or the model"
        )
        return
    out.print(
        f"  plan for the budget: {chosen['plan']}; predicted peak "
        f"{format_bytes(chosen['predicted_peak_bytes'])}, overhead {pct(chosen['predicted_overhead'])}, "
        f"set by the {chosen['phase']}"
    )
    for chunked in chosen.get("chunked", ()):
        out.print(
            f"    {chunked['path']} and its loss in {chunked['chunks']} slices of tokens "
            "(logits never whole; exact up to the order of sums)"
        )
    flags = [f"--optimizer {args.optimizer}"] if args.optimizer != "none" else []
    flags += [f"--accumulation {args.accumulation}"] if args.accumulation > 1 else []
    flags += ["--zero-grads"] if args.zero_grads else []
    flags += [f"--device {args.device}"] if args.device != "cpu" else []
    flags += [] if args.chunking else ["--no-chunking"]
    out.print(
        f"  write it: gradckpt plan {target.name} --fake --budget '{args.budget}' "
        f"{' '.join(flags)}".rstrip()
    )
