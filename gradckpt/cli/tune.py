"""``gradckpt tune``: the micro-batch size and the plan that train TARGET fastest in a budget.

Runs :func:`gradckpt.tune` on TARGET's ``make_loss(b)`` (the built-ins have one;
a user's target returns ``(model, loss_fn, make_loss)``, see
:mod:`gradckpt.cli.targets`): every divisor of ``--global-batch`` as the
micro-batch, under no checkpointing, per-layer checkpointing and gradckpt's
plan, in whole-step bytes, the fastest few run for real. Prints the candidate
table, writes the chosen plan (``gradckpt.Plan.load``) and, with ``--plot``,
samples per second against the micro-batch size per strategy.

Example:
    $ gradckpt tune tiny-gpt --budget 40MiB --global-batch 16 --plot tune.png
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gradckpt.cli.common import OPTIMIZERS, budget_at_least, check_writable
from gradckpt.cli.extras import CliError, optional, require
from gradckpt.cli.output import Out
from gradckpt.cli.targets import BUILTINS, resolve
from gradckpt.measure.memory import format_bytes

__all__ = ["add_parser", "run_tune", "write_tune_png"]

#: Per strategy: colour, measured marker, predicted line (none dashed: where gradckpt's plan
#: keeps everything, the two curves are one).
STYLE = {
    "gradckpt": ("tab:red", "D", "-"),
    "per-layer": ("tab:blue", "s", "-"),
    "none": ("0.3", "o", "--"),
}

HINT = (
    "Train with micro-batch {micro} and {accum} accumulation step(s) per optimizer step, "
    "and apply the plan in your training script:\n"
    "    plan = gradckpt.Plan.load({path!r})\n"
    "    gradckpt.apply(model, plan)   # the same model class and input shapes"
)


def add_parser(sub: Any) -> None:
    """The ``tune`` subcommand and its flags."""
    from gradckpt.cli.arguments import budget_type, common_flags, positive_int, positive_ints

    _whole = positive_int("samples per optimizer step")
    _rounds = positive_int("real runs per measured candidate")
    _sizes = positive_ints("micro-batch sizes >= 1", "1,2,4")

    p = sub.add_parser(
        "tune", help="the micro-batch size and plan that train fastest in a budget",
        description="Try every micro-batch size that divides --global-batch (gradient "
        "accumulation makes up the rest) under no checkpointing, per-layer checkpointing and "
        "gradckpt's plan for the budget, predicted in whole-step bytes (optimizer state and "
        "accumulation counted) under fake tensors; run the fastest few for real, interleaved, "
        "never above the budget; keep the fastest measured. Prints every candidate, writes "
        "the chosen plan as JSON.",
    )  # fmt: skip
    p.add_argument(
        "target",
        help="a built-in (see gradckpt plan --help), or package.module:function / "
        "path/to/file.py[:function] returning (model, loss_fn, make_loss)",
    )  # fmt: skip
    p.add_argument(
        "--budget", type=budget_type, required=True,
        help="the whole training step's memory: bytes with units (800MB, 1.5GiB) or 'auto' "
        "(--device memory less headroom); not a fraction (the plain peak differs per size)",
    )  # fmt: skip
    p.add_argument(
        "--global-batch", type=_whole, required=True, metavar="G",
        help="samples per optimizer step: each micro-batch size divides it",
    )  # fmt: skip
    p.add_argument(
        "--batch-sizes", type=_sizes, default=None, metavar="B,B,...",
        help="only these micro-batch sizes (default: every divisor of --global-batch)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", default="adamw", type=str.lower, choices=OPTIMIZERS, metavar="NAME",
        help=f"the optimizer whose state and step count in the budget, with torch's defaults: "
        f"{', '.join(OPTIMIZERS)} (default: adamw)",
    )  # fmt: skip
    p.add_argument(
        "--zero-grads", action="store_true",
        help="gradients are zeroed in place (resident through every forward); default: set to None",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=_rounds, default=3, metavar="N",
        help="real runs of each measured candidate (default: 3)",
    )  # fmt: skip
    p.add_argument(
        "--out", default="plan.json", help="where to write the plan (default: plan.json)"
    )
    p.add_argument("--plot", default=None, help="also write samples/s per micro-batch as this PNG")
    p.add_argument("--device", default="cpu", help="device for built-in targets (default: cpu)")
    p.add_argument(
        "--blocks", default=None,
        help="comma-separated module paths of the repeated blocks (default: found automatically)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON only (machine-readable)")
    common_flags(p)


def _check_budget(args: argparse.Namespace) -> None:
    if args.budget == "least" or isinstance(args.budget, float):
        raise CliError(
            f"tune needs --budget in bytes (e.g. 2GiB) or 'auto', got {args.budget!r}: a "
            "fraction of the plain peak, or the least peak, differs for every micro-batch size"
        )


#: gradckpt.tune's argument names in its errors, and the flags the command line knows them by.
_FLAGS = (
    ("global_batch=", "--global-batch "),
    ("batch_sizes=", "--batch-sizes "),
    ("global_batch", "--global-batch"),
    ("batch_sizes", "--batch-sizes"),
)


def _candidate_sizes(args: argparse.Namespace) -> list[int]:
    """The micro-batch sizes tune will try, its bounds checked (the errors name the flags)."""
    from gradckpt.tuning.sizes import candidate_sizes

    try:
        sizes = candidate_sizes(args.global_batch, args.batch_sizes)
    except ValueError as e:
        text = str(e)
        for name, flag in _FLAGS:
            text = text.replace(name, flag)
        raise CliError(text) from e
    assert sizes is not None  # the global batch is required
    return sizes


def _budget_bytes(args: argparse.Namespace, target: Any, optimizer: Any, out: Out) -> int:
    if args.budget != "auto":
        from gradckpt.planning.solving.budget import read_budget

        return int(read_budget(args.budget)[1])
    from gradckpt.api.budget import resolve_budget
    from gradckpt.planning.solving.budget import BudgetError

    try:
        nbytes, device = resolve_budget(target.model, "auto", optimizer)
    except (BudgetError, ValueError, RuntimeError) as e:
        raise CliError(f"--budget auto: {str(e).splitlines()[0]}") from e
    if device is not None:
        out.print(f"  {device.line()}")
    return int(nbytes)


def run_tune(args: argparse.Namespace, out: Out) -> int:
    from gradckpt.planning.solving.budget import BudgetError
    from gradckpt.profiling.run import ProfileError
    from gradckpt.tuning import tune

    _check_budget(args)
    check_writable(args.out, "--out")  # fail before the (possibly long) tuning
    if args.plot:
        check_writable(args.plot, "--plot")
        require("matplotlib", "--plot")
    builtin = BUILTINS.get(args.target)
    if builtin is not None and builtin.needs_fake_on_cpu and args.device.startswith("cpu"):
        raise CliError(
            f"{args.target} has about 5 GB of float32 weights and tune runs real steps: "
            "tune it with --device cuda (gradckpt estimate/plan take --fake)"
        )
    sizes = _candidate_sizes(args)
    with out.status(f"[1/3] building {args.target} ..."):
        target = resolve(args.target, device=args.device)
    if target.make_loss is None:
        raise CliError(
            f"target {target.name!r} gives no make_loss(b) to build micro-batches of b samples: "
            "return (model, loss_fn, make_loss), e.g. make_loss = "
            "gradckpt.tuning.sliced_loss(model, batch)"
        )
    optimizer = None if args.optimizer == "none" else args.optimizer
    budget = _budget_bytes(args, target, optimizer, out)
    blocks = [b.strip() for b in args.blocks.split(",") if b.strip()] if args.blocks else None
    counted = f"optimizer {args.optimizer}" if optimizer else "optimizer not counted"
    with out.status(
        f"[2/3] tuning {target.name}: micro-batches {', '.join(map(str, sizes))} of a global "
        f"batch of {args.global_batch} within {format_bytes(budget)} ({counted}): each profiled "
        f"under fake tensors, the plain step timed, the fastest run {args.rounds} rounds ..."
    ):  # fmt: skip
        try:
            result = tune(
                target.model, target.make_loss, budget, optimizer=optimizer,
                global_batch=args.global_batch, batch_sizes=args.batch_sizes,
                set_to_none=not args.zero_grads, rounds=args.rounds, blocks=blocks,
                progress=lambda line: out.print(f"  {line}"),
            )  # fmt: skip
        except BudgetError as e:
            least = e.least_peak_bytes
            if not least:
                raise CliError(f"{target.name}: {str(e).splitlines()[0]}") from e
            raise CliError(
                f"{target.name}: no micro-batch size fits {format_bytes(budget)} with any plan; "
                f"the least peak is {format_bytes(least)} ({least} bytes): use --budget "
                f"{budget_at_least(least)} or more"
            ) from e
        except (ProfileError, ValueError, TypeError) as e:
            raise CliError(f"tuning {target.name} failed: {str(e).splitlines()[0]}") from e
    measured = sum(c.measured_samples_per_s is not None for c in result.candidates)
    out.print(
        f"[3/3] predicted {len(result.candidates)} candidates in {result.planning_seconds:.1f} s, "
        f"ran {measured} for real in {result.measuring_seconds:.1f} s"
    )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    result.plan.save(path)
    plotted = None
    if args.plot:
        title = (f"{target.name}: global batch {args.global_batch}, "
                 f"budget {format_bytes(result.budget_bytes)}")  # fmt: skip
        write_tune_png(Path(args.plot), result, title=title)
        plotted = str(args.plot)
    if args.json:
        out.json({**result.to_json(), "target": target.name, "global_batch": args.global_batch,
                  "plan_path": str(path), "plot_path": plotted})  # fmt: skip
        return 0
    out.print()
    out.print(result.table())
    out.print()
    out.print(f"wrote {path}" + (f" and {plotted}" if plotted else ""))
    out.print(HINT.format(micro=result.micro_batch, accum=result.accumulation_steps,
                          path=str(path)))  # fmt: skip
    return 0


def write_tune_png(path: Path, result: Any, *, title: str) -> bool:
    """Samples per second against the micro-batch, one curve per strategy (predicted: lines,
    measured: markers with their rounds' spread, the chosen one starred); False if no matplotlib.
    """
    matplotlib = optional("matplotlib")
    if matplotlib is None:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    sizes = sorted({c.micro_batch for c in result.candidates})
    for strategy, (color, marker, line) in STYLE.items():
        rows = sorted((c for c in result.candidates if c.strategy == strategy),
                      key=lambda c: c.micro_batch)  # fmt: skip
        predicted = [(c.micro_batch, c.predicted_samples_per_s) for c in rows
                     if c.predicted_samples_per_s]  # fmt: skip
        if predicted:
            xs, ys = zip(*predicted)
            ax.plot(xs, ys, line, color=color, alpha=0.7, label=f"{strategy} (predicted)")
        ran = [c for c in rows if c.measured_samples_per_s]
        for c in ran:
            low, high = c.measured_spread or (c.measured_samples_per_s,) * 2
            err = [[c.measured_samples_per_s - low], [high - c.measured_samples_per_s]]
            ax.errorbar(c.micro_batch, c.measured_samples_per_s, yerr=err, fmt=marker,
                        color=color, ms=7, capsize=3)  # fmt: skip
        if ran:
            ax.plot([], [], marker, color=color, label=f"{strategy} (measured)")
    for c in result.candidates:
        if c.verdict == "chosen":
            ax.plot(c.micro_batch, c.measured_samples_per_s, "*", color="gold", mec="black",
                    ms=15, zorder=5, alpha=0.9,
                    label=f"chosen: {c.micro_batch} x {c.accumulation_steps}, {c.strategy}")  # fmt: skip
    over = [b for b in sizes if all(c.plan is None for c in result.candidates
                                    if c.micro_batch == b)]  # fmt: skip
    if over:
        ax.axvspan(min(over) / 1.3, max(sizes) * 1.3, color="0.9", zorder=0,
                   label="no plan fits the budget")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
    ax.set_xlabel("micro-batch size (accumulation makes up the global batch)")
    ax.set_ylabel("samples / s (whole optimizer step)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
