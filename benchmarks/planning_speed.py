"""Planning speed: seconds from a ready profile to a plan, by depth, on CPU.

For residual-MLP and GPT models of 24 to 400 blocks (profiled under fake
tensors: only planning is timed), it times the three stages of ``solve_dp``:

* **chain**: :func:`gradckpt.planning.solving.chain.build_chain` (calibration simulations)
  and the engine's costs added to its options, as ``solve_dp`` does;
* **dp**: :class:`gradckpt.planning.solving.dp.ChainDP` (tables for every budget);
* **finish**: ``solve_dp`` at one budget given the chain and tables (the DP's
  plans checked on the simulator, polish, predictions).

Each is reported as wall-clock seconds and as CPU seconds of this process
(``time.process_time``), the latter being the better guide on a shared machine.
The three together are what ``gradckpt.plan(..., profile=prof)`` spends.

With ``--llama70b`` it also plans the Llama-70B shape end to end (80 layers,
hidden 8192, bf16 weights on the meta device, batch 4 x 4096 tokens): import
of transformers and building the model, profiling under fake tensors, and
``gradckpt.plan`` at the same budget rule, each timed.

    python -m benchmarks.planning_speed               # 24 48 96 200 400 blocks
    python -m benchmarks.planning_speed --quick       # a smoke test
    python -m benchmarks.planning_speed --profiles /tmp/profiles   # reuse profiles
    python -m benchmarks.planning_speed --llama70b                  # and Llama-70B
    python -m benchmarks.planning_speed --models none --llama70b    # Llama-70B only
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import gradckpt
from benchmarks.harness import (
    base_parser,
    info_block,
    load_average,
    load_note,
    machine_info,
    markdown_table,
    read_results,
    settle,
    unknown_models,
    verdict,
    write_results,
)
from gradckpt.planning.solving.chain import build_chain, with_engine_costs
from gradckpt.planning.solving.dp import ChainDP
from gradckpt.planning.solving.solvers import solve_dp
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
LLAMA70B_TARGET = 120.0  # seconds, end to end
# Llama-3-70B's shape. Batch 4 x 4096 tokens: at batch 1 the step peaks at the end of
# the backward (weights plus their gradients, 2 x 131 GiB in bf16), where no plan helps.
LLAMA70B = {"layers": 80, "hidden": 8192, "intermediate": 28672, "heads": 64, "kv_heads": 8,
            "vocab": 128256, "seq": 4096, "batch": 4, "dtype": "bfloat16"}  # fmt: skip
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
    # As solve_dp builds it: the engine's costs are part of each option's time.
    model, chain_wall, chain_cpu = _timed(lambda: with_engine_costs(build_chain(prof), prof))
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


def measure_llama70b() -> dict[str, Any]:
    """Build the Llama-70B shape on the meta device, profile it under fake tensors, plan it."""
    import torch

    start_wall, start_cpu = time.perf_counter(), time.process_time()

    def build() -> tuple[Any, Any]:
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = LLAMA70B
        config = LlamaConfig(
            hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
            max_position_embeddings=8192, use_cache=False,
        )  # fmt: skip
        with torch.device("meta"):
            model = LlamaForCausalLM(config).to(getattr(torch, shape["dtype"]))

        def loss_fn() -> Any:
            ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]))
            return model(input_ids=ids, labels=ids).loss

        return model, loss_fn

    (model, loss_fn), build_wall, build_cpu = _timed(build)
    prof, prof_wall, prof_cpu = _timed(lambda: gradckpt.profile(model, loss_fn, fake=True))
    print(f"llama-70b: built in {build_wall:.1f} s, profiled in {prof_wall:.1f} s", flush=True)
    budget = int(prof.param_bytes + BUDGET_SHARE * (prof.measured_peak_bytes - prof.param_bytes))
    plan, plan_wall, plan_cpu = _timed(lambda: gradckpt.plan(model, loss_fn, budget, profiling=gradckpt.ProfileOptions(profile=prof)))
    row = {
        **LLAMA70B,
        "blocks": len(prof.blocks),
        "param_bytes": prof.param_bytes,
        "plain_peak_bytes": prof.measured_peak_bytes,
        "budget_bytes": budget,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_overhead": plan.predicted_step_time / prof.step_time - 1.0,
        "wall": {"build": build_wall, "profile": prof_wall, "plan": plan_wall},
        "cpu": {"build": build_cpu, "profile": prof_cpu, "plan": plan_cpu},
        "total_wall": time.perf_counter() - start_wall,
        "total_cpu": time.process_time() - start_cpu,
    }
    print(f"llama-70b {row['blocks']} layers: build {build_wall:.1f} s, profile {prof_wall:.1f} s, "
          f"plan {plan_wall:.1f} s, total {row['total_wall']:.1f} s wall "
          f"({row['total_cpu']:.1f} s CPU); overhead {row['predicted_overhead']:+.1%}",
          flush=True)  # fmt: skip
    return row


def _llama_section(row: dict[str, Any]) -> str:
    gib = 2**30
    table = markdown_table(
        ["stage", "wall (s)", "CPU (s)"],
        [[k, f"{row['wall'][k]:.1f}", f"{row['cpu'][k]:.1f}"] for k in row["wall"]]
        + [["total", f"{row['total_wall']:.1f}", f"{row['total_cpu']:.1f}"]],
    )
    met = row["total_wall"] <= LLAMA70B_TARGET
    return "\n\n".join([
        "## Llama-70B shape, end to end",
        f"{row['layers']} layers, hidden {row['hidden']}, {row['dtype']} weights on the meta "
        f"device, batch {row['batch']} x {row['seq']} tokens: weights "
        f"{row['param_bytes'] / gib:.1f} GiB, plain peak {row['plain_peak_bytes'] / gib:.1f} GiB, "
        f"budget {row['budget_bytes'] / gib:.1f} GiB, planned peak "
        f"{row['predicted_peak_bytes'] / gib:.1f} GiB, predicted overhead "
        f"{row['predicted_overhead']:+.1%}. Import and build, fake-tensor profile and "
        f"`gradckpt.plan` are each timed; wanted: under {LLAMA70B_TARGET:.0f} s in all, "
        f"{verdict(met)} ({row['total_wall']:.1f} s wall).",
        table,
    ])  # fmt: skip


def render(
    rows: list[dict[str, Any]], info: dict[str, Any], out: Path, llama: dict[str, Any] | None = None
) -> str:
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
        table if rows else "",
    ]
    if targets:
        parts += [
            "## Targets",
            markdown_table(
                ["case", "wanted", "measured", "verdict (CPU)", "verdict (wall)"], targets
            ),
        ]
    if llama is not None:
        parts.append(_llama_section(llama))
    parts += ["## Setup", info_block(info)]
    markdown = "\n\n".join(p for p in parts if p)
    data: dict[str, Any] = {"info": info, "rows": rows}
    if llama is not None:
        data["llama70b"] = llama
    write_results(out, "planning-speed", markdown, data, info["date"])
    return markdown


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--blocks", default=None, help="comma-separated depths (default 24,48,96,200,400)"
    )
    p.add_argument("--models", default="mlp,gpt",
                   help="mlp, gpt, both, or none (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--llama70b",
        action="store_true",
        help="also plan the 80-layer Llama-70B shape end to end (needs transformers)",
    )
    p.add_argument("--profiles", type=Path, default=None,
                   help="directory to keep fake-tensor profiles in and reuse them from")  # fmt: skip
    args = p.parse_args(argv)
    settle(args)
    if args.from_json is not None:
        saved = read_results(args.from_json)
        print(render(saved["rows"], saved["info"], args.out, saved.get("llama70b")))
        return 0
    blocks = BLOCKS_QUICK if args.quick else BLOCKS_FULL
    if args.blocks:
        blocks = tuple(int(b) for b in args.blocks.split(","))
    kinds = [k.strip() for k in args.models.split(",") if k.strip() not in ("", "none")]
    if error := unknown_models(kinds, SIZES):
        p.error(error)
    load_before = load_average()
    rows = [measure(kind, n, args.profiles) for kind in kinds for n in blocks]
    llama = measure_llama70b() if args.llama70b else None
    info = machine_info(
        sizes={k: SIZES[k] for k in kinds},
        budget="parameters + 50% of the rest of the plain peak",
        quick=args.quick,
        load_average_before=" / ".join(f"{x:.2f}" for x in load_before),
        load_average_after=" / ".join(f"{x:.2f}" for x in load_average()),
    )
    print(render(rows, info, args.out, llama))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
