"""Planning speed: seconds from a ready profile to a plan, by depth, on CPU.

For residual-MLP and GPT models of 24 to 400 blocks (profiled under fake
tensors: only planning is timed), it times the three stages of ``solve_dp``:

* **chain**: :func:`gradckpt.planning.chain.build_chain` (calibration simulations);
* **dp**: :class:`gradckpt.planning.dp.ChainDP` (tables for every budget);
* **finish**: ``solve_dp`` at one budget given the chain and tables (the DP's
  plans checked on the simulator, polish, predictions).

Each is reported as wall-clock seconds and as CPU seconds of this process
(``time.process_time``), the latter being the better guide on a shared machine.

    python -m benchmarks.planning_speed               # 24 48 96 200 400 blocks
    python -m benchmarks.planning_speed --quick       # a smoke test
    python -m benchmarks.planning_speed --profiles /tmp/profiles   # reuse profiles
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import gradckpt
from benchmarks.common import (
    base_parser,
    info_block,
    load_average,
    load_note,
    machine_info,
    markdown_table,
    settle,
    verdict,
    write_results,
)
from gradckpt.planning.chain import build_chain
from gradckpt.planning.dp import ChainDP
from gradckpt.planning.solvers import solve_dp
from gradckpt.profiling.records import Profile
from gradckpt.testing import make

BLOCKS_FULL = (24, 48, 96, 200, 400)
BLOCKS_QUICK = (4, 8)
# Activations outweigh a block's parameters, as in training: the budget has room to trade.
SIZES = {
    "mlp": {"width": 64, "hidden": 256, "batch": 512},
    "gpt": {"d_model": 64, "heads": 2, "seq": 128, "vocab": 256, "batch": 4},
}
#: The compass targets (total seconds from a ready profile), by blocks.
TARGETS = {96: 1.0, 400: 10.0}
BUDGET_SHARE = 0.5  # budget = parameters + this share of the rest of the plain peak


def _profile(kind: str, blocks: int, cache: Path | None) -> Profile:
    path = cache / f"{kind}{blocks}.json" if cache else None
    if path is not None and path.exists():
        return Profile.from_json(json.loads(path.read_text()))
    depth = {"layers": blocks} if kind == "gpt" else {"blocks": blocks}
    example = make(kind, **depth, **SIZES[kind])
    prof = gradckpt.profile(example.model, example.loss_fn, fake=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof.to_json()))
    return prof


def _timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def measure(kind: str, blocks: int, cache: Path | None) -> dict[str, Any]:
    """Time chain, DP and finish for one model; returns one result row."""
    start = time.perf_counter()
    prof = _profile(kind, blocks, cache)
    profiled = time.perf_counter() - start
    budget = int(prof.param_bytes + BUDGET_SHARE * (prof.measured_peak_bytes - prof.param_bytes))
    model, chain_wall, chain_cpu = _timed(lambda: build_chain(prof))
    dp, dp_wall, dp_cpu = _timed(lambda: ChainDP(model.chain))
    plan, fin_wall, fin_cpu = _timed(lambda: solve_dp(prof, budget, model=model, dp=dp))
    row = {
        "model": kind,
        "blocks": blocks,
        "stages": len(model.chain.stages),
        "distinct_nested_cells": dp._cells.cells,
        "profile_s": round(profiled, 2),
        "wall": {"chain": chain_wall, "dp": dp_wall, "finish": fin_wall},
        "cpu": {"chain": chain_cpu, "dp": dp_cpu, "finish": fin_cpu},
        "budget_bytes": budget,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_overhead": plan.predicted_step_time / prof.step_time - 1.0,
    }
    total = sum(row["wall"].values())
    print(f"{kind:>4} {blocks:>4} blocks: chain {chain_wall:.2f} s, dp {dp_wall:.2f} s, "
          f"finish {fin_wall:.2f} s, total {total:.2f} s wall ({sum(row['cpu'].values()):.2f} s CPU); "
          f"overhead {row['predicted_overhead']:+.1%}", flush=True)  # fmt: skip
    return row


def render(rows: list[dict[str, Any]], info: dict[str, Any], out: Path) -> str:
    def secs(row: dict, clock: str, key: str | None = None) -> str:
        values = row[clock]
        return f"{(values[key] if key else sum(values.values())):.2f}"

    table = markdown_table(
        [
            "model",
            "blocks",
            "chain (s)",
            "dp (s)",
            "finish (s)",
            "total (s)",
            "total CPU (s)",
            "distinct nested cells",
            "predicted overhead",
        ],
        [
            [
                r["model"],
                r["blocks"],
                secs(r, "wall", "chain"),
                secs(r, "wall", "dp"),
                secs(r, "wall", "finish"),
                secs(r, "wall"),
                secs(r, "cpu"),
                r["distinct_nested_cells"],
                f"{r['predicted_overhead']:+.2%}",
            ]
            for r in rows
        ],
    )
    targets = []
    for blocks, limit in TARGETS.items():
        for r in (r for r in rows if r["blocks"] == blocks):
            wall, cpu = sum(r["wall"].values()), sum(r["cpu"].values())
            targets.append([f"{r['model']} {blocks} blocks", f"<= {limit:.0f} s",
                            f"{wall:.2f} s wall, {cpu:.2f} s CPU", verdict(cpu <= limit),
                            verdict(wall <= limit)])  # fmt: skip
    parts = [
        f"# Planning speed from a ready profile, CPU ({info['date']})",
        __doc__.split("\n\n")[1].strip() + "\n\n" + __doc__.split("\n\n")[2].strip(),
        load_note(info),
        table,
    ]
    if targets:
        parts += [
            "## Targets",
            markdown_table(
                ["case", "wanted", "measured", "verdict (CPU)", "verdict (wall)"], targets
            ),
        ]
    parts += ["## Setup", info_block(info)]
    markdown = "\n\n".join(p for p in parts if p)
    write_results(out, "planning-speed", markdown, {"info": info, "rows": rows}, info["date"])
    return markdown


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--blocks", default=None, help="comma-separated depths (default 24,48,96,200,400)"
    )
    p.add_argument("--models", default="mlp,gpt", help="mlp, gpt or both (default: %(default)s)")
    p.add_argument("--profiles", type=Path, default=None,
                   help="directory to keep fake-tensor profiles in and reuse them from")  # fmt: skip
    args = p.parse_args(argv)
    settle(args)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        print(render(saved["rows"], saved["info"], args.out))
        return 0
    blocks = BLOCKS_QUICK if args.quick else BLOCKS_FULL
    if args.blocks:
        blocks = tuple(int(b) for b in args.blocks.split(","))
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in SIZES]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(SIZES)}")
    load_before = load_average()
    rows = [measure(kind, n, args.profiles) for kind in kinds for n in blocks]
    info = machine_info(
        sizes={k: SIZES[k] for k in kinds},
        budget="parameters + 50% of the rest of the plain peak",
        quick=args.quick,
        load_average_before=" / ".join(f"{x:.2f}" for x in load_before),
        load_average_after=" / ".join(f"{x:.2f}" for x in load_average()),
    )
    print(render(rows, info, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
