"""Why a compiled point is slower at a lower peak: what each compiled step saves and recomputes.

Deterministic (no timing): each contender of ``benchmarks/compiled.py`` is
compiled with AOT autograd and the min-cut partitioner (inductor's
partitioner, without inductor's fusion), and its graphs are read:

* ``saved (MiB)``: the bytes the forward graph hands to backward (its outputs
  beyond the loss's), what the partitioner decided to keep;
* ``backward matmuls``: matmul-like ops in the backward graph; above the
  plain compile's count, the rest are forward matmuls recomputed.

Usage:
    python -m benchmarks.compiled_graphs --models llama       # SMALL sizes
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.compiled import (
    COMPILER_BUDGETS,
    FUSED_FRACTIONS,
    KNOB_BUDGETS,
    PLAN_FRACTIONS,
    SMALL,
    _example,
)
from benchmarks.harness import (
    base_parser,
    info_block,
    machine_info,
    markdown_table,
    mib,
    settle,
    write_results,
)

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


def _reader() -> tuple[Any, dict[str, int]]:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    record = {"saved": 0, "forward_matmuls": 0, "backward_matmuls": 0}

    def matmuls(gm: Any) -> int:
        return sum(1 for n in gm.graph.nodes if str(n.target) in MATMULS)

    def forward(gm: Any, _inputs: Any) -> Any:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        for node in output.args[0]:
            value = getattr(node, "meta", {}).get("val")
            if isinstance(value, torch.Tensor):
                record["saved"] += optimization_hint(value.numel()) * value.element_size()
        record["forward_matmuls"] += matmuls(gm)
        return make_boxed_func(gm)

    def backward(gm: Any, _inputs: Any) -> Any:
        record["backward_matmuls"] += matmuls(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=forward, bw_compiler=backward,
        partition_fn=min_cut_rematerialization_partition,
    )  # fmt: skip
    return backend, record


def _read(model: str, sizes: dict, plan: Any = None, budget: float = 1.0) -> dict[str, int]:
    import torch._functorch.config as functorch_config

    import gradckpt

    torch._dynamo.reset()
    ex = _example(model, sizes)
    backend, record = _reader()
    if plan is not None:
        gradckpt.apply(ex.model, plan)
        gradckpt.compile(ex.model, ex.loss_fn, backend=backend, dynamic=False)
    else:
        ex.model.compile(backend=backend, dynamic=False)
    with functorch_config.patch(activation_memory_budget=budget):
        ex.loss_fn().backward()
    return record


def _rows(model: str) -> list[tuple[str, dict[str, int], str]]:
    import gradckpt
    from gradckpt.compiled.budget import fused_profile
    from gradckpt.planning.solve import solve
    from gradckpt.planning.solving.budget import parse_budget

    sizes = SMALL[model]
    rows = []
    for b in COMPILER_BUDGETS + KNOB_BUDGETS:
        rows.append((f"compile amb={b:g}", _read(model, sizes, budget=b), ""))
    ex = _example(model, sizes)
    prof = gradckpt.profile(ex.model, ex.loss_fn, repeats=1)
    seen: list = []
    for name, view, fractions in (("gradckpt", prof, PLAN_FRACTIONS),
                                  ("gradckpt fused", fused_profile(prof), FUSED_FRACTIONS)):  # fmt: skip
        for fraction in fractions:
            try:
                plan = solve(view, parse_budget(fraction, prof.measured_peak_bytes), "dp",
                             segments=False)  # fmt: skip
            except gradckpt.BudgetError:
                continue
            if plan.items in seen:
                continue
            seen.append(plan.items)
            modes = ", ".join(
                f"{u.path.split('.')[-1]}:{u.mode[:3]}{len(u.save) or ''}"
                for u in plan.units if u.mode != "keep"
            )  # fmt: skip
            rows.append((f"{name} {fraction:g}", _read(model, sizes, plan=plan), modes))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=("gpt2", "llama"), default=["llama"])
    args = p.parse_args(argv)
    settle(args)
    results = {m: _rows(m) for m in args.models}
    parts = [
        "# Compiled graphs: what each compiled step saves and recomputes (deterministic)",
        __doc__.split("\n\n")[1],
    ]
    for model, rows in results.items():
        plain = next(r for label, r, _ in rows if label == "compile amb=1")
        table = [
            (f"`{label}`", mib(r["saved"]), r["backward_matmuls"],
             r["backward_matmuls"] - plain["backward_matmuls"], modes)
            for label, r, modes in rows
        ]  # fmt: skip
        parts += [
            f"## {model} {SMALL[model]}",
            markdown_table(
                [
                    "contender",
                    "saved (MiB)",
                    "backward matmuls",
                    "recomputed matmuls",
                    "plan (unit: mode, saved ops)",
                ],
                table,
            ),
        ]
    info = machine_info(models=args.models, sizes={m: SMALL[m] for m in args.models})
    parts += ["## Setup", info_block(info)]
    data = {"version": 1, "info": info, "results": {
        m: [dict(label=label, modes=modes, **r) for label, r, modes in rows]
        for m, rows in results.items()
    }}  # fmt: skip
    what = "compiled-graphs-" + "-".join(args.models)
    md_path, _ = write_results(args.out, what, "\n\n".join(parts), data)
    print("\n\n".join(parts))
    print(f"\nwrote {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
