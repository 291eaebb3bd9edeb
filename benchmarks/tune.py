"""Tune benchmark: gradckpt.tune's micro-batch and plan against the usual ways to fit a budget.

For the GPT-2, Llama and ViT configs of ``benchmarks/hf_models.py`` (transformers,
random weights, smaller sizes here so that the whole run stays short), AdamW and
a fixed global batch ``G`` (16 samples per optimizer step), at two whole-step
budgets, four contenders train whole optimizer steps (``zero_grad``, ``K = G / b``
micro-batches of forward + backward, each on its own rows of the global batch,
``AdamW.step()``):

* **(a) plain**: no checkpointing, at the largest micro-batch that fits, found
  the way accelerate's ``find_executable_batch_size`` finds it: start at ``G``,
  halve on "out of memory" (here: the measured whole-step peak over the budget);
* **(b) per-layer**: transformers' own checkpointing (every layer one checkpoint,
  ``activation_checkpointing_enable(use_reentrant=False)``, the 5.x name of
  ``gradient_checkpointing_enable``) at the largest micro-batch it fits, found
  the same way;
* **(c) fit**: ``gradckpt.fit(model, loss_fn, budget, optimizer=opt,
  accumulation_steps=K)`` at (a)'s micro-batch;
* **(d) tune**: ``gradckpt.tune(model, make_loss, budget, optimizer=opt,
  global_batch=G)``, then ``result.apply(model)`` at its micro-batch.

The budgets come from the plain whole-step peaks measured at micro-batches 1, 2
and 4: ``loose`` halfway between the peaks at 2 and 4 (plain training fits a
micro-batch of 2), ``tight`` halfway between those at 1 and 2 (plain fits 1).

Whole-step peak: the allocator's high-water (``AllocatorTracker``) over two whole
steps of a fresh model and a fresh AdamW (the first allocates AdamW's state, the
second runs forward and backward with it resident) plus what existed at entry
(``state_bytes``: parameters and buffers). A search trial is those two steps;
its seconds are what it took (under the tracker), so "OOM seconds" are what
finding out cost, the trial's own model build included. Peaks at a micro-batch
do not depend on the budget, so each is measured once per model and both
budgets' searches read them.

Each contender trains its own model built from the same seed (same weights and
batch) with its own AdamW. Times: one whole step per contender in turn (a, b, c,
d, a, b, ...), ``--repeats`` timed rounds after ``--warmup`` rounds; medians with
the least and greatest round. Tune's verdict: per round, the best of (a)-(c)'s
step time (the one with the highest median samples/s) over tune's, the median of
those ratios with a bootstrap 95% interval (``benchmarks.harness.stats.paired_stats``);
the interval holding 1 or lying above it means "not slower".
The verdicts, tables, report and plot are ``benchmarks/tune_report.py``'s.

Usage:
    python -m benchmarks.tune                    # 3 models x 2 budgets (~4 min on 2 CPU cores)
    python -m benchmarks.tune --quick            # tiny sizes, a smoke test
    python -m benchmarks.tune --models gpt2 --device cuda   # the GPU check's stage
    python -m benchmarks.tune --from-json benchmarks/results/tune-cpu-<date>.json
        # re-renders the report and plot; a "notes" list added to the JSON (a reading of
        # the numbers written after the run) becomes its "Notes" section
"""

from __future__ import annotations

import sys
import time
import warnings
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
    clear_grads,
    hardware_slug,
    library_checkpointing,
    machine_info,
    mib,
    read_results,
    release,
    rerun_command,
    results_path,
    settle,
    step_clock,
    sync,
    wall_timed,
    write_results,
)
from benchmarks.tune_report import CONTENDERS, NAMES, PEAK_STEPS, plot, render
from gradckpt.api.budget import resident_bytes
from gradckpt.measure import AllocatorTracker, time_interleaved

MODELS = ("gpt2", "llama", "vit")
# hf_models.py's configs, smaller: a whole step of 16 samples takes about a second on one
# CPU thread, so 3 models x 2 budgets x 4 contenders (and tune itself) fit in minutes.
FULL: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=4, hidden=256, heads=4, seq=128, vocab=4096),
    "llama": dict(layers=4, hidden=256, heads=4, seq=128, vocab=4096),
    "vit": dict(layers=4, hidden=256, heads=4, image=128, patch=16),
}
QUICK: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=2, hidden=32, heads=2, seq=32, vocab=128),
    "llama": dict(layers=2, hidden=32, heads=2, seq=32, vocab=128),
    "vit": dict(layers=2, hidden=32, heads=2, image=32, patch=8),
}
# On a GPU: GPT-2 small's shape (vocab cut to 16k), 1024 tokens a sample.
GPU: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=16384),
    "llama": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=16384),
    "vit": dict(layers=12, hidden=768, heads=12, image=224, patch=16),
}
Rows = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- models and steps


@dataclass
class Setup:
    """What every contender of one model shares."""

    name: str
    sizes: dict[str, Any]
    global_batch: int
    device: str
    seed: int
    lr: float = 1e-4

    def build(self) -> tuple[nn.Module, Rows]:
        """A fresh model (same seed, same weights) and the global batch, on the device."""
        from gradckpt.integrations import hf
        from gradckpt.integrations.hf.zoo import hf_example

        ex = hf_example(self.name, batch=self.global_batch, dropout=0.0, seed=self.seed,
                        **self.sizes)  # fmt: skip
        hf.disable_cache(ex.model)  # as in training
        model = ex.model.to(self.device)
        inputs = {k: v.to(self.device) for k, v in ex.inputs.items()}
        return model, inputs

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr)


def micro_batches(inputs: Rows, b: int) -> list[Rows]:
    """The global batch cut into micro-batches of ``b`` rows (each its own rows)."""
    n = next(iter(inputs.values())).shape[0]
    return [{k: v[i : i + b] for k, v in inputs.items()} for i in range(0, n, b)]


def whole_step(
    model: nn.Module, opt: torch.optim.Optimizer, micro: list[Rows], seed: int
) -> Callable[[], None]:
    """One optimizer step: zero_grad, K micro-batches of forward + backward (loss / K), step."""
    k = len(micro)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        for rows in micro:
            (model(**rows).loss / k).backward()
        opt.step()

    return step


def whole_step_peak(
    model: nn.Module, opt: torch.optim.Optimizer, step: Callable[[], None], device: str
) -> int:
    """Allocator high-water over ``PEAK_STEPS`` whole steps plus what existed at entry; on
    CUDA the caching allocator's reserved high-water when higher (what an OOM sees)."""
    at_entry = resident_bytes(model, opt)
    with AllocatorTracker(device) as allocator:
        for _ in range(PEAK_STEPS):
            step()
    return max(at_entry + allocator.peak_bytes, allocator.reserved_high_water_bytes or 0)


def trial(setup: Setup, strategy: str, b: int) -> dict[str, Any]:
    """One search trial: a fresh model under ``strategy`` at micro-batch ``b``, its peak."""
    started = time.perf_counter()
    model, inputs = setup.build()
    if strategy == "per-layer":
        library_checkpointing(model)
    opt = setup.optimizer(model)
    micro = micro_batches(inputs, b)
    peak = whole_step_peak(model, opt, whole_step(model, opt, micro, setup.seed), setup.device)
    sync(setup.device)
    seconds = time.perf_counter() - started
    del model, opt
    release(setup.device)
    return {"micro_batch": b, "accumulation": len(micro), "peak_bytes": peak, "seconds": seconds}


class Peaks:
    """Whole-step peaks per (strategy, micro-batch), each measured once per model."""

    def __init__(self, setup: Setup, log: Callable[[str], None]) -> None:
        self.setup, self.log = setup, log
        self.done: dict[tuple[str, int], dict[str, Any]] = {}

    def __call__(self, strategy: str, b: int) -> dict[str, Any]:
        if (strategy, b) not in self.done:
            t = trial(self.setup, strategy, b)
            self.done[strategy, b] = t
            self.log(f"  {strategy:<9} micro-batch {b:>3}: whole-step peak "
                     f"{mib(t['peak_bytes'])} MiB ({t['seconds']:.1f} s)")  # fmt: skip
        return self.done[strategy, b]


def find_executable(peaks: Peaks, strategy: str, budget: int, start: int) -> dict[str, Any]:
    """accelerate's ``find_executable_batch_size``: from ``start``, halve while over the budget."""
    trials, b = [], start
    while b >= 1:
        t = {**peaks(strategy, b)}
        t["fits"] = t["peak_bytes"] <= budget
        trials.append(t)
        if t["fits"]:
            break
        b //= 2
    found = trials[-1]["micro_batch"] if trials[-1]["fits"] else None
    ooms = [t for t in trials if not t["fits"]]
    return {
        "micro_batch": found,
        "trials": trials,
        "oom_trials": len(ooms),
        "oom_seconds": sum(t["seconds"] for t in ooms),
    }


# --------------------------------------------------------------------------- contenders


@dataclass
class Contender:
    key: str
    model: nn.Module
    opt: torch.optim.Optimizer
    micro_batch: int
    step: Callable[[], None]
    info: dict[str, Any]


def _plan_text(plan: gradckpt.Plan | None) -> str:
    if plan is None:
        return "no plan"
    from collections import Counter

    modes = Counter(u.mode for u in plan.units)
    segments = sum(isinstance(i, gradckpt.Segment) for i in plan.items)
    text = ", ".join(f"{n} {m}" for m, n in sorted(modes.items()))
    return (text or "nothing") + (f", {segments} segment(s)" if segments else "")


def make_contender(setup: Setup, key: str, b: int | None, budget: int) -> Contender:
    """Build, install and (for c, d) plan one contender; ``b`` is its micro-batch (d: tune's)."""
    from gradckpt.tuning import sliced_loss

    model, inputs = setup.build()
    opt = setup.optimizer(model)
    info: dict[str, Any] = {}
    if key == "b":
        library_checkpointing(model)
    elif key == "c":
        assert b is not None
        micro = micro_batches(inputs, b)
        first = micro[0]
        started = time.perf_counter()
        plan = gradckpt.fit(model, lambda: model(**first).loss, budget, step=gradckpt.StepOptions(optimizer=opt, accumulation_steps=len(micro)))  # fmt: skip
        info.update(fit_seconds=time.perf_counter() - started, plan=_plan_text(plan),
                    predicted_peak_bytes=plan.predicted_peak_bytes)  # fmt: skip
    elif key == "d":
        started = time.perf_counter()
        result = gradckpt.tune(model, sliced_loss(model, inputs), budget, optimizer=opt,
                               global_batch=setup.global_batch)  # fmt: skip
        total = time.perf_counter() - started
        result.apply(model)
        b = result.micro_batch
        chosen = next(c for c in result.candidates if c.verdict == "chosen")
        tune_json = result.to_json()
        tune_json.pop("plan", None)
        info.update(
            tune=tune_json, tune_seconds=total, plan=_plan_text(result.plan),
            strategy=result.strategy, predicted_peak_bytes=result.plan.predicted_peak_bytes,
            predicted_samples_per_s=chosen.predicted_samples_per_s,
            tune_measured_samples_per_s=chosen.measured_samples_per_s,
            planning_seconds=result.planning_seconds, measuring_seconds=result.measuring_seconds,
            table=result.table(),
        )  # fmt: skip
    assert b is not None
    micro = micro_batches(inputs, b)
    return Contender(key, model, opt, b, whole_step(model, opt, micro, setup.seed), info)


def run_row(
    setup: Setup, label: str, budget: int, peaks: Peaks, args: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    """One (model, budget): the searches, the four contenders, their peaks and interleaved times."""
    g = setup.global_batch
    searches = {
        "a": find_executable(peaks, "plain", budget, g),
        "b": find_executable(peaks, "per-layer", budget, g),
    }
    sizes = {"a": searches["a"]["micro_batch"], "b": searches["b"]["micro_batch"]}
    sizes["c"] = sizes["a"]
    row: dict[str, Any] = {
        "model": setup.name, "budget": label, "budget_bytes": budget, "searches": searches,
        "contenders": {},
    }  # fmt: skip
    contenders: dict[str, Contender] = {}
    for key in CONTENDERS:
        if key != "d" and sizes[key] is None:
            row["contenders"][key] = {"error": "no micro-batch fits (even 1 is over the budget)"}
            log(f"  {NAMES[key]}: nothing fits")
            continue
        try:
            c = make_contender(setup, key, sizes.get(key), budget)
        except gradckpt.BudgetError as e:
            row["contenders"][key] = {"error": f"BudgetError: {str(e)[:300]}"}
            log(f"  {NAMES[key]}: {e}")
            continue
        if key in ("a", "b"):  # the search measured this very configuration already
            peak = peaks("plain" if key == "a" else "per-layer", c.micro_batch)["peak_bytes"]
        else:
            peak = whole_step_peak(c.model, c.opt, c.step, setup.device)
        contenders[key] = c
        row["contenders"][key] = {
            "micro_batch": c.micro_batch, "accumulation": g // c.micro_batch,
            "peak_bytes": peak, "within_budget": peak <= budget, **c.info,
        }  # fmt: skip
        extra = ""
        if key == "d":
            extra = (f"; tune {c.info['tune_seconds']:.1f} s (planning "
                     f"{c.info['planning_seconds']:.1f}, measuring "
                     f"{c.info['measuring_seconds']:.1f}), {c.info['strategy']}")  # fmt: skip
        log(f"  {NAMES[key]:<14} micro-batch {c.micro_batch:>3} x {g // c.micro_batch:<3} "
            f"peak {mib(peak)} MiB (budget {mib(budget)}){extra}")  # fmt: skip
    if contenders:
        times, walls = time_contenders(contenders, setup.device, args)
        for key in contenders:
            row["contenders"][key]["times"] = times[key]
            row["contenders"][key]["wall_times"] = walls[key]
    for c in contenders.values():
        clear_grads(c.model)
    del contenders
    release(setup.device)
    return row


def time_contenders(
    contenders: dict[str, Contender], device: str, args: Any
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleaved whole steps: times on ``--clock`` (via ``time_interleaved``) and wall times."""
    walls: dict[str, list[float]] = {k: [] for k in contenders}
    steps = {k: wall_timed(c.step, device, walls[k]) for k, c in contenders.items()}
    timings = time_interleaved(steps, warmup=args.warmup, repeats=args.repeats,
                               sync=device, clock=step_clock(device, args.clock))  # fmt: skip
    times = {k: list(t.times) for k, t in timings.items()}
    return times, {k: w[args.warmup :] for k, w in walls.items()}


def per_sample_times(setup: Setup, sizes: list[int], args: Any) -> dict[str, Any]:
    """Plain forward + backward at each micro-batch, interleaved: does a bigger one pay?"""
    model, inputs = setup.build()
    params = list(model.parameters())
    walls: dict[int, list[float]] = {b: [] for b in sizes}

    def fwd_bwd(b: int) -> Callable[[], None]:
        rows = {k: v[:b] for k, v in inputs.items()}
        timed = wall_timed(lambda: model(**rows).loss.backward(), setup.device, walls[b])

        def run() -> None:
            for p in params:  # listed once: the step is timed
                p.grad = None
            timed()

        return run

    timings = time_interleaved({str(b): fwd_bwd(b) for b in sizes}, warmup=args.warmup,
                               repeats=args.repeats, sync=setup.device,
                               clock=step_clock(setup.device, args.clock))  # fmt: skip
    release(setup.device)
    return {
        str(b): {"times": list(timings[str(b)].times), "wall_times": walls[b][args.warmup :]}
        for b in sizes
    }


def run_model(setup: Setup, args: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """Budgets from the plain peaks at 1, 2 and 4, then both rows and the per-sample table."""
    started = time.perf_counter()
    peaks = Peaks(setup, log)
    plain = {b: peaks("plain", b)["peak_bytes"] for b in (1, 2, 4)}
    budgets = {
        "loose": (plain[2] + plain[4]) // 2,
        "tight": (plain[1] + plain[2]) // 2,
    }
    rows = []
    for label, budget in budgets.items():
        log(f" {setup.name}, budget {label}: {mib(budget)} MiB")
        rows.append(run_row(setup, label, budget, peaks, args, log))
    g = setup.global_batch
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= g and g % b == 0]
    log(f" {setup.name}: plain forward + backward per micro-batch {sizes}")
    table = per_sample_times(setup, sizes, args)
    return {
        "model": setup.name, "sizes": setup.sizes, "rows": rows, "per_sample": table,
        "peaks": {f"{s}@{b}": t for (s, b), t in peaks.done.items()},
        "seconds": time.perf_counter() - started,
    }  # fmt: skip


def write(data: dict[str, Any], out: Path, tag: str) -> tuple[Path, Path]:
    info = data["info"]
    where = hardware_slug(info.get("gpu"))
    png = results_path(out, tag, "png", info["date"], where)
    try:
        out.mkdir(parents=True, exist_ok=True)
        plot(data, png)
        info["plot"] = png.name
    except ImportError:
        info["plot"] = None
    return write_results(out, tag, render(data), data, date=info["date"], where=where)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default 16; quick 8)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="what times a step: this thread's CPU time (default on CPU: the machine "
                        "is shared; tune measures its own steps so) or wall time (default on CUDA)")  # fmt: skip
    p.add_argument("--tag", default="tune", help="results file name prefix (default %(default)s)")
    # One thread: on 2 shared cores two OpenMP threads wait on each other whenever another
    # process runs (benchmarks/hf_models.py), and the CPU clock counts one thread's work only.
    p.set_defaults(threads=1)
    args = p.parse_args(argv)
    settle(args)
    if args.from_json is not None:
        data = read_results(args.from_json)
        md, js = write(data, args.out, args.tag)
        print(render(data))
        print(f"wrote {md} and {js}")
        return 0
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("tune: no CUDA device here")
        return 1
    args.clock = args.clock or ("wall" if cuda else "cpu")
    g = args.global_batch or (8 if args.quick else 16)
    import transformers

    transformers.logging.set_verbosity_error()  # config chatter, not results
    warnings.filterwarnings("ignore", message="gradckpt.fit on")  # the use_cache message
    table = QUICK if args.quick else (GPU if cuda else FULL)
    clock = RunClock.start()
    _warm_up(args.device)
    models = []
    for name in args.models:
        setup = Setup(name, table[name], g, args.device, args.seed)
        print(f"{name}: {setup.sizes}, global batch {g}", flush=True)
        models.append(run_model(setup, args, lambda s: print(s, flush=True)))
    info = machine_info(
        transformers=transformers.__version__, models=", ".join(args.models),
        sizes={m: table[m] for m in args.models}, global_batch=g, lr=Setup.lr,
        device=args.device, gpu=torch.cuda.get_device_name() if cuda else None,
        clock=args.clock, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
        quick=args.quick, optimizer="torch.optim.AdamW (torch defaults otherwise)",
        command=rerun_command("benchmarks.tune", argv), **clock.info(),
    )  # fmt: skip
    data = {"info": info, "models": models}
    md, js = write(data, args.out, args.tag)
    print(render(data))
    print(f"wrote {md} and {js}")
    return 0


def _warm_up(device: str) -> None:
    """One tiny whole step under the tracker: the process's first sets up kernels, the profiler
    and (CUDA) cuBLAS workspaces, which are no contender's memory."""
    setup = Setup("gpt2", QUICK["gpt2"], 2, device, 0)
    trial(setup, "plain", 1)


if __name__ == "__main__":
    raise SystemExit(main())
