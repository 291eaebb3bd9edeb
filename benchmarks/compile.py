"""Compile benchmark: a planned GPT compiled with ``compile_model``, against eager and plain compile.

Contenders (each on its own copy of the zoo GPT, same weights and batch; dropout off,
so every backend draws the same numbers):

* ``plain``: no plan, eager;
* ``planned``: a gradckpt plan at ``--budget`` of the plain peak, eager;
* ``planned_compiled``: the same plan, then ``compile_model(model, backend=...)``
  (unit bodies compiled and rerun compiled inside their regions);
* ``plain_compiled``: no plan, ``model.compile(backend=...)``.

Times: interleaved rounds, median after warm-up (the warm-up rounds compile).
Peaks: measured for the eager contenders only: the CPU tracker is a dispatch
mode, under which compiled code runs eagerly, and a CPU build has no allocator
statistics (on CUDA, compare ``torch.cuda.max_memory_allocated``). Gradients of
every contender are compared with ``plain``'s.

Usage:
    python -m benchmarks.compile                       # inductor (needs a C++ compiler)
    python -m benchmarks.compile --backend aot_eager   # no code generation
    python -m benchmarks.compile --quick               # smoke test (aot_eager)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import gradckpt
from benchmarks.harness import (
    MiB,
    RunClock,
    base_parser,
    fmt_ratio,
    info_block,
    machine_info,
    make_step,
    markdown_table,
    mib,
    settle,
    write_results,
)
from gradckpt.compiled.around_regions import compile_model
from gradckpt.measure import MemoryTracker, ratio, time_interleaved
from gradckpt.testing import make

FULL = dict(layers=6, d_model=256, heads=8, seq=256, vocab=2048, batch=4, dropout=0.0)
QUICK = dict(layers=2, d_model=64, heads=4, seq=64, vocab=256, batch=2, dropout=0.0)

DESCRIPTIONS = {
    "plain": "no plan, eager",
    "planned": "gradckpt plan, eager",
    "planned_compiled": "gradckpt plan, then compile_model",
    "plain_compiled": "no plan, model.compile",
}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend (default: inductor; aot_eager with --quick)",
    )
    p.add_argument("--budget", type=float, default=0.6, help="fraction of the plain peak")
    args = p.parse_args(argv)  # fmt: skip
    settle(args)
    backend = args.backend or ("aot_eager" if args.quick else "inductor")
    sizes = QUICK if args.quick else FULL
    clock = RunClock.start()
    print(f"compile benchmark: gpt {sizes}, backend {backend}, budget {args.budget}")

    probe = make("gpt", **sizes)
    try:
        plan = gradckpt.plan(probe.model, probe.loss_fn, args.budget, profiling=gradckpt.ProfileOptions(repeats=1))
    except gradckpt.BudgetError as exc:  # tiny --quick sizes: the leanest plan instead
        print(f"  budget {args.budget} does not fit; planning at the least peak")
        plan = gradckpt.plan(probe.model, probe.loss_fn, exc.least_peak_bytes, profiling=gradckpt.ProfileOptions(repeats=1))
    examples = {name: make("gpt", **sizes) for name in DESCRIPTIONS}
    peaks: dict[str, int | None] = {}
    for name, ex in examples.items():
        if name.startswith("planned"):
            gradckpt.apply(ex.model, plan)
        if name in ("plain", "planned"):
            with MemoryTracker(ex.model) as tracker:
                make_step(ex, args.seed)()
            peaks[name] = tracker.peak_bytes
        else:
            peaks[name] = None
        if name == "planned_compiled":
            compile_model(ex.model, backend=backend, whole_model=False)
        elif name == "plain_compiled":
            ex.model.compile(backend=backend)
    steps = {name: make_step(ex, args.seed) for name, ex in examples.items()}
    compile_started = time.perf_counter()
    for step in steps.values():  # compiles; its gradients are compared below
        step()
    first_round = time.perf_counter() - compile_started
    reference = _grads(examples["plain"].model)
    worst = {
        name: max((g - reference[k]).abs().max().item() for k, g in _grads(ex.model).items())
        for name, ex in examples.items()
    }
    print(f"  first round (compiles) {first_round:.1f} s; timing ...")
    timings = time_interleaved(steps, warmup=args.warmup, repeats=args.repeats)

    rows = [
        (f"`{name}`", DESCRIPTIONS[name], f"{timings[name].median:.3f}",
         fmt_ratio(ratio(timings[name], timings["plain"])),
         fmt_ratio(ratio(timings[name], timings["planned"])),
         mib(peaks[name]), f"{worst[name]:.1e}")
        for name in DESCRIPTIONS
    ]  # fmt: skip
    table = markdown_table(
        ["contender", "what", "median step (s)", "time / plain", "time / planned",
         "peak (MiB)", "max |grad - plain|"],
        rows,
    )  # fmt: skip
    info = machine_info(
        model="gpt (gradckpt.testing)", sizes=sizes, backend=backend, budget=args.budget,
        plan_predicted_peak_mib=round(plan.predicted_peak_bytes / MiB, 1),
        plan_units=", ".join(f"{u.path}:{u.mode}" for u in plan.units),
        warmup=args.warmup, repeats=args.repeats, quick=args.quick,
        first_round_s=round(first_round, 1),
        **clock.info(),
    )  # fmt: skip
    md = "\n\n".join(
        [
            f"# Compile benchmark: planned GPT under torch.compile ({backend}), CPU "
            f"({info['date']})",
            "Each contender runs on its own copy of the zoo GPT (same seed, weights, batch; "
            "dropout off). Times: interleaved rounds, median after warm-up, as ratios over "
            "`plain` and over `planned` (eager) from the same rounds. Peaks only for eager "
            "contenders (see the script's docstring). `planned_compiled` runs the unit bodies "
            "compiled in the forward and again in the recompute.",
            table,
            "## Setup",
            info_block(info),
        ]
    )
    data = {
        "info": info,
        "results": {
            name: {
                "median_s": timings[name].median,
                "times_s": list(timings[name].times),
                "peak_bytes": peaks[name],
                "max_grad_diff": worst[name],
            }
            for name in DESCRIPTIONS
        },
    }
    md_path, json_path = write_results(args.out, "compile", md, data)
    print(md)
    print(f"\nwrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
