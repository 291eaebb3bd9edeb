"""HF benchmark: gradckpt.fit against the libraries' own checkpointing, on CPU.

For GPT-2, Llama, BERT, ViT and T5 (built from configs, random weights), a
PEFT-LoRA Llama (frozen base, adapters on q/v) and two diffusers U-Nets (a
pixel-space ``UNet2DModel`` on 512x512 images and a latent ``UNet2DConditionModel``
on 64x64 latents, i.e. 512x512 images after an SD-style VAE), four contenders,
each on its own copy of the model (same seed, weights and batch, ``use_cache``
off as in training):

* ``plain``: no checkpointing;
* ``hf``: the library's own switch, every layer one checkpoint: transformers'
  ``activation_checkpointing_enable({"use_reentrant": False})`` (the 5.x name of
  ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``; for the
  PEFT model, on its base), or diffusers' ``enable_gradient_checkpointing()``
  (non-reentrant; every resnet and attention is one checkpoint);
* ``gradckpt@hf``: ``gradckpt.fit`` with the budget transformers reached (its measured peak);
* ``gradckpt@half``: ``gradckpt.fit`` with the budget halfway between that and plain.

A byte budget is held at malloc's level on the CPU: the allocator's peak (tensors
and kernel workspaces, with parameters and buffers) and what malloc holds beside
it (autograd's graph, Python objects). Every contender's memory is measured so,
and transformers' own is the ``gradckpt@hf`` budget: both sides counted alike.

Targets (issue #16's Done-when): every gradckpt peak within its budget; at
transformers' peak, overhead no worse than transformers'; at the halfway budget,
at most half of it; every predicted overhead within 10 points (or 25% relative,
whichever is larger) of the measured median. Overheads are medians of per-round
ratios over ``plain`` in the same round, with their min-max spread. Issue #42's
row: ``gradckpt@hf``'s step over ``hf``'s, paired by round, its median with a
bootstrap 95% interval, met when the interval's upper end is at most 1.00.

Usage:
    python -m benchmarks.hf_models --repeats 5  # full run (~10 min on a loaded 2-core CPU)
    python -m benchmarks.hf_models --quick    # smoke test (< 60 s)
    python -m benchmarks.hf_models --models gpt2 t5
    python -m benchmarks.hf_models --models llama-lora unet-512 sd-unet --tag hf-lora-unet
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import gradckpt
from benchmarks.harness import (
    RunClock,
    base_parser,
    clear_grads,
    fastest_ratio,
    fmt_ratio,
    info_block,
    library_checkpointing,
    machine_info,
    make_step,
    markdown_table,
    median_interval,
    mib,
    settle,
    step_clock,
    verdict,
    write_results,
)
from gradckpt.measure import TensorsOnlyWarning, ratio, time_interleaved

MODELS = ("gpt2", "llama", "bert", "vit", "t5", "llama-lora", "unet-512", "sd-unet")
# Sizes for a 0.5-3 s step on one CPU thread.
FULL: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=8, hidden=384, heads=6, seq=256, batch=4, vocab=4096),
    "llama": dict(layers=8, hidden=384, heads=6, seq=256, batch=4, vocab=4096),
    "bert": dict(layers=8, hidden=384, heads=6, seq=256, batch=4, vocab=4096),
    "vit": dict(layers=8, hidden=384, heads=6, image=160, patch=16, batch=8),
    "t5": dict(layers=4, hidden=384, heads=6, seq=256, batch=4, vocab=4096),
    "llama-lora": dict(layers=8, hidden=384, heads=6, seq=256, batch=4, vocab=4096),
    "unet-512": dict(sample=512, batch=1, channels=(16, 32, 32, 64)),
    "sd-unet": dict(sample=64, batch=2, channels=(32, 64, 128), layers_per_block=2),
}
QUICK: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=3, hidden=64, seq=64, batch=2),
    "llama": dict(layers=3, hidden=64, seq=64, batch=2),
    "bert": dict(layers=3, hidden=64, seq=64, batch=2),
    "vit": dict(layers=3, hidden=64, image=64, patch=8, batch=2),
    "t5": dict(layers=2, hidden=64, seq=64, batch=2),
    "llama-lora": dict(layers=3, hidden=64, seq=64, batch=2),
    "unet-512": dict(sample=32, batch=1, channels=(16, 32, 32)),
    "sd-unet": dict(sample=16, batch=1, channels=(32, 64)),
}
CONTENDERS = ("plain", "hf", "gradckpt@hf", "gradckpt@half")
DESCRIPTIONS = {
    "plain": "no checkpointing",
    "hf": "the library's own switch: transformers activation_checkpointing_enable("
    "use_reentrant=False), diffusers enable_gradient_checkpointing()",
    "gradckpt@hf": "gradckpt.fit, budget = hf's measured peak and beside",
    "gradckpt@half": "gradckpt.fit, budget = halfway between hf's and plain's (peak and beside)",
}


@dataclass
class Run:
    """One contender on one model."""

    name: str
    example: Any
    peak_bytes: int = 0  # at the allocator, with parameters and buffers
    beside_bytes: int = 0  # what malloc held beside the allocator's blocks, at most
    grad_diff: float = 0.0
    budget_bytes: int | None = None
    plan: gradckpt.Plan | None = None
    plan_s: float = 0.0
    error: str = ""
    ratio: float | None = None
    min_ratio: float | None = None
    round_ratios: tuple[float, ...] = ()  # this contender's time / plain's, per round
    median_s: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def within_budget(self) -> bool | None:
        if self.budget_bytes is None or self.error:
            return None if not self.error else False
        if self.info.get("tensors_only"):  # as fit said it planned
            return self.peak_bytes <= self.budget_bytes
        return self.held_bytes <= self.budget_bytes

    @property
    def held_bytes(self) -> int:
        """The step's memory at the level a byte budget is held: the allocator's peak and
        what malloc held beside it."""
        return self.peak_bytes + self.beside_bytes


def _fit(run: Run, budget: int, prof: gradckpt.Profile, log: Any) -> gradckpt.Plan:
    """``gradckpt.fit`` at ``budget``; refused only for what the step and planning hold from
    malloc beside the tensors (a byte budget holds them, #40), at the budget the refusal
    names, recorded as ``budget_raised_to`` (the run's budget is then that one). Where fit
    says it planned for the tensors alone (:class:`~gradckpt.measure.TensorsOnlyWarning`:
    no plan holds them and what is beside them), the run is held to that."""
    ex = run.example

    def fitted(nbytes: int) -> gradckpt.Plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = gradckpt.fit(ex.model, ex.loss_fn, budget=nbytes,
                                profiling=gradckpt.ProfileOptions(profile=prof))  # fmt: skip
        for w in caught:
            if issubclass(w.category, TensorsOnlyWarning):
                run.info["tensors_only"] = True
                log(f"  {run.name}: fit planned for the tensors alone: {w.message}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return plan

    try:
        return fitted(budget)
    except gradckpt.BudgetError as exc:
        named = exc.least_peak_bytes
        if named is None or "beside the step's tensors" not in str(exc):
            raise
        log(f"  {run.name}: {mib(budget)} MiB holds the tensors but not what is beside them; "
            f"at the {mib(named)} MiB the refusal names")  # fmt: skip
        run.budget_bytes = named
        run.info["budget_raised_to"] = named
        return fitted(named)


def _measure(run: Run, seed: int, plain: Run | None) -> None:
    from gradckpt.integrations.hf.zoo import run_step

    step = run_step(run.example, seed, beside=True)
    run.peak_bytes = step.peak_bytes
    run.beside_bytes = step.beside_bytes
    run.info["step"] = step
    if plain is not None:
        run.grad_diff = step.max_grad_diff(plain.info["step"])


def bench_model(name: str, sizes: dict[str, Any], args: Any, log=print) -> dict[str, Run]:
    """Build, install, measure and time the four contenders on one model."""
    from gradckpt.integrations import hf
    from gradckpt.integrations.hf.zoo import hf_example

    def build() -> Any:
        if name == "llama-lora":
            from gradckpt.integrations.peft_zoo import lora_example

            ex = lora_example("llama", dropout=args.dropout, lora_dropout=args.dropout, **sizes)
        elif name in ("unet-512", "sd-unet"):
            from gradckpt.integrations.diffusers_zoo import unet_example

            kind = "unet2d" if name == "unet-512" else "unet2d_condition"
            return unet_example(kind, dropout=args.dropout, **sizes)
        else:
            ex = hf_example(name, dropout=args.dropout, **sizes)
        hf.disable_cache(ex.model)  # as in training (fit would do it anyway)
        return ex

    runs = {c: Run(c, build()) for c in CONTENDERS}
    plain, hf_run = runs["plain"], runs["hf"]
    _measure(plain, args.seed, None)
    library_checkpointing(hf_run.example.model)
    _measure(hf_run, args.seed, plain)
    budgets = {
        "gradckpt@hf": hf_run.held_bytes,
        "gradckpt@half": (hf_run.held_bytes + plain.held_bytes) // 2,
    }
    # One profile serves both budgets (same architecture, weights and batch);
    # gradckpt.profile prepares the model as gradckpt.fit does (no KV cache).
    started = time.perf_counter()
    ex = runs["gradckpt@hf"].example
    prof = gradckpt.profile(ex.model, ex.loss_fn)
    profile_s = time.perf_counter() - started
    for contender, budget in budgets.items():
        run = runs[contender]
        run.budget_bytes = budget
        started = time.perf_counter()
        try:
            run.plan = _fit(run, budget, prof, log)
        except gradckpt.BudgetError as exc:
            run.error = str(exc)
            log(f"  {contender}: {exc}")
            continue
        run.plan_s = profile_s + time.perf_counter() - started
        # The planner's view of the baseline at the same budget: does the DP pick
        # a plan it predicts cheaper than checkpointing every layer?
        try:
            every = gradckpt.plan(
                run.example.model, run.example.loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof),
                solver="every_block",
            )  # fmt: skip
            run.info["every_block_predicted_overhead"] = every.predicted_overhead
        except gradckpt.BudgetError:
            run.info["every_block_predicted_overhead"] = None
        _measure(run, args.seed, plain)
    for run in runs.values():
        if not run.error:
            log(
                f"  peak {run.name:<14} {mib(run.peak_bytes):>9} MiB"
                f" + {mib(run.beside_bytes)} MiB beside"
                + (f"  budget {mib(run.budget_bytes)} MiB" if run.budget_bytes else "")
                + f"  max|dgrad| {run.grad_diff:.2e}"
            )
    steps = {c: make_step(r.example, args.seed) for c, r in runs.items() if not r.error}
    log(
        f"  timing {len(steps)} contenders interleaved: {args.warmup} warm-up, {args.repeats} rounds"
    )
    clock = step_clock("cpu", args.clock)
    timings = time_interleaved(steps, warmup=args.warmup, repeats=args.repeats, clock=clock)
    for c, timing in timings.items():
        runs[c].median_s = timing.median
        runs[c].ratio = ratio(timing, timings["plain"])
        runs[c].min_ratio = fastest_ratio(timing, timings["plain"])
        runs[c].round_ratios = tuple(
            t / p for t, p in zip(timing.times, timings["plain"].times, strict=True)
        )
    if "hf" in timings and "gradckpt@hf" in timings:  # at one memory: the plans against hf's
        runs["gradckpt@hf"].info["paired_vs_hf"] = median_interval(
            [t / h for t, h in zip(timings["gradckpt@hf"].times, timings["hf"].times, strict=True)]
        )
    for run in runs.values():
        run.info.pop("step", None)
        clear_grads(run.example.model)
    return runs


# --------------------------------------------------------------------------- report


def _overhead(run: Run) -> float | None:
    """Measured overhead: the median over rounds of this round's time over plain's."""
    if not run.round_ratios:
        return None if run.ratio is None else run.ratio - 1.0
    return statistics.median(run.round_ratios) - 1.0


def _spread(run: Run) -> tuple[float, float] | None:
    if not run.round_ratios:
        return None
    return min(run.round_ratios) - 1.0, max(run.round_ratios) - 1.0


def _measured(run: Run) -> str:
    """``+12.3% (+10.1% to +15.0%)``: median overhead and its min-max over rounds."""
    median, spread = _overhead(run), _spread(run)
    if median is None:
        return "n/a"
    return f"{median:+.1%}" + (f" ({spread[0]:+.1%} to {spread[1]:+.1%})" if spread else "")


def prediction_ok(predicted: float, measured: float) -> bool:
    """Within 10 points, or 25% of the measured overhead if that is larger."""
    return abs(predicted - measured) <= max(0.10, 0.25 * abs(measured))


def targets(runs: dict[str, Run]) -> list[tuple[str, str, str, bool]]:
    """(target, wanted, measured, met) for one model."""
    hf_over = _overhead(runs["hf"])
    at_hf, half = runs["gradckpt@hf"], runs["gradckpt@half"]
    rows = []
    for run in (at_hf, half):
        measured = (
            run.error.split(":")[0]
            if run.error
            else f"{mib(run.peak_bytes)} <= {mib(run.budget_bytes)} MiB"
            if run.info.get("tensors_only")
            else f"{mib(run.held_bytes)} <= {mib(run.budget_bytes)} MiB"
        )
        wanted = ("peak <= budget (fit warned: tensors alone)" if run.info.get("tensors_only")
                  else "peak + beside <= budget")  # fmt: skip
        rows.append((f"{run.name} within budget", wanted, measured, bool(run.within_budget)))
    o_hf = _overhead(at_hf)
    rows.append(
        (
            "gradckpt@hf overhead <= hf's",
            f"<= {hf_over:+.1%}",
            "n/a" if o_hf is None else f"{o_hf:+.1%}",
            o_hf is not None and o_hf <= hf_over,
        )
    )
    paired = at_hf.info.get("paired_vs_hf")
    if paired is not None:
        rows.append(
            (
                "gradckpt@hf step / hf's, paired by round",
                "<= 1.00 (interval's upper end)",
                f"{paired[0]:.3f} [{paired[1]:.3f}, {paired[2]:.3f}]",
                paired[2] <= 1.0,
            )
        )
    o_half = _overhead(half)
    rows.append(
        (
            "gradckpt@half overhead <= hf's / 2",
            f"<= {hf_over / 2:+.1%}",
            "n/a" if o_half is None else f"{o_half:+.1%}",
            o_half is not None and o_half <= hf_over / 2,
        )
    )
    for run in (at_hf, half):
        measured = _overhead(run)
        if run.plan is None or measured is None:
            continue
        predicted = run.plan.predicted_overhead
        rows.append(
            (
                f"{run.name} predicted overhead near measured",
                "within 10 pts or 25%",
                f"predicted {predicted:+.1%}, measured {measured:+.1%}",
                prediction_ok(predicted, measured),
            )
        )
    return rows


def model_table(runs: dict[str, Run]) -> str:
    base = runs["plain"].peak_bytes
    rows = []
    for run in runs.values():
        pred = run.plan.predicted_peak_bytes if run.plan else None
        rows.append(
            (
                f"`{run.name}`",
                "n/a" if run.budget_bytes is None else mib(run.budget_bytes)
                + (" (raised: beside the tensors)" if "budget_raised_to" in run.info else ""),
                "n/a" if run.error else mib(run.peak_bytes),
                "n/a" if run.error else f"{run.peak_bytes / base:.3f}",
                "n/a" if run.error else mib(run.beside_bytes),
                {None: "", True: "yes", False: "**no**"}[run.within_budget],
                "n/a" if run.median_s is None else f"{run.median_s:.3f}",
                _measured(run),
                fmt_ratio(run.min_ratio),
                "n/a" if run.error else f"{run.grad_diff:.1e}",
                "" if pred is None else f"{(pred - run.peak_bytes) / run.peak_bytes:+.2%}",
                "" if run.plan is None else f"{run.plan.predicted_overhead:+.1%}",
                "" if run.plan is None else _pct(run.plan.measured_overhead),
                _pct(run.info.get("every_block_predicted_overhead")),
                f"{run.plan_s:.1f}" if run.plan else "",
            )
        )
    return markdown_table(
        [
            "contender", "budget (MiB)", "peak (MiB)", "peak / plain", "beside (MiB)",
            "within budget",
            "median step (s)", "overhead: median (min to max over rounds)",
            "fastest / plain's fastest", "max abs dgrad", "peak prediction error",
            "predicted overhead", "fit's own measured overhead", "every-layer predicted overhead",
            "plan time (s)",
        ],
        rows,
    )  # fmt: skip


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def _plan_modes(plan: gradckpt.Plan | None) -> str:
    if plan is None:
        return "n/a"
    from collections import Counter

    modes = Counter(u.mode for u in plan.units)
    segments = sum(isinstance(i, gradckpt.Segment) for i in plan.items)
    text = ", ".join(f"{n} {m}" for m, n in sorted(modes.items())) + f", {segments} segment(s)"
    if plan.token_chunks:  # MLPs in slices of tokens live beside the units' decisions
        text += ", MLPs in slices: " + ", ".join(f"`{p}` x{k}" for p, k in plan.token_chunks)
    return text


_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "bert": "BERT", "vit": "ViT", "t5": "T5"}


def readme_rows(all_runs: dict[str, dict[str, Run]]) -> str:
    """The README's HF table: every overhead with its spread, gradckpt's with its prediction."""

    def cell(run: Run) -> str:
        if run.error:
            return "does not fit"
        text = _measured(run)
        return text + (f" [pred. {run.plan.predicted_overhead:+.1%}]" if run.plan else "")

    rows = [
        (_NAMES.get(name, name), cell(runs["hf"]), cell(runs["gradckpt@hf"]),
         cell(runs["gradckpt@half"]))
        for name, runs in all_runs.items()
    ]  # fmt: skip
    return markdown_table(
        [
            "model",
            "transformers' checkpointing",
            "gradckpt at its peak",
            "gradckpt halfway to plain",
        ],
        rows,
    )


def report(all_runs: dict[str, dict[str, Run]], sizes: dict, info: dict) -> tuple[str, dict]:
    parts = [
        f"# HF models: gradckpt.fit vs the libraries' own checkpointing, CPU ({info['date']})",
        "Each contender runs on its own copy of the model (same seed, weights and batch; "
        "`use_cache=False` as in training). Peaks: one untimed step at the allocator "
        "(tensors and kernel workspaces, with parameters and buffers); `beside`: what malloc "
        "held beside the allocator's blocks at most (autograd's graph, Python objects). A "
        "byte budget holds both on the CPU, so `hf`'s peak and beside are `gradckpt@hf`'s "
        "budget, and `within budget` counts both (the peak alone where fit warned that no "
        "plan holds both and it planned for the tensors alone). Times: interleaved rounds, median after warm-up, as a "
        "ratio over `plain` in the same rounds (`fastest / plain's fastest`: the least "
        "disturbed runs; verdicts use the medians). `max abs dgrad`: largest gradient "
        "difference from `plain` (same seed).",
        "Contenders: " + "; ".join(f"`{c}`: {d}" for c, d in DESCRIPTIONS.items()) + ".",
    ]
    summary = []
    data: dict[str, Any] = {"info": info, "models": {}}
    for name, runs in all_runs.items():
        rows = targets(runs)
        parts += [
            f"## {name}",
            f"Sizes: {sizes[name]}. Blocks: {len(runs['plain'].example.block_paths)} "
            f"(`{runs['plain'].example.block_paths[0]}` ...). Plans: "
            f"`gradckpt@hf` {_plan_modes(runs['gradckpt@hf'].plan)}; "
            f"`gradckpt@half` {_plan_modes(runs['gradckpt@half'].plan)}.",
            model_table(runs),
            markdown_table(
                ["target", "wanted", "measured", "verdict"],
                [(t, w, m, verdict(ok)) for t, w, m, ok in rows],
            ),
        ]
        summary += [(name, t, w, m, verdict(ok)) for t, w, m, ok in rows]
        data["models"][name] = {
            "sizes": sizes[name],
            "blocks": runs["plain"].example.block_paths,
            "runs": {
                c: {
                    "peak_bytes": r.peak_bytes,
                    "beside_bytes": r.beside_bytes,
                    "budget_bytes": r.budget_bytes,
                    "within_budget": r.within_budget,
                    "median_s": r.median_s,
                    "ratio": r.ratio,
                    "min_ratio": r.min_ratio,
                    "round_ratios": list(r.round_ratios),
                    "measured_overhead_median": _overhead(r),
                    "measured_overhead_spread": _spread(r),
                    "fit_measured_overhead": r.plan.measured_overhead if r.plan else None,
                    "tensors_only": bool(r.info.get("tensors_only")),
                    "paired_vs_hf": r.info.get("paired_vs_hf"),
                    "grad_max_abs_diff": r.grad_diff,
                    "predicted_peak_bytes": r.plan.predicted_peak_bytes if r.plan else None,
                    "predicted_overhead": r.plan.predicted_overhead if r.plan else None,
                    "every_block_predicted_overhead": r.info.get("every_block_predicted_overhead"),
                    "plan_s": r.plan_s,
                    "plan": r.plan.to_json() if r.plan else None,
                    "error": r.error,
                }
                for c, r in runs.items()
            },
            "targets": [dict(target=t, wanted=w, measured=m, met=ok) for t, w, m, ok in rows],
        }
    met = sum(1 for row in summary if row[-1] == verdict(True))
    parts[3:3] = [
        "## Targets",
        f"{met} of {len(summary)} met.",
        markdown_table(["model", "target", "wanted", "measured", "verdict"], summary),
    ]
    parts += [
        "## README rows",
        "Overhead over plain: measured median (min to max over rounds); predicted in brackets.",
        readme_rows(all_runs),
        "## Setup",
        info_block(info),
    ]
    return "\n\n".join(parts), data


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout of every config (default %(default)s: SDPA takes the flash kernel on CPU)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time (default; a quiet machine) or this thread's CPU time (a loaded one; "
        "with --threads 1)",
    )
    # One thread by default: on 2 shared cores, two OpenMP threads of one step wait on
    # each other whenever another process runs, and steps got 3-7x slower and noisy.
    p.set_defaults(threads=1)
    p.add_argument("--tag", default="hf", help="results file name prefix (default %(default)s)")
    args = p.parse_args(argv)
    settle(args)
    import transformers

    transformers.logging.set_verbosity_error()  # config chatter, not results
    warnings.filterwarnings("ignore", message="gradckpt.fit on")  # the use_cache message
    table = QUICK if args.quick else FULL
    sizes = {name: table[name] for name in args.models}
    clock = RunClock.start()
    all_runs = {}
    for name in args.models:
        print(f"{name}: {sizes[name]}", flush=True)
        all_runs[name] = bench_model(name, sizes[name], args)
    info = machine_info(
        transformers=transformers.__version__,
        **{
            lib: sys.modules[lib].__version__
            for lib in ("peft", "diffusers")
            if lib in sys.modules
        },
        models=", ".join(args.models),
        dropout=args.dropout,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        quick=args.quick,
        clock=args.clock,
        **clock.info(),
    )
    md, data = report(all_runs, sizes, info)
    md_path, json_path = write_results(args.out, args.tag, md, data)
    print(md)
    print(f"\nwrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
