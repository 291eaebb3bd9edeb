"""GPU readiness check: predicted peaks against ``torch.cuda.max_memory_allocated``, in one run.

On a CUDA machine, for GPU-sized models (the zoo GPT and U-Net; GPT-2 small, a
Llama-3.2-1B-shaped model and ViT-B/16 from transformers configs when
transformers is installed), it profiles the step, plans it at a few budgets
(the least feasible peak, halfway to the plain peak, 90% of it) and measures
each plan's step at the allocator with :class:`gradckpt.measure.AllocatorTracker`:
on CUDA, stats are reset before the step, and the peak is what
``max_memory_allocated`` shows above what was allocated before it, plus the
parameters and buffers; ``max_memory_reserved`` above the reserved bytes before
is reported beside it. Each plan must fit its budget at the allocator and its
prediction must be within 5% of the measured peak (the report also gives the
median error; the target is 2%).

What the prediction models of the CUDA caching allocator: every tensor storage
and every kernel workspace (measured per op in the profile from the
allocator's own events) is counted as the block the allocator hands out, its
size rounded up to a multiple of 512 bytes. Not modelled: fragmentation and
the 2 MiB / 20 MiB segments blocks are carved from (they make *reserved*
exceed *allocated*; reported, not predicted), ``expandable_segments`` (changes
reserved, not allocated), ``roundup_power2_divisions`` (further rounding of
large blocks, off by default), and memory other libraries allocate outside
torch's allocator (NCCL buffers, the CUDA context). Then it runs the frontier benchmark (``benchmarks/frontier.py``'s
``run_model``) and the Hugging Face benchmark (``benchmarks/hf_models.py``) at GPU
sizes while time is left (``--time-limit``, default 7 minutes), the short-op engine
rows (``benchmarks/shortops_gpu.py``: torch per block and SAC against gradckpt per
block, selective and ``fit``, eagerly and as CUDA graphs where torch can capture
them), and the offload
contenders (``benchmarks/offload_gpu.py``: gradckpt with offload, full
checkpointing, offload-everything + full checkpointing) side by side, and
last the compiled benchmark (``benchmarks/compiled.py --device cuda``: the
compiler's ``activation_memory_budget`` at 1/0.7 against gradckpt's knob and
saved-bytes rows on Llama, each compiled from scratch in its own process) when
more than 5 minutes are left (``--time-limit 720`` leaves it room; or run
``python -m benchmarks.compiled`` with the arguments of ``compiled_arguments``),
and the tune benchmark's GPT-2 rows (``benchmarks/tune.py --models gpt2 --device
cuda``: ``gradckpt.tune`` against plain, per-layer checkpointing and ``fit`` at
the largest micro-batches that fit two whole-step budgets) when more than 2
minutes are left.

Writes ``benchmarks/results/gpu-check-<gpu>-<date>.md`` (and ``.json``).

Without CUDA it exits at once with one line. ``--cpu-dry-run`` runs the same code
on CPU at tiny sizes, with the CPU allocator's peak (torch's profiler memory
events) in place of the CUDA counters (which are never read without CUDA).

Usage:
    python benchmarks/gpu_check.py                 # on a CUDA machine (< 8 minutes)
    python benchmarks/gpu_check.py --cpu-dry-run   # the same code path on CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
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
    RESULTS,
    MiB,
    clear_grads,
    hardware_slug,
    info_block,
    release,
    results_path,
    unknown_models,
)
from gradckpt.measure import AllocatorTracker, MemoryTracker, state_bytes

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.05  # predicted peak within 5% of the measured one (DESIGN.md's target)

# name -> (GPU sizes, dry-run sizes) for the zoo models
ZOO = {
    "gpt": (
        dict(layers=12, d_model=768, heads=12, seq=1024, vocab=16384, batch=8, dropout=0.1),
        dict(layers=3, d_model=32, heads=2, seq=32, vocab=128, batch=2, dropout=0.1),
    ),
    "unet": (dict(depth=4, base=64, image=256, batch=8), dict(depth=2, base=8, image=32, batch=2)),
}
FRONTIER_GPU = {
    "gpt": dict(layers=12, d_model=1024, heads=16, seq=1024, vocab=8192, batch=8, dropout=0.0),
    "unet": dict(depth=4, base=64, image=256, batch=8),
}
FRONTIER_DRY = {"gpt": dict(layers=3, d_model=32, heads=2, seq=32, vocab=128, batch=2, dropout=0.0)}

Step = Callable[[], Any]
LossFn = Callable[[], torch.Tensor]


# --------------------------------------------------------------------------- models


def _hf(kind: str, tiny: bool, device: str) -> tuple[nn.Module, LossFn]:
    import transformers

    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        config = transformers.GPT2Config(**(dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256)
                                            if tiny else {}))  # fmt: skip
        cls, shape = transformers.GPT2LMHeadModel, (2, 32) if tiny else (8, 1024)
    elif kind == "llama":
        config = transformers.LlamaConfig(
            **(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
               if tiny else
               dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    rope_theta=500000.0, tie_word_embeddings=True)),
        )  # fmt: skip
        cls, shape = transformers.LlamaForCausalLM, (2, 32) if tiny else (2, 1024)
    else:
        config = transformers.ViTConfig(**(dict(hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=128,
                                                image_size=32, patch_size=8) if tiny else {}))  # fmt: skip
        cls, shape = transformers.ViTForImageClassification, (2 if tiny else 32,)
    config.use_cache = False
    with torch.device(device):
        model = cls(config).train()

    def loss_fn() -> torch.Tensor:
        on = next(model.parameters()).device
        if kind == "vit":
            size = config.image_size
            pixels = torch.randn(shape[0], 3, size, size, device=on)
            labels = torch.randint(0, config.num_labels, (shape[0],), device=on)
            return model(pixel_values=pixels, labels=labels).loss
        ids = torch.randint(0, config.vocab_size, shape, device=on)
        return model(input_ids=ids, labels=ids).loss

    return model, loss_fn


def models(dry: bool, device: str) -> dict[str, Callable[[], tuple[nn.Module, LossFn]]]:
    from gradckpt.testing import make

    out: dict[str, Callable[[], tuple[nn.Module, LossFn]]] = {}
    for name, (gpu, tiny) in ZOO.items():
        sizes = tiny if dry else gpu

        def build(name=name, sizes=sizes):
            ex = make(name, device=device, **sizes)
            return ex.model, ex.loss_fn

        out[f"zoo-{name}"] = build
    try:
        import transformers  # noqa: F401
    except ImportError:
        return out
    for kind in ("gpt2", "llama", "vit"):
        out[f"hf-{kind}"] = lambda kind=kind: _hf(kind, dry, device)
    return out


# --------------------------------------------------------------------------- measuring


def allocator_peak(model: nn.Module, step: Step, device: str) -> tuple[int, int | None]:
    """Parameters and buffers plus the allocator's peak above what it held before the step,
    and (CUDA) the peak of reserved bytes above those reserved before (None on CPU)."""
    clear_grads(model)
    with AllocatorTracker(device) as allocator:
        step()
    clear_grads(model)
    reserved = allocator.reserved_peak_bytes
    return state_bytes(model) + allocator.peak_bytes, reserved


def tracker_peak(model: nn.Module, step: Step) -> int:
    """The same quantity from the live-storage tracker (CPU, or a cross-check on CUDA)."""
    clear_grads(model)
    with MemoryTracker(model) as tracker:
        step()
    clear_grads(model)
    return tracker.peak_bytes


def check_model(name: str, build: Callable, dry: bool, log: Callable[[str], None]) -> dict:
    """Profile, plan at three budgets, and measure the plain step and each plan."""
    t0 = time.perf_counter()
    model, loss_fn = build()

    def step() -> None:
        torch.manual_seed(0)
        loss_fn().backward()

    prof = gradckpt.profile(model, loss_fn, repeats=2)
    plain = prof.measured_peak_bytes
    planner = gradckpt.Planner(prof)
    least = planner.least_peak()[1].peak_bytes
    budgets = {"least": least, "halfway": (least + plain) // 2, "90%": int(0.9 * plain)}
    budgets = {k: b for k, b in budgets.items() if k == "least" or b > least}  # all reachable
    step()  # warm-up: lazily allocated workspaces (cuBLAS) exist before any measurement
    clear_grads(model)
    rows = []
    contenders: list[tuple[str, int | None, gradckpt.Plan | None]] = [("plain", None, None)]
    for label, budget in budgets.items():
        try:
            contenders.append((label, budget, planner.plan(budget)))
        except gradckpt.BudgetError as e:
            rows.append({"budget_label": label, "budget_bytes": budget, "error": str(e)[:200]})
    for label, budget, plan in contenders:
        if plan is not None:
            gradckpt.apply(model, plan)
        try:
            predicted = plan.predicted_peak_bytes if plan is not None else plain
            measured, reserved = allocator_peak(model, step, "cpu" if dry else "cuda")
            tracked = tracker_peak(model, step)
        finally:
            gradckpt.remove(model)
        error = (predicted - measured) / measured
        fits = budget is None or measured <= budget
        rows.append({
            "budget_label": label, "budget_bytes": budget,
            "plan": _describe(plan) if plan is not None else "no checkpointing",
            "predicted_bytes": predicted, "measured_bytes": measured, "tracker_bytes": tracked,
            "reserved_bytes": None if reserved is None else state_bytes(model) + reserved,
            "error": error, "fits_budget": fits,
            "ok": fits and abs(error) <= TOLERANCE,
        })  # fmt: skip
        log(f"  {name} {label:<8} predicted {predicted / MiB:10.1f} MiB, measured "
            f"{measured / MiB:10.1f} MiB ({error:+.1%}), tracker {tracked / MiB:10.1f} MiB"
            f"{'' if fits else ', OVER BUDGET'}")  # fmt: skip
    del model
    return {"model": name, "params": prof.param_bytes, "plain_peak_profiled": plain,
            "peak_level": prof.peak_level, "plain_tracker_peak_profiled": prof.tracker_peak_bytes,
            "blocks": len(prof.blocks), "rows": rows,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def _describe(plan: gradckpt.Plan) -> str:
    from gradckpt.planning.plans.plan import Segment

    modes = [u.mode for u in plan.units]
    parts = [f"{modes.count(m)} {m}" for m in ("recompute", "selective") if modes.count(m)]
    segments = sum(isinstance(i, Segment) for i in plan.items)
    parts += [f"{segments} segment(s)"] if segments else []
    return ", ".join(parts) or "all kept"


# --------------------------------------------------------------------------- benchmarks


def run_frontier(dry: bool, device: str, log: Callable[[str], None]) -> list[dict]:
    """``benchmarks/frontier.py``'s ``run_model`` at GPU sizes (tiny in a dry run)."""
    from benchmarks import frontier

    args = argparse.Namespace(profile_repeats=2, warmup=1, repeats=2 if dry else 5, seed=0)
    out = []
    for name, sizes in (FRONTIER_DRY if dry else FRONTIER_GPU).items():
        result = frontier.run_model(name, {**sizes, "device": device}, args, log=log)
        out.append({"model": name, "budgets": result["budgets"]})
    return out


def _run_script(
    name: str, args: list[str], outdir: Path, timeout: float, log: Callable[[str], None]
) -> str:
    """Run one benchmark script (``python -m benchmarks.<name>``) within ``timeout``; its status."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    log(f"  running {' '.join(cmd[1:])} (timeout {timeout:.0f} s)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1),
                              cwd=HERE.parent)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{name}.py did not finish in {timeout:.0f} s: stopped"
    if proc.returncode != 0:
        return f"{name}.py failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return f"{name}.py: done, results in {outdir}"


def run_hf_benchmark(dry: bool, outdir: Path, timeout: float, log: Callable[[str], None]) -> str:
    if not (HERE / "hf_models.py").is_file():
        return "benchmarks/hf_models.py is missing: skipped"
    args = ["--out", str(outdir)] + (["--quick"] if dry else [])
    return _run_script("hf_models", args, outdir, timeout, log)


def compiled_arguments(dry: bool, outdir: Path) -> list[str]:
    """``benchmarks/compiled.py``'s arguments for this check: Llama at the compiler's two points
    that tie within the CPU's process noise (amb 1.0 and 0.7), its twin, and gradckpt's rows
    nearest them (the default partition driven in bytes, the saved-bytes caps)."""
    args = ["--out", str(outdir), "--models", "llama"]
    if dry:
        return [*args, "--quick", "--kinds", "compiler", "knob", "bytes"]
    return [*args, "--device", "cuda", "--kinds", "compiler", "twin", "knob", "bytes",
                   "--budgets", "1", "0.7", "--knobs", "1", "--saved", "0.7",
                   "--warmup", "3", "--repeats", "15"]  # fmt: skip


def run_compiled_benchmark(
    dry: bool, outdir: Path, timeout: float, log: Callable[[str], None]
) -> str:
    """torch.compile's knob against gradckpt's saved-bytes rows at GPU sizes (issue 13)."""
    # A few contenders only: each compiles from scratch (about a minute), and the GPU run
    # must leave time for the other stages. Llama, as its amb 1.0/0.7 verdicts flip between
    # CPU runs (compiled-llama-3-processes-cpu-2026-12-01.md); GPT-2 holds on the CPU.
    return _run_script("compiled", compiled_arguments(dry, outdir), outdir, timeout, log)


def tune_arguments(dry: bool, outdir: Path) -> list[str]:
    """``benchmarks/tune.py``'s arguments for this check: its GPT-2 rows (both budgets) on the
    GPU at GPT-2 small's shape; in a dry run its quick sizes on the CPU."""
    args = ["--out", str(outdir), "--models", "gpt2"]
    return [*args, "--quick"] if dry else [*args, "--device", "cuda"]


def run_tune_benchmark(dry: bool, outdir: Path, timeout: float, log: Callable[[str], None]) -> str:
    """gradckpt.tune against plain, per-layer and fit at their largest micro-batches (GPT-2)."""
    return _run_script("tune", tune_arguments(dry, outdir), outdir, timeout, log)


def _log(line: str) -> None:
    print(line, flush=True)


@dataclass(frozen=True)
class BenchmarkRun:
    """What every benchmark stage is run with."""

    dry: bool
    device: str
    outdir: Path
    seconds_left: float


@dataclass(frozen=True)
class Benchmark:
    """One benchmark run after the prediction checks, when enough time is left.

    ``result`` names where its output goes: ``"frontier"`` and ``"offload"`` are
    report sections, ``"note"`` a line of the report's notes.
    """

    title: str  # how the report's notes name it
    min_seconds_left: float  # it starts only with more than this left of --time-limit
    result: str
    run: Callable[[BenchmarkRun], Any]


def _frontier_stage(ctx: BenchmarkRun) -> list[dict]:
    return run_frontier(ctx.dry, ctx.device, _log)


def _offload_stage(ctx: BenchmarkRun) -> dict:
    from benchmarks.offload_gpu import run_offload_contenders

    return run_offload_contenders(ctx.dry, ctx.device, _log)


def _hf_stage(ctx: BenchmarkRun) -> str:
    return run_hf_benchmark(ctx.dry, ctx.outdir, ctx.seconds_left, print)


def _whole_step_stage(ctx: BenchmarkRun) -> str:
    from benchmarks.gpu_whole_step import run_whole_step_check

    return run_whole_step_check(ctx.dry, ctx.device, _log)


def _compiled_stage(ctx: BenchmarkRun) -> str:
    return run_compiled_benchmark(ctx.dry, ctx.outdir, ctx.seconds_left, print)


def _tune_stage(ctx: BenchmarkRun) -> str:
    return run_tune_benchmark(ctx.dry, ctx.outdir, ctx.seconds_left, print)


def _shortops_stage(ctx: BenchmarkRun) -> dict:
    from benchmarks.shortops_gpu import run_shortops

    return run_shortops(ctx.dry, ctx.device, _log)


# In the order they run (and their notes appear).
BENCHMARKS = (
    Benchmark("whole-step budget", 60, "note", _whole_step_stage),
    Benchmark("short-op engine rows", 60, "shortops", _shortops_stage),
    Benchmark("frontier benchmark", 60, "frontier", _frontier_stage),
    Benchmark("offload contenders", 60, "offload", _offload_stage),
    Benchmark("hf_models benchmark", 30, "note", _hf_stage),
    Benchmark("tune benchmark", 120, "note", _tune_stage),
    Benchmark("compiled benchmark", 300, "note", _compiled_stage),
)


def run_benchmarks(
    dry: bool, device: str, outdir: Path, seconds_left: Callable[[], float], notes: list[str]
) -> dict[str, Any]:
    """Each of :data:`BENCHMARKS` that time allows; ``{result: output}``, and lines added to ``notes``.

    A benchmark that fails adds a note instead of stopping the others.

    Example:
        >>> run_benchmarks(True, "cpu", Path("out"), lambda: 0.0, notes)
        {}
        >>> notes[0]
        'frontier benchmark: skipped, out of time'
    """
    results: dict[str, Any] = {}
    for bench in BENCHMARKS:
        left = seconds_left()
        if left <= bench.min_seconds_left:
            notes.append(f"{bench.title}: skipped, out of time")
            continue
        try:
            output = bench.run(BenchmarkRun(dry, device, outdir, left))
        except Exception as e:  # one benchmark's failure must not hide the others' results
            notes.append(f"{bench.title} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        if bench.result == "note":
            notes.append(output)
        else:
            results[bench.result] = output
    return results


# --------------------------------------------------------------------------- report


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def report(
    gpu: str, checks: list[dict], frontier: list[dict], notes: list[str], info: dict,
    offload: dict | None = None, shortops: dict | None = None,
) -> str:  # fmt: skip
    lines = [
        f"# gradckpt GPU check: {gpu} ({info['date']})",
        "",
        "Predicted peak (`simulate`) against the allocator's measured peak: parameters and "
        "buffers plus "
        + ("the CPU allocator's peak above its level before the step, from torch's profiler "
           "memory events (CPU dry run)" if info["dry_run"] else
           "`torch.cuda.max_memory_allocated()` above `memory_allocated()` before the step "
           "(stats reset before each step, after a warm-up step); reserved: "
           "`max_memory_reserved()` above `memory_reserved()` before, plus parameters")
        + ". Tracker: the tensor-level peak (`MemoryTracker`), without kernel workspaces. "
        f"A row passes when the plan fits its budget at the allocator and the prediction is "
        f"within {TOLERANCE:.0%}.",
        "",
        "| model | budget | budget (MiB) | plan | predicted (MiB) | measured (MiB) | tracker (MiB) "
        "| reserved (MiB) | error | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for check in checks:
        for r in check["rows"]:
            if "error" in r and isinstance(r["error"], str):
                lines.append(f"| {check['model']} | {r['budget_label']} | "
                             f"{_mib(r['budget_bytes'])} | no plan: {r['error'][:80]} "
                             "| - | - | - | - | - | **missed** |")  # fmt: skip
                continue
            lines.append(
                f"| {check['model']} | {r['budget_label']} | {_mib(r['budget_bytes'])} | "
                f"{r['plan']} | {_mib(r['predicted_bytes'])} | {_mib(r['measured_bytes'])} | "
                f"{_mib(r['tracker_bytes'])} | {_mib(r.get('reserved_bytes'))} | "
                f"{r['error']:+.1%} | "
                f"{'**met**' if r['ok'] else '**missed**'} |"
            )
    if frontier:
        lines += ["", "## Frontier benchmark at these sizes (`benchmarks/frontier.py`)", "",
                  "| model | budget | budget (MiB) | gradckpt peak (MiB) | predicted (MiB) | "
                  "time / plain | best fitting baseline |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for f in frontier:
            for b in f["budgets"]:
                ratio = b.get("gradckpt_ratio")
                lines.append(
                    f"| {f['model']} | {b['label']} | {_mib(b['budget_bytes'])} | "
                    f"{_mib(b.get('gradckpt_peak'))} | {_mib(b.get('gradckpt_predicted_peak'))} | "
                    f"{'-' if ratio is None else f'{ratio:.3f}'} | {b.get('best_baseline') or '-'} |"
                )
    if offload:
        from benchmarks.offload_gpu import report_lines

        lines += report_lines(offload)
    if shortops:
        from benchmarks.shortops_gpu import report_lines as shortops_lines

        lines += shortops_lines(shortops)
    lines += ["", "## Notes", "", *(f"- {n}" for n in notes), "", "## Setup", ""]
    lines.append(info_block(info))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the same code on CPU at tiny sizes (MemoryTracker for the counters)",
    )
    p.add_argument(
        "--out", type=Path, default=RESULTS, help="results folder (default: %(default)s)"
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=420.0,
        help="seconds after which no new model or benchmark starts (default: 420)",
    )
    p.add_argument(
        "--skip-benchmarks",
        action="store_true",
        help="only the prediction check (not frontier.py / hf_models.py)",
    )
    p.add_argument("--models", default=None, help="comma-separated subset of the checked models")
    args = p.parse_args(argv)  # fmt: skip
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here, nothing to check (--cpu-dry-run runs the same "
              "code on CPU)")  # fmt: skip
        return 0
    started = time.perf_counter()
    device = "cpu" if dry else "cuda"
    gpu = "cpu-dry-run" if dry else torch.cuda.get_device_name()
    slug = hardware_slug(gpu)
    date = datetime.date.today().isoformat()
    notes: list[str] = []

    def left() -> float:
        return args.time_limit - (time.perf_counter() - started)

    checks = []
    chosen = models(dry, device)
    if args.models:
        wanted = [m.strip() for m in args.models.split(",")]
        if error := unknown_models(wanted, chosen):
            p.error(error)
        chosen = {m: chosen[m] for m in wanted}
    if not any(name.startswith("hf-") for name in chosen) and not args.models:
        notes.append("transformers is not installed: the Hugging Face models were skipped")
    for name, build in chosen.items():
        if left() <= 0:
            notes.append(f"{name}: skipped, out of time")
            continue
        print(f"{name}: profiling and measuring", flush=True)
        try:
            checks.append(check_model(name, build, dry, print))
        except Exception as e:  # one model's failure must not hide the others' results
            notes.append(f"{name}: failed with {type(e).__name__}: {str(e)[:300]}")
            print(f"  {name} failed: {type(e).__name__}: {e}", flush=True)
        release(device)  # CUDA: the next model starts with the cache emptied
    benchmarks = {} if args.skip_benchmarks else run_benchmarks(dry, device, args.out, left, notes)
    frontier: list[dict] = benchmarks.get("frontier", [])
    offload: dict | None = benchmarks.get("offload")
    shortops: dict | None = benchmarks.get("shortops")
    rows = [r for c in checks for r in c["rows"]]
    passed = sum(bool(r.get("ok")) for r in rows)
    notes.insert(0, f"{passed}/{len(rows)} rows met the target")
    errors = sorted(abs(r["error"]) for r in rows if isinstance(r.get("error"), float))
    if errors:
        notes.insert(1, f"prediction error: median {errors[len(errors) // 2]:.2%}, max "
                        f"{errors[-1]:.2%} (targets 2% / 5%)")  # fmt: skip
    if not dry:
        notes.append(
            "modelled: every storage and kernel workspace as a caching-allocator block (rounded "
            "up to 512 B); not modelled: fragmentation and segment sizes (reserved > "
            "allocated), expandable_segments, roundup_power2_divisions, memory outside "
            "torch's allocator"
        )
    info = {
        "date": date, "gpu": gpu, "dry_run": dry, "torch": torch.__version__,
        "cuda": torch.version.cuda, "gradckpt": gradckpt.__version__,
        "wall_time_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    md = results_path(args.out, "gpu-check", "md", date, slug)
    md.write_text(report(gpu, checks, frontier, notes, info, offload, shortops))
    md.with_suffix(".json").write_text(json.dumps(
        {"info": info, "checks": checks, "frontier": frontier, "offload": offload,
         "shortops": shortops, "notes": notes}, indent=1, default=str))  # fmt: skip
    print(f"{passed}/{len(rows)} rows met the target; wrote {md}")
    return 0 if passed == len(rows) and rows else 1


if __name__ == "__main__":
    sys.exit(main())
