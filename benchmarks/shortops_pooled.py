"""Several runs of the short-op benchmark read as one: each target's ratio per run and pooled.

One run of :mod:`benchmarks.engine_shortops` times 80 interleaved rounds; a target
whose true ratio sits a few tenths of a percent below its bound (``fit`` at the
plain peak against plain, issue #42) gets an interval that reaches past it in
some runs and not in others. Pooling the paired rounds of runs made at one commit,
all of them (a rule fixed before the runs says which), gives the interval of all
the rounds together; each run's own median is listed beside it.

Run (measures nothing; reads the runs' JSON)::

    python -m benchmarks.shortops_pooled benchmarks/results/engine-shortops-cpu-2026-12-05-{g,h,i,j}.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import markdown_table
from benchmarks.harness.results import read_results, write_results
from benchmarks.harness.stats import median_interval, paired_ratios

#: Each target: its name, its bound, and where its two rows are in a config's data.
TARGETS = {
    "fit at the plain peak / the same model plain (toggled)": (
        1.01, lambda c: ({"times": c["toggled_fit_plain"]["fit_plain"]},
                         {"times": c["toggled_fit_plain"]["plain"]}),
    ),
    "gradckpt per block / torch per block": (
        1.03, lambda c: (_row(c, "gradckpt_full"), _row(c, "torch_full")),
    ),
    "gradckpt selective / torch SAC": (
        1.03, lambda c: (_row(c, "gradckpt_selective"), _row(c, "torch_sac")),
    ),
}  # fmt: skip


def _row(config: dict[str, Any], name: str) -> dict[str, Any]:
    return {"times": config["results"][name]["times_s"]}


def _short(name: str) -> str:
    """``engine-shortops-cpu-2026-12-05-g`` -> ``-g`` (the run's letter; ``""`` for the first)."""
    tail = name.rsplit("-", 1)[-1]
    return f"-{tail}" if len(tail) == 1 else "(first)"


def pooled_report(runs: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown and JSON of every target in every config: per run, and all rounds pooled."""
    sections, data = [], {}
    configs = next(iter(runs.values()))["configs"]
    for config in configs:
        rows, found = [], {}
        for target, (bound, pick) in TARGETS.items():
            pooled: list[float] = []
            per_run = {}
            for name, run in runs.items():
                ratios = paired_ratios(*pick(run["configs"][config]))
                pooled += ratios
                per_run[name] = median_interval(ratios)
            med, low, high = median_interval(pooled)
            found[target] = {"bound": bound, "pooled": [med, low, high], "rounds": len(pooled),
                             "per_run": per_run}  # fmt: skip
            runs_text = ", ".join(f"{_short(n)} {m:.3f}" for n, (m, _, _) in per_run.items())
            under = sum(m <= bound for m, _, _ in per_run.values())
            rows.append((target, f"<= {bound}", runs_text, f"{under} of {len(per_run)}",
                         f"{med:.3f} [{low:.3f}, {high:.3f}]", str(len(pooled)),
                         "**met**" if high <= bound else "not met"))  # fmt: skip
        data[config] = found
        header = ("target", "wanted", "run medians", "runs within", "pooled [95% CI]", "rounds",
                  "pooled interval within")  # fmt: skip
        sections.append(f"## `{config}`\n\n{markdown_table(header, rows)}")
    return "\n\n".join(sections), data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="engine-shortops result JSON files")
    p.add_argument("--out", type=Path, default=None, help="write the report there too")
    args = p.parse_args(argv)
    runs = {path.stem: read_results(path) for path in args.runs}
    heads = sorted({run["info"].get("git_head", "?") for run in runs.values()})
    body, data = pooled_report(runs)
    md = (
        f"# Short-op benchmark, {len(runs)} runs pooled\n\n"
        f"Runs: {', '.join(f'`{n}`' for n in runs)} (commit(s) {', '.join(heads)}). "
        "Per run: the median paired ratio of its rounds; pooled: the median over every "
        "round of every run, with a bootstrap 95% interval.\n\n" + body
    )
    print(md)
    if args.out is not None:
        date = next(iter(runs.values()))["info"]["date"]
        info = {"runs": list(runs), "git_heads": heads}
        md_path, _ = write_results(args.out, "engine-shortops-pooled", md,
                                   {"info": info, "configs": data}, date)  # fmt: skip
        print(f"wrote {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
