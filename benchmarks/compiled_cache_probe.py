"""Does a process that compiled its code step slower than one that loaded the same code from cache?

Why it matters: ``benchmarks/compiled.py`` times each contender in its own
process. If contenders share inductor's caches, those started later load what
earlier ones compiled, and a process's history stays with it. This probe
starts three workers of one configuration (the compiler at
``activation_memory_budget=0.5``) on one fresh cache: ``scratch`` compiles,
``cached1`` and ``cached2`` load its code. Their steps are interleaved in a
shuffled order each round, and the report gives the paired per-round ratios
``scratch / cached1`` (the history effect plus noise) and ``cached2 / cached1``
(noise alone). Each trial uses a new, empty cache.

Usage:
    python -m benchmarks.compiled_cache_probe --trials 3        # GPT-2 8 layers, ~3 min a trial
    python -m benchmarks.compiled_cache_probe --quick           # smoke test
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compiled import FULL, QUICK, start_worker, timed_rounds
from benchmarks.harness import (
    base_parser,
    info_block,
    machine_info,
    markdown_table,
    write_results,
)

WORKERS = ("scratch", "cached1", "cached2")


def trial(model: str, sizes: dict, backend: str, threads: int, rounds: int, warmup: int,
          cache: Path, seed: int) -> dict[str, Any]:  # fmt: skip
    """One trial: the three workers on one empty cache; their step times per round."""
    ctx = mp.get_context("spawn")
    spec = dict(kind="compiler", budget=0.5, backend=backend)
    conns, procs, first = {}, [], {}
    for label in WORKERS:  # in turn: the first compiles, the others find its code
        conn, proc, reply = start_worker(ctx, model, sizes, spec, threads, cache)
        if "error" in reply:
            raise RuntimeError(f"{label}: {reply['error']}")
        first[label] = reply["first_s"]
        conns[label] = conn
        procs.append(proc)
    times = timed_rounds(conns, warmup, rounds, seed)
    for conn in conns.values():
        conn.send("stop")
    for proc in procs:
        proc.join()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    return dict(
        first_s=first, times=times,
        scratch_over_cached=ratio("scratch", "cached1"),
        cached_over_cached=ratio("cached2", "cached1"),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=None, help="default 3 (--quick: 1)")
    args = p.parse_args(argv)
    args.trials = args.trials or (1 if args.quick else 3)
    model, sizes = "gpt2", (QUICK if args.quick else FULL)["gpt2"]
    backend = "aot_eager" if args.quick else "inductor"
    rounds = args.repeats or (2 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    results = []
    for index in range(args.trials):
        with tempfile.TemporaryDirectory() as folder:
            results.append(trial(model, sizes, backend, args.threads, rounds, warmup,
                                 Path(folder), seed=index))  # fmt: skip
        r = results[-1]
        print(f"trial {index}: scratch/cached x{r['scratch_over_cached']:.3f}, "
              f"cached/cached x{r['cached_over_cached']:.3f}", flush=True)  # fmt: skip
    info = machine_info(model=model, sizes=sizes, backend=backend, threads=args.threads,
                        rounds=rounds, warmup=warmup, trials=args.trials, quick=args.quick)  # fmt: skip
    rows = [
        (str(i), f"x{r['scratch_over_cached']:.3f}", f"x{r['cached_over_cached']:.3f}",
         f"{r['first_s']['scratch']:.1f}", f"{r['first_s']['cached1']:.1f}")
        for i, r in enumerate(results)
    ]  # fmt: skip
    headers = ["trial", "scratch / cached1", "cached2 / cached1", "scratch first step (s)",
               "cached first step (s)"]  # fmt: skip
    md = "\n\n".join([
        f"# Compile history probe, CPU ({info['date']})",
        "Three processes of one configuration (GPT-2, `compile amb=0.5`, inductor) on one "
        "fresh cache: `scratch` compiled the code, `cached1` and `cached2` loaded it. Median "
        f"of paired per-round step ratios over {rounds} shuffled rounds after {warmup} "
        "warm-ups; each trial on a new, empty cache.",
        markdown_table(headers, rows),
        "## Setup",
        info_block(info),
    ])
    data = {"version": 1, "info": info, "trials": results}
    write_results(args.out, "compiled-cache-probe", md, data)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
