"""The ``gradckpt`` command: ``demo``, ``estimate``, ``plan``, ``explain``, ``tune``, ``bench``.

Errors in the input (unknown target, bad budget, a budget below the least
feasible peak, a missing optional extra) print one line on stderr and exit with
status 2; ``--debug`` prints the traceback as well, and ``--json`` prints the error as a
JSON object on stdout too. Arguments and output paths are checked before profiling.

Example:
    $ gradckpt demo
    $ gradckpt estimate llama-1b --optimizer adamw --budget 24GB
    $ gradckpt plan gpt2-small --budget 0.5 --fake --out plan.json
    $ gradckpt explain mypkg.train:make_model --budget 3GiB
    $ gradckpt tune tiny-gpt --budget 40MiB --global-batch 16
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections.abc import Sequence

from gradckpt.cli.arguments import budget_type as _budget
from gradckpt.cli.arguments import common_flags as _common
from gradckpt.cli.arguments import positive_int, positive_ints
from gradckpt.cli.extras import CliError

__all__ = ["CliError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2) like every other input error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(f"{message} (see {self.prog} --help)")


_lengths = positive_ints("positive sequence lengths", "128,256,512")
_micro_batches = positive_int("micro-batches per optimizer step (1: no accumulation)")


def _step_flags(p: argparse.ArgumentParser, what: str) -> None:
    from gradckpt.cli.common import OPTIMIZERS

    p.add_argument(
        "--optimizer", default="none", type=str.lower, choices=OPTIMIZERS, metavar="NAME",
        help=f"count the optimizer's state and step in {what}, with torch's defaults: "
        f"{', '.join(OPTIMIZERS[1:])}; predicted on fake tensors (default: none, not counted)",
    )  # fmt: skip
    p.add_argument(
        "--accumulation", type=_micro_batches, default=1, metavar="K",
        help="micro-batches per optimizer step; from the second on the gradients are "
        "resident through forward and backward (default: 1)",
    )  # fmt: skip
    p.add_argument(
        "--zero-grads", action="store_true",
        help="gradients are zeroed in place (zero_grad(set_to_none=False)), so resident "
        "through every forward (default: set to None)",
    )  # fmt: skip


def _target_flags(p: argparse.ArgumentParser) -> None:
    from gradckpt.cli.targets import BUILTINS

    p.add_argument(
        "target",
        help="package.module:function or path/to/file.py[:function] returning "
        f"(model, loss_fn), or a built-in: {', '.join(BUILTINS)}",
    )
    p.add_argument(
        "--fake", action="store_true",
        help="profile under fake tensors: nothing is allocated, op times are estimated "
        "(plan a model too big for this machine; built-ins are then built on the meta device)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cpu",
        help="device for built-in targets, and the device fake tensors claim (default: cpu)",
    )  # fmt: skip
    p.add_argument(
        "--blocks", default=None,
        help="comma-separated module paths of the repeated blocks (default: found automatically)",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=3, help="profiled steps for op times (default: 3)"
    )
    p.add_argument("--json", action="store_true", help="print JSON only (machine-readable)")


def _offload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--offload", type=float, nargs="?", const=25.0, default=None, metavar="GB/S",
        help="also consider offloading blocks' saved tensors to host memory over a link of "
        "GB/S each way (default 25, PCIe Gen4 class; on CPU the time is simulated)",
    )  # fmt: skip
    p.add_argument(
        "--host-budget", type=_budget, default=None, metavar="BYTES",
        help="with --offload: most bytes held in host memory (800MB, 8GiB; default: no limit)",
    )  # fmt: skip


def _chunking_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-chunking", dest="chunking", action="store_false",
        help="never run the LM head and its loss in slices of tokens (plans keep, recompute, "
        "select and offload only, bit for bit as the plain step)",
    )  # fmt: skip


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    from gradckpt.cli.pipeline import add_pipeline_flags as add

    add(p)


def build_parser() -> argparse.ArgumentParser:
    from gradckpt import __version__
    from gradckpt.planning.solving.solvers import SOLVERS

    parser = _Parser(
        prog="gradckpt",
        description="Activation checkpointing for PyTorch that plans itself: state a memory "
        "budget, get the cheapest plan that fits.",
    )
    parser.add_argument("--version", action="version", version=f"gradckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser(
        "demo", help="plan a small GPT for half its memory, train it, prove the result",
        description="Measure a small GPT's training step (CPU, synthetic tokens), plan it for "
        "a budget, train a plain and a planned copy side by side and show the peak, the "
        "overhead and that the loss curves are identical. Writes frontier.png, plan.json and "
        "demo.json to --out.",
    )  # fmt: skip
    demo.add_argument(
        "--budget", type=_budget, default=None,
        help="memory budget: a fraction of the plain peak (0.5, 50%%), bytes with units "
        "(40MiB) or 'least' (default: half the plain peak)",
    )  # fmt: skip
    demo.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    demo.add_argument(
        "--out", default="gradckpt-demo", help="output folder (default: ./gradckpt-demo/)"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed for weights, data and dropout")
    _common(demo, 1, "; the model is small and one thread keeps timings steady on a busy machine")

    est = sub.add_parser(
        "estimate", help="the whole training step's memory, plain and leanest: before renting a GPU",
        description="Estimate TARGET's whole training step under fake tensors (nothing is "
        "allocated; built-ins are built on the meta device): parameters, gradients, optimizer "
        "state, the optimizer step's temporaries and activations, for the plain step and for "
        "the leanest checkpointing plan, next to the parameter-count formulas; with --budget, "
        "whether each fits and the plan for it.",
    )  # fmt: skip
    est.add_argument(
        "target",
        help="package.module:function or path/to/file.py[:function] returning (model, loss_fn), "
        "or a built-in (see gradckpt plan --help)",
    )  # fmt: skip
    _step_flags(est, "the estimate")
    est.add_argument(
        "--budget", type=_budget, default=None,
        help="also check this budget: bytes with units (24GB, 80GiB), a fraction of the plain "
        "step's peak (0.5), 'least', or 'auto' (this machine's --device memory less headroom)",
    )  # fmt: skip
    est.add_argument(
        "--device", default="cpu",
        help="the device the step is estimated for, as fake tensors claim it (default: cpu)",
    )  # fmt: skip
    est.add_argument(
        "--blocks", default=None,
        help="comma-separated module paths of the repeated blocks (default: found automatically)",
    )  # fmt: skip
    est.add_argument("--json", action="store_true", help="print JSON only (machine-readable)")
    _chunking_flag(est)
    add_pipeline_flags(est)
    _common(est)

    plan = sub.add_parser(
        "plan", help="plan TARGET for a memory budget; write plan.json",
        description="Profile TARGET's training step, find the least-recompute plan whose peak "
        "fits --budget, print it per unit and write it as JSON. Apply it in your own script "
        "with gradckpt.Plan.load(path) and gradckpt.apply(model, plan).",
    )  # fmt: skip
    _target_flags(plan)
    plan.add_argument(
        "--budget", type=_budget, required=True,
        help="a fraction of the plain peak (0.5, 50%%), bytes with units (800MB, 1.5GiB), "
        "bytes, 'least' (the least feasible peak) or 'auto' (--device memory less headroom)",
    )  # fmt: skip
    _step_flags(plan, "the plan's peak (the whole training step)")
    plan.add_argument(
        "--out", default="plan.json", help="where to write the plan (default: plan.json)"
    )
    plan.add_argument("--plot", default=None, help="also write the frontier as this PNG")
    plan.add_argument(
        "--shapes", type=_lengths, default=None, metavar="N,N,...",
        help="also plan these sequence lengths (dimension 1 of the target's inputs) under the "
        "same budget in bytes, planned under fake tensors; --out then holds a plan set "
        "(gradckpt.PlanSet.load, gradckpt.apply)",
    )  # fmt: skip
    plan.add_argument(
        "--solver", default="dp",
        choices=sorted(SOLVERS),
        help="dp (default, the least recompute) or a hand-placed baseline, for comparison",
    )  # fmt: skip
    _offload_flags(plan)
    _chunking_flag(plan)
    add_pipeline_flags(plan)
    _common(plan)

    exp = sub.add_parser(
        "explain", help="every tensor kept for backward, why, and where the peak is",
        description="List every tensor TARGET's step keeps for backward (grouped by unit: "
        "producer op, shape, dtype, bytes, and why it is kept or recomputed), the totals, "
        "and where the peak occurs: the answer to 'checkpointing does not lower my peak'.",
    )  # fmt: skip
    _target_flags(exp)
    exp.add_argument(
        "--budget", type=_budget, default=None,
        help="explain the plan for this budget (default: the plain step)",
    )  # fmt: skip
    exp.add_argument("--plan", default=None, help="explain this saved plan.json instead")
    exp.add_argument(
        "--units", dest="units_only", action="store_true",
        help="one line per unit instead of one per tensor",
    )  # fmt: skip
    _offload_flags(exp)
    _chunking_flag(exp)
    _common(exp)

    from gradckpt.cli.tune import add_parser as add_tune

    add_tune(sub)

    bench = sub.add_parser(
        "bench", help="run the benchmark scripts (benchmarks/*.py) and write their results",
        description="Run benchmarks/engine.py, frontier.py and hf_models.py (those present) "
        "one after the other; each writes Markdown/JSON (and PNG) results.",
    )  # fmt: skip
    bench.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    bench.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    bench.add_argument(
        "--only", default=None, help="comma-separated subset of: engine, frontier, hf_models"
    )
    bench.add_argument("--dir", default=None, help="the benchmarks folder (default: found)")
    _common(bench)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # Warnings go to stdout as one line each: stderr is kept for the error line.
    print(f"warning: {category.__name__}: {message}", flush=True)


def _show_warning_beside_json(message, category, filename, lineno, file=None, line=None) -> None:
    # With --json, stdout holds the document alone: a warning goes to stderr.
    print(f"warning: {category.__name__}: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradckpt`` command; returns the exit status (used as the console script)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help()
            return 2
        return _run(args)
    except CliError as e:
        if debug:
            traceback.print_exc()
        print(f"gradckpt: error: {e}", file=sys.stderr, flush=True)
        if "--json" in argv:  # machine-readable output stays machine-readable
            print(json.dumps({"kind": "gradckpt.Error", "error": str(e), "exit_code": e.code}))
        return e.code
    except KeyboardInterrupt:
        print("gradckpt: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        if debug:
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"gradckpt: error: {type(e).__name__}: {first}{hint}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace) -> int:
    import torch

    from gradckpt.cli.output import Out

    if getattr(args, "repeats", 1) < 1:
        raise CliError(f"--repeats must be at least 1 (profiled steps), got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    out = Out(quiet=getattr(args, "json", False))
    with warnings.catch_warnings():
        if not args.debug:
            json_out = getattr(args, "json", False)
            warnings.showwarning = _show_warning_beside_json if json_out else _show_warning
        if args.command == "demo":
            from gradckpt.cli.demo import run_demo

            return run_demo(args, out)
        if args.command in ("estimate", "plan") and getattr(args, "stages", None) is not None:
            from gradckpt.cli.pipeline import run_pipeline

            return run_pipeline(args, out, budget_required=args.command == "plan")
        if args.command == "estimate":
            from gradckpt.cli.estimate import run_estimate

            return run_estimate(args, out)
        if args.command == "tune":
            from gradckpt.cli.tune import run_tune

            return run_tune(args, out)
        from gradckpt.cli import commands

        run = {"plan": commands.run_plan, "explain": commands.run_explain,
               "bench": commands.run_bench}[args.command]  # fmt: skip
        return run(args, out)
