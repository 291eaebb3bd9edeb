"""Compiled benchmark: torch.compile's own activation_memory_budget against gradckpt's plan run by the compiler.

Per model (HF GPT-2 and Llama from ``gradckpt.integrations.hf.zoo``, the
U-Net from ``gradckpt.testing``), contenders:

* ``eager``: no plan, not compiled (the reference for the ratios);
* ``compile amb=F``: ``model.compile()`` with
  ``torch._functorch.config.activation_memory_budget = F`` (1.0 is the
  default), F in 1.0/0.7/0.5/0.3/0.1/0.0;
* ``gradckpt F``: a gradckpt plan (segments allowed) at F of the eager peak, then
  ``gradckpt.compile`` (the plan inside the compiled graph);
* ``gradckpt fused F``: the same, planned on the fused view of the profile
  (``compiled.budget.fused_profile``: ops without FLOPs cost no time, as the
  compiler fuses them), which keeps matmuls and recomputes pointwise ops;
* ``gradckpt knob amb=F``: the compiler's partitioner as ``fit_compiled``
  drives it: in bytes, measured, chosen from the table (never over,
  monotone); at 1.0 (its default partition, one of ``fit_compiled``'s
  candidates, in its own processes) and at budgets between the compiler
  rows' (0.8/0.6/0.4);
* ``gradckpt bytes F``: the compiler's partitioner held by gradckpt's knapsack
  solver (``compiled.knapsack.SavedBytesSolver``) to saving at most
  F of the bytes its default saves, chosen on the compiled graph itself;
* ``gradckpt bytes <=amb=F``: the same solver capped at the bytes the compiler's
  own knob F saves for the same graph: it saves no more and recomputes no more
  FLOPs than the compiler's answer at F (where that answer is the cheapest that
  fits, it *is* the compiler's partition, and the two rows tie);
* ``twin amb=F``: a compiler point run again in a second process, to measure
  the timing noise that stays with a process (never counted as gradckpt's).

Two verdict tables per model: gradckpt's plans alone (``gradckpt`` and
``gradckpt fused`` rows), and gradckpt's whole candidate set (plans, the knob
driven in bytes and the saved-bytes solver: what ``fit_compiled`` chooses from).
``--kinds`` runs a subset.

Every contender lives in its own worker process (the compiler's config is
process-wide and Dynamo's caches are shared by same-class models), or in
``--processes K`` of them (its time in a round is then the median of its K
workers' steps, which shrinks the noise that stays with a process), compiled
from scratch into its own empty inductor cache (``--shared-cache`` to share
them: see ``_compile_cache`` for why not) and warmed there; its peak is the allocator bytes one training step adds
(``gradckpt.measure.AllocatorTracker``: what the step's allocator adds above
its level before the step). Times: the coordinator asks the workers for
one step each, in a new shuffled order every round (interleaved; a short gap
lets the last worker's threads go idle), and reports medians. Verdicts pair
the rounds (``benchmarks.compiled_report``).

Usage:
    python -m benchmarks.compiled                         # full sizes, inductor
    python -m benchmarks.compiled --models gpt2 --threads 2
    python -m benchmarks.compiled --small                 # 4 layers, d=128 (shorter)
    python -m benchmarks.compiled --quick                 # smoke test (aot_eager, tiny)
    python -m benchmarks.compiled --device cuda --models gpt2 --budgets 1 0.5 0.1 --saved 0.55
    python -m benchmarks.compiled --models llama --processes 3 --budgets 1 0.7 --knobs 1
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.compiled_report import OURS_ALL, plot, report, verdicts
from benchmarks.harness import (
    RunClock,
    base_parser,
    hardware_slug,
    load_note,
    machine_info,
    mib,
    pooled,
    read_results,
    settle,
    write_results,
)

MODELS = ("gpt2", "llama", "unet")
KINDS = ("compiler", "twin", "gradckpt", "knob", "bytes")
_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"  # inductor's FX graph, AOTAutograd and C++ caches
# A worker at the full sizes takes up to about 0.9 GiB; one is not started below this.
MIN_AVAILABLE_MIB = 1536
# Between two workers' steps: the last one's OpenMP threads stop spinning before the next starts.
GAP_S = 0.05
FULL: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=8, hidden=256, heads=4, seq=256, batch=4, vocab=4096),
    "llama": dict(layers=8, hidden=256, heads=4, seq=256, batch=4, vocab=4096),
    "unet": dict(depth=3, base=16, image=64, batch=4),
}
# A shorter run (about 15 min on a loaded 2-core machine): 4 layers, d=128, T=128.
SMALL: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=4, hidden=128, heads=4, seq=128, batch=4, vocab=2048),
    "llama": dict(layers=4, hidden=128, heads=4, seq=128, batch=4, vocab=2048),
    "unet": dict(depth=3, base=16, image=64, batch=2),
}
# --device cuda: GPT-2 small's width, 8 layers; batch 4, as every worker's caching allocator
# keeps up to its own peak reserved on the one GPU.
GPU: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=8, hidden=768, heads=12, seq=1024, batch=4, vocab=16384),
    "llama": dict(layers=8, hidden=768, heads=12, seq=1024, batch=4, vocab=16384),
    "unet": dict(depth=4, base=64, image=256, batch=4),
}
QUICK: dict[str, dict[str, Any]] = {
    "gpt2": dict(layers=2, hidden=32, heads=2, seq=32, batch=2, vocab=128),
    "llama": dict(layers=2, hidden=32, heads=2, seq=32, batch=2, vocab=128),
    "unet": dict(depth=2, base=4, image=16, batch=2),
}
COMPILER_BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)
PLAN_FRACTIONS = (0.8, 0.6, 0.45, 0.3)
FUSED_FRACTIONS = (0.9, 0.8, 0.7)
KNOB_BUDGETS = (1.0, 0.8, 0.6, 0.4)
SAVED_FRACTIONS = (0.8, 0.7, 0.65, 0.6, 0.55, 0.5)
QUICK_COMPILER_BUDGETS = (1.0, 0.0)
QUICK_PLAN_FRACTIONS = (0.9,)
QUICK_FUSED_FRACTIONS = (0.9,)
QUICK_KNOB_BUDGETS = (0.5,)
QUICK_SAVED_FRACTIONS = (0.5,)


def _sizes(args: Any) -> dict[str, dict[str, Any]]:
    if args.quick:
        return QUICK
    if args.small:
        return SMALL
    return GPU if args.device == "cuda" else FULL


def _example(model: str, sizes: dict[str, Any], device: str = "cpu") -> Any:
    if model == "unet":
        from gradckpt.testing import make

        return make("unet", device=device, **sizes)
    from gradckpt.integrations.hf import disable_cache
    from gradckpt.integrations.hf.zoo import hf_example

    ex = hf_example(model, **sizes)
    disable_cache(ex.model)  # training: no KV cache, for every contender (as gradckpt.fit does)
    if device != "cpu":  # loss_fn reads ex.inputs, so moving its tensors moves the batch
        ex.model.to(device)
        for key, value in ex.inputs.items():
            ex.inputs[key] = value.to(device)
    return ex


def _worker(conn: Any, model: str, sizes: dict, spec: dict, threads: int) -> None:
    """One contender: build, install, compile, warm, measure the peak; then step on request."""
    torch.set_num_threads(threads)
    device = spec.get("device", "cpu")
    import gradckpt
    from gradckpt.measure import AllocatorTracker

    solver = None
    try:
        ex = _example(model, sizes, device)
        if spec["kind"] in ("compiler", "twin", "knob"):
            import torch._functorch.config as functorch_config

            functorch_config.activation_memory_budget = spec["budget"]
            ex.model.compile(backend=spec["backend"])
        elif spec["kind"] == "bytes":
            import torch._functorch.config as functorch_config

            from gradckpt.compiled.knapsack import (
                SavedBytesSolver,
                saved_bytes_config,
            )

            # Set for the worker's life: the partitioner runs at the first step.
            solver = SavedBytesSolver(spec.get("fraction"), knob=spec.get("knob"))
            for key, value in saved_bytes_config(solver).items():
                setattr(functorch_config, key, value)
            ex.model.compile(backend=spec["backend"])
        elif spec["kind"] == "gradckpt":
            gradckpt.apply(ex.model, gradckpt.Plan.load(spec["plan"]))
            gradckpt.compile(ex.model, ex.loss_fn, backend=spec["backend"])

        def step() -> float:
            ex.model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            loss = ex.loss_fn()
            loss.backward()
            if device == "cuda":  # the step's kernels are queued: wait for them before the clock
                torch.cuda.synchronize()
            return float(loss.detach())

        started = time.perf_counter()
        loss = step()
        first = time.perf_counter() - started
        step()
        ex.model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with AllocatorTracker(device) as measured:
            ex.loss_fn().backward()
        chosen = [c._asdict() for c in solver.chosen] if solver is not None else None
        conn.send(dict(peak=measured.peak_bytes, method=measured.method, first_s=first, loss=loss,
                       **({"partitions": chosen} if chosen is not None else {})))  # fmt: skip
        while conn.recv() == "step":
            started = time.perf_counter()
            step()
            conn.send(time.perf_counter() - started)
    except Exception as exc:  # reported by the coordinator, which goes on with the others
        conn.send(dict(error=f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _plans(
    model: str, sizes: dict, fractions: tuple, fused: tuple, folder: Path, device: str
) -> dict[str, str]:
    """gradckpt plans (segments allowed) at each fraction of the eager peak, saved for the workers.

    ``fused`` fractions plan on the fused view of the profile; a plan equal to
    one already listed is not repeated.
    """
    import gradckpt
    from gradckpt.compiled.budget import fused_profile
    from gradckpt.planning.solve import solve
    from gradckpt.planning.solving.budget import parse_budget

    ex = _example(model, sizes, device)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    paths: dict[str, str] = {}
    seen: list = []
    for name, view, chosen in (("gradckpt", prof, fractions),
                               ("gradckpt fused", fused_profile(prof), fused)):  # fmt: skip
        for fraction in chosen:
            try:
                budget = parse_budget(fraction, prof.measured_peak_bytes)
                plan = solve(view, budget, "dp", segments=True)
            except gradckpt.BudgetError:
                continue
            if plan.items in seen:
                continue
            seen.append(plan.items)
            path = folder / f"{model}-{name.replace(' ', '-')}-{fraction:g}.json"
            plan.save(path)
            paths[f"{name} {fraction:g}"] = str(path)
    return paths


@contextlib.contextmanager
def _compile_cache(folder: Path | None) -> Iterator[None]:
    """Processes started inside compile into ``folder``'s empty caches (None: the shared ones).

    Why: a process's history stays with it. One that compiled its code tends
    to step slower than one that loaded the same code from a warm cache
    (GPT-2 at amb 0.5, inductor, ``benchmarks/compiled_cache_probe.py``: x0.997,
    x1.015 and x1.018 in ``compiled-cache-probe-cpu-2026-12-01.md``, x1.018,
    x1.048 and x1.032 in three earlier probes; two cache-loaded processes read
    x0.986-x1.019). With shared caches, contenders started later load what
    earlier ones compiled (the knob-matched rows reuse the compiler's own
    kernels), which may flatter them by about that much. Each with its own
    empty cache, every contender compiles from scratch, as on a fresh machine.
    """
    if folder is None:
        yield
        return
    before = os.environ.get(_CACHE_VARIABLE)
    os.environ[_CACHE_VARIABLE] = str(folder)  # the spawned child inherits it at start
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_CACHE_VARIABLE)
        else:
            os.environ[_CACHE_VARIABLE] = before


def start_worker(
    ctx: Any, model: str, sizes: dict, spec: dict, threads: int, cache: Path | None
) -> tuple[Any, Any, dict[str, Any]]:
    """Start one contender's worker (compiling into ``cache``; None: the shared caches) and
    wait for its first report: ``(connection, process, report)``; a failed one is joined."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, model, sizes, spec, threads))
    with _compile_cache(cache):
        proc.start()
    child.close()  # a worker that dies then reads as EOF here, not as a hang
    try:
        first = parent.recv()
    except EOFError:
        first = dict(error=f"worker exited with code {proc.join() or proc.exitcode}")
    if "error" in first:
        proc.join()
    return parent, proc, first


def timed_rounds(conns: dict[str, Any], warmup: int, repeats: int, seed: int) -> dict[str, list]:
    """Step every worker once per round, in a new shuffled order each round; the step times of
    the ``repeats`` rounds after ``warmup``, per worker (the i-th entries share a round).

    Why shuffled: a worker is not always stepped right after the same neighbour (whose
    threads may still be busy), so no order bias persists.

    A worker that dies (killed for memory, say) keeps the times it had and is
    stepped no more, so the others' rounds still count.
    """
    times: dict[str, list[float]] = {label: [] for label in conns}
    alive = dict(conns)
    shuffle = random.Random(seed)
    for round_ in range(warmup + repeats):
        order = list(alive)
        shuffle.shuffle(order)
        for label in order:
            time.sleep(GAP_S)
            try:
                alive[label].send("step")
                seconds = alive[label].recv()
            except (EOFError, OSError):
                print(f"  {label}: worker died in round {round_}; its later rounds are missing")
                del alive[label]
                continue
            if round_ >= warmup:
                times[label].append(seconds)
    return times


def available_mib() -> int | None:
    """The memory the kernel says is available for new processes (None: not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def _start_replicas(
    ctx: Any, model: str, sizes: dict, spec: dict, threads: int, caches: list[Path | None]
) -> tuple[list[tuple[Any, Any, dict]], str | None]:
    """One worker per cache, or none and why: all of a contender's processes start, or none."""
    started: list[tuple[Any, Any, dict]] = []
    error = None
    for cache in caches:
        if (left := available_mib()) is not None and left < MIN_AVAILABLE_MIB:
            # Another worker might be killed for memory mid-run, taking its rounds with it.
            error = f"not started: {left} MiB of memory available"
            break
        conn, proc, first = start_worker(ctx, model, sizes, spec, threads, cache)
        if "error" in first:
            error = first["error"]
            break
        started.append((conn, proc, first))
    if error is not None:
        for conn, proc, _ in started:
            conn.send("stop")
            proc.join()
        return [], error
    return started, None


def _bench_model(model: str, args: Any, folder: Path) -> dict[str, dict[str, Any]]:
    sizes = _sizes(args)[model]
    quick = args.quick
    budgets = tuple(args.budgets or (QUICK_COMPILER_BUDGETS if quick else COMPILER_BUDGETS))
    fractions = QUICK_PLAN_FRACTIONS if quick else PLAN_FRACTIONS
    fused = QUICK_FUSED_FRACTIONS if quick else FUSED_FRACTIONS
    knobs = tuple(args.knobs or (QUICK_KNOB_BUDGETS if quick else KNOB_BUDGETS))
    saved = tuple(args.saved or (QUICK_SAVED_FRACTIONS if quick else SAVED_FRACTIONS))
    specs: dict[str, dict] = {"eager": dict(kind="eager", backend=args.backend)}
    for b in budgets:
        specs[f"compile amb={b:g}"] = dict(kind="compiler", budget=b, backend=args.backend)
    for b in budgets[::2]:  # some of the same configurations again, in their own processes
        specs[f"twin amb={b:g}"] = dict(
            kind="twin", budget=b, backend=args.backend, twin_of=f"compile amb={b:g}"
        )
    for label, path in _plans(model, sizes, fractions, fused, folder, args.device).items():
        specs[label] = dict(kind="gradckpt", plan=path, backend=args.backend)
    for b in knobs:
        specs[f"gradckpt knob amb={b:g}"] = dict(kind="knob", budget=b, backend=args.backend)
    for f in saved:
        specs[f"gradckpt bytes {f:g}"] = dict(kind="bytes", fraction=f, backend=args.backend)
    for b in budgets:  # capped at what the compiler's own knob saves: dominates it in bytes, FLOPs
        specs[f"gradckpt bytes <=amb={b:g}"] = dict(kind="bytes", knob=b, backend=args.backend)
    kinds = set(args.kinds) | {"eager"}
    specs = {
        label: dict(spec, device=args.device)
        for label, spec in specs.items() if spec["kind"] in kinds
    }  # fmt: skip
    ctx = mp.get_context("spawn")
    workers: dict[str, tuple[Any, Any]] = {}  # worker key -> (connection, process)
    replicas: dict[str, list[str]] = {}  # label -> its workers' keys
    results: dict[str, dict[str, Any]] = {}
    for index, (label, spec) in enumerate(specs.items()):  # one at a time: compiles do not compete
        caches = [
            None if args.shared_cache else folder / f"cache-{model}-{index}-{replica}"
            for replica in range(args.processes)
        ]  # fmt: skip
        started, error = _start_replicas(ctx, model, sizes, spec, args.threads, caches)
        if error is not None:  # a contender whose every process did not start is left out
            print(f"  {model} {label}: FAILED {error}")
            results[label] = dict(kind=spec["kind"], error=error)
            continue
        reports = []
        for replica, (conn, proc, first) in enumerate(started):
            key = label if args.processes == 1 else f"{label} #{replica}"
            workers[key] = (conn, proc)
            replicas.setdefault(label, []).append(key)
            reports.append(first)
        peaks = [r["peak"] for r in reports]
        results[label] = dict(
            kind=spec["kind"], budget=spec.get("budget"), times=[], **reports[0],
            **({"twin_of": spec["twin_of"]} if "twin_of" in spec else {}),
        )  # fmt: skip
        results[label]["peak"] = max(peaks)  # the same compiled code: equal unless layout differs
        if args.processes > 1:
            results[label]["replica_peaks"] = peaks
            results[label]["replica_first_s"] = [r["first_s"] for r in reports]
        print(f"  {model} {label}: peak {' / '.join(mib(p) for p in peaks)} MiB, "
              f"first step {reports[0]['first_s']:.1f} s")  # fmt: skip
    conns = {key: conn for key, (conn, _) in workers.items()}
    times = timed_rounds(conns, args.warmup, args.repeats, args.seed)
    for label, keys in replicas.items():
        per_process = [times[key] for key in keys]
        results[label]["times"] = pooled(per_process)  # one process: its own times
        if len(keys) > 1:
            results[label]["replica_times"] = per_process
    for conn, proc in workers.values():
        with contextlib.suppress(OSError):  # a worker that died is joined all the same
            conn.send("stop")
        proc.join()
    for row in results.values():
        if "times" in row:
            row["median_s"] = statistics.median(row["times"])
    return results


def _render(data: dict[str, Any], out: Path, what: str) -> None:
    """Verdicts from the measured rows, then the Markdown, JSON and plot."""
    data["verdicts"] = {m: verdicts(rows) for m, rows in data["results"].items()}
    data["verdicts_all"] = {m: verdicts(rows, OURS_ALL) for m, rows in data["results"].items()}
    data["verdicts_held_out"] = {
        m: verdicts(rows, OURS_ALL, held_out=True) for m, rows in data["results"].items()
    }
    md = report(data)
    where = hardware_slug(data["info"].get("gpu"))
    md_path, json_path = write_results(out, what, md, data, date=data["info"]["date"], where=where)
    png = md_path.with_suffix(".png")
    plot(data, png)
    print(md)
    print(f"\nwrote {md_path}, {json_path} and {png}")


def parser() -> Any:
    """The command line (``benchmarks/gpu_check.py`` builds one for its GPU run)."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=None)
    p.add_argument("--backend", default=None, help="default inductor; aot_eager with --quick")
    p.add_argument("--small", action="store_true", help="smaller models (SMALL), inductor")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                   help="which contenders to run (eager always runs)")  # fmt: skip
    p.add_argument("--shared-cache", action="store_true",
                   help="let contenders share inductor's caches (faster start, biased times)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the steps run (cuda: GPU sizes unless --small/--quick)")
    p.add_argument("--budgets", nargs="+", type=float, default=None,
                   help=f"the compiler's knob values (default {COMPILER_BUDGETS})")
    p.add_argument("--saved", nargs="+", type=float, default=None,
                   help=f"saved-bytes caps for the bytes rows (default {SAVED_FRACTIONS})")
    p.add_argument("--knobs", nargs="+", type=float, default=None,
                   help=f"knob values gradckpt drives in bytes (default {KNOB_BUDGETS})")
    p.add_argument("--processes", type=int, default=1,
                   help="worker processes per contender; a round's time is their median")
    p.add_argument("--name", default=None,
                   help="results file stem (default compiled[-MODELS]); the date is appended")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes {args.processes}: at least one worker per contender")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if args.from_json is not None:  # re-render an earlier run (e.g. with today's verdict rule)
        data = read_results(args.from_json)
        data["info"].setdefault("shuffled", False)
        where = hardware_slug(data["info"].get("gpu"))
        _render(data, args.out, args.from_json.stem.rsplit(f"-{where}-", 1)[0])
        return 0
    if not args.quick:  # paired verdicts want more rounds than the shared defaults
        args.warmup = 2 if args.warmup is None else args.warmup
        args.repeats = 15 if args.repeats is None else args.repeats
    settle(args)
    args.backend = args.backend or ("aot_eager" if args.quick else "inductor")
    models = args.models or (["gpt2"] if args.quick else list(MODELS))
    clock = RunClock.start()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for model in models:
            print(f"compiled benchmark: {model}, backend {args.backend}")
            results[model] = _bench_model(model, args, Path(folder))
    info = machine_info(
        backend=args.backend, models=models, quick=args.quick, threads=args.threads,
        sizes={m: _sizes(args)[m] for m in models}, small=args.small,
        warmup=args.warmup, repeats=args.repeats, shuffled=True, gap_s=GAP_S,
        own_compile_caches=not args.shared_cache, device=args.device,
        processes=args.processes,
        gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
        **clock.info(),
    )  # fmt: skip
    info["load_note"] = load_note(info)
    data = {"version": 4, "info": info, "results": results}
    name = args.name or ("compiled" if args.models is None else "compiled-" + "-".join(models))
    _render(data, args.out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
