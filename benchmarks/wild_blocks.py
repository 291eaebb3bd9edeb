"""Blocks as the code defines them: gradckpt on a torchtitan-style Llama against torch's schemes.

The model is :func:`gradckpt.testing.wild`'s ``titan_llama`` (blocks in a
``ModuleDict``, fused QKV, RoPE, RMSNorm, a SwiGLU of one ``nn.Linear``
subclass: the layout block discovery once split at its projections). Contenders,
each on its own copy of the model (same seed, weights and batch):

* ``plain``: no checkpointing;
* ``torch_full``: ``torch.utils.checkpoint`` around every transformer block
  (torchtitan's ``full`` mode);
* ``torch_sac``: torch's selective checkpointing around every block with
  torchtitan's default policy (save matmuls, attention and ``max``, but recompute
  every second matmul);
* ``gradckpt_full_peak``: ``gradckpt.fit`` with the budget at ``torch_full``'s
  measured peak, discovering the blocks itself;
* ``gradckpt_sac_peak``: ``gradckpt.fit`` at ``torch_sac``'s measured peak.

Peaks are at the allocator; times are interleaved rounds (median after warm-up,
with a bootstrap interval of the median ratio). Targets: gradckpt holds each
budget, and at SAC's peak its overhead is below SAC's.

Usage:
    python -m benchmarks.wild_blocks            # 8 layers, dim 256, seq 512, batch 2
    python -m benchmarks.wild_blocks --quick    # tiny sizes (seconds)
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradckpt
from benchmarks.harness import (
    RunClock,
    base_parser,
    fmt_ratio,
    info_block,
    load_note,
    machine_info,
    markdown_table,
    measure_contenders,
    measure_peaks,
    measured_from_json,
    median_interval,
    mib,
    per_block,
    plain,
    read_results,
    settle,
    torch_checkpoint,
    verdict,
    with_plan,
    write_results,
)
from gradckpt.profiling import find_blocks
from gradckpt.testing.wild import torchtitan_sac, wild

FULL = dict(layers=8, dim=256, heads=4, seq=512, batch=2, vocab=2048)
QUICK = dict(layers=2, dim=64, heads=4, seq=64, batch=2, vocab=256)

DESCRIPTIONS = {
    "plain": "no checkpointing",
    "torch_full": "torch.utils.checkpoint per block (torchtitan full)",
    "torch_sac": "torch SAC per block, torchtitan's policy",
    "gradckpt_full_peak": "gradckpt.fit at torch_full's peak",
    "gradckpt_sac_peak": "gradckpt.fit at torch_sac's peak",
}


def fitted_at(sizes: dict, budget: int) -> gradckpt.Plan:
    """``gradckpt.fit`` on a fresh copy of the model (its own discovery) at ``budget``."""
    ex = wild("titan_llama", **sizes)
    return gradckpt.fit(ex.model, ex.loss_fn, budget)


def run(sizes: dict, warmup: int, repeats: int, seed: int) -> tuple[dict, dict]:
    build = lambda: wild("titan_llama", **sizes)  # noqa: E731
    probe = build()
    found = find_blocks(probe.model)
    torch_side = {"torch_full": per_block(torch_checkpoint), "torch_sac": per_block(torchtitan_sac)}
    budgets = {name: measure_peaks(build(), install, seed)[0] for name, install in torch_side.items()}
    plans = {
        "gradckpt_full_peak": fitted_at(sizes, budgets["torch_full"]),
        "gradckpt_sac_peak": fitted_at(sizes, budgets["torch_sac"]),
    }
    contenders = {"plain": plain(), **torch_side, **{k: with_plan(p) for k, p in plans.items()}}
    results = measure_contenders(build, contenders, baseline="plain", warmup=warmup,
                                 repeats=repeats, seed=seed)  # fmt: skip
    extra = {
        "blocks_found": found,
        "budgets": {
            "gradckpt_full_peak": budgets["torch_full"],
            "gradckpt_sac_peak": budgets["torch_sac"],
        },
        "predicted_overhead": {k: p.predicted_overhead for k, p in plans.items()},
        "summaries": {k: p.summary() for k, p in plans.items()},
    }
    return results, extra


def _ratio_interval(results: dict, a: str, b: str) -> tuple[float, float, float]:
    """``a``'s step time over ``b``'s, round by round: median and bootstrap interval."""
    ta, tb = results[a].timing.times, results[b].timing.times
    return median_interval([x / y for x, y in zip(ta, tb)])


def report(results: dict, extra: dict, info: dict) -> tuple[str, dict]:
    base_peak = results["plain"].peak_bytes
    rows = [
        (f"`{name}`", DESCRIPTIONS[name], fmt_ratio(m.ratio), mib(m.peak_bytes),
         f"{m.peak_bytes / base_peak:.3f}",
         mib(extra["budgets"].get(name)) if name in extra["budgets"] else "",
         f"{extra['predicted_overhead'][name]:+.1%}" if name in extra["predicted_overhead"] else "")
        for name, m in results.items()
    ]  # fmt: skip
    table = markdown_table(
        ["contender", "what", "time / plain", "peak (MiB)", "peak / plain", "budget (MiB)",
         "predicted overhead"],
        rows,
    )  # fmt: skip
    held = {k: results[k].peak_bytes <= extra["budgets"][k] for k in extra["budgets"]}
    sac = _ratio_interval(results, "gradckpt_sac_peak", "torch_sac")
    full = _ratio_interval(results, "gradckpt_full_peak", "torch_full")
    targets = [
        ("blocks discovery finds", "the transformer blocks", ", ".join(extra["blocks_found"][:3])
         + (", ..." if len(extra["blocks_found"]) > 3 else ""),
         verdict(all(p.startswith("layers.") and p.count(".") == 1 for p in extra["blocks_found"]))),
        ("gradckpt at torch_full's peak holds it", "peak <= budget",
         f"{mib(results['gradckpt_full_peak'].peak_bytes)} / {mib(extra['budgets']['gradckpt_full_peak'])}",
         verdict(held["gradckpt_full_peak"])),
        ("gradckpt at torch_sac's peak holds it", "peak <= budget",
         f"{mib(results['gradckpt_sac_peak'].peak_bytes)} / {mib(extra['budgets']['gradckpt_sac_peak'])}",
         verdict(held["gradckpt_sac_peak"])),
        ("step time, gradckpt at SAC's peak / torch SAC", "< 1",
         f"{sac[0]:.3f} [{sac[1]:.3f}, {sac[2]:.3f}]", verdict(sac[2] < 1.0)),
        ("step time, gradckpt at full's peak / torch full", "report",
         f"{full[0]:.3f} [{full[1]:.3f}, {full[2]:.3f}]", "reported"),
    ]  # fmt: skip
    md = "\n\n".join(
        [
            f"# Blocks as the code defines them: a torchtitan-style Llama on CPU ({info['date']})",
            "Each contender runs on its own copy of `gradckpt.testing.wild('titan_llama')` "
            "(same seed, weights and batch). Peaks: one untimed step each at the allocator "
            "(parameters and buffers included). Times: interleaved rounds, median over "
            "`plain`'s in the same rounds; the targets' ratios are taken round by round, "
            "with a bootstrap 95% interval of their median (the verdict is the interval's "
            "upper end).",
            *([note] if (note := load_note(info)) else []),
            table,
            "## Targets",
            markdown_table(["target", "wanted", "measured", "verdict"], targets),
            "## The plans",
            *[f"`{k}`:\n\n```\n{s}\n```" for k, s in extra["summaries"].items()],
            "## Setup",
            info_block(info),
        ]
    )
    data = {
        "info": info,
        "results": {name: m.to_json() for name, m in results.items()},
        "extra": extra,
        "targets": {"sac_ratio": sac, "full_ratio": full, "held": held},
    }
    return md, data


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    settle(args)
    if args.from_json is not None:
        saved = read_results(args.from_json)
        results = measured_from_json(saved["results"], "plain")
        md, data = report(results, saved["extra"], saved["info"])
        write_results(args.out, "wild-blocks-titan-llama", md, data, saved["info"]["date"])
        print(md)
        return 0
    sizes = QUICK if args.quick else FULL
    clock = RunClock.start()
    print(f"wild blocks benchmark: titan_llama {sizes}, warmup {args.warmup}, repeats {args.repeats}")
    results, extra = run(sizes, args.warmup, args.repeats, args.seed)
    info = machine_info(model="titan_llama (gradckpt.testing.wild)", sizes=sizes,
                        warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                        quick=args.quick, **clock.info())  # fmt: skip
    md, data = report(results, extra, info)
    md_path, json_path = write_results(args.out, "wild-blocks-titan-llama", md, data)
    print(md)
    print(f"\nwrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
